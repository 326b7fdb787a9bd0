"""Heads spread over ranks: vocabulary-parallel groups, DTensors, FSDP2 and DeepSpeed ZeRO-3."""
