r"""Self-Guide GRPO as pure tensor functions (no model, no Lightning).

Everything the trainer needs between "a group of finished episodes" and "a scalar loss" lives here.

Notation: N episodes (trajectories), grouped by task instance; S samples (one sample = one model call whose
tokens we score: a guidance call or an actor call of some step of some episode); L tokens per sample (padded).

Blended return (paper eq. 5-6)::

    r_t      = g(z_t) in {+0.1, 0, -0.1}                     (label -> reward, done in guidance.py)
    S_i      = \sum_t r_{i,t}                                  (normalise="sum", the paper)
             = (1/T_i) \sum_t r_{i,t}   (0 if T_i = 0)         (normalise="mean", our option)
    P_i      = c * (invalid actions of episode i)              (grpo.invalid_action_penalty c; verl-agent: 0.1)
    R_i      = R_env,i - P_i + \lambda(u) * S_i

Group-relative advantage (paper eq. 8)::

    \hat A_i = (R_i - mean_{j in g(i)} R_j) / (std_{j in g(i)} R_j + eps)     (scale="std")
    \hat A_i =  R_i - mean_{j in g(i)} R_j                                       (scale="none", Dr.GRPO)

and every policy-written token of every call of episode i carries \hat A_i (guidance and action tokens alike);
with ``guidance_advantage_scale`` w (opt-in, default 1 = the paper) the self-assessment tokens carry w * \hat A_i
(:func:`scale_guidance_advantages`).

Clipped surrogate with KL (paper eq. 9), per policy token k::

    rho_k    = exp(log pi_theta(y_k) - log pi_old(y_k))
    l_k      = -min(rho_k * A_k, clip(rho_k, 1 - eps_low, 1 + eps_high) * A_k) + beta * KL_k
    loss     = \sum_k m_k l_k / \sum_k m_k                        (loss_agg="token_mean", DAPO / paper)
             = mean_{s: n_s > 0} (\sum_k m_{s,k} l_{s,k} / n_s)    (loss_agg="seq_mean_token_mean")
             = mean_{s: n_s > 0} (\sum_k m_{s,k} l_{s,k} / T)      (loss_agg="seq_mean_token_sum_norm", Dr. GRPO;
                                                                   T = loss_norm_tokens, a constant)

where m_k marks the policy tokens and k runs over the whole step's batch — every micro-batch on every rank: a
micro-batch's own mean is weighted by its share of the global count (:func:`microbatch_weight`), so accumulated
micro-batch gradients (summed over ranks) equal the gradient of the one global mean.

Trust schedule (paper eq. 10), u = training step, breakpoints b0 <= b1 <= b2 <= b3::

    \lambda(u) = 0                      u < b0
               = (u - b0) / (b1 - b0)   b0 <= u < b1
               = 1                      b1 <= u < b2
               = 1 - (u - b2)/(b3 - b2) b2 <= u < b3
               = 0                      u >= b3

Departures from the paper (and why)
-----------------------------------
* ``normalise="mean"`` for the internal return is offered: the paper's un-normalised sum reaches +-5 over 50 steps
  and can swamp a 0/1 success reward. Default stays "sum" (paper-faithful).
* Clip-higher (DAPO): separate ``clip_low=0.2`` / ``clip_high=0.28`` -- the paper's DAPO appendix values; the paper's
  eq. 9 writes one symmetric epsilon (pass ``clip_high=clip_low`` for that).
* Group std is the *sample* (unbiased, N-1) std, ``torch.std``'s default, as in TRL and verl. The paper does not
  say which.
* Degenerate groups (all returns equal to float rounding, ``RETURN_TOL``, incl. groups of size 1) get advantage
  exactly 0, set explicitly, rather than 0/(0+eps) which can leave float noise. The same labels in another order sum to
  returns that differ in the last float32 bit; bitwise equality called such groups informative, and their advantages
  were ±0.01 of noise. They carry no learning signal; ``degenerate_groups`` counts them.
* KL estimator: default ``low_var_kl`` (Schulman's k3, e^d − d − 1 with d = log π_ref − log π_θ); past d* ≈ 2.6,
  where it reaches 10, it continues as its tangent line (value ≤ a line, gradient e^d* − 1 ≈ 12.6). verl clamps the
  value at 10, which zeroes the gradient of exactly the tokens that drifted farthest; the paper only says "KL
  penalty" and ran on verl-agent. The KL is added per token inside the loss (GRPO style), not subtracted from the
  reward; there k3's expected gradient is that of KL(π_ref ‖ π_θ), the reverse direction (``kl_penalty``).
* Token log-ratios are clamped to [-20, 20] before ``exp`` (verl does the same) so garbage never overflows.
* Loss aggregation defaults to token-mean over all policy tokens of the batch (DAPO); the per-sequence mean of the
  original GRPO is available as ``seq_mean_token_mean``, and Dr. GRPO's sum over a sequence's tokens divided by one
  constant T (no length bias) as ``seq_mean_token_sum_norm`` (with ``adv_scale: none`` for all of Dr. GRPO).
* ``calibration`` (opt-in; α = 0 is the paper): a supervised term on the self-assessment itself.  Where the env
  measured the progress p_{t−1} of the action a label z_t rates, the label's distribution (restricted to the label
  words, as sampled) is pulled toward v* = sign(p_{t−1}) by α · mean_k(−log q_θ(y*_k)) over the label's policy tokens
  whose sampled path agrees with v*'s.  With ``calibration_balance`` each target is weighted by N/(K·n_c) (n_c the
  step's targets of its label c, K the labels present), so each label carries 1/K of the term whatever its share of
  the steps (the class-balanced cross-entropy).  The paper relies on the shared GRPO objective alone to improve the
  guide; the target uses the env's progress at training time only (acting and validation need no env signal).
* ``rollout_correction`` (``auto``: on wherever half precision samples or trains — a bf16 base, ``bf16-mixed``, a
  bf16 engine; off in fp32, where sampler and trainer agree to ~1e-5): the old log-probs are the trainer's (its
  first forward's, detached; one no-grad pass in eval mode where the model drops out) and each token's policy term
  is weighted by the truncated importance weight
  between the trainer's old policy and the sampler (TIS, as verl's rollout correction and TRL's vLLM importance
  sampling). In bf16 the two disagree per token by up to ~0.02 nats (measured on a GPU), which the ratio would
  otherwise read as a policy change; the paper does not say how it handled this.
* ``guidance_advantage_scale`` (opt-in; 1 = the paper): when the model writes a reason line before every action,
  the guidance tokens can be ~90 % of a step's policy tokens (TextWorldExpress twc, SmolLM2-135M: ~1 100 of ~1 200),
  so under the token-mean the action tokens steer a small share of the update. A scale w < 1 on the guidance
  tokens' advantages shifts the update towards the actions; w = 0 leaves the guidance untrained by the policy
  gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Literal

import torch
from torch import Tensor

from sglightning.errors import check_number

__all__ = [
    "trust_schedule",
    "validate_breakpoints",
    "internal_returns",
    "group_advantages",
    "degenerate_groups",
    "in_degenerate_group",
    "broadcast_advantages",
    "token_advantages",
    "scale_guidance_advantages",
    "blend",
    "AdvantageInputs",
    "ADVANTAGE_ESTIMATORS",
    "register_advantage",
    "resolve_advantage",
    "grpo_advantages",
    "check_clip",
    "check_loss_norm",
    "check_choice",
    "policy_counts",
    "microbatch_weight",
    "StepCounts",
    "calibration_term",
    "kl_penalty",
    "masked_mean",
    "rollout_correction_weights",
    "grpo_loss",
    "entropy_from_logits",
    "NORMALISE_CHOICES",
    "SCALE_CHOICES",
    "KL_KINDS",
    "LOSS_AGGS",
]

NORMALISE_CHOICES = ("sum", "mean")
SCALE_CHOICES = ("std", "none")
KL_KINDS = ("k1", "k2", "k3", "low_var_kl")
LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
ROLLOUT_CORRECTION_MODES = ("token", "sequence")
ROLLOUT_CORRECTIONS = (None, "auto", *ROLLOUT_CORRECTION_MODES)

_LOG_RATIO_CLAMP = 20.0
_KL_CLAMP = 10.0


def _k3_knee(bound: float) -> float:
    """The log-ratio d* > 0 at which k3 = e^d − d − 1 reaches ``bound`` (Newton's method)."""
    d = math.log(bound + 1.0) + 1.0
    for _ in range(50):
        d -= (math.exp(d) - d - 1.0 - bound) / (math.exp(d) - 1.0)
    return d


#: k3 continues as a straight line past the point where it reaches _KL_CLAMP: (d*, slope e^d* − 1)
_K3_KNEE = _k3_knee(_KL_CLAMP)
_K3_SLOPE = math.exp(_K3_KNEE) - 1.0


def check_choice(key: str, value: str, allowed: Sequence[str]) -> None:
    """``ValueError("<key>: '<value>' is not one of …")`` unless ``value`` is in ``allowed``: the one check of every
    string choice of the update (the config runs it at parse time; the function that branches on it runs it too, so a
    direct call with a bad value fails instead of taking a default branch)."""
    if value not in allowed:
        raise ValueError(f"{key}: {value!r} is not one of {', '.join('null' if a is None else a for a in allowed)}")


def check_trust_constant(constant: float | None) -> None:
    """λ ≡ ``constant`` must lie in [0, 1] (None = the schedule)."""
    if constant is not None and not 0.0 <= float(constant) <= 1.0:
        raise ValueError(f"grpo.trust_constant: must be in [0, 1], got {constant!r}")


# --------------------------------------------------------------------------------------------- trust schedule
def validate_breakpoints(breakpoints, key: str = "grpo.trust_breakpoints") -> tuple[float, float, float, float]:
    """Check trust-schedule breakpoints; return them as a float 4-tuple or raise ``ValueError`` naming ``key``.

    Rules: exactly 4 finite, non-negative numbers, non-decreasing. All <= 1.0 means "fractions of total steps";
    any > 1 means "absolute steps", and then no value may be a non-integer fraction in (0, 1) (that would be a
    mix of the two conventions, e.g. (0.4, 50, 70, 80)).
    """
    try:
        values = tuple(breakpoints)
    except TypeError:
        raise ValueError(f"{key}: expected 4 numbers, got {breakpoints!r}") from None
    if len(values) != 4:
        raise ValueError(f"{key}: expected 4 numbers (b0 <= b1 <= b2 <= b3), got {len(values)}: {values!r}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, Real) or not math.isfinite(float(v)):
            raise ValueError(f"{key}: every breakpoint must be a finite number, got {values!r}")
    out = tuple(float(v) for v in values)
    if any(v < 0 for v in out):
        raise ValueError(f"{key}: breakpoints must be >= 0, got {values!r}")
    if any(a > b for a, b in zip(out, out[1:])):
        raise ValueError(f"{key}: breakpoints must be non-decreasing (b0 <= b1 <= b2 <= b3), got {values!r}")
    if any(v > 1.0 for v in out) and any(0.0 < v < 1.0 for v in out):
        raise ValueError(
            f"{key}: mixes fractions (<= 1) with absolute steps (> 1): {values!r}; "
            "give all four as fractions of training or all as step numbers"
        )
    return out  # type: ignore[return-value]


def label_reliability(moments: Sequence[float]) -> float:
    """How far the guidance labels can be trusted, from the moments ``[n, Σx, Σy, Σx², Σy², Σxy]`` of the pairs
    (x = v(z_t) ∈ {−1, 0, 1}, the label's value; y = sign(p_{t−1}), the previous action's measured progress):

        ρ = max(0, corr(x, y)) = max(0, (nΣxy − ΣxΣy) / √((nΣx² − (Σx)²)(nΣy² − (Σy)²)))

    1 = the labels track progress perfectly; 0 = no positive relation — labels independent of progress, a constant
    label (always "positive": no information, zero variance), anti-correlated labels, or fewer than 2 pairs.  Used by
    ``grpo.trust_adaptive`` as the factor on λ(u)."""
    n, sx, sy, sxx, syy, sxy = (float(v) for v in moments)
    if n < 2:
        return 0.0
    vx, vy = n * sxx - sx * sx, n * syy - sy * sy
    if vx <= 1e-12 or vy <= 1e-12:
        return 0.0
    return max(0.0, min(1.0, (n * sxy - sx * sy) / math.sqrt(vx * vy)))


def trust_schedule(
    step: int,
    total_steps: int,
    breakpoints: tuple[float, float, float, float] = (0.4, 0.5, 0.7, 0.8),
    *,
    constant: float | None = None,
) -> float:
    """Trust weight lambda(u) in [0, 1] for training step ``step`` (paper eq. 10, a trapezoid).

    ``breakpoints`` are fractions of ``total_steps`` when all are <= 1.0, else absolute step numbers.
    ``constant`` overrides the schedule (lambda == constant), e.g. 0.0 for "guidance in rollouts only" and 1.0 for
    "full reward from step 0".
    """
    if constant is not None:
        check_trust_constant(constant)
        return float(constant)
    b0, b1, b2, b3 = validate_breakpoints(breakpoints)
    if max(b0, b1, b2, b3) <= 1.0:  # fractions of training
        if total_steps is None or total_steps <= 0:
            raise ValueError(
                f"grpo.trust_breakpoints: fractional breakpoints need total_steps > 0, got {total_steps!r}"
            )
        b0, b1, b2, b3 = (b * total_steps for b in (b0, b1, b2, b3))
    u = float(step)
    if u < b0:
        return 0.0
    if u < b1:  # only reachable when b1 > b0, so no division by zero
        return (u - b0) / (b1 - b0)
    if u < b2:
        return 1.0
    if u < b3:
        return 1.0 - (u - b2) / (b3 - b2)
    return 0.0


# --------------------------------------------------------------------------------------------- returns
def internal_returns(
    internal_rewards: list[Tensor] | Tensor,
    normalise: str = "sum",
    step_mask: Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Tensor:
    """Per-episode internal return S_i: sum (or mean) of step rewards. Returns ``[N]``.

    ``internal_rewards``: list of 1-D tensors (any lengths, empty allowed) or a padded ``[N, T]`` tensor; for the
    padded form ``step_mask`` ``[N, T]`` (bool or 0/1) marks real steps (all steps real when None).
    An episode with no steps has S_i = 0 under both normalisations.
    """
    check_choice("grpo.internal_reward_norm", normalise, NORMALISE_CHOICES)
    if isinstance(internal_rewards, Tensor):
        r = internal_rewards.detach()
        if r.dim() != 2:
            raise ValueError(f"padded internal_rewards must be [N, T], got shape {tuple(r.shape)}")
        r = r.to(dtype=dtype, device=device if device is not None else r.device)
        if step_mask is None:
            m = torch.ones_like(r, dtype=torch.bool)
        else:
            if step_mask.shape != r.shape:
                raise ValueError(f"step_mask shape {tuple(step_mask.shape)} != rewards shape {tuple(r.shape)}")
            m = step_mask.to(device=r.device).bool()
        total = torch.where(m, r, torch.zeros_like(r)).sum(dim=1)  # [N]; where() so NaN padding can't leak
        if normalise == "sum":
            return total
        count = m.sum(dim=1).to(dtype)  # [N]
        return total / count.clamp(min=1.0)  # empty episode: 0 / 1 = 0
    if step_mask is not None:
        raise ValueError("step_mask is only meaningful with a padded [N, T] internal_rewards tensor")
    out = []
    for ep in internal_rewards:  # one 1-D tensor of step rewards per episode
        ep = torch.as_tensor(ep).detach().to(dtype=dtype, device=device).reshape(-1)
        if ep.numel() == 0:
            out.append(torch.zeros((), dtype=dtype, device=ep.device))
        else:
            out.append(ep.sum() if normalise == "sum" else ep.mean())
    return torch.stack(out) if out else torch.zeros(0, dtype=dtype, device=device)  # [N]


def blend(env_returns: Tensor, internal: Tensor, lam: float, penalties: Tensor | None = None,
          extra: Tensor | None = None) -> Tensor:
    """R_i = R_env,i − P_i + λ·S_i (+ E_i) from per-episode tensors ``[N]``: env returns, internal returns S_i from
    :func:`internal_returns`, invalid-action penalties P_i ≥ 0 and, optionally, the sum E_i of any extra reward terms
    (:mod:`sglightning.rewards`).  No autograd."""
    env = env_returns.detach()
    if env.dim() != 1 or internal.shape != env.shape:
        raise ValueError(f"env_returns and internal returns must both be [N]; got {tuple(env.shape)} and "
                         f"{tuple(internal.shape)}")
    dtype = env.dtype if env.is_floating_point() else torch.float32
    out = env.to(dtype) + float(lam) * internal.detach().to(dtype=dtype, device=env.device)
    for name, term, sign in (("penalties", penalties, -1.0), ("extra rewards", extra, 1.0)):
        if term is not None:
            if term.shape != env.shape:
                raise ValueError(f"{term.shape[0]} {name} for {env.shape[0]} env returns")
            out = out + sign * term.detach().to(dtype=dtype, device=env.device)
    return out


# --------------------------------------------------------------------------------------------- advantages
def _group_stats(returns: Tensor, group_ids: Tensor):
    """In float64: deviation from group mean [N], group unbiased std [N], degenerate flag [N] and per group [G]."""
    if returns.dim() != 1 or group_ids.shape != returns.shape:
        raise ValueError(
            f"returns and group_ids must both be [N]; got {tuple(returns.shape)} and {tuple(group_ids.shape)}"
        )
    if group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    r = returns.detach().to(torch.float64)  # [N]
    if not torch.isfinite(r).all():
        raise ValueError("returns contain NaN/inf; refusing to compute advantages")
    _, inv = torch.unique(group_ids.to(r.device), return_inverse=True)  # inv: [N] dense group index 0..G-1
    num_groups = int(inv.max().item()) + 1 if inv.numel() else 0
    counts = torch.bincount(inv, minlength=num_groups).to(torch.float64)  # [G]
    mean = torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add_(0, inv, r) / counts  # [G]
    dev = r - mean[inv]  # [N]
    sq = torch.zeros_like(mean).index_add_(0, inv, dev * dev)  # [G]
    std = (sq / (counts - 1.0).clamp(min=1.0)).sqrt()  # [G] unbiased (N-1); size-1 groups are degenerate anyway
    init = torch.zeros_like(mean)
    gmax = init.scatter_reduce(0, inv, r, reduce="amax", include_self=False)  # [G]
    gmin = init.scatter_reduce(0, inv, r, reduce="amin", include_self=False)  # [G]
    degenerate = ~returns_differ(gmax, gmin)  # [G] all returns equal to rounding (includes size-1 groups)
    return dev, std[inv], degenerate[inv], degenerate


RETURN_TOL = 1e-6
"""Returns closer than this (relative to the larger, or absolute below 1) are equal: sums of the same step rewards in
another order differ by float32 rounding (up to ~5e-7 over 200 steps), real ones by a step reward (0.1) × λ."""


def returns_differ(hi: Tensor, lo: Tensor) -> Tensor:
    """Whether a group's largest return ``hi`` and smallest ``lo`` (same shapes) differ beyond ``RETURN_TOL``."""
    return (hi - lo) > RETURN_TOL * torch.maximum(hi.abs(), lo.abs()).clamp(min=1.0)


def group_advantages(returns: Tensor, group_ids: Tensor, eps: float = 1e-6, scale: str = "std") -> Tensor:
    """GRPO advantage per episode: (R_i - mean_g) / (std_g + eps), or mean-centering only for ``scale="none"``.

    ``std_g`` is the unbiased (N-1) std, like ``torch.std`` / TRL / verl. Group ids may be any integers, groups
    may have unequal sizes. A group whose returns are all identical (including a group of one) gets exactly 0.
    Returns ``[N]`` in the returns' float dtype (float32 for integer returns); never requires grad.
    """
    check_choice("grpo.adv_scale", scale, SCALE_CHOICES)
    out_dtype = returns.dtype if returns.is_floating_point() else torch.float32
    if returns.numel() == 0:
        return torch.zeros_like(returns, dtype=out_dtype)
    dev, std, degen, _ = _group_stats(returns, group_ids)  # each [N]
    adv = dev / (std + eps) if scale == "std" else dev
    adv = torch.where(degen, torch.zeros_like(adv), adv)  # no signal in an all-equal group: exact zeros
    return adv.to(out_dtype)


def degenerate_groups(returns: Tensor, group_ids: Tensor) -> int:
    """Number of groups whose returns are all equal (to ``RETURN_TOL``; incl. size-1 groups)."""
    if returns.numel() == 0:
        return 0
    *_, per_group = _group_stats(returns, group_ids)
    return int(per_group.sum().item())


def in_degenerate_group(returns: Tensor, group_ids: Tensor) -> Tensor:
    """``[N]`` bool: whether each episode's group has all returns equal (the groups advantage 0 is set for)."""
    if returns.numel() == 0:
        return torch.zeros(0, dtype=torch.bool)
    return _group_stats(returns, group_ids)[2]


def broadcast_advantages(adv: Tensor, sample_episode: Tensor) -> Tensor:
    """Per-sample advantage: ``adv[sample_episode]``. ``adv`` [N], ``sample_episode`` [S] long -> [S]."""
    if sample_episode.is_floating_point():
        raise ValueError(f"sample_episode must be an integer tensor, got {sample_episode.dtype}")
    idx = sample_episode.to(device=adv.device, dtype=torch.long)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= adv.shape[0]):
        raise ValueError(
            f"sample_episode indices must lie in [0, {adv.shape[0]}), got [{int(idx.min())}, {int(idx.max())}]"
        )
    return adv.detach()[idx]  # [S]


def token_advantages(adv_per_sample: Tensor, mask: Tensor) -> Tensor:
    """``[S]`` advantages -> ``[S, L]``: the sample's advantage at policy tokens (mask true), 0 elsewhere."""
    if mask.dim() != 2 or adv_per_sample.shape != mask.shape[:1]:
        raise ValueError(f"need adv [S] and mask [S, L]; got {tuple(adv_per_sample.shape)} and {tuple(mask.shape)}")
    a = adv_per_sample.detach()[:, None].expand(mask.shape)  # [S, L] view, no copy
    return torch.where(mask.to(a.device).bool(), a, torch.zeros((), dtype=a.dtype, device=a.device))  # [S, L]


# --------------------------------------------------------------------------------------------- advantage estimators
@dataclass
class AdvantageInputs:
    """Everything an advantage estimator may use.  N episodes, S samples, L tokens per sample."""

    returns: Tensor  # [N] blended returns R_i
    group_ids: Tensor  # [N] the task group of each episode
    step_returns: list[Tensor]  # N × [T_i]: each step's share of R_i (env reward − penalty + λ·r_t, and extra terms
    #                             at the last step); sums to R_i
    sample_episode: Tensor  # [S] which episode (row of ``returns``) each sample belongs to
    token_step: Tensor  # [S, L] the episode step of each token
    mask: Tensor  # [S, L] policy tokens
    eps: float = 1e-6
    scale: str = "std"


#: name -> estimator: ``AdvantageInputs -> [S, L]`` token advantages (0 where ``mask`` is false)
ADVANTAGE_ESTIMATORS: dict[str, Callable[[AdvantageInputs], Tensor]] = {}


def register_advantage(name: str):
    """Decorator: make an estimator selectable as ``grpo.advantage: <name>``."""

    def add(fn: Callable[[AdvantageInputs], Tensor]) -> Callable[[AdvantageInputs], Tensor]:
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return add


def resolve_advantage(name: str) -> Callable[[AdvantageInputs], Tensor]:
    """A registered estimator, or ``package.module:function`` (imported); ``ValueError`` naming ``grpo.advantage``."""
    if name in ADVANTAGE_ESTIMATORS:
        return ADVANTAGE_ESTIMATORS[name]
    if ":" in name:
        import importlib

        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"grpo.advantage: cannot import {name!r}: {err}") from None
        if callable(fn):
            return fn
    raise ValueError(f"grpo.advantage: {name!r} is not one of {', '.join(ADVANTAGE_ESTIMATORS)} "
                     f"and not an importable 'package.module:function' (a name registered in a module of yours "
                     f"counts once the run imports that module: give package.module:function instead)")


@register_advantage("grpo")
def grpo_advantages(x: AdvantageInputs) -> Tensor:
    """The paper's: one group-relative advantage per episode (:func:`group_advantages`) at every policy token of it."""
    adv = group_advantages(x.returns, x.group_ids, eps=x.eps, scale=x.scale)  # [N]
    return token_advantages(broadcast_advantages(adv, x.sample_episode), x.mask)  # [S, L]


def scale_guidance_advantages(tok_adv: Tensor, guidance: Tensor, scale: float) -> Tensor:
    """``[S, L]`` advantages with the guidance tokens' multiplied by ``scale`` (w ≥ 0), the others unchanged.

    The clipped surrogate is positively homogeneous in the advantage, -min(ρ·wÂ, clip(ρ)·wÂ) = w · -min(ρÂ, clip(ρ)Â)
    for w ≥ 0, so this multiplies the guidance tokens' policy-gradient term by w; their KL term and their place in the
    token-mean denominator do not change.  ``guidance``: ``[S, L]`` bool, the self-assessment tokens."""
    if scale == 1.0:
        return tok_adv
    return torch.where(guidance.to(tok_adv.device), tok_adv * scale, tok_adv)  # [S, L]


# --------------------------------------------------------------------------------------------- loss
def check_clip(clip_low: float, clip_high: float) -> None:
    """The clip band [1 − clip_low, 1 + clip_high] needs 0 < clip_low < 1 and clip_high > 0."""
    if not 0.0 < clip_low < 1.0:
        raise ValueError(f"grpo.clip_low: must be in (0, 1), got {clip_low}")
    if not clip_high > 0.0:
        raise ValueError(f"grpo.clip_high: must be > 0, got {clip_high}")


def check_loss_norm(loss_agg: str, loss_norm_tokens: float | None) -> None:
    """``seq_mean_token_sum_norm`` divides each sequence's token sum by T = ``loss_norm_tokens``: it needs T >= 1."""
    if loss_agg == "seq_mean_token_sum_norm" and not (loss_norm_tokens or 0) >= 1:
        raise ValueError(f"grpo.loss_norm_tokens: seq_mean_token_sum_norm divides each sequence's token sum by it: "
                         f"give an integer >= 1 (e.g. the tokens an episode may write), got {loss_norm_tokens}")


def policy_counts(mask: Tensor | None) -> Tensor:
    """``[2]`` float64: (policy tokens, sequences with at least one policy token) of a ``[S, L]`` mask (zeros for
    None: a rank without samples still takes part in the sum over ranks)."""
    if mask is None:
        return torch.zeros(2, dtype=torch.float64)
    m = mask.bool()
    return torch.tensor([float(m.sum()), float((m.sum(1) > 0).sum())], dtype=torch.float64, device=mask.device)


def zero_advantage_rows(tok_adv: Tensor, mask: Tensor) -> Tensor:
    """``[S]`` bool: samples whose policy tokens all carry advantage 0. With no KL term their clipped-ratio loss
    min(ρÂ, clip(ρ)Â) is 0 whatever ρ, so their gradient is exactly 0 and their forward/backward can be skipped
    (they keep their place in the token-mean denominator: :func:`policy_counts` is taken over every sample)."""
    return ((tok_adv != 0) & mask.bool()).sum(1) == 0  # [S]


@dataclass(frozen=True)
class StepCounts:
    """What one step's means divide by, counted before any row is left out and summed over micro-batches and ranks:
    its policy tokens, its sequences with a policy token, its hindsight label targets, and those of each label."""

    tokens: float = 0.0
    sequences: float = 0.0
    targets: float = 0.0
    #: the targets of each label (LABELS order): for ``grpo.calibration_balance``
    per_label: tuple[float, ...] = ()

    def to_tensor(self, device=None) -> Tensor:
        """``[3 + labels]`` float64, for a sum over ranks (every rank has the same number of labels)."""
        return torch.tensor([self.tokens, self.sequences, self.targets, *self.per_label], dtype=torch.float64,
                            device=device)

    @classmethod
    def from_tensor(cls, t: Tensor) -> StepCounts:
        v = [float(x) for x in t.tolist()]
        return cls(v[0], v[1], v[2], tuple(v[3:]))


def calibration_term(target_logq: Tensor, targets: Tensor, target_label: Tensor, totals: StepCounts,
                     balance: bool = False) -> tuple[Tensor, Tensor]:
    r"""One micro-batch's share of the step's hindsight label loss (``grpo.calibration``, before α), and the plain sum
    of −log q(y*) over its targets (for the log).

    ``target_logq`` [B, W]: log q_θ(y*) (0 where no target); ``targets`` [B, W] bool: the positions with a target;
    ``target_label`` [B, W]: each target's label (index in LABELS, −1 = none); ``totals``: the step's counts, N =
    ``totals.targets``, n_c = ``totals.per_label``.  Over all micro-batches the shares add up to

        uniform:   (1/N) Σ_k −log q(y*_k)
        balanced:  (1/N) Σ_k w_{c(k)} · (−log q(y*_k)),   w_c = N / (K · n_c),  K = |{c : n_c > 0}|
                   = (1/K) Σ_c mean_{k ∈ c}(−log q(y*_k))

    The balanced form gives each target label present the same weight whatever its share of the steps."""
    nll = -(target_logq * targets)  # [B, W]
    n = max(totals.targets, 1.0)
    if balance:
        n_c = torch.tensor(totals.per_label, dtype=torch.float64, device=nll.device)  # [C]
        k = max(int((n_c > 0).sum()), 1)
        w_c = torch.where(n_c > 0, totals.targets / (k * n_c.clamp(min=1)), torch.zeros_like(n_c))  # [C]
        w = (w_c[target_label.clamp(min=0)] * targets).to(nll.dtype)  # [B, W]
        return (nll * w).sum() / n, nll.sum().detach()
    return nll.sum() / n, nll.sum().detach()


def microbatch_weight(mask: Tensor, totals: StepCounts, loss_agg: str = "token_mean") -> Tensor:
    """The share of the step's global loss that one micro-batch's own mean carries: its policy tokens over all
    micro-batches' and ranks' (``token_mean``), or its sequences over all (the two ``seq_mean_…``).  ``totals``: the
    step's counts.  Σ weight · (micro-batch mean) = the global mean."""
    check_choice("grpo.loss_agg", loss_agg, LOSS_AGGS)
    mine = policy_counts(mask)
    if loss_agg == "token_mean":
        return (mine[0] / max(totals.tokens, 1.0)).to(torch.float32)
    return (mine[1] / max(totals.sequences, 1.0)).to(torch.float32)


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str = "low_var_kl") -> Tensor:
    """Per-token KL estimate of KL(pi_theta || pi_ref) from sampled-token log-probs (elementwise).

    In the loss, on tokens sampled from pi_theta, the expected gradient of each is: k1 zero (E[∇ log pi] = 0; the
    config refuses it with kl_coef > 0), k2 ∇ KL(pi_theta || pi_ref), k3 ∇ KL(pi_ref || pi_theta) (the reverse).

    "k1": logp - ref; "k2": 0.5 (logp - ref)^2; "k3" / "low_var_kl": exp(ref - logp) - (ref - logp) - 1 with
    d = ref - logp, continued as its tangent line past the point d* ≈ 2.6 where it reaches 10 (so the value stays
    bounded by a line, never overflows, and the gradient never vanishes; verl's low_var_kl clamps the value to 10
    instead, which leaves no gradient exactly where the policy has drifted farthest from the reference).
    """
    check_choice("grpo.kl_kind", kind, KL_KINDS)
    if kind == "k1":
        return logp - ref_logp
    if kind == "k2":
        return 0.5 * (logp - ref_logp).square()
    d = ref_logp - logp
    d_in = d.clamp(max=_K3_KNEE)  # finite in the branch not taken (no inf · 0 in the backward)
    curve = torch.exp(d_in.clamp(min=-_LOG_RATIO_CLAMP)) - d_in - 1.0  # below −20, e^d ≈ 0: k3 ≈ −d − 1 (slope −1)
    line = _KL_CLAMP + _K3_SLOPE * (d - _K3_KNEE)
    return torch.where(d > _K3_KNEE, line, curve)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is true (0 where there are none; never NaN).

    Masked-out entries may hold anything (even inf/NaN): they are selected away, not multiplied by 0.
    """
    m = mask.to(x.device).bool().expand_as(x)
    total = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
    if dim is None:
        return total.sum() / m.sum().clamp(min=1).to(x.dtype)
    return total.sum(dim) / m.sum(dim).clamp(min=1).to(x.dtype)


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_kind: str = "low_var_kl",
    loss_agg: str = "token_mean",
    is_weight: Tensor | None = None,
    dual_clip: float | None = None,
    loss_norm_tokens: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped GRPO surrogate + optional per-token KL (paper eq. 9). Returns ``(loss, stats)``.

    ``dual_clip`` c (dual-clip PPO, Ye et al. 2020; not in the paper): a token with Â < 0 has its policy loss capped
    at −c·Â, so a ratio far above 1 + ε_high cannot make one token's loss (and the update) unbounded; there its
    gradient is 0.  With it, the stats hold dual_clip_frac (the share of policy tokens capped).
    ``loss_norm_tokens`` T: the constant a sequence's token sum is divided by under ``seq_mean_token_sum_norm``.

    Shapes: ``logp``, ``old_logp``, ``mask``, ``ref_logp``, ``is_weight``: ``[S, L]``; ``advantages``: ``[S, L]`` or
    ``[S]``.  ``is_weight`` (rollout correction, :func:`rollout_correction_weights`) multiplies each token's policy
    term (not its KL term): the tokens were sampled by an engine whose distribution differs slightly from the
    trainer's old policy.
    Gradient flows only through ``logp``. Stats are detached scalars: policy_loss (surrogate part, same
    aggregation as the loss), kl (token-mean KL over policy tokens; computed whenever ``ref_logp`` is given, even
    if ``kl_coef`` is 0), clip_frac, ratio_mean, ratio_max, num_tokens (float), adv_mean. An empty mask gives
    loss 0 (still attached to ``logp``'s graph) and zero stats.
    """
    check_choice("grpo.kl_kind", kl_kind, KL_KINDS)  # even without ref_logp: a bad value fails on the first call
    check_choice("grpo.loss_agg", loss_agg, LOSS_AGGS)
    check_clip(clip_low, clip_high)
    check_loss_norm(loss_agg, loss_norm_tokens)
    if logp.dim() != 2 or old_logp.shape != logp.shape or mask.shape != logp.shape:
        raise ValueError(
            f"logp, old_logp, mask must all be [S, L]; got {tuple(logp.shape)}, {tuple(old_logp.shape)}, "
            f"{tuple(mask.shape)}"
        )
    if ref_logp is not None and ref_logp.shape != logp.shape:
        raise ValueError(f"ref_logp must match logp {tuple(logp.shape)}, got {tuple(ref_logp.shape)}")
    if advantages.dim() == 1 and advantages.shape[0] == logp.shape[0]:
        adv = advantages.detach()[:, None].expand(logp.shape)  # [S] -> [S, L]
    elif advantages.shape == logp.shape:
        adv = advantages.detach()  # [S, L]
    else:
        raise ValueError(
            f"advantages must be [S] or [S, L] for logp {tuple(logp.shape)}, got {tuple(advantages.shape)}"
        )
    m = mask.to(logp.device).bool()  # [S, L]
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    # Select padding away *before* any arithmetic: padded entries may be garbage (inf/NaN), and 0 * NaN in a
    # backward pass would poison logp.grad even though the forward value is masked.
    lp = torch.where(m, logp, zero)  # [S, L]
    old = torch.where(m, old_logp.detach().to(logp.dtype), zero)  # [S, L]
    adv = torch.where(m, adv.to(logp.dtype), zero)  # [S, L]

    log_ratio = (lp - old).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # [S, L]
    ratio = torch.exp(log_ratio)  # [S, L]
    surr1 = ratio * adv  # [S, L]
    surr2 = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv  # [S, L]
    pg = torch.where(m, -torch.minimum(surr1, surr2), zero)  # [S, L] per-token policy loss
    if dual_clip is not None:
        capped = (adv < 0) & (pg > -dual_clip * adv) & m  # [S, L] Â < 0 and −min(ρÂ, clip(ρ)Â) > −c·Â
        pg = torch.where(capped, -dual_clip * adv, pg)  # [S, L] a constant there: no gradient
    if is_weight is not None:
        pg = pg * torch.where(m, is_weight.detach().to(logp.dtype), zero)  # [S, L] rollout correction
    clipped = (surr2 < surr1) & m  # [S, L] the clipped term is the active (smaller) one

    if ref_logp is not None:
        ref = torch.where(m, ref_logp.detach().to(logp.dtype), zero)  # [S, L]
        kl = torch.where(m, kl_penalty(lp, ref, kl_kind), zero)  # [S, L]
    else:
        kl = None
    per_token = pg + kl_coef * kl if (kl is not None and kl_coef > 0) else pg  # [S, L]

    n_tok = m.sum()
    mf = m.to(logp.dtype)
    if loss_agg == "token_mean":
        denom = n_tok.clamp(min=1).to(logp.dtype)
        loss = per_token.sum() / denom
        policy_loss = pg.detach().sum() / denom
    else:  # seq_mean_token_mean, seq_mean_token_sum_norm
        n_seq = mf.sum(dim=1)  # [S] tokens per sequence
        has = n_seq > 0  # [S]
        n_valid = has.sum().clamp(min=1).to(logp.dtype)
        # each sequence's token sum over its own length, or over one constant T (Dr. GRPO: no length bias)
        per_seq = n_seq.clamp(min=1) if loss_agg == "seq_mean_token_mean" else torch.full_like(n_seq, loss_norm_tokens)
        loss = (per_token.sum(dim=1) / per_seq).sum() / n_valid  # empty rows contribute 0
        policy_loss = (pg.detach().sum(dim=1) / per_seq).sum() / n_valid

    with torch.no_grad():
        r = ratio.detach()
        stats = {
            "policy_loss": policy_loss.detach(),
            "kl": masked_mean(kl.detach(), m) if kl is not None else zero.clone(),
            "clip_frac": masked_mean(clipped.to(logp.dtype), m),
            "ratio_mean": masked_mean(r, m),
            # ratios are > 0, so the zeros put at padding never win the max
            "ratio_max": torch.where(m, r, zero).amax() if r.numel() else zero.clone(),
            "num_tokens": n_tok.to(logp.dtype),
            "adv_mean": masked_mean(adv, m),
        }
        if dual_clip is not None:
            stats["dual_clip_frac"] = masked_mean(capped.to(logp.dtype), m)
    return loss, stats


