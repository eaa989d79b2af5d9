"""A new advantage estimator in one file: step-level credit from returns-to-go.

Token k of step t of episode i gets  A = (G_{i,t} − mean_g G_{·,t}) / (std_g G_{·,t} + eps),  where
G_{i,t} = Σ_{t' ≥ t} (step t' share of R_i) and the mean/std run over the episodes of i's group that reached step t.
Select it with ``grpo.advantage: return_to_go:return_to_go`` (a module:function path).
"""

from __future__ import annotations

import torch

from sglightning.grpo import AdvantageInputs


def return_to_go(x: AdvantageInputs) -> torch.Tensor:
    T = max((len(r) for r in x.step_returns), default=0)
    n = len(x.step_returns)
    rtg = torch.full((n, max(T, 1)), float("nan"))  # [N, T] NaN where an episode had ended
    for i, r in enumerate(x.step_returns):
        if len(r):
            rtg[i, : len(r)] = torch.flip(torch.cumsum(torch.flip(r, [0]), 0), [0])
    adv = torch.zeros_like(rtg)  # [N, T]
    for g in x.group_ids.unique():
        rows = (x.group_ids == g).nonzero().squeeze(-1)
        vals = rtg[rows]  # [G, T]
        seen = ~torch.isnan(vals)
        count = seen.sum(0).clamp(min=1)
        mean = torch.where(seen, vals, 0.0).sum(0) / count  # [T]
        var = torch.where(seen, (vals - mean) ** 2, 0.0).sum(0) / (count - 1).clamp(min=1)
        a = (vals - mean) / (var.sqrt() + x.eps)
        adv[rows] = torch.where(seen & (count > 1), a, 0.0)
    steps = x.token_step.clamp(max=adv.shape[1] - 1)  # [S, L]
    tok = adv[x.sample_episode[:, None], steps]  # [S, L]
    return torch.where(x.mask, tok, 0.0)
