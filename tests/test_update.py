"""prepare_update on hand-built rollouts (no model, no Lightning): returns, token advantages, row selection, counts."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from sglightning import grpo
from sglightning.engines.builtin import BuiltinEngine
from sglightning.episodes import KIND_ACTION, KIND_GUIDANCE, Episode, Piece, RolloutBatch, Sample, StepRecord
from sglightning.grpo import GRPOConfig, StepCounts
from sglightning.update import UpdateConfig, prepare_update

A = 1 / math.sqrt(2)  # a group of two unequal returns: Â = ±(d/2) / (|d|/√2) = ±1/√2 (unbiased std), up to eps


def _sample(episode: int, prompt: list[int], guidance: list[int], action: list[int]) -> Sample:
    s = Sample(episode)
    s.extend_context(prompt)
    for ids, kind in ((guidance, KIND_GUIDANCE), (action, KIND_ACTION)):
        p = Piece(kind)
        for t in ids:
            p.add(t, -0.5, True)
        s.extend_piece(p)
    s.check()
    return s


def _episode(index: int, group: int, env_reward: float, labels: list[float], invalid: list[bool],
             error: str | None = None, prompt=(1, 2, 3)) -> Episode:
    ep = Episode(index=index, group=group, seed=100 + group, error=error)
    for k, (r, bad) in enumerate(zip(labels, invalid)):
        ep.steps.append(StepRecord(observation="o", internal_reward=r, invalid=bad,
                                   env_reward=env_reward if k == len(labels) - 1 else 0.0))
    ep.env_return = env_reward
    ep.samples = [_sample(index, list(prompt), [10 + index, 11], [20 + index])]
    return ep


def _batch() -> RolloutBatch:
    """Group 0: one won (R = 1 + λ·0.2), one lost with an invalid action (R = −0.1 + λ·0); group 1: equal returns."""
    return RolloutBatch(episodes=[
        _episode(0, 0, 1.0, [0.1, 0.1], [False, False]),
        _episode(1, 0, 0.0, [0.0, 0.0], [True, False]),
        _episode(2, 1, 0.0, [0.1], [False], prompt=(1, 2, 9)),
        _episode(3, 1, 0.0, [0.1], [False], prompt=(1, 2, 9)),
    ])


def _prepare(batch=None, lam=0.5, **kw):
    grpo = dict(kl_coef=0.0, invalid_action_penalty=0.1)
    grpo.update(kw.pop("grpo", {}))
    return prepare_update(batch or _batch(), lam, GRPOConfig(**grpo), UpdateConfig(**kw.pop("update", {})), pad_id=0,
                          **kw)


def test_returns_by_hand_and_every_policy_token_carries_its_episode_advantage():
    u = _prepare(grpo={"kl_coef": 0.01})  # with a KL term every row is scored
    # R = env − 0.1·invalid + λ·Σr
    torch.testing.assert_close(u.returns, torch.tensor([1.0 + 0.5 * 0.2, -0.1, 0.05, 0.05]))
    torch.testing.assert_close(u.internal, torch.tensor([0.2, 0.0, 0.1, 0.1]))
    assert u.lam == 0.5 and u.data is not None and u.data["ids"].shape[0] == 4
    m = u.data["mask"]
    expected = [A, -A, 0.0, 0.0]  # group 1 is degenerate: exactly 0
    for row, a in enumerate(expected):
        assert torch.allclose(u.adv[row][m[row]], torch.full((3,), a), atol=1e-5), row
        assert (u.adv[row][~m[row]] == 0).all()
    assert u.stats["tokens/policy"] == 12.0 and u.stats["tokens/guidance_share"] == pytest.approx(8 / 12)
    assert u.stats["tokens/zero_advantage_samples"] == 2.0 and u.stats["tokens/skipped_zero_advantage_samples"] == 0
    assert u.counts == StepCounts(tokens=12.0, sequences=4.0, targets=0.0, per_label=(0.0, 0.0, 0.0))


def test_guidance_tokens_carry_the_scaled_advantage():
    u = _prepare(grpo={"kl_coef": 0.01, "guidance_advantage_scale": 0.25})
    kinds, m = u.data["kinds"][0], u.data["mask"][0]
    assert torch.allclose(u.adv[0][m & (kinds == KIND_GUIDANCE)], torch.full((2,), 0.25 * A), atol=1e-5)
    assert torch.allclose(u.adv[0][m & (kinds == KIND_ACTION)], torch.full((1,), A), atol=1e-5)


def test_without_kl_zero_advantage_rows_are_left_out_but_still_counted():
    u = _prepare()
    assert u.rows_left_out and u.data["ids"].shape[0] == 2 and u.adv.shape[0] == 2
    assert u.data["episode"].tolist() == [0, 1]
    assert (u.counts.tokens, u.counts.sequences) == (12.0, 4.0)  # the token-mean's denominator keeps every row
    assert u.stats["tokens/skipped_zero_advantage_samples"] == 2.0
    kept = _prepare(update={"skip_zero_advantage": False})
    assert not kept.rows_left_out and kept.data["ids"].shape[0] == 4


def test_a_failed_group_is_dropped_only_when_asked():
    batch = _batch()
    batch.episodes[2].error = "step: env died"
    keep = _prepare(batch, grpo={"kl_coef": 0.01})
    assert keep.data["ids"].shape[0] == 4 and keep.stats["rollout/failed_groups"] == 1.0
    assert keep.stats["rollout/dropped_groups"] == 0.0
    drop = _prepare(batch, grpo={"kl_coef": 0.01}, drop_failed_groups=True)
    assert drop.data["episode"].tolist() == [0, 1] and drop.stats["rollout/dropped_groups"] == 1.0
    assert (drop.counts.tokens, drop.counts.sequences, drop.counts.targets) == (6.0, 2.0, 0.0)


def test_shared_prefixes_sit_side_by_side():
    batch = _batch()
    batch.episodes[1].samples[0].ids[2] = 9  # episode 1's prompt now equals group 1's (1, 2, 9)
    u = _prepare(batch, grpo={"kl_coef": 0.01}, share_prefix=True)
    # rows sorted by their ids: (1, 2, 3, …) first, then the three rows that share (1, 2, 9, …), in order
    assert u.data["episode"].tolist() == [0, 1, 2, 3]
    batch.episodes[3].samples[0].ids[2] = 0  # (1, 2, 0, …) sorts first
    u = _prepare(batch, grpo={"kl_coef": 0.01}, share_prefix=True)
    assert u.data["episode"].tolist() == [3, 0, 1, 2]
    assert torch.allclose(u.adv[0][u.data["mask"][0]], torch.zeros(3))  # the advantages moved with their rows
    assert torch.allclose(u.adv[1][u.data["mask"][1]], torch.full((3,), A), atol=1e-5)
    plain = _prepare(batch, grpo={"kl_coef": 0.01})
    assert plain.data["episode"].tolist() == [0, 1, 2, 3]


def test_with_calibration_the_counts_hold_the_targets_of_each_label():
    """The step's hindsight targets counted per label (LABELS order), before row selection: the balanced loss's
    weights come from them (summed over ranks); a rank with nothing to score sends as many zeros."""
    batch = _batch()
    for ep, label in zip(batch.episodes, (1, 1, 0, 1)):  # label token (position 3) of each sample: a target
        s = ep.samples[0]
        s.targets, s.target_labels = {3: 7}, {3: label}
    u = _prepare(batch, grpo={"calibration": 1.0})
    assert u.counts == StepCounts(12.0, 4.0, 4.0, (1.0, 3.0, 0.0))  # 4 targets: 1 positive, 3 neutral, 0 negative
    # group 1's rows have Â = 0 but hold a target: scored all the same, their labels collated with them
    assert u.data["target_label"][u.data["target"] >= 0].tolist() == [1, 1, 0, 1]
    assert _prepare(RolloutBatch(episodes=[]), grpo={"calibration": 1.0}).counts.to_tensor().tolist() == [0.0] * 6


def test_a_rank_with_nothing_to_score():
    u = _prepare(RolloutBatch(episodes=[]))
    # the same six counts on every rank, whatever the config: they are summed over ranks
    assert u.data is None and u.adv is None and u.counts.to_tensor().tolist() == [0.0] * 6
    assert u.stats["tokens/zero_advantage_samples"] == 0.0


def test_the_update_preparation_imports_no_lightning():
    code = "import sys, sglightning.update, sglightning.metrics; assert 'lightning' not in sys.modules, 'lightning'"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def _microbatch(calibrate: bool):
    """Two rows × three tokens, policy tokens at (0, 1), (0, 2), (1, 1), sampled as the current policy would
    (ratio 1)."""
    mask = torch.tensor([[False, True, True], [False, True, False]])
    logp = torch.tensor([[0.0, -1.0, -0.5], [0.0, -2.0, 0.0]], requires_grad=True)
    mb = {"mask": mask, "old_logp": logp.detach().clone(), "adv": torch.tensor([[0.0, 1.0, 1.0], [0.0, -1.0, 0.0]]),
          "kinds": torch.full((2, 3), KIND_ACTION), "full_logp": logp.detach().clone(),
          "restrict": {"index": torch.full((2, 3), -1),
                       "target": torch.tensor([[-1, 5, -1], [-1, -1, -1]]) if calibrate else None,
                       "target_label": torch.tensor([[-1, 1, -1], [-1, -1, -1]]) if calibrate else None}}
    ent = {"sampled": torch.ones(2, 3), "unrestricted": torch.ones(2, 3)}
    if calibrate:
        ent["target_logq"] = torch.tensor([[0.0, -0.7, 0.0], [0.0, 0.0, 0.0]])
    return mb, logp, ent


def test_the_microbatch_objective_by_hand_without_lightning():
    """No KL, ratio 1: the micro-batch's token-mean loss is −(1 + 1 − 1)/3; the step has 6 policy tokens, so its
    share is 3/6 of it: −1/6, and its gradient −Â_k/6 at each policy token.  With α = 0.5 and one target of −log q =
    0.7 among the step's 2: + 0.5 · 0.7/2.  Pure: nothing of Lightning is imported."""
    from sglightning.update import microbatch_objective

    totals = StepCounts(tokens=6.0, sequences=4.0, targets=2.0, per_label=(0.0, 2.0, 0.0))
    mb, logp, ent = _microbatch(calibrate=False)
    part = microbatch_objective(mb, logp, ent, None, totals, GRPOConfig(kl_coef=0.0), first_epoch=True)
    assert math.isclose(float(part.objective), -1 / 6, rel_tol=1e-6) and part.tokens == 3.0
    part.objective.backward()
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -1 / 6, -1 / 6], [0.0, 1 / 6, 0.0]]), atol=1e-7)
    assert part.stats["policy/ratio_mean"] == pytest.approx(1.0) and part.stats["policy/sampler_ratio_max"] == 1.0
    mb, logp, ent = _microbatch(calibrate=True)
    cfg = GRPOConfig(kl_coef=0.0, calibration=0.5)
    part = microbatch_objective(mb, logp, ent, None, totals, cfg, first_epoch=False)
    assert math.isclose(float(part.objective), -1 / 6 + 0.5 * 0.7 / 2, rel_tol=1e-6)
    assert (part.calibration_nll, part.calibration_targets) == (pytest.approx(0.7), 1.0)
    assert "policy/sampler_ratio_max" not in part.stats  # the sampler comparison is the first epoch's only
    assert "loss/dual_clip_frac" not in part.stats
    mb, logp, ent = _microbatch(calibrate=False)  # grpo.dual_clip reaches the loss (ratio 1: nothing capped)
    part = microbatch_objective(mb, logp, ent, None, totals, GRPOConfig(kl_coef=0.0, dual_clip=3.0), first_epoch=True)
    assert part.stats["loss/dual_clip_frac"] == 0.0 and math.isclose(float(part.objective), -1 / 6, rel_tol=1e-6)
    script = ("import sys, sglightning.update; "
              "sys.exit(any(m.startswith(('lightning', 'pytorch_lightning')) for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", script]).returncode == 0


