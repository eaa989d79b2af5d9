"""Episodes → returns: the blended return (penalty and extra terms included) and its per-step shares."""

from __future__ import annotations

import pytest
import torch

from sglightning.episodes import Episode, StepRecord
from sglightning.grpo import GRPOConfig
from sglightning.rewards import ScoreGain, advantage_inputs, episode_returns


def _episode(index: int, group: int, rewards, labels_r, invalid, won=False, score=None, initial=None) -> Episode:
    ep = Episode(index=index, group=group, seed=group, won=won, score=score, initial_score=initial)
    for r, lr, bad in zip(rewards, labels_r, invalid):
        ep.steps.append(StepRecord(observation="o", env_reward=r, internal_reward=lr, invalid=bad))
    ep.env_return = sum(rewards)
    return ep


@pytest.mark.parametrize("norm", ["sum", "mean"])
def test_step_shares_sum_to_the_blended_return(norm):
    eps = [_episode(0, 0, [0, 0, 1], [0.1, -0.1, 0.1], [False, True, False], won=True, score=80.0, initial=50.0),
           _episode(1, 0, [0, 0], [0.1, 0.1], [True, True])]
    lam = 0.5
    returns, s, terms = episode_returns(eps, lam, norm, 0.1, [ScoreGain(weight=2.0)])
    # by hand: S = Σ r (sum) or mean; R = env − P + λS + 2·gained/100
    s0, s1 = (0.1, 0.2) if norm == "sum" else (0.1 / 3, 0.1)
    torch.testing.assert_close(s, torch.tensor([s0, s1]))
    torch.testing.assert_close(terms["score_gain"], torch.tensor([2.0 * 0.3, 0.0]))
    torch.testing.assert_close(returns, torch.tensor([1 - 0.1 + lam * s0 + 0.6, 0 - 0.2 + lam * s1]))
    step_data = {"episode": torch.tensor([0, 1]), "steps": torch.zeros(2, 4, dtype=torch.long),
                 "mask": torch.ones(2, 4, dtype=torch.bool)}
    cfg = GRPOConfig(internal_reward_norm=norm, invalid_action_penalty=0.1)
    x = advantage_inputs(eps, returns, lam, terms, step_data, cfg)
    assert [len(r) for r in x.step_returns] == [3, 2]
    torch.testing.assert_close(torch.stack([r.sum() for r in x.step_returns]), returns)
