"""The TRL comparison benchmark's own pieces (TRL itself is an optional extra, not needed here): the TRL-side
rollout hands TRL a consistent completion (ids, env mask, the sampled tokens' log-probs), both sides get the same
task seeds, and the sglightning side's config runs and reports per-step numbers."""

from __future__ import annotations

import argparse

import torch
from scripts import benchmark

from sglightning.embedded import EMBEDDED_TINY
from sglightning.models import PolicyConfig, load_policy


def _bench():
    return benchmark("vs_trl")


def _args(**over) -> argparse.Namespace:
    base = dict(model="tiny", env="household", tasks=2, group=2, turns=2, max_new=8, micro=2, steps=2, lr=1e-5,
                threads=1, no_skip=False)
    return argparse.Namespace(**{**base, **over})


def test_trl_side_rollout_returns_aligned_completions_with_the_sampled_log_probs():
    vs = _bench()
    model, tok = load_policy(PolicyConfig(name_or_path=EMBEDDED_TINY))
    model.eval()
    tok.padding_side = "left"
    roll = vs.EpisodeRollout(tok, vs.env_factory("household"), turns=3, max_new=8)
    torch.manual_seed(0)

    class Trainer:  # what the rollout function uses of TRL's trainer
        pass

    trainer = Trainer()
    trainer.model = model
    out = roll(["task 5", "task 5", "task 9"], trainer)
    assert set(out) == {"prompt_ids", "completion_ids", "logprobs", "env_mask", "env_reward"}
    assert all(len(x) == 3 for x in out.values())
    assert out["prompt_ids"][0] == out["prompt_ids"][1] != out["prompt_ids"][2]  # same task, same first prompt
    for p, c, lp, m in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"], out["env_mask"]):
        assert len(c) == len(lp) == len(m) and sum(m) > 0
        assert m[0] == 1 and m[-1] == 1  # starts with the model's first turn, ends with its last
        assert all(v == 0.0 for v, k in zip(lp, m) if k == 0)
        # the log-probs TRL gets are the policy's own for the sampled tokens (temperature 1): a clean forward agrees
        ids = torch.tensor([p + c])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(p) - 1 : -1]  # [C, V]: predicts each completion token
        ref = logits.float().log_softmax(-1).gather(-1, torch.tensor(c)[:, None])[:, 0]
        sampled = torch.tensor(m, dtype=torch.bool)
        torch.testing.assert_close(torch.tensor(lp)[sampled], ref[sampled], atol=2e-4, rtol=1e-4)
    assert roll.records and roll.records[0]["generated"] == sum(map(sum, out["env_mask"]))
    assert model.training is False  # left as found


def test_both_sides_play_the_same_task_seeds_and_the_sglightning_side_reports_every_step(tmp_path):
    vs = _bench()
    args = _args()
    from sglightning.data import task_seeds

    seeds = [vs.step_seeds(args, s) for s in range(3)]
    assert seeds[0] == task_seeds(0, 0, 2, 0, 1, 1_000_000) and seeds[0] != seeds[1]
    cfg = vs.sgl_config(args, tmp_path)
    assert cfg["model"]["rollout"]["groups_per_step"] == 2 and cfg["model"]["grpo"]["kl_coef"] == 0.0
    assert cfg["model"]["update"]["skip_zero_advantage"] and not vs.sgl_config(_args(no_skip=True), tmp_path)[
        "model"]["update"]["skip_zero_advantage"]
    assert cfg["model"]["env"]["init_args"]["task_types"] == ["pick_up", "pick_and_place"]
    res = vs.sgl_worker(args, tmp_path)
    assert len(res["step_s"]) == len(res["rollout_s"]) == len(res["update_tokens"]) == 2
    assert all(s > 0 for s in res["step_s"]) and all(t > 0 for t in res["update_tokens"])
    res["peak_rss_mb"] = vs.peak_rss_mb()
    summ = vs.summary(res)
    assert summ["step_s"] == res["step_s"][1]  # the warm-up step is left out
    assert summ["rollout_tok_s"] == res["generated"][1] / res["rollout_s"][1]