def test_the_configs_clip_kl_and_aggregation_reach_the_loss():
    """The by-hand test runs at ratio 1 with the defaults: dropping clip_low, clip_high, kl_kind or loss_agg from the
    loss call passed it. Ratios outside a narrow band, k2 against a reference and the sequence mean must each show."""
    from sglightning.update import microbatch_objective

    mb, logp, ent = _microbatch(calibrate=False)
    mb["old_logp"] = mb["old_logp"] + torch.tensor([[0.0, 0.3, -0.3], [0.0, 0.25, 0.0]])  # ratios e^∓0.3, e^-0.25
    ref = logp.detach() - 0.2  # [2, 3] a reference 0.2 below: k2 = 0.02 per token, k3 another value
    totals = StepCounts(tokens=3.0, sequences=2.0, targets=0.0, per_label=(0.0, 0.0, 0.0))
    cfg = GRPOConfig(clip_low=0.1, clip_high=0.1, kl_kind="k2", kl_coef=0.1, loss_agg="seq_mean_token_mean")
    part = microbatch_objective(mb, logp, ent, ref, totals, cfg, first_epoch=False)
    want, _ = grpo.grpo_loss(logp, mb["old_logp"], mb["adv"], mb["mask"], clip_low=0.1, clip_high=0.1, ref_logp=ref,
                             kl_coef=0.1, kl_kind="k2", loss_agg="seq_mean_token_mean")
    weight = grpo.microbatch_weight(mb["mask"], totals, "seq_mean_token_mean")
    assert float(part.objective) == pytest.approx(float(want * weight), rel=1e-6)
    for other in (dict(clip_low=0.2, clip_high=0.28), dict(kl_kind="low_var_kl"), dict(loss_agg="token_mean"),
                  dict(loss_agg="seq_mean_token_sum_norm", loss_norm_tokens=16)):
        base = dict(clip_low=0.1, clip_high=0.1, kl_kind="k2", kl_coef=0.1, loss_agg="seq_mean_token_mean")
        moved = microbatch_objective(mb, logp, ent, ref, totals, GRPOConfig(**{**base, **other}), first_epoch=False)
        assert float(moved.objective) != pytest.approx(float(part.objective), rel=1e-4), other  # each one counts
    # Dr. GRPO's constant reaches the loss: T = 16 against 32 halves it
    normed = [microbatch_objective(mb, logp, ent, ref, totals, GRPOConfig(
        clip_low=0.1, clip_high=0.1, kl_kind="k2", kl_coef=0.1, loss_agg="seq_mean_token_sum_norm",
        loss_norm_tokens=t), first_epoch=False).objective for t in (16, 32)]
    assert float(normed[1]) == pytest.approx(float(normed[0]) / 2, rel=1e-6) and float(normed[0]) != 0.0


