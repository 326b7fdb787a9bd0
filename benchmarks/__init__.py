"""Benchmarks of fusedloss against the materialised reference and its peers (see NOTES.md)."""
