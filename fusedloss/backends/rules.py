"""The plans' choices, as named rules: which path a call takes and how its grad-in-forward rows are grouped.

Each rule is a plain function of the call's shapes (``core/workload.py``) and the shapes its backend's plan can
run (chunk rows, chunks, tiles); no rate, no price. The thresholds are where the performance model
(``benchmarks/model/``, docs/design.md, "Plans and the performance model") puts the crossing of the two choices;
``tests/test_model_plan_rules.py`` checks over a grid of shapes, dtypes, GPUs and workspaces that each rule
takes the plan the model prices cheapest, or one within 2% of it. A choice is a matter of speed, never of
correctness: every path runs any shape the rules may give it.
"""

from __future__ import annotations

from ..core.workload import GPU, Workload

# ------------------------------------------------------------------------------------------------
# Grad-in-forward (3 products) or composable (4)
# ------------------------------------------------------------------------------------------------

# Rows a grad-in-forward chunk must have, by operand dtype, for its three products to beat the composable path's
# four. Each chunk streams the weight again (its logits and d hidden products read [V, D]) and, past the first,
# accumulates d weight with beta = 1 (8 bytes per entry): against one GEMM-sized product saved that is paid back
# once a chunk has about as many rows as the GPU does flops per byte of HBM. fp32's products run at a tenth of
# the half rate, so any chunk pays; fp16's grad-in-forward dx takes two more passes over the chunk (fp32 in
# place, then pre-scaled into a copy), so it needs twice bf16's rows.
GRAD_IN_FORWARD_MIN_ROWS = {"bfloat16": 384, "float16": 768, "float32": 1}


def cuda_grad_in_forward(w: Workload, gpu: GPU, chunk_rows: int, chunks: int, groups: int, deferred: bool,
                         tile_row_chunks: int, tile_vocab_tiles: int) -> tuple[bool, str]:
    """Grad-in-forward when its chunks have ``GRAD_IN_FORWARD_MIN_ROWS`` rows, or hold every row; always for the
    JSD when the composable tile does not cover the call (its second sweep then forms both heads' logits again:
    two more products than the grad-in-forward path's one pass over the kept tiles). (whether, why)."""
    if w.op == "distill_jsd" and tile_row_chunks * tile_vocab_tiles > 1:
        return True, "the composable JSD would form both heads' logits again"
    least = min(w.n, GRAD_IN_FORWARD_MIN_ROWS[w.dtype])
    if chunk_rows >= least:
        return True, f"grad-in-forward chunks of {chunk_rows} rows (at least {least})"
    return False, f"grad-in-forward chunks of {chunk_rows} rows, fewer than {least}"


def triton_grad_in_forward(w: Workload, gpu: GPU, chunk_rows: int) -> tuple[bool, str]:
    """The Triton backend's path: grad-in-forward when its chunks have ``GRAD_IN_FORWARD_MIN_ROWS`` rows, or hold
    every row. (whether, why)."""
    least = min(w.n, GRAD_IN_FORWARD_MIN_ROWS[w.dtype if w.dtype in GRAD_IN_FORWARD_MIN_ROWS else "float32"])
    if chunk_rows >= least:
        return True, f"grad-in-forward chunks of {chunk_rows} rows (at least {least})"
    return False, f"grad-in-forward chunks of {chunk_rows} rows, fewer than {least}"


# ------------------------------------------------------------------------------------------------
# d weight of the CUDA grad-in-forward path: deferred, grouped or per chunk
# ------------------------------------------------------------------------------------------------


def defer_d_weight(w: Workload, chunks: int) -> bool:
    """Deferred d weight wherever it applies (bf16, a weight gradient, N rows of dx no larger than [V, D]: the
    plan offers it only there): the backward then writes d weight once instead of reading, scaling and writing
    the [V, D] the forward wrote, and the forward's chunks hold only the fp32 tiles."""
    return True


# The fewest rows a grouped shape's chunks keep: below, its extra chunks' small launches and short products cost
# more than the beta = 1 accumulations of d weight that grouping saves.
GROUPED_MIN_CHUNK_ROWS = 1024


def cuda_groups(w: Workload, chunk_rows: int, chunks: int, candidates: list) -> int:
    """How many groups of chunks keep their dx together for one d weight product each (0: none, each chunk
    its own products). ``candidates``: (groups, chunk rows) of the grouped shapes the workspace holds, fewest
    groups first. The fewest groups whose chunks keep ``GROUPED_MIN_CHUNK_ROWS`` rows: every group fewer saves
    one beta = 1 accumulation of the fp32 [V, D] d weight (8 bytes per entry)."""
    for groups, rows in candidates:
        if rows >= min(w.n, GROUPED_MIN_CHUNK_ROWS):
            return groups
    return 0