def test_rollout_correction_statistics_by_hand():
    """The statistics were checked against the same two calls that make them: weights [0.5, 1.5, 1.0] on the policy
    tokens at cap 1.5 have mean 1, min 0.5, max 1.5 and one third truncated; a padded 9.0 is no token."""
    from sglightning.update import rollout_correction_stats

    weights = torch.tensor([[0.5, 1.5, 9.0], [1.0, 9.0, 9.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert rollout_correction_stats(weights, mask, 1.5, 0.125) == pytest.approx(
        {"policy/engine_mismatch_kl": 0.125, "policy/is_weight_mean": 1.0, "policy/is_weight_min": 0.5,
         "policy/is_weight_max": 1.5, "policy/is_weight_truncated": 1 / 3})
    d = torch.tensor([[0.1, -0.2, 0.0], [0.3, 0.0, 0.0]])  # log π_old − log π_engine at the policy tokens
    _, mismatch = grpo.rollout_correction_weights(d, torch.zeros_like(d), mask, "token", 2.0)
    k3 = [math.exp(x) - x - 1 for x in (0.1, -0.2, 0.3)]
    assert float(mismatch) == pytest.approx(sum(k3) / 3)


def test_step_stats_average_by_tokens_and_keep_maxima_and_minima():
    from sglightning.update import MicrobatchObjective, StepStats

    s = StepStats()
    s.add(MicrobatchObjective(torch.zeros(()), {"a": 1.0, "b_max": 2.0, "c_min": 5.0}, 3.0, 0.6, 2.0))
    s.add(MicrobatchObjective(torch.zeros(()), {"a": 3.0, "b_max": 4.0, "c_min": 1.0}, 1.0, 0.3, 1.0))
    assert s.result() == {"a": 1.5, "b_max": 4.0, "c_min": 1.0, "loss/calibration": pytest.approx(0.3)}


def test_ranks_pool_step_stats_as_one_rank_holding_every_micro_batch(monkeypatch):
    """Under DDP each rank's means were averaged alike: a rank of 1 token weighed as one of 9, and loss/calibration
    was the mean of the ranks' means.  Pooled, two ranks give what one rank with all their micro-batches gives."""
    from sglightning import distributed
    from sglightning.update import MicrobatchObjective, StepStats

    parts = [MicrobatchObjective(torch.zeros(()), {"loss/policy": 1.0, "policy/ratio_max": 2.0}, 9.0, 0.9, 3.0,
                                 {"policy/entropy_guidance": 0.0}),
             MicrobatchObjective(torch.zeros(()), {"loss/policy": 5.0, "policy/ratio_max": 7.0, "policy/ratio_min": 0.5,
                                                   "policy/entropy_guidance": 4.0}, 1.0, 2.0, 1.0)]
    one = StepStats()
    for p in parts:
        one.add(p)
    sent = []  # what rank 1 puts into the gather
    ranks = [StepStats(distributed.pool_weighted), StepStats(lambda sums, weights: sent.append((sums, weights))
                                                             or (sums, weights))]
    for rank, p in zip(ranks, parts):
        rank.add(p)
    ranks[1].result()
    monkeypatch.setattr(distributed, "is_distributed", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    monkeypatch.setattr(torch.distributed, "all_gather_object", lambda out, obj: out.__setitem__(slice(None),
                                                                                                 [obj, *sent]))
    pooled = ranks[0].result()
    assert pooled == pytest.approx(one.result())
    assert pooled["loss/policy"] == pytest.approx(1.4)  # (9·1 + 1·5) / 10, where the ranks' mean said 3.0
    assert pooled["loss/calibration"] == pytest.approx(2.9 / 4)  # Σ −log q(y*) / Σ targets, not (0.3 + 2.0) / 2
    assert pooled["policy/ratio_max"] == 7.0 and pooled["policy/ratio_min"] == 0.5  # extremes over ranks
    assert pooled["policy/entropy_guidance"] == 4.0  # the rank without guidance tokens adds nothing
    alone = StepStats()
    alone.add(parts[0])
    assert alone.result() == pytest.approx({"loss/policy": 1.0, "policy/ratio_max": 2.0, "loss/calibration": 0.3})


def test_a_statistic_of_one_token_kind_weighs_micro_batches_by_that_kind():
    """In two_call a row holds guidance tokens or action tokens: a micro-batch of action rows logged a guidance
    entropy of 0 (the mean over none), weighted by its policy tokens, so the step's value moved with the batch size."""
    from sglightning.update import MicrobatchObjective, StepStats

    guide = MicrobatchObjective(torch.zeros(()), {"policy/entropy_guidance": 2.0, "policy/entropy_action": 0.0,
                                                  "policy/entropy": 2.0}, 10.0,
                                stat_weights={"policy/entropy_guidance": 10.0, "policy/entropy_action": 0.0})
    act = MicrobatchObjective(torch.zeros(()), {"policy/entropy_guidance": 0.0, "policy/entropy_action": 1.0,
                                                "policy/entropy": 1.0}, 90.0,
                              stat_weights={"policy/entropy_guidance": 0.0, "policy/entropy_action": 90.0})
    s = StepStats()
    s.add(guide)
    s.add(act)
    got = s.result()
    assert got["policy/entropy_guidance"] == 2.0 and got["policy/entropy_action"] == 1.0  # as one micro-batch says
    assert got["policy/entropy"] == pytest.approx(1.1)  # over all policy tokens: (10·2 + 90·1) / 100


@pytest.mark.parametrize("setting,dtype,precision,engine,expected", [
    ("auto", torch.float32, "32-true", ("builtin", "float32"), None),
    ("auto", torch.bfloat16, "32-true", ("builtin", "float32"), "token"),
    ("auto", torch.float32, "bf16-mixed", ("builtin", "float32"), "token"),
    ("auto", torch.float32, "32-true", ("vllm", "bfloat16"), "token"),
    ("auto", torch.float32, "32-true", ("vllm", "float32"), None),
    ("auto", torch.float32, "32-true", ("test_update.HalfEngine", "float32"), "token"),  # an engine of one's own
    (None, torch.bfloat16, "bf16-mixed", ("builtin", "float32"), None),
    ("sequence", torch.float32, "32-true", ("builtin", "float32"), "sequence"),
])
def test_rollout_correction_mode_by_case(setting, dtype, precision, engine, expected):
    """Whether an engine samples in half precision is the engine's to say (no backend is named in the update)."""
    from sglightning.engines import EngineConfig, engine_class
    from sglightning.update import rollout_correction_mode

    cfg = EngineConfig(backend=engine[0], dtype=engine[1])
    half = engine_class(cfg).samples_in_half_precision(cfg)
    assert rollout_correction_mode(setting, weights_dtype=dtype, precision=precision, engine_half=half) == expected


class HalfEngine(BuiltinEngine):
    """An engine of a user's own with bf16 weights apart from the trainer's."""

    @classmethod
    def samples_in_half_precision(cls, cfg) -> bool:
        return True


def _collated(lengths: list[int], policy: list[bool] | None = None) -> dict[str, torch.Tensor]:
    """A collated step of rows with these lengths (right padding); each row's last token a policy token."""
    S, L = len(lengths), max(lengths)
    attn = torch.zeros(S, L, dtype=torch.long)
    mask = torch.zeros(S, L, dtype=torch.bool)
    for i, n in enumerate(lengths):
        attn[i, :n] = 1
        mask[i, n - 1] = True if policy is None else policy[i]
    return {"attn": attn, "mask": mask}


def test_micro_batches_by_rows_and_by_token_budget():
    from sglightning.scoring import microbatch_rows

    data = _collated([10, 9, 4, 3, 3, 1])
    assert microbatch_rows(data, 4) == [slice(0, 4), slice(4, 6)]  # rows only, as before
    # a budget of 20 fed positions (rows × the longest): 10+9 → 2×10; 4+3+3+1 → 4×4 = 16
    assert microbatch_rows(data, 4, max_tokens=20) == [slice(0, 2), slice(2, 6)]
    assert microbatch_rows(data, 2, max_tokens=20) == [slice(0, 2), slice(2, 4), slice(4, 6)]  # the row cap too
    # a row longer than the budget goes alone; every row lands in exactly one micro-batch
    assert microbatch_rows(data, 8, max_tokens=5) == [slice(i, i + 1) for i in range(6)]  # 2 × 3 > 5: alone too
    assert microbatch_rows(data, 8, max_tokens=6) == [*(slice(i, i + 1) for i in range(3)), slice(3, 5), slice(5, 6)]
    # micro-batches without a policy token are left out; no rows, no micro-batches
    quiet = _collated([5, 5, 5, 5], policy=[False, False, True, False])
    assert microbatch_rows(quiet, 2) == [slice(2, 4)]
    assert microbatch_rows(None, 4) == []


def test_whole_rows_come_longest_first_and_prefix_order_wins():
    """Whole rows (no shared prefixes) are scored longest first, with or without a token budget: a micro-batch's rows
    pad to similar lengths (in played order ``two_call`` pads 13-28 % of the positions fed)."""
    batch = RolloutBatch(episodes=[
        _episode(0, 0, 1.0, [0.1], [False]),  # prompt 3 tokens: 6 scored
        _episode(1, 0, 0.0, [0.0], [True], prompt=(1, 2, 4)),  # 6
        _episode(2, 1, 1.0, [0.1], [False], prompt=(1, 2, 9, 9, 9, 9)),  # 9
        _episode(3, 1, 0.0, [0.1], [False], prompt=(1, 2, 0, 7)),  # 7
    ])
    u = _prepare(batch, grpo={"kl_coef": 0.01}, update={"micro_batch_tokens": 64})
    assert u.data["episode"].tolist() == [2, 3, 0, 1] and u.data["attn"].sum(1).tolist() == [9, 7, 6, 6]
    assert torch.allclose(u.adv[0][u.data["mask"][0]], torch.full((3,), A), atol=1e-5)  # advantages moved too
    assert _prepare(batch, grpo={"kl_coef": 0.01}).data["episode"].tolist() == [2, 3, 0, 1]  # no budget: the same
    shared = _prepare(batch, grpo={"kl_coef": 0.01}, update={"micro_batch_tokens": 64}, share_prefix=True)
    assert shared.data["episode"].tolist() == [3, 0, 1, 2]  # sorted by ids: (1, 2, 0, …) < (1, 2, 3, …) < …
    with pytest.raises(ValueError, match="update.micro_batch_tokens"):
        UpdateConfig(micro_batch_tokens=0)


def test_trust_keeps_the_checkpoints_horizon_unless_total_steps_is_set():
    from sglightning.rewards import Trust

    t = Trust(GRPOConfig())
    assert t.restore(None, 100) is None and t.saved_horizon is None
    assert t.restore(100, 100) is None and t.saved_horizon == 100  # same horizon: nothing to say
    line = t.restore(50, 100)
    assert t.saved_horizon == 50 and "keeps its horizon of 50 steps" in line
    # breakpoints 0.4-0.8 of the horizon: the saved 50 wins over the run's 100, which is not even asked for
    assert t.scheduled(30, 100) == 1.0 and t.horizon(lambda: 1 / 0) == 50
    assert Trust(GRPOConfig()).scheduled(30, 100) == 0.0  # the control: no saved horizon
    explicit = Trust(GRPOConfig(total_steps=200))
    assert "rescaled" in explicit.restore(50, 200) and explicit.saved_horizon is None
    constant = Trust(GRPOConfig(trust_constant=0.3))
    assert constant.restore(50, 100) is None and constant.scheduled(7, 100) == 0.3  # no horizon to keep


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_the_correction_fed_by_micro_batches_gives_the_whole_steps_weights_and_statistics(mode):
    """Without Lightning: micro-batches' trainer log-probs fed to :class:`RolloutCorrection` in any order give the
    weights and statistics of the whole step at once (:func:`grpo.rollout_correction_weights`), keep the sampler's
    log-probs, and leave the rows for later PPO epochs (a row not yet passed keeps weight 1 on its policy tokens)."""
    from sglightning.grpo import rollout_correction_weights
    from sglightning.update import RolloutCorrection, rollout_correction_stats

    gen = torch.Generator().manual_seed(0)
    S, L = 5, 7
    mask = torch.rand(S, L, generator=gen) > 0.3
    mask[:3, 5:] = False  # rows 0-2 end at column 5: their micro-batch is cut there
    sampler = torch.where(mask, -torch.rand(S, L, generator=gen) * 3, torch.zeros(S, L))
    trainer = torch.where(mask, sampler + torch.randn(S, L, generator=gen) * 0.3, torch.zeros(S, L))
    sampler_copy = sampler.clone()
    steps = torch.arange(L).repeat(S, 1) // 3  # three turns per row
    data = {"old_logp": sampler, "mask": mask, "steps": steps}
    weights, kl = rollout_correction_weights(trainer, sampler, mask, mode, 1.5, segments=steps)  # the whole step
    expected_stats = rollout_correction_stats(weights, mask, 1.5, float(kl))
    corr = RolloutCorrection(data, mode, cap=1.5)
    d = corr.data
    for rows, width in ((slice(3, 5), 7), (slice(0, 3), 5)):  # the later micro-batch first; one cut narrower
        mb = {k: d[k][rows, :width] for k in ("old_logp", "sampler_logp", "mask", "steps")}
        out = corr.apply(mb, trainer[rows, :width].clone().requires_grad_(), rows)
        assert not out["old_logp"].requires_grad
        torch.testing.assert_close(out["is_weight"], weights[rows, :width])
        torch.testing.assert_close(out["old_logp"], trainer[rows, :width])
        if rows.start == 3:  # rows 0-2 not passed yet: the sampler's log-probs, weight 1 on policy tokens
            torch.testing.assert_close(d["old_logp"][:3], sampler[:3])
            assert torch.equal(d["is_weight"][:3], mask[:3].float()) and not corr.complete
    assert corr.complete and data["old_logp"] is sampler and torch.equal(sampler, sampler_copy)  # caller's untouched
    torch.testing.assert_close(d["sampler_logp"], sampler)
    torch.testing.assert_close(d["old_logp"], trainer)
    torch.testing.assert_close(d["is_weight"], weights)
    assert corr.stats() == pytest.approx(expected_stats) and expected_stats["policy/engine_mismatch_kl"] > 0


def _fed(blocks, order, size):
    from sglightning.prefixes import fed_positions, microbatch_runs

    return sum(fed_positions([blocks[i] for i in order[a:b]])
               for a, b in microbatch_runs([len(blocks[i]) for i in order], size))


def test_the_shared_prefix_order_keeps_a_family_and_a_length_together():
    """two_call-like rows: two groups' prompts (12 tokens after a 4-token system prompt), 2 episodes each, 3 env steps
    whose prompts grow by 6 tokens.  Sorted by ids, a micro-batch of 2 pairs an episode's short and long rows (much
    shared, much padded); the chosen order pairs the group's two episodes at one step: fewer positions fed."""
    from sglightning.prefixes import shared_prefix_order

    system = [1, 2, 3, 4]
    blocks = []
    for g in range(2):
        prompt = system + [10 + g] * 12
        for e in range(2):
            trajectory = [20 + 10 * g + 5 * e + t for t in range(18)]
            blocks += [prompt + trajectory[: 6 * (t + 1)] for t in range(3)]
    by_ids = sorted(range(len(blocks)), key=lambda i: blocks[i])
    order = shared_prefix_order(blocks, 2)
    assert sorted(order) == list(range(len(blocks)))
    assert _fed(blocks, order, 2) == 240 < _fed(blocks, by_ids, 2) == 252
    for a in range(0, len(order), 2):
        x, y = blocks[order[a]], blocks[order[a + 1]]
        assert x[:16] == y[:16] and len(x) == len(y)  # one group, one step
    # rows that only share their group's prompt (single stream: one row per episode): sorted by ids
    single = [system + [10 + g] * 12 + [30 + e] * (5 + e) for g in range(2) for e in range(3)]
    assert shared_prefix_order(single, 3) == sorted(range(6), key=lambda i: single[i])
    assert shared_prefix_order([], 4) == [] and shared_prefix_order([[1, 2]], 4) == [0]


def test_the_shared_prefix_update_moves_every_row_whole():
    """Episodes of two_call-like rows (3 per episode, prompts growing by 3 tokens): with shared prefixes in
    micro-batches of 2, the trainer's order is not the ids' order, and each row keeps its own tensors and advantages
    (compared by ids with the update without shared prefixes)."""
    episodes = []
    for i, (group, reward) in enumerate(((0, 1.0), (0, 0.0), (1, 1.0), (1, 0.0))):
        ep = _episode(i, group, reward, [0.1, 0.0, 0.1], [False, False, False])
        prompt = [1, 2, 3, 4, 5, 6, 7, 8, 40 + group]
        trajectory = [50 + 10 * i + t for t in range(9)]
        ep.samples = [_sample(i, prompt + trajectory[: 3 * t], [10 + i, 11], [20 + i]) for t in range(1, 4)]
        episodes.append(ep)
    batch = RolloutBatch(episodes=episodes)
    shared = _prepare(batch, grpo={"kl_coef": 0.01}, update={"micro_batch_size": 2}, share_prefix=True)
    plain = _prepare(batch, grpo={"kl_coef": 0.01}, update={"micro_batch_size": 2})
    rows = lambda u: [tuple(r[:n]) for r, n in zip(u.data["ids"].tolist(), u.data["attn"].sum(1).tolist())]  # noqa
    got, want = rows(shared), rows(plain)
    assert sorted(got) == sorted(want) and got != sorted(got)  # the same rows, not in the ids' order
    lengths = [len(r) for r in got]
    assert lengths[0] == lengths[1] and lengths[2] == lengths[3]  # a micro-batch: one group, one step
    for i, r in enumerate(got):
        j = want.index(r)
        for key, value in shared.data.items():
            if key not in ("restrict_ids", "restrict_valid", "restrict_exclude"):
                assert torch.equal(value[i], plain.data[key][j]), key
        assert torch.equal(shared.adv[i], plain.adv[j])


def test_a_sliding_window_model_shares_no_prefix_and_corrects_its_rollouts():
    """Sliding-window layers count cache slots, pads included: a padded shared prefix, or the engine's pads inside a
    row, shifted the window (a Qwen2 with 16-token windows: shared-prefix hidden states off by up to 2.9)."""
    import types

    from transformers import MistralConfig, Qwen2Config

    from sglightning import distributed
    from sglightning.engines.builtin import BuiltinEngine
    from sglightning.engines.vllm import VLLMEngine
    from sglightning.errors import ConfigError
    from sglightning.traits import sliding_window
    from sglightning.update import rollout_correction_mode

    def model(config):
        return types.SimpleNamespace(config=config)

    sliding = model(Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=0, num_hidden_layers=2))
    assert sliding_window(sliding) == 16 and sliding_window(model(MistralConfig(sliding_window=4096))) == 4096
    assert sliding_window(model(Qwen2Config())) is None  # the control: Qwen2's window is switched off
    assert sliding_window(model(MistralConfig(sliding_window=None))) is None and sliding_window(None) is None
    assert distributed.prefix_sharing(None, None, False) and not distributed.prefix_sharing(None, None, False, True)
    with pytest.raises(ConfigError, match="update.share_prefix: true is not supported here .*sliding-window"):
        distributed.prefix_sharing(True, None, False, sliding=True)
    assert rollout_correction_mode("auto", weights_dtype=torch.float32, precision="32-true", sliding=True) == "token"
    assert BuiltinEngine.pads_inside_rows and not VLLMEngine.pads_inside_rows


def test_a_model_scored_whole_shares_no_prefix_and_counts_none():
    """A family whose logits the decoder-only scoring does not know is scored through the whole model
    (``traits.head_is_exact``), which shares no prefix: the update must not count shared positions for it."""
    from sglightning import distributed
    from sglightning.errors import ConfigError

    assert distributed.prefix_sharing(None, None, False, head_exact=True)  # the control
    assert not distributed.prefix_sharing(None, None, False, head_exact=False)
    with pytest.raises(ConfigError, match="update.share_prefix: true is not supported here .*scored whole"):
        distributed.prefix_sharing(True, None, False, head_exact=False)
