"""Tests for sglightning.grpo: every expected number is derived by hand in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from sglightning import grpo
from sglightning.grpo import (
    GRPOConfig,
    blend,
    broadcast_advantages,
    degenerate_groups,
    entropy_from_logits,
    group_advantages,
    grpo_loss,
    internal_returns,
    kl_penalty,
    masked_mean,
    token_advantages,
    trust_schedule,
    validate_breakpoints,
)

LN2 = math.log(2.0)


# ---------------------------------------------------------------------------------------------- trust schedule
@pytest.mark.parametrize(
    "step, expected",
    [
        (0, 0.0),
        (39, 0.0),  # before b0 = 40
        (40, 0.0),  # ramp starts at 0
        (45, 0.5),  # (45 - 40) / (50 - 40)
        (50, 1.0),
        (69, 1.0),
        (70, 1.0),  # anneal starts at 1
        (75, 0.5),  # 1 - (75 - 70) / (80 - 70)
        (79, 0.1),  # 1 - 9/10
        (80, 0.0),
        (100, 0.0),
        (250, 0.0),
    ],
)
def test_trust_schedule_paper_points(step, expected):
    assert trust_schedule(step, 100, (40, 50, 70, 80)) == pytest.approx(expected)
    # default breakpoints are the same schedule as fractions of training
    assert trust_schedule(step, 100) == pytest.approx(expected)


def test_trust_schedule_fractions_scale_with_total_steps():
    # fractions (0.4, 0.5, 0.7, 0.8) of 200 steps = absolute (80, 100, 140, 160)
    for step in range(0, 201):
        assert trust_schedule(step, 200, (0.4, 0.5, 0.7, 0.8)) == pytest.approx(
            trust_schedule(step, 12345, (80, 100, 140, 160))
        )
    assert trust_schedule(90, 200) == pytest.approx(0.5)  # (90 - 80) / 20


def test_trust_schedule_constant_override_and_degenerate_ramps():
    assert trust_schedule(10, 100, constant=0.0) == 0.0  # "guidance in rollouts only"
    assert trust_schedule(0, 100, constant=1.0) == 1.0  # "full reward from step 0"
    assert trust_schedule(60, 100, (40, 50, 70, 80), constant=0.0) == 0.0  # overrides the trapezoid
    with pytest.raises(ValueError, match="grpo.trust_constant"):
        trust_schedule(0, 100, constant=1.5)
    # zero-width ramps are steps, not divisions by zero ("no anneal" ablation: b2 = b3 = total)
    assert trust_schedule(49, 100, (50, 50, 100, 100)) == 0.0
    assert trust_schedule(50, 100, (50, 50, 100, 100)) == 1.0
    assert trust_schedule(99, 100, (50, 50, 100, 100)) == 1.0


@pytest.mark.parametrize(
    "bad",
    [
        (0.4, 0.5, 0.7),  # 3 numbers
        (0.4, 0.5, 0.7, 0.8, 0.9),  # 5 numbers
        (0.5, 0.4, 0.7, 0.8),  # decreasing
        (-0.1, 0.5, 0.7, 0.8),  # negative
        (0.4, 50, 70, 80),  # fraction mixed with absolute steps
        (0.4, "a", 0.7, 0.8),  # not a number
        (0.4, float("nan"), 0.7, 0.8),
        5,  # not a sequence
    ],
)
def test_validate_breakpoints_names_the_key(bad):
    with pytest.raises(ValueError, match=r"grpo\.trust_breakpoints"):
        validate_breakpoints(bad)
    with pytest.raises(ValueError, match=r"my\.key"):
        validate_breakpoints(bad, key="my.key")


def test_validate_breakpoints_accepts_and_trust_needs_total_for_fractions():
    assert validate_breakpoints((40, 50, 70, 80)) == (40.0, 50.0, 70.0, 80.0)
    assert validate_breakpoints((0, 1, 70, 80)) == (0.0, 1.0, 70.0, 80.0)  # 0 and 1 are fine as absolute steps
    with pytest.raises(ValueError, match="grpo.trust_breakpoints"):
        trust_schedule(5, 0, (0.4, 0.5, 0.7, 0.8))
    with pytest.raises(ValueError, match="grpo.trust_breakpoints"):
        trust_schedule(5, 100, (50, 40, 70, 80))


# ---------------------------------------------------------------------------------------------- blended return
def blend_returns(env, rewards, lam, normalise="sum", step_mask=None):
    """R_i = R_env,i + λ·S_i from step rewards, as the trainer composes it."""
    return blend(env, internal_returns(rewards, normalise, step_mask), lam)


def test_blend_returns_sum_by_hand():
    env = torch.tensor([1.0, 0.0])
    rewards = [torch.tensor([0.1, 0.1, -0.1]), torch.tensor([-0.1])]
    # S = [0.1 + 0.1 - 0.1, -0.1] = [0.1, -0.1];  R = env + 0.5 * S = [1.05, -0.05]
    out = blend_returns(env, rewards, 0.5)
    torch.testing.assert_close(out, torch.tensor([1.05, -0.05]))
    # lambda = 0: exactly the environment return
    torch.testing.assert_close(blend_returns(env, rewards, 0.0), env)


def test_blend_returns_mean_and_empty_episode():
    env = torch.tensor([1.0, 0.0, 1.0])
    rewards = [torch.tensor([0.1, 0.1, -0.1]), torch.tensor([-0.1]), torch.tensor([])]
    # S_mean = [0.1 / 3, -0.1 / 1, 0 (no steps)] ; R = env + 0.5 * S = [1 + 0.0166667, -0.05, 1.0]
    out = blend_returns(env, rewards, 0.5, normalise="mean")
    torch.testing.assert_close(out, torch.tensor([1.0 + 0.05 / 3, -0.05, 1.0]))
    # sum of an empty episode is 0 too
    torch.testing.assert_close(blend_returns(env, rewards, 0.5), torch.tensor([1.05, -0.05, 1.0]))


def test_blend_returns_padded_with_mask_matches_list():
    env = torch.tensor([1.0, 0.0, 1.0])
    padded = torch.tensor([[0.1, 0.1, -0.1], [-0.1, float("nan"), 9.0], [7.0, 7.0, 7.0]])  # garbage in padding
    step_mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    for norm, expected in [("sum", [1.05, -0.05, 1.0]), ("mean", [1.0 + 0.05 / 3, -0.05, 1.0])]:
        out = blend_returns(env, padded, 0.5, norm, step_mask=step_mask)
        torch.testing.assert_close(out, torch.tensor(expected))
    # no mask: every column counts. row 0: sum 0.1
    torch.testing.assert_close(internal_returns(padded[:1]), torch.tensor([0.1]))


def test_blend_returns_validation():
    env = torch.tensor([1.0, 0.0])
    with pytest.raises(ValueError, match=r"grpo\.internal_reward_norm"):
        blend_returns(env, [torch.zeros(1), torch.zeros(1)], 0.5, normalise="max")
    with pytest.raises(ValueError):
        blend_returns(env, [torch.zeros(1)], 0.5)  # 1 episode of rewards for 2 returns
    # integer env returns come back as float
    assert blend_returns(torch.tensor([1, 0]), [torch.zeros(1), torch.zeros(0)], 1.0).dtype == torch.float32


# ---------------------------------------------------------------------------------------------- advantages
def test_group_advantages_two_groups_of_four_by_hand():
    # group 7 (positions 0, 2, 4, 6) returns [1, 0, 0, 0]:
    #   mean = 0.25; deviations [0.75, -0.25, -0.25, -0.25]; sum sq = 0.5625 + 3 * 0.0625 = 0.75
    #   unbiased var = 0.75 / 3 = 0.25; std = 0.5  ->  A = [1.5, -0.5, -0.5, -0.5]
    # group 3 (positions 1, 3, 5, 7) returns [1, 1, 0, 0]:
    #   mean = 0.5; deviations [0.5, 0.5, -0.5, -0.5]; sum sq = 1.0
    #   unbiased var = 1/3; std = 0.5773503  ->  A = +-0.5 / 0.5773503 = +-0.8660254 (= sqrt(3)/2)
    returns = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    groups = torch.tensor([7, 3, 7, 3, 7, 3, 7, 3])
    h = math.sqrt(3) / 2
    expected = torch.tensor([1.5, h, -0.5, h, -0.5, -h, -0.5, -h])
    torch.testing.assert_close(group_advantages(returns, groups, eps=0.0), expected)
    torch.testing.assert_close(group_advantages(returns, groups), expected, atol=1e-5, rtol=1e-5)
    # scale="none" (Dr.GRPO): mean-centering only -> [0.75, 0.5, -0.25, 0.5, -0.25, -0.5, -0.25, -0.5]
    torch.testing.assert_close(
        group_advantages(returns, groups, scale="none"),
        torch.tensor([0.75, 0.5, -0.25, 0.5, -0.25, -0.5, -0.25, -0.5]),
    )
    # advantages sum to zero within each group
    adv = group_advantages(returns, groups)
    assert abs(adv[groups == 7].sum().item()) < 1e-6 and abs(adv[groups == 3].sum().item()) < 1e-6


def test_the_same_step_rewards_in_another_order_make_a_degenerate_group(monkeypatch):
    """Sums of the same labels' rewards in another order differ in float32's last bit; such a group has no signal.
    Bitwise equality called it informative: advantages of ±0.01 of noise, a dynamic-sampling slot used up."""
    import types

    from sglightning import rewards

    steps = [[-0.1, -0.1, -0.1, 0.1], [-0.1, 0.1, -0.1, -0.1], [0.1, -0.1, -0.1, -0.1], [-0.1, -0.1, 0.1, -0.1]]
    internal = grpo.internal_returns([torch.tensor(r) for r in steps])  # [4]
    returns = grpo.blend(torch.zeros(4), internal, lam=1.0)  # [4]
    assert len(set(returns.tolist())) > 1  # the control: the order shows in the bits
    groups = torch.zeros(4, dtype=torch.long)
    assert torch.equal(group_advantages(returns, groups), torch.zeros(4)) and degenerate_groups(returns, groups) == 1
    real = torch.tensor([-0.2, -0.2, -0.2, -0.2 + 0.1 * 0.01])  # one label differs, at λ = 0.01: a real difference
    assert degenerate_groups(real, groups) == 0 and group_advantages(real, groups).abs().max() > 0.5
    monkeypatch.setattr(rewards, "episode_returns", lambda episodes, *a: (torch.cat([returns, real]), None, None))
    episodes = [types.SimpleNamespace(group=g, error=None) for g in (0, 0, 0, 0, 1, 1, 1, 1)]
    assert rewards.informative_groups(episodes, 1.0) == {1}
    # failed_episodes: drop_group: a group with a failed episode is dropped from the update, so it carries no signal
    episodes[5].error = "step: timeout after 1 s"
    assert rewards.informative_groups(episodes, 1.0) == {1} and rewards.informative_groups(episodes, 1.0,
                                                                                           drop_failed=True) == set()


def test_group_advantages_degenerate_groups_exact_zero():
    # group 0: all 0.3 (float noise would appear from 0.3 - mean(0.3...) without explicit zeroing)
    # group 1: size 1;  group 2: [1, 0] -> mean 0.5, unbiased std = sqrt(0.5) = 0.7071068, A = +-0.7071068
    returns = torch.tensor([0.3, 0.3, 0.3, 5.0, 1.0, 0.0])
    groups = torch.tensor([0, 0, 0, 1, 2, 2])
    for scale in ("std", "none"):
        adv = group_advantages(returns, groups, scale=scale)
        assert torch.isfinite(adv).all()
        assert torch.equal(adv[:4], torch.zeros(4))  # exactly zero, not 1e-9
    torch.testing.assert_close(
        group_advantages(returns, groups, eps=0.0)[4:], torch.tensor([1 / math.sqrt(2), -1 / math.sqrt(2)])
    )
    assert degenerate_groups(returns, groups) == 2  # the all-equal group and the size-1 group
    assert degenerate_groups(torch.tensor([1.0, 0.0]), torch.tensor([0, 0])) == 0
    # an all-degenerate batch: all zeros, no NaN, even with eps = 0
    assert torch.equal(group_advantages(torch.ones(4), torch.tensor([0, 0, 1, 1]), eps=0.0), torch.zeros(4))


def test_group_advantages_random_never_nan_and_matches_loop():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        n = int(torch.randint(1, 30, (1,), generator=g))
        groups = torch.randint(0, 6, (n,), generator=g)
        returns = torch.randint(0, 3, (n,), generator=g).float() * 0.5  # many ties -> many degenerate groups
        adv = group_advantages(returns, groups)
        assert torch.isfinite(adv).all()
        for gid in groups.unique():
            sel = groups == gid
            r = returns[sel]
            if r.numel() < 2 or bool((r == r[0]).all()):
                assert torch.equal(adv[sel], torch.zeros_like(r))
            else:
                torch.testing.assert_close(adv[sel], (r - r.mean()) / (r.std() + 1e-6))


def test_group_advantages_validation_and_empty():
    assert group_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long)).shape == (0,)
    with pytest.raises(ValueError, match=r"grpo\.adv_scale"):
        group_advantages(torch.ones(2), torch.zeros(2, dtype=torch.long), scale="mad")
    with pytest.raises(ValueError):
        group_advantages(torch.tensor([1.0, float("nan")]), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError):
        group_advantages(torch.ones(2), torch.zeros(2))  # float group ids


# ---------------------------------------------------------------------------------------------- broadcast
def test_broadcast_and_token_advantages_every_policy_token_carries_episode_advantage():
    adv = torch.tensor([0.5, -1.0, 2.0])  # 3 episodes
    # 6 samples (guide/act calls): episode 0 has 2, episode 1 has 1, episode 2 has 3
    sample_episode = torch.tensor([0, 0, 1, 2, 2, 2])
    per_sample = broadcast_advantages(adv, sample_episode)
    torch.testing.assert_close(per_sample, torch.tensor([0.5, 0.5, -1.0, 2.0, 2.0, 2.0]))

    g = torch.Generator().manual_seed(1)
    mask = torch.rand(6, 9, generator=g) > 0.4  # policy tokens at scattered positions, in every step
    mask[:, 0] = True  # each sample has at least one policy token
    mask_before = mask.clone()
    tok = token_advantages(per_sample, mask)
    assert tok.shape == (6, 9)
    for s in range(6):
        ep_adv = adv[sample_episode[s]]
        assert torch.equal(tok[s][mask[s]], ep_adv.expand(int(mask[s].sum())))  # every policy token
        assert torch.equal(tok[s][~mask[s]], torch.zeros(int((~mask[s]).sum())))  # env / prompt tokens: 0
    assert torch.equal(mask, mask_before)  # inputs untouched
    # 0/1 float masks work the same
    torch.testing.assert_close(token_advantages(per_sample, mask.float()), tok)
    with pytest.raises(ValueError):
        broadcast_advantages(adv, torch.tensor([0, 3]))


# ---------------------------------------------------------------------------------------------- KL, masked mean
def test_k3_keeps_a_gradient_past_its_bound():
    """The k3 estimate is continuous at its knee and its gradient never vanishes (a clamp at 10 gave 0 there)."""
    knee = grpo._K3_KNEE
    ref = torch.tensor([knee - 1e-3, knee + 1e-3, 5.0, 30.0, -50.0])
    logp = torch.zeros(5, requires_grad=True)
    k3 = kl_penalty(logp, ref)
    k3.sum().backward()
    assert abs(float(k3[1] - k3[0])) < 0.05  # continuous
    slope = math.exp(knee) - 1.0  # d k3 / d d = e^d - 1; d = ref - logp, so d k3 / d logp = -(e^d - 1)
    assert logp.grad[2:4].tolist() == pytest.approx([-slope, -slope], rel=1e-5)
    assert logp.grad[4].item() == pytest.approx(1.0)  # far below: k3 ≈ -d - 1, slope -1 in d
    assert torch.isfinite(k3).all() and float(k3[4]) == pytest.approx(49.0)


def test_kl_penalty_by_hand():
    logp = torch.tensor([0.0, 0.0])
    ref = torch.tensor([LN2, -LN2])
    # k1 = logp - ref = [-ln2, ln2]
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([-LN2, LN2]))
    # k2 = 0.5 * ln2^2 = 0.2402265 for both
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([0.5 * LN2**2] * 2))
    # k3: d = ref - logp; exp(d) - d - 1:  d = ln2 -> 2 - 0.6931472 - 1 = 0.3068528
    #                                      d = -ln2 -> 0.5 + 0.6931472 - 1 = 0.1931472
    expected = torch.tensor([1.0 - LN2, LN2 - 0.5])
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), expected)
    torch.testing.assert_close(kl_penalty(logp, ref), expected)  # default low_var_kl
    # past d* (k3 = 10) the tangent line: d = 30 -> 10 + (e^d* - 1)(30 - d*), finite, never e^30
    knee = grpo._K3_KNEE
    assert math.exp(knee) - knee - 1.0 == pytest.approx(10.0)
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([30.0])).item() == pytest.approx(
        10.0 + (math.exp(knee) - 1.0) * (30.0 - knee), rel=1e-5)
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([0.0])).item() == 0.0
    with pytest.raises(ValueError, match=r"grpo\.kl_kind"):
        kl_penalty(logp, ref, "k4")


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, float("inf")], [3.0, float("nan"), 5.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 1]])
    # (1 + 2 + 3 + 5) / 4 = 2.75 ; per row [1.5, 4.0] ; per column [2, 2, 5]
    assert masked_mean(x, m).item() == pytest.approx(2.75)
    torch.testing.assert_close(masked_mean(x, m, dim=1), torch.tensor([1.5, 4.0]))
    torch.testing.assert_close(masked_mean(x, m, dim=0), torch.tensor([2.0, 2.0, 5.0]))
    assert masked_mean(x, torch.zeros_like(m)).item() == 0.0


# ---------------------------------------------------------------------------------------------- loss
# Hand example, 2 sequences x 3 tokens, clip (0.2, 0.28) -> band [0.8, 1.28].
#   seq 0, A = +1, ratios [1.5, 1.0, 0.5]:
#     tok0: min(1.5, 1.28) = 1.28  -> clipped above (active clipped term), loss -1.28, grad 0
#     tok1: min(1.0, 1.0)  = 1.0   -> inside band,                          loss -1.00, grad -A*rho/5 = -0.2
#     tok2: min(0.5, 0.8)  = 0.5   -> below band but A>0: unclipped,        loss -0.50, grad -0.5/5 = -0.1
#   seq 1, A = -1, ratios [0.5, 1.5, (1.1 masked out)]:
#     tok0: min(-0.5, -0.8) = -0.8 -> clipped below (active clipped term), loss +0.80, grad 0
#     tok1: min(-1.5, -1.28)= -1.5 -> above band but A<0: unclipped,       loss +1.50, grad +1.5/5 = 0.3
#     tok2: masked: no loss, grad 0
#   token_mean = (-1.28 - 1.0 - 0.5 + 0.8 + 1.5) / 5 = -0.48 / 5 = -0.096
#   seq_mean_token_mean = mean(-2.78 / 3, 2.3 / 2) = (-0.9266667 + 1.15) / 2 = 0.1116667
#   clip_frac = 2/5 = 0.4 ; ratio_mean = (1.5 + 1 + 0.5 + 0.5 + 1.5) / 5 = 1.0 ; ratio_max = 1.5
#   adv_mean = (1 + 1 + 1 - 1 - 1) / 5 = 0.2 ; num_tokens = 5
RATIOS = torch.tensor([[1.5, 1.0, 0.5], [0.5, 1.5, 1.1]], dtype=torch.float64)
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]], dtype=torch.float64)
ADV = torch.tensor([1.0, -1.0], dtype=torch.float64)
MASK = torch.tensor([[True, True, True], [True, True, False]])


def _logp():
    return (OLD + RATIOS.log()).clone().requires_grad_(True)


def test_grpo_loss_hand_example_value_stats_and_grads():
    logp = _logp()
    loss, stats = grpo_loss(logp, OLD, ADV, MASK)
    assert loss.item() == pytest.approx(-0.096)
    assert stats["policy_loss"].item() == pytest.approx(-0.096)
    assert stats["clip_frac"].item() == pytest.approx(0.4)
    assert stats["ratio_mean"].item() == pytest.approx(1.0)
    assert stats["ratio_max"].item() == pytest.approx(1.5)
    assert stats["adv_mean"].item() == pytest.approx(0.2)
    assert stats["num_tokens"].item() == 5
    assert stats["kl"].item() == 0.0
    assert all(not v.requires_grad and v.dim() == 0 for v in stats.values())
    loss.backward()
    expected_grad = torch.tensor([[0.0, -0.2, -0.1], [0.0, 0.3, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected_grad)
    assert logp.grad[0, 0] == 0 and logp.grad[1, 0] == 0  # clipped tokens: exactly no gradient
    # per-token [S, L] advantages give the same result as [S]
    loss2, _ = grpo_loss(_logp(), OLD, ADV[:, None].expand(2, 3), MASK)
    assert loss2.item() == pytest.approx(-0.096)


def test_dual_clip_caps_a_negative_advantage_tokens_loss_and_its_gradient():
    """Dual-clip PPO by hand: Â = −1 at ratios 0.5, 4.0, 1.1 (c = 3): −min(ρÂ, clip(ρ)Â) = max(ρ, clip(ρ)) is
    0.8, 4.0, 1.1; the 4.0 is capped at 3 with no gradient. Positive-advantage tokens and the loss off are untouched."""
    old = torch.zeros(2, 3, dtype=torch.float64)
    ratios = torch.tensor([[0.5, 4.0, 1.1], [0.5, 4.0, 1.1]], dtype=torch.float64)
    adv, mask = torch.tensor([-1.0, 1.0], dtype=torch.float64), torch.ones(2, 3, dtype=torch.bool)
    logp = ratios.log().requires_grad_(True)
    loss, stats = grpo_loss(logp, old, adv, mask, dual_clip=3.0)
    # row 0 (Â = −1): 0.8 + 3.0 + 1.1; row 1 (Â = 1): −min(ρ, clip(ρ)) = −0.5, −1.28, −1.1
    assert loss.item() == pytest.approx((0.8 + 3.0 + 1.1 - 0.5 - 1.28 - 1.1) / 6)
    assert stats["dual_clip_frac"].item() == pytest.approx(1 / 6)
    loss.backward()
    assert logp.grad[0, 1] == 0 and logp.grad[0, 2] != 0 and logp.grad[1, 0] != 0
    plain, plain_stats = grpo_loss(ratios.log(), old, adv, mask)  # the control: off, the 4.0 counts in full
    assert plain.item() == pytest.approx((0.8 + 4.0 + 1.1 - 0.5 - 1.28 - 1.1) / 6)
    assert "dual_clip_frac" not in plain_stats


def test_grpo_loss_gradient_only_through_logp():
    logp = _logp()
    old = OLD.clone().requires_grad_(True)
    adv = ADV.clone().requires_grad_(True)
    ref = (logp.detach() + LN2).requires_grad_(True)
    loss, _ = grpo_loss(logp, old, adv, MASK, ref_logp=ref, kl_coef=0.1)
    loss.backward()
    assert logp.grad is not None
    assert old.grad is None and adv.grad is None and ref.grad is None


def test_grpo_loss_masked_positions_do_not_matter():
    base, _ = grpo_loss(_logp(), OLD, ADV, MASK)
    for garbage in (5.0, float("inf"), float("-inf"), float("nan")):
        logp = _logp().detach().clone()
        logp[1, 2] = garbage
        old = OLD.clone()
        old[1, 2] = -garbage
        adv = ADV[:, None].expand(2, 3).clone()
        adv[1, 2] = garbage
        ref = OLD.clone()
        ref[1, 2] = garbage
        logp.requires_grad_(True)
        loss, stats = grpo_loss(logp, old, adv, MASK, ref_logp=ref, kl_coef=0.1)
        loss_nokl, _ = grpo_loss(logp, old, adv, MASK)
        assert loss_nokl.item() == pytest.approx(base.item())
        assert torch.isfinite(loss) and all(torch.isfinite(v) for v in stats.values())
        loss.backward()
        assert torch.isfinite(logp.grad).all() and logp.grad[1, 2] == 0


def test_grpo_loss_with_kl_by_hand():
    # ref = logp + ln2 at every token -> k3 = exp(ln2) - ln2 - 1 = 0.3068528 per token
    # loss = -0.096 + 0.1 * 0.3068528 = -0.0653147
    # dk3/dlogp = 1 - exp(ref - logp) = 1 - 2 = -1 -> adds 0.1 * (-1) / 5 = -0.02 to each policy token's grad
    logp = _logp()
    ref = logp.detach() + LN2
    loss, stats = grpo_loss(logp, OLD, ADV, MASK, ref_logp=ref, kl_coef=0.1, kl_kind="k3")
    assert loss.item() == pytest.approx(-0.096 + 0.1 * (1 - LN2))
    assert stats["policy_loss"].item() == pytest.approx(-0.096)
    assert stats["kl"].item() == pytest.approx(1 - LN2)
    loss.backward()
    expected_grad = torch.tensor([[-0.02, -0.22, -0.12], [-0.02, 0.28, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected_grad)
    # kl_coef = 0: KL is reported but not in the loss ; ref None with kl_coef > 0: no KL term at all
    loss0, stats0 = grpo_loss(_logp(), OLD, ADV, MASK, ref_logp=ref, kl_coef=0.0)
    assert loss0.item() == pytest.approx(-0.096) and stats0["kl"].item() == pytest.approx(1 - LN2)
    loss_none, stats_none = grpo_loss(_logp(), OLD, ADV, MASK, ref_logp=None, kl_coef=0.1)
    assert loss_none.item() == pytest.approx(-0.096) and stats_none["kl"].item() == 0.0


def test_grpo_loss_seq_mean_token_mean_differs_with_unequal_lengths():
    logp = _logp()
    loss, stats = grpo_loss(logp, OLD, ADV, MASK, loss_agg="seq_mean_token_mean")
    assert loss.item() == pytest.approx((-2.78 / 3 + 2.3 / 2) / 2)  # 0.1116667, vs token_mean -0.096
    assert stats["policy_loss"].item() == pytest.approx(0.1116667, abs=1e-6)
    loss.backward()
    # grads: seq 0 tokens weigh 1/(3*2), seq 1 tokens 1/(2*2):
    #   seq0 tok1: -1 * 1.0 / 6 = -0.1666667 ; tok2: -0.5 / 6 = -0.0833333 ; seq1 tok1: +1.5 / 4 = 0.375
    expected_grad = torch.tensor([[0.0, -1 / 6, -0.5 / 6], [0.0, 0.375, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected_grad)
    # a sequence with no policy tokens is left out of the mean over sequences
    logp3 = torch.cat([_logp().detach(), torch.zeros(1, 3, dtype=torch.float64)]).requires_grad_(True)
    mask3 = torch.cat([MASK, torch.zeros(1, 3, dtype=torch.bool)])
    loss3, _ = grpo_loss(logp3, torch.cat([OLD, torch.zeros(1, 3, dtype=torch.float64)]),
                         torch.cat([ADV, torch.tensor([9.0], dtype=torch.float64)]), mask3,
                         loss_agg="seq_mean_token_mean")
    assert loss3.item() == pytest.approx(loss.item())


def test_grpo_loss_seq_mean_token_sum_norm_weighs_every_token_alike_whatever_its_sequence_length():
    """Dr. GRPO: each sequence's token sum over one constant T, then the mean over sequences.  With T = 4:
    loss = (−2.78/4 + 2.3/4) / 2 = −0.06, and every policy token's gradient weight is 1/(T·2) = 1/8 in both sequences
    (seq_mean_token_mean gave the 3-token one 1/6 and the 2-token one 1/4: a length bias)."""
    logp = _logp()
    loss, stats = grpo_loss(logp, OLD, ADV, MASK, loss_agg="seq_mean_token_sum_norm", loss_norm_tokens=4)
    assert loss.item() == pytest.approx(-0.06) and stats["policy_loss"].item() == pytest.approx(-0.06)
    loss.backward()
    expected_grad = torch.tensor([[0.0, -1 / 8, -0.5 / 8], [0.0, 1.5 / 8, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected_grad)
    for missing in (None, 0):
        with pytest.raises(ValueError, match=r"grpo\.loss_norm_tokens"):
            grpo_loss(_logp(), OLD, ADV, MASK, loss_agg="seq_mean_token_sum_norm", loss_norm_tokens=missing)
    from sglightning.grpo import GRPOConfig

    with pytest.raises(ValueError, match=r"^grpo\.loss_norm_tokens: seq_mean_token_sum_norm divides"):
        GRPOConfig(loss_agg="seq_mean_token_sum_norm")
    assert GRPOConfig(loss_agg="seq_mean_token_sum_norm", loss_norm_tokens=64).loss_norm_tokens == 64


def test_grpo_loss_symmetric_clip_and_validation():
    # clip_high = clip_low = 0.2 -> band [0.8, 1.2]; seq0 tok0 now min(1.5, 1.2) = 1.2, seq1 tok1 still -1.5
    # token_mean = (-1.2 - 1.0 - 0.5 + 0.8 + 1.5) / 5 = -0.4 / 5 = -0.08
    loss, _ = grpo_loss(_logp(), OLD, ADV, MASK, clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx(-0.08)
    with pytest.raises(ValueError, match=r"grpo\.loss_agg"):
        grpo_loss(_logp(), OLD, ADV, MASK, loss_agg="seq_sum")
    with pytest.raises(ValueError, match=r"grpo\.kl_kind"):
        grpo_loss(_logp(), OLD, ADV, MASK, kl_kind="k9")
    with pytest.raises(ValueError):
        grpo_loss(_logp(), OLD, torch.ones(3), MASK)  # advantages neither [S] nor [S, L]
    with pytest.raises(ValueError):
        grpo_loss(_logp(), OLD[:, :2], ADV, MASK)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_grpo_loss_empty_mask_zero_and_backward(agg):
    logp = _logp()
    empty = torch.zeros_like(MASK)
    loss, stats = grpo_loss(logp, OLD, ADV, empty, ref_logp=OLD, kl_coef=0.1, loss_agg=agg, loss_norm_tokens=8)
    assert loss.item() == 0.0 and loss.grad_fn is not None
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros_like(logp))
    for k, v in stats.items():
        assert v.item() == 0.0, k


def test_grpo_loss_float32_and_01_float_mask():
    logp = _logp().detach().float().requires_grad_(True)
    loss, stats = grpo_loss(logp, OLD.float(), ADV.float(), MASK.float())
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(-0.096, abs=1e-6)
    assert stats["clip_frac"].item() == pytest.approx(0.4)


# ---------------------------------------------------------------------------------------------- entropy
def test_entropy_from_logits():
    v = 50
    # uniform over V -> log V = log 50 = 3.912023
    torch.testing.assert_close(entropy_from_logits(torch.zeros(2, 3, v)), torch.full((2, 3), math.log(v)))
    # uniform after a constant shift is still uniform
    torch.testing.assert_close(entropy_from_logits(torch.full((v,), 123.0)), torch.tensor(math.log(v)))
    # nearly one-hot -> ~0
    logits = torch.full((v,), -1e4)
    logits[3] = 1e4
    assert entropy_from_logits(logits).item() == pytest.approx(0.0, abs=1e-6)
    # -inf logits (masked vocab): uniform over the 2 finite ones -> ln 2, finite gradient
    x = torch.tensor([0.0, 0.0, float("-inf"), float("-inf")], requires_grad=True)
    h = entropy_from_logits(x)
    assert h.item() == pytest.approx(LN2)
    h.backward()
    assert torch.isfinite(x.grad).all()
    # bf16 input is computed in float32
    assert entropy_from_logits(torch.zeros(4, dtype=torch.bfloat16)).dtype == torch.float32


# ---------------------------------------------------------------------------------------------- the whole return
def test_blend_includes_penalties_and_extra_terms_by_hand():
    from sglightning.grpo import blend

    env = torch.tensor([1.0, 0.0])
    s = torch.tensor([0.3, -0.2])
    pen = torch.tensor([0.1, 0.2])
    extra = torch.tensor([0.5, 0.0])
    # R = env − P + λ·S + E
    torch.testing.assert_close(blend(env, s, 0.5, pen, extra), torch.tensor([1.0 - 0.1 + 0.15 + 0.5, 0.0 - 0.2 - 0.1]))
    with pytest.raises(ValueError, match="penalties"):
        blend(env, s, 0.5, torch.zeros(3))


def test_microbatch_weights_make_one_global_token_mean():
    """Micro-batch means weighted by microbatch_weight sum to the mean over all policy tokens (token_mean) or over all
    sequences (seq_mean_token_mean)."""
    from sglightning.grpo import StepCounts, microbatch_weight, policy_counts

    torch.manual_seed(0)
    vals = torch.randn(5, 6)
    mask = torch.rand(5, 6) > 0.4
    mask[2] = False  # a sequence without policy tokens
    totals = StepCounts(*policy_counts(mask).tolist())
    for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        whole = grpo_loss_like(vals, mask, agg)
        parts = sum(float(microbatch_weight(mask[a:b], totals, agg)) * grpo_loss_like(vals[a:b], mask[a:b], agg)
                    for a, b in ((0, 2), (2, 3), (3, 5)))
        assert parts == pytest.approx(whole, abs=1e-6)


def grpo_loss_like(vals, mask, agg):
    if agg == "token_mean":
        return float(vals[mask].sum() / mask.sum().clamp(min=1))
    per_seq = [(v[m].sum() / (m.sum() if agg == "seq_mean_token_mean" else 8)) for v, m in zip(vals, mask) if m.any()]
    return float(sum(per_seq) / max(len(per_seq), 1))


def test_clip_checks_are_the_same_in_the_loss_and_the_config():
    from sglightning.grpo import GRPOConfig

    for low, high, key in ((0.0, 0.2, "clip_low"), (1.0, 0.2, "clip_low"), (0.2, 0.0, "clip_high")):
        with pytest.raises(ValueError, match=key):
            GRPOConfig(clip_low=low, clip_high=high)
        with pytest.raises(ValueError, match=key):
            grpo_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2, dtype=torch.bool),
                      clip_low=low, clip_high=high)


def test_grpo_estimator_is_the_episode_advantage_at_every_policy_token():
    from sglightning.grpo import AdvantageInputs, grpo_advantages

    returns, groups = torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[False, True, True], [False, True, False], [False, True, True]])
    x = AdvantageInputs(returns=returns, group_ids=groups, step_returns=[], sample_episode=torch.tensor([0, 1, 2]),
                        token_step=torch.zeros(3, 3, dtype=torch.long), mask=mask, eps=0.0)
    adv = group_advantages(returns, groups, eps=0.0)
    expected = torch.where(mask, adv[torch.tensor([0, 1, 2])][:, None].expand(3, 3), torch.zeros(()))
    torch.testing.assert_close(grpo_advantages(x), expected)


@pytest.mark.parametrize("w", [0.0, 0.3])
def test_scaled_guidance_advantages_scale_exactly_those_tokens_policy_gradient(w):
    """-min(ρ·wÂ, clip(ρ)·wÂ) = w · -min(ρÂ, clip(ρ)Â) for w ≥ 0: the guidance tokens' gradient is w times the
    unscaled one (clipped tokens included), the action tokens' is unchanged."""
    g = torch.Generator().manual_seed(0)
    S, L = 3, 6
    logp0 = torch.randn(S, L, generator=g) - 2.0
    old = logp0 + 0.4 * torch.randn(S, L, generator=g)  # ratios both inside and outside the clip band
    mask = torch.rand(S, L, generator=g) > 0.2
    guidance = torch.rand(S, L, generator=g) > 0.5
    adv = torch.tensor([1.5, -0.7, 0.9])[:, None].expand(S, L) * mask

    def grad(a):
        lp = logp0.clone().requires_grad_(True)
        loss, _ = grpo.grpo_loss(lp, old, a, mask, clip_low=0.2, clip_high=0.28)
        loss.backward()
        return lp.grad

    plain = grad(adv)
    scaled = grad(grpo.scale_guidance_advantages(adv, guidance, w))
    assert torch.allclose(scaled[guidance & mask], w * plain[guidance & mask], atol=1e-7)
    assert torch.equal(scaled[~guidance & mask], plain[~guidance & mask])
    assert (plain[guidance & mask] != 0).any() and grpo.scale_guidance_advantages(adv, guidance, 1.0) is adv


