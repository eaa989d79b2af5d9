"""Feeding context blocks of unequal lengths to the in-process engine's dynamic cache in stages: every row up to a
cut, then only the rows still longer, on a copy of their keys and values (a CPU's cost model: there a padded
position costs a real one's FLOPs)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def plan_stages(lens: Sequence[int], cached: int, copy_cost: float = 1 / 64, pass_cost: float = 48) -> list[int]:
    """How to feed blocks of unequal lengths: cumulative cut widths ``c_1 < … < c_m = max(lens)``.

    One forward over all rows pads every block to the longest, and a padded position costs as much as a real one
    (a turn's observations of 46 to 183 tokens for 16 rows were ~40 % padding in a twc rollout).  Fed in stages,
    stage 1 gives every row its first ``c_1`` tokens and stage ``j`` gives the rows longer than ``c_{j-1}`` their
    next ``c_j - c_{j-1}`` tokens, on a copy of those rows' cache.  Chosen by dynamic programming over the distinct
    lengths to minimise, in units of one position's forward,

        Σ_j n_j · (c_j − c_{j−1})  +  Σ_{j≥2} (n_j · cached · copy_cost + pass_cost)

    with ``n_1`` = all rows and ``n_j`` = rows longer than ``c_{j−1}``: the positions computed, plus copying a
    stage's rows' ``cached`` positions of keys/values (``copy_cost``: a cached position's keys and values across
    the layers are ~1/100 of a position's forward FLOPs in bytes moved, on a memory-bound CPU) and a pass's fixed
    cost (``pass_cost``: every pass reads all the weights; a 16-row decode step of SmolLM2-135M on 2 CPU cores costs
    about as much as 50 prefill positions).  Decode steps (blocks of a few tokens) are therefore fed in one pass;
    a turn's observations are cut where the lengths jump.  Returns ``[max(lens)]`` when one pass is cheapest."""
    n = len(lens)
    top = max(lens)
    points = [0] + sorted({x for x in lens if 0 < x < top}) + [top]
    longer = [sum(1 for x in lens if x > p) for p in points]  # rows still to feed after points[i]
    best = [0.0] + [float("inf")] * (len(points) - 1)
    back = [0] * len(points)
    for j in range(1, len(points)):
        for i in range(j):
            rows = n if i == 0 else longer[i]
            cost = best[i] + rows * (points[j] - points[i]) + (0 if i == 0 else rows * cached * copy_cost + pass_cost)
            if cost < best[j]:
                best[j], back[j] = cost, i
    cuts, j = [], len(points) - 1
    while j > 0:
        cuts.append(points[j])
        j = back[j]
    return cuts[::-1]


def row_subset_cache_ok(cache) -> bool:
    """Staged feeding needs plain full-attention layers holding ``keys``/``values`` tensors (transformers >= 4.56
    ``DynamicLayer``); sliding-window, quantised or older caches are fed in one pass."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:
        return False
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer and layer.keys is not None for layer in layers)


def row_subset_cache(cache, idx: torch.Tensor):
    """A new cache holding copies of rows ``idx`` of ``cache``'s keys/values: [n, heads, T, d] per layer."""
    from transformers.cache_utils import DynamicCache

    sub = DynamicCache()
    for i, layer in enumerate(cache.layers):
        sub.update(layer.keys[idx], layer.values[idx], i)
    return sub


def append_row_subset(cache, sub, idx: torch.Tensor, width: int) -> None:
    """Append the last ``width`` positions of ``sub`` (rows ``idx``) to ``cache``; the other rows get zeros there
    (masked out: they attend to nothing)."""
    for layer, part in zip(cache.layers, sub.layers):
        for name in ("keys", "values"):
            full = getattr(layer, name)  # [B, H, T, d]
            new = getattr(part, name)[:, :, -width:]  # [n, H, W, d]
            slots = full.new_zeros(full.shape[0], full.shape[1], width, full.shape[3])  # [B, H, W, d]
            slots[idx] = new
            setattr(layer, name, torch.cat([full, slots], dim=2))
