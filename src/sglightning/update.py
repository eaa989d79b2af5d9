r"""From one step's rollout to what its optimiser step consumes, as one pure function (no model, no Lightning).

:func:`prepare_update` is the algorithm between "the groups of this step have been played" and "score these rows
and minimise this loss", in the order the paper writes it:

    R_i  = R_env,i − P_i + λ(u)·S_i + Σ_k term_k(i)               blended return            (rewards.episode_returns)
    Â    = estimator(R, groups, step shares, …)                    [S, L] per policy token   (grpo.resolve_advantage)
    Â_k ← w·Â_k at self-assessment tokens                          grpo.guidance_advantage_scale
    rows: samples with a policy token; groups with a failed env left out (``rollout.failed_episodes: drop_group``);
          with β = 0, rows whose every Â_k = 0 and that hold no hindsight label target left out (their loss and
          gradient are exactly 0)
    y*   = hindsight label targets (``grpo.calibration`` > 0): the label token the rated action's measured progress
           calls for, where the sampled label's path agrees with it (recorded by the rollout); counted per label
           for ``grpo.calibration_balance``

It returns an :class:`UpdateBatch`: the collated rows to score (ids, masks, the sampler's log-probs, restrictions),
their token advantages, the step's policy-token counts (the token-mean's denominator, taken *before* any row is
left out) and the numbers the step logs about all of this.

:func:`microbatch_objective` is one micro-batch's share of the step's loss: the clipped surrogate, the KL and
calibration terms, each weighted by its own denominator from :class:`sglightning.grpo.StepCounts`, with the statistics
the step logs; :class:`StepStats` sums them over micro-batches.  Both are pure: scored log-probs in, tensors out.
The LightningModule keeps what needs Lightning: scoring under FSDP, backward, collectives and the optimiser.

:class:`UpdateConfig` holds how the update is computed — micro-batch size, shared prefixes, skipping zero-advantage
rows, when to stop on non-finite updates: settings that change speed or robustness, never the result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from sglightning import distributed, grpo, prefixes, rewards, scoring
from sglightning.episodes import KIND_GUIDANCE, RolloutBatch
from sglightning.errors import ConfigError
from sglightning.guidance import LABELS


@dataclass
class UpdateConfig:
    """How the update is computed: none of these change what it computes (up to float rounding)."""

    micro_batch_size: int = 4
    """samples per forward/backward pass (gradients accumulate over micro-batches into one step)"""
    share_prefix: bool | None = None
    """compute a prefix shared by a micro-batch's samples once (same result; LoRA dropout: one mask). null = on
    unless FSDP, checkpointing or sliding windows"""
    micro_batch_tokens: int | None = None
    """at most this many fed positions per micro-batch (rows × the longest row; a longer row goes alone); null = limited
    by micro_batch_size only"""
    skip_zero_advantage: bool = True
    """skip the forward and backward of samples whose advantages are all 0 and without hindsight targets (the update is
    unchanged); only with grpo.kl_coef 0"""
    max_consecutive_skips: int = 5
    """stop the run (with a checkpoint) after this many consecutive non-finite updates; 0 = never stop"""
    compile: bool = False
    """compile each decoder layer for the update (torch.compile: fused norms, activations, LoRA adds); compiles of tens
    of seconds in the first steps"""

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ValueError(f"update.micro_batch_size: must be >= 1, got {self.micro_batch_size}")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ValueError(f"update.micro_batch_tokens: must be >= 1 or null, got {self.micro_batch_tokens}")
        if self.max_consecutive_skips < 0:
            raise ValueError(f"update.max_consecutive_skips: must be >= 0, got {self.max_consecutive_skips}")


@dataclass(kw_only=True)
class UpdateBatch:
    """What one optimiser step consumes.  N episodes; S rows to score (after row selection); L tokens per row."""

    lam: float  # λ the returns were blended with
    returns: Tensor  # [N] blended returns R_i
    internal: Tensor  # [N] internal returns S_i (as blended: summed or averaged over steps)
    terms: dict[str, Tensor]  # extra reward terms, weighted, [N] each
    groups: Tensor  # [N] the task group of each episode
    #: the rows to score (:func:`sglightning.scoring.collate`, then row selection), or None: nothing to score here
    data: dict[str, Tensor] | None
    adv: Tensor | None  # [S, L] token advantages of those rows (0 off the policy tokens)
    #: this rank's policy tokens, sequences, hindsight label targets and those of each label, *before* row selection:
    #: the loss is one mean over all of them (summed over ranks by the caller)
    counts: grpo.StepCounts
    rows_left_out: bool = False  # zero-advantage rows were left out (their gradient is an exact 0)
    stats: dict[str, float] = field(default_factory=dict)  # logged: failed/dropped groups, token counts


def prepare_update(
    rollout: RolloutBatch,
    lam: float,
    cfg: grpo.GRPOConfig,
    update: UpdateConfig,
    pad_id: int,
    *,
    reward_terms: Sequence[rewards.RewardTerm] = (),
    share_prefix: bool = False,
    drop_failed_groups: bool = False,
) -> UpdateBatch:
    """Blend the returns of ``rollout``'s episodes with ``lam``, compute the token advantages of their policy samples
    and select the rows the update scores.  ``share_prefix``: the update shares prefixes (rows are ordered so that a
    micro-batch's rows share much and pad little: :func:`prefix_order`); ``drop_failed_groups``: leave out every
    group with a failed episode.  Pure: same inputs, same tensors (on the CPU)."""
    episodes = rollout.episodes
    returns, internal, terms = rewards.episode_returns(
        episodes, lam, cfg.internal_reward_norm, cfg.invalid_action_penalty, reward_terms)  # [N], [N], {name: [N]}
    groups = torch.tensor([e.group for e in episodes], dtype=torch.long)  # [N]
    stats: dict[str, float] = {}

    samples = [s for s in rollout.samples if any(s.policy)]
    failed = {e.group for e in episodes if e.error is not None}
    stats["rollout/failed_groups"] = float(len(failed))
    stats["rollout/dropped_groups"] = 0.0
    if failed and drop_failed_groups:
        group_of = {e.index: e.group for e in episodes}
        samples = [s for s in samples if group_of[s.episode] not in failed]
        stats["rollout/dropped_groups"] = float(len(failed))
    if share_prefix:  # samples with common prefixes side by side: they share within a micro-batch
        samples.sort(key=lambda s: s.ids)
    else:  # whole rows longest first: a micro-batch's rows pad to similar lengths, and the largest runs first (out of
        samples.sort(key=lambda s: -scoring.scored_length(s))  # memory at once); the loss is one sum: order-free
    if not samples:  # nothing to score on this rank (it still takes part in the step's collectives)
        stats["tokens/zero_advantage_samples"] = stats["tokens/skipped_zero_advantage_samples"] = 0.0
        stats["tokens/update_positions"] = 0.0
        return UpdateBatch(lam=lam, returns=returns, internal=internal, terms=terms, groups=groups, data=None,
                           adv=None, counts=grpo.StepCounts(per_label=(0.0,) * len(LABELS)), stats=stats)

    calibrate = cfg.calibration > 0
    data = scoring.collate(samples, pad_id, targets=calibrate)  # [S, L] each (+ the restriction table, targets)
    # the grpo estimator: every policy token of every call of episode i carries Â_i (guidance and action tokens, every
    # step); another estimator may give each step its own
    inputs = rewards.advantage_inputs(episodes, returns, lam, terms, data, cfg)
    adv = grpo.resolve_advantage(cfg.advantage)(inputs)  # [S, L]
    mask = data["mask"]  # [S, L]
    if not isinstance(adv, Tensor) or adv.shape != mask.shape:
        got = tuple(adv.shape) if isinstance(adv, Tensor) else type(adv).__name__
        raise ConfigError(f"grpo.advantage: {cfg.advantage!r} returned {got}, expected token advantages of shape "
                          f"[S, L] = {tuple(mask.shape)} (rows scored x their tokens; 0 off the policy tokens)")
    adv = adv.to(mask.device)
    guidance_tokens = mask & (data["kinds"] == KIND_GUIDANCE)  # [S, L]
    adv = grpo.scale_guidance_advantages(adv, guidance_tokens, cfg.guidance_advantage_scale)  # [S, L]
    stats["tokens/policy"] = float(mask.sum())
    stats["tokens/guidance_share"] = float(guidance_tokens.sum()) / max(stats["tokens/policy"], 1.0)
    # choice tokens with one allowed continuation: no choice was made, so no loss and no place in the mean
    stats["tokens/forced_choice"] = float(sum(s.forced for s in rollout.samples))  # all of them, scored or not
    stats["tokens/total"] = float(data["attn"].sum())
    # every row, before selection: the token-mean's denominators, the hindsight targets and those of each label
    targets = (data["target"] >= 0) & mask if calibrate else torch.zeros_like(mask)  # [S, L]
    tokens, sequences = grpo.policy_counts(mask).tolist()
    per_label = (0.0,) * len(LABELS)
    if calibrate:  # the targets of each label (LABELS order), for grpo.calibration_balance's weights
        labels = data["target_label"][targets]  # [T] the label index of each target
        per_label = tuple(float(x) for x in torch.bincount(labels, minlength=len(LABELS)).tolist())
        stats["guidance/calibration_targets"] = float(targets.sum())
    counts = grpo.StepCounts(tokens, sequences, float(targets.sum()), per_label)

    zero = grpo.zero_advantage_rows(adv, mask) & ~targets.any(1)  # [S] no advantage and no target: no gradient
    stats["tokens/zero_advantage_samples"] = float(zero.sum())
    left_out = bool(zero.any()) and update.skip_zero_advantage and cfg.kl_coef == 0
    if left_out:
        # no KL: rows with Â = 0 on every policy token add exactly 0 to loss and gradient (they stay in `counts`):
        # no forward/backward for them.  With KL they are computed.
        data, adv = scoring.select_rows(data, ~zero), adv[~zero]
    if share_prefix:  # micro-batches of rows that share much and pad little (prefixes.shared_prefix_order)
        order = torch.tensor(prefix_order(data, update), dtype=torch.long)  # [S']
        data, adv = scoring.select_rows(data, order), adv[order]
    stats["tokens/skipped_zero_advantage_samples"] = stats["tokens/zero_advantage_samples"] if left_out else 0.0
    stats["tokens/update_positions"] = float(update_positions(data, update, share_prefix))
    return UpdateBatch(lam=lam, returns=returns, internal=internal, terms=terms, groups=groups, data=data, adv=adv,
                       counts=counts, rows_left_out=left_out, stats=stats)


def prefix_order(data: dict[str, Tensor], update: UpdateConfig) -> list[int]:
    """An order of the rows of ``data`` (collated, right-padded) for the shared-prefix forward.  Its micro-batches
    feed the fewest positions of a few candidates (:func:`prefixes.shared_prefix_order`)."""
    lengths = data["attn"].sum(1).tolist()  # [S]
    blocks = [row[:n] for row, n in zip(data["ids"].tolist(), lengths)]
    return prefixes.shared_prefix_order(blocks, update.micro_batch_size, update.micro_batch_tokens)


def update_positions(data: dict[str, Tensor], update: UpdateConfig, share_prefix: bool) -> int:
    """Positions one pass over the update's micro-batches feeds the model: pads included, a shared prefix once.  What
    the update's FLOPs count (≈ 2·N per position and forward), where ``tokens/total`` counts each row's own tokens.

    Args:
        data: the rows to score, collated and ordered as the update takes them ([S, L] each, right-padded).
        update: the micro-batch size and token budget.
        share_prefix: the update shares prefixes within a micro-batch (:func:`prefixes.fed_positions`)."""
    lengths = data["attn"].sum(1).tolist()  # [S]
    ids = data["ids"].tolist() if share_prefix else None  # [S][L]
    total = 0
    for rows in scoring.microbatch_rows(data, update.micro_batch_size, update.micro_batch_tokens):
        if ids is not None:
            total += prefixes.fed_positions([row[:n] for row, n in zip(ids[rows], lengths[rows])])
        else:
            total += (rows.stop - rows.start) * max(lengths[rows])
    return total


# ----------------------------------------------------------------------------------------------------------------------
# one micro-batch's objective, and the step's statistics over its micro-batches


@dataclass
class MicrobatchObjective:
    """One micro-batch's part of the step's objective, from its log-probs (the caller's forward passes)."""

    #: scalar: its share of the step's loss — the GRPO loss × its weight (:func:`grpo.microbatch_weight`) plus
    #: α × its share of the hindsight label loss (:func:`grpo.calibration_term`); summed over micro-batches (and
    #: ranks) it is the step's loss.  Backward on it accumulates the step's gradient
    objective: Tensor
    #: its statistics (:func:`scoring.microbatch_stats`), averaged over the step by policy tokens
    stats: dict[str, float]
    tokens: float  # its policy tokens
    calibration_nll: float = 0.0  # Σ −log q(y*) over its hindsight targets
    calibration_targets: float = 0.0  # how many
    #: the tokens a statistic averages over where not all its policy tokens (a token kind): its weight in the step
    stat_weights: dict[str, float] = field(default_factory=dict)


def microbatch_objective(mb: dict, logp: Tensor, ent: dict, ref_logp: Tensor | None, totals: grpo.StepCounts,
                         cfg: grpo.GRPOConfig, first_epoch: bool) -> MicrobatchObjective:
    """The objective of micro-batch ``mb`` (:func:`scoring.microbatch`: ids, masks, old log-probs, advantages,
    restrictions, rollout-correction weights) given the current log-probs of its sampled tokens ``logp`` [B, W] and
    their entropies ``ent`` (with ``target_logq`` when calibrating), the reference's ``ref_logp`` (None without the KL
    term), the step's ``totals`` over ranks, and whether this is the rollout's first PPO epoch.  Pure: no model, no
    collective; the caller runs the forward passes, the backward and the optimiser."""
    m = mb["mask"]
    loss, st = grpo.grpo_loss(
        logp, mb["old_logp"], mb["adv"], m, clip_low=cfg.clip_low, clip_high=cfg.clip_high, ref_logp=ref_logp,
        kl_coef=cfg.kl_coef, kl_kind=cfg.kl_kind, loss_agg=cfg.loss_agg, is_weight=mb.get("is_weight"),
        dual_clip=cfg.dual_clip, loss_norm_tokens=cfg.loss_norm_tokens,
    )
    objective = loss * grpo.microbatch_weight(m, totals, cfg.loss_agg).to(loss.device)
    nll = n_targets = 0.0
    if cfg.calibration > 0 and "target_logq" in ent:
        # the hindsight label loss, one mean over the step's targets (all micro-batches and ranks): α·(−log q(y*));
        # grpo.calibration_balance: each target label's mean weighs 1/K
        restrict = mb["restrict"]
        targets = (restrict["target"] >= 0) & m  # [B, W]
        term, nll_sum = grpo.calibration_term(ent["target_logq"], targets, restrict["target_label"], totals,
                                              cfg.calibration_balance)
        objective = objective + cfg.calibration * term
        nll, n_targets = float(nll_sum), float(targets.sum())
    stats, weights = scoring.microbatch_stats(mb, loss, st, logp, ent, first_epoch)
    return MicrobatchObjective(objective, stats, float(m.sum()), nll, n_targets, weights)


class StepStats:
    """A step's statistics over its micro-batches: means weighted by policy tokens (or by the tokens a statistic
    averages over: ``stat_weights``, so a micro-batch without guidance tokens does not pull the guidance entropy to
    0); ``…_max`` the maximum and ``…_min`` the minimum; ``loss/calibration`` the mean −log q(y*) over the step's
    hindsight targets."""

    def __init__(self, pool: Callable[[dict, dict], tuple[dict, dict]] | None = None) -> None:
        """A step's statistics, empty.

        Args:
            pool: merges the weighted sums and weights over ranks (:func:`sglightning.distributed.pool_weighted`),
                so every mean is over the step's tokens on all ranks; None: this rank's alone.
        """
        self._pool = pool
        self._sums: dict[str, float] = {}
        self._weights: dict[str, float] = {}
        self._nll = self._targets = 0.0

    def add(self, part: MicrobatchObjective) -> None:
        for k, v in part.stats.items():
            pick = distributed.extreme(k)  # maxima and minima merge as such, as over ranks
            if pick:
                self._sums[k], self._weights[k] = pick(self._sums.get(k, v), v), 1.0
                continue
            w = part.stat_weights.get(k, part.tokens)
            self._sums[k] = self._sums.get(k, 0.0) + v * w
            self._weights[k] = self._weights.get(k, 0.0) + w
        self._nll += part.calibration_nll
        self._targets += part.calibration_targets

    def result(self) -> dict[str, float]:
        """The step's statistics (over every rank's tokens where pooled: a collective, every rank calls it)."""
        sums, weights = dict(self._sums), dict(self._weights)
        if self._targets:  # a rank without hindsight targets adds nothing to their mean
            sums["loss/calibration"], weights["loss/calibration"] = self._nll, self._targets
        if self._pool is not None:
            sums, weights = self._pool(sums, weights)
        # loss/calibration: the mean −log q(y*) over the step's hindsight targets
        return {k: sums[k] / max(weights[k], 1e-9) for k in sums}


# ----------------------------------------------------------------------------------------------------------------------
# rollout correction: when it is on, and what its weights were


def rollout_correction_mode(setting: str | None, *, weights_dtype: torch.dtype, precision: str,
                            engine_half: bool = False, sliding: bool = False) -> str | None:
    """``grpo.rollout_correction`` resolved: ``auto`` is ``token`` where half precision samples or trains — a bf16 or
    fp16 base (``weights_dtype``), a mixed- or half-precision trainer (Lightning's ``precision``), an engine with
    half-precision weights of its own (``engine_half``: ``Engine.samples_in_half_precision``, e.g. vLLM in bf16) —
    or where the in-process engine cannot sample exactly (``sliding``: a model with sliding-window layers, whose
    window pads inside a row shift), and None otherwise, where the sampler's log-probs are the trainer's to ~1e-5."""
    if setting != "auto":
        return setting
    half = (weights_dtype in (torch.bfloat16, torch.float16) or not str(precision).startswith(("32", "64"))
            or engine_half or sliding)
    return "token" if half else None


class RolloutCorrection:
    """The rollout correction, fed micro-batch by micro-batch with the trainer's log-probs of the step's rows: by the
    update's first forward where it computes what a no-grad pass would (nothing drops out: the weights have not moved
    yet this step, so that pass, detached, is the old policy), else by one no-grad pass in eval mode before it.

    ``data`` (the step's collated rows, the caller's tensors untouched) keeps the sampler's log-probs as
    ``sampler_logp``; each micro-batch's pass writes its rows' ``old_logp`` and ``is_weight`` (1 until then), which
    later PPO epochs read.  A step cut short (a loss that is not finite) leaves rows unpassed: :attr:`complete` says
    so, and the next epoch, on the same weights, passes them again."""

    def __init__(self, data: dict[str, Tensor], mode: str, cap: float) -> None:
        old = data["old_logp"]  # [S, L]
        self.data = dict(data, old_logp=old.clone(), sampler_logp=old, is_weight=data["mask"].to(old.dtype))
        self.mode, self.cap = mode, cap
        self._passed = torch.zeros(old.shape[0], dtype=torch.bool)  # [S]

    @property
    def complete(self) -> bool:
        """Whether every row has passed (the statistics and later epochs may read :attr:`data`)."""
        return bool(self._passed.all())

    def apply(self, mb: dict, logp: Tensor, rows: slice) -> dict:
        """Micro-batch ``mb`` (rows ``rows`` of :attr:`data`) with the trainer's ``old_logp`` — its log-probs ``logp``
        [B, W] detached — and the truncated weights against the sampler's (:func:`grpo.rollout_correction_weights`)."""
        old = logp.detach().to(mb["sampler_logp"].dtype)  # [B, W]
        weights, _ = grpo.rollout_correction_weights(old, mb["sampler_logp"], mb["mask"], self.mode, self.cap,
                                                     segments=mb.get("steps"))  # sequence: per turn
        width = old.shape[1]
        self.data["old_logp"][rows, :width], self.data["is_weight"][rows, :width] = old, weights
        self._passed[rows] = True
        return dict(mb, old_logp=old, is_weight=weights)

    def stats(self) -> dict[str, float]:
        """What the correction logs, once every micro-batch has passed (:func:`rollout_correction_stats`)."""
        d = self.data
        _, mismatch = grpo.rollout_correction_weights(d["old_logp"], d["sampler_logp"], d["mask"], self.mode, self.cap,
                                                      segments=d.get("steps"))  # the KL over the whole step
        return rollout_correction_stats(d["is_weight"], d["mask"], self.cap, float(mismatch))


def rollout_correction_stats(weights: Tensor, mask: Tensor, cap: float, mismatch: float) -> dict[str, float]:
    """What the rollout correction logs: the engine/trainer mismatch KL, and the weights' mean, min, max and share
    truncated at ``cap`` over the policy tokens of ``mask`` (``weights``, ``mask``: [S, L])."""
    w = weights[mask.bool()]  # [M]
    out = {"policy/engine_mismatch_kl": float(mismatch)}
    if w.numel():
        out.update({"policy/is_weight_mean": float(w.mean()), "policy/is_weight_min": float(w.min()),
                    "policy/is_weight_max": float(w.max()),
                    "policy/is_weight_truncated": float((w >= cap).float().mean())})
    return out