def test_a_negative_or_nonfinite_guidance_advantage_scale_names_the_key():
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="grpo.guidance_advantage_scale: must be a finite number >= 0"):
            grpo.GRPOConfig(guidance_advantage_scale=bad)


@pytest.mark.parametrize("key, value", [("adv_eps", -0.1), ("adv_eps", float("nan")), ("kl_coef", float("nan")),
                                        ("kl_coef", float("inf")), ("max_grad_norm", float("nan")),
                                        ("max_grad_norm", 0.0), ("total_steps", -3), ("calibration", float("inf")),
                                        ("rollout_correction_cap", 0.5), ("dual_clip", 1.0),
                                        ("dual_clip", float("nan"))])
def test_a_number_outside_its_range_is_refused_naming_the_key(key, value):
    """NaN passes every `<` test: a NaN clip norm wrote NaN into the adapters with a finite logged norm, a NaN KL
    weight switched the KL off; a negative ε flipped the sign of a low-variance group's advantages."""
    with pytest.raises(ValueError, match=rf"grpo\.{key}: must be"):
        GRPOConfig(**{key: value})


def test_k1_in_the_loss_is_refused_as_it_pulls_on_nothing():
    """E_π[∇ log π] = 0: β·k1 has no expected gradient; k2 and k3 have (checked here on a 3-way softmax)."""
    with pytest.raises(ValueError, match=r"grpo\.kl_kind: k1 .* zero expected gradient"):
        GRPOConfig(kl_kind="k1", kl_coef=0.1)
    GRPOConfig(kl_kind="k1", kl_coef=0.0)  # no KL term: nothing to refuse
    logits = torch.tensor([0.5, -0.3, 0.1], dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([0.0, 0.4, -0.2], dtype=torch.float64), 0)
    for kind, direction in (("k1", None), ("k2", "forward"), ("k3", "reverse")):
        logp = torch.log_softmax(logits, 0)
        expected = (logp.exp().detach() * kl_penalty(logp, ref, kind)).sum()  # Σ_y π(y) ∇k(y): E_y~π[∇k]
        (grad,) = torch.autograd.grad(expected, logits)
        p, q = torch.softmax(logits, 0), ref.exp()
        if direction is None:
            assert grad.abs().max() < 1e-12
            continue
        kl = (p * (p.log() - q.log())).sum() if direction == "forward" else (q * (q.log() - p.log())).sum()
        (want,) = torch.autograd.grad(kl, logits)
        assert torch.allclose(grad, want, atol=1e-12), (kind, grad, want)
