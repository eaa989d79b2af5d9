"""Cutting rows of the in-process engine's KV cache back to a prefix of their tokens, so that a prompt which repeats
what a row already holds computes only the rest.

Why.  In ``two_call`` mode each env step sends the model two fresh prompts, and each repeats most of the last one:
the rate prompt is the whole trajectory so far plus one new step, the actor prompt the task and the recent history.
Computed afresh, the rate call's prefill grows with the step index, so an episode of T steps costs O(T²) positions.
Kept and rewound, each step computes only what is new.

How.  A row's real tokens sit at slots with pads between them (blocks are left-padded within themselves, and a
finished row writes pads).  :func:`kept_slots` finds, on the device, the slots of each row's first ``keep`` real
tokens; one gather per layer moves them to the front, left-padded to the longest kept prefix.  A key carries its
rotary position from when it was computed, and the first ``keep`` tokens of a row have positions ``0 … keep-1`` in
the new prompt as in the old, so the moved keys are exactly those a fresh prefill would compute (to float rounding).
"""

from __future__ import annotations

import torch


def kept_slots(seen: torch.Tensor, keep: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each row's first ``keep[r]`` real tokens sit, compacted to ``width`` columns and left-padded.

    Args:
        seen: [R, T] bool, a real token of the row at that slot.
        keep: [R] long, the tokens to keep per row (≤ the row's real tokens).
        width: at least ``max(keep)``: the compacted rows' width.

    Returns ``index`` [R, width] (column c of row r takes slot ``index[r, c]``; pads take slot 0) and ``valid``
    [R, width] (True where a kept token lands)."""
    rows, slots = seen.shape
    rank = seen.long().cumsum(1) - 1  # [R, T] the rank of each real token in its row
    take = seen & (rank < keep[:, None])  # [R, T] the slots kept
    dest = torch.where(take, width - keep[:, None] + rank, width)  # [R, T] their column (width: dropped)
    index = torch.zeros(rows, width + 1, dtype=torch.long, device=seen.device)  # [R, width + 1]
    index.scatter_(1, dest, torch.arange(slots, device=seen.device).expand(rows, slots))
    valid = torch.arange(width, device=seen.device)[None, :] >= (width - keep)[:, None]  # [R, width]
    return index[:, :width], valid


def gather_slots(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Keys or values ``t`` [R, H, T, d] at slots ``index`` [R, W]: [R, H, W, d]."""
    return t.gather(2, index[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))