def rollout_correction_weights(trainer_old: Tensor, engine: Tensor, mask: Tensor, mode: str, cap: float,
                               segments: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Truncated importance weights between the engine that sampled and the trainer's old policy (TIS)::

        token:     w_k = min(exp(log π_old(y_k) − log π_engine(y_k)), C)
        sequence:  w_g = min(exp(Σ_{k∈g} (log π_old(y_k) − log π_engine(y_k))), C)   for every token of segment g

    and the engine/trainer mismatch as the k3 estimate of KL(π_engine ‖ π_old) over the sampled tokens,
    mean_k (e^d − d − 1), d = log π_old − log π_engine.  A segment is one (sample, ``segments`` value) pair: with the
    episode step of each token, one turn (its guidance and action), so a long single-stream episode is not one
    product over ~1,000 tokens that drifts with its length; None: the whole sample.  Shapes ``[S, L]``; returns
    (weights ``[S, L]``, mismatch scalar)."""
    check_choice("grpo.rollout_correction", mode, ROLLOUT_CORRECTION_MODES)
    m = mask.bool()
    zero = torch.zeros((), dtype=trainer_old.dtype, device=trainer_old.device)
    d = torch.where(m, trainer_old - engine.to(trainer_old.dtype), zero).clamp(-_LOG_RATIO_CLAMP,
                                                                               _LOG_RATIO_CLAMP)  # [S, L]
    if mode == "token":
        w = d.exp().clamp(max=cap)  # [S, L]
    else:
        seg = torch.zeros_like(d, dtype=torch.long) if segments is None else segments.long()  # [S, L]
        n = int(seg.max()) + 1 if seg.numel() else 1
        index = torch.arange(d.shape[0], device=d.device).unsqueeze(1) * n + seg  # [S, L] one id per segment
        sums = torch.zeros(d.shape[0] * n, dtype=d.dtype, device=d.device).index_add_(0, index.flatten(), d.flatten())
        w = sums.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP).exp().clamp(max=cap)[index]  # [S, L]
    w = torch.where(m, w, zero)
    mismatch = masked_mean(d.exp() - d - 1.0, m)
    return w, mismatch


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim: ``[..., V] -> [...]``, stable for -inf logits.

    Half-precision inputs are computed (and returned) in float32.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logq = torch.log_softmax(logits, dim=-1)  # [..., V]
    q = logq.exp()  # [..., V]
    safe_logq = torch.where(q > 0, logq, torch.zeros_like(logq))  # avoid 0 * -inf = NaN (forward and backward)
    return -(q * safe_logq).sum(dim=-1)  # [...]


@dataclass
class GRPOConfig:
    """The algorithm: the blended return, the trust schedule, advantages and the clipped surrogate with KL.

    How the update is computed (micro-batches, shared prefixes) is ``update``."""

    clip_low: float = 0.2
    """ε_low: the ratio is clipped below at 1 − clip_low (0 < clip_low < 1)"""
    clip_high: float = 0.28
    """ε_high: the ratio is clipped above at 1 + clip_high (DAPO's clip-higher; equal to clip_low for the symmetric
    clip of the paper's equation)"""
    dual_clip: float | None = None
    """dual-clip PPO: a negative-advantage token's policy loss is capped at −c·Â (c > 1; verl's default is 3). null =
    off, the paper"""
    kl_coef: float = 0.01
    """β, the weight of the per-token KL to the reference policy (the same model with adapters off); 0 skips the
    reference pass"""
    kl_kind: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    """KL estimator: k1, k2, k3 or low_var_kl (both k3, continued linearly past k3 = 10 so the gradient never
    vanishes)"""
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    """token_mean over the step's policy tokens (DAPO, the paper), seq_mean_token_mean, or seq_mean_token_sum_norm
    (Dr. GRPO: each sequence's sum over loss_norm_tokens)"""
    loss_norm_tokens: int | None = None
    """T, the constant each sequence's token sum is divided by under seq_mean_token_sum_norm (e.g. the policy
    tokens an episode may write)"""
    advantage: str = "grpo"
    """the advantage estimator: ``grpo`` (one group-relative advantage per episode, the paper), another registered
    name (``grpo.register_advantage``) or ``package.module:function`` taking ``AdvantageInputs``"""
    adv_scale: Literal["std", "none"] = "std"
    """std: divide by the group's std (GRPO); none: mean-centred only (Dr. GRPO)"""
    adv_eps: float = 1e-6
    """ε added to the group std"""
    internal_reward_norm: Literal["sum", "mean"] = "sum"
    """the internal return S_i: the sum of the step rewards (the paper) or their mean over steps"""
    trust_breakpoints: tuple[float, float, float, float] = (0.4, 0.5, 0.7, 0.8)
    """λ(u) trapezoid breakpoints b0 ≤ b1 ≤ b2 ≤ b3: fractions of the run (all ≤ 1) or absolute steps"""
    trust_constant: float | None = None
    """λ ≡ this constant instead of the schedule (0 = guidance in rollouts only; 1 = full reward from the start)"""
    trust_adaptive: bool = False
    """scale λ(u) by how well the labels tracked the env's measured progress over trust_window steps; no measured
    progress: λ = 0. Off = the paper"""
    invalid_action_penalty: float = 0.0
    """P: subtracted from an episode's return per invalid action, R_i = R_env,i − P·(invalid actions) + λ·S_i
    (verl-agent, the paper's base, uses 0.1)"""
    guidance_advantage_scale: float = 1.0
    """the multiple w of its episode's advantage each guidance token carries (action tokens: 1). 1 = the paper; 0 =
    guidance gets no policy gradient"""
    trust_window: int = 8
    """steps of label/progress pairs behind ``trust_adaptive``'s reliability"""
    total_steps: int | None = None
    """total steps the fractional breakpoints refer to (default: trainer.max_steps / ppo_epochs)"""
    ppo_epochs: int = 1
    """optimiser steps per rollout (1 = on-policy; more reuse the rollout with the clipped ratio)"""
    max_grad_norm: float | None = 1.0
    """clip the total gradient norm to this (null: no clipping; the norm is logged either way)"""
    rollout_correction: Literal["auto", "token", "sequence"] | None = "auto"
    """token or sequence: old log-probs from the trainer, each term weighted min(π_trainer / π_sampler, cap); auto =
    token in half precision; null = off"""
    rollout_correction_cap: float = 2.0
    """the truncation C of the rollout-correction weight"""
    calibration: float = 0.0
    """α of the hindsight label loss: trains labels toward the sign of the progress the env measured (0 = off, the
    paper; needs guidance.decoding constrained)"""
    calibration_balance: bool = False
    """weight the hindsight targets so every label present counts equally: always saying neutral no longer minimises the
    loss (needs calibration > 0)"""

    def __post_init__(self) -> None:
        check_clip(self.clip_low, self.clip_high)
        for key, low in (("kl_coef", 0), ("adv_eps", 0), ("invalid_action_penalty", 0),
                         ("guidance_advantage_scale", 0), ("calibration", 0), ("rollout_correction_cap", 1)):
            check_number(f"grpo.{key}", getattr(self, key), low)
        check_number("grpo.max_grad_norm", self.max_grad_norm, 0, strict=True, null=True)
        check_number("grpo.dual_clip", self.dual_clip, 1, strict=True, null=True)
        for key, allowed in (("kl_kind", KL_KINDS), ("loss_agg", LOSS_AGGS), ("adv_scale", SCALE_CHOICES),
                             ("internal_reward_norm", NORMALISE_CHOICES)):
            check_choice(f"grpo.{key}", getattr(self, key), allowed)
        if self.kl_kind == "k1" and self.kl_coef > 0:
            raise ValueError("grpo.kl_kind: k1 (log π − log π_ref) in the loss has zero expected gradient on policy "
                             "(E[∇ log π] = 0): use k2 or low_var_kl, or grpo.kl_coef 0")
        resolve_advantage(self.advantage)
        self.trust_breakpoints = validate_breakpoints(self.trust_breakpoints, key="grpo.trust_breakpoints")
        for key in ("trust_window", "ppo_epochs"):
            if getattr(self, key) < 1:
                raise ValueError(f"grpo.{key}: must be >= 1, got {getattr(self, key)}")
        if self.total_steps is not None and self.total_steps < 1:
            raise ValueError(f"grpo.total_steps: must be >= 1 or null, got {self.total_steps}")
        check_trust_constant(self.trust_constant)
        check_choice("grpo.rollout_correction", self.rollout_correction, ROLLOUT_CORRECTIONS)
        check_loss_norm(self.loss_agg, self.loss_norm_tokens)
        if self.calibration_balance and self.calibration == 0:
            raise ValueError("grpo.calibration_balance: weights the hindsight label loss, which is off "
                             "(grpo.calibration: 0): set grpo.calibration > 0 or leave calibration_balance false")
