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
left out) and the numbers the step logs about all of this.  The micro-batch loop that consumes it (scoring,
:func:`sglightning.grpo.grpo_loss`, backward, the optimiser step) is the LightningModule's ``update``.

:class:`UpdateConfig` holds how the update is computed — micro-batch size, shared prefixes, skipping zero-advantage
rows, when to stop on non-finite updates: settings that change speed or robustness, never the result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from sglightning import grpo, rewards, scoring
from sglightning.episodes import KIND_GUIDANCE, RolloutBatch
from sglightning.guidance import LABELS


@dataclass
class UpdateConfig:
    """How the update is computed: none of these change what it computes (up to float rounding)."""

    micro_batch_size: int = 4
    """samples per forward/backward pass (gradients accumulate over micro-batches into one step)"""
    share_prefix: bool | None = None
    """compute a prefix that several samples of a micro-batch share (a group's prompt) once, in the update's forward
    and backward (same loss and gradients up to float rounding; samples are ordered so that shared prefixes sit in one
    micro-batch: use ``micro_batch_size`` ≥ ``rollout.group_size`` to share a whole group's prompt).  null = on where
    it is supported (one device, DDP; not FSDP, not with gradient checkpointing); true there is an error"""
    skip_zero_advantage: bool = True
    """with ``grpo.kl_coef: 0``, samples whose policy tokens all have advantage 0 (every sample of a group whose
    returns are all equal) get no forward/backward: their loss and gradient are exactly 0, and they still count in
    the token-mean denominator, so the update is unchanged. With the KL term on they are computed (the KL pulls on
    them too)"""
    max_consecutive_skips: int = 5
    """stop the run (with a checkpoint) after this many consecutive non-finite updates; 0 = never stop"""

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ValueError(f"update.micro_batch_size: must be >= 1, got {self.micro_batch_size}")
        if self.max_consecutive_skips < 0:
            raise ValueError(f"update.max_consecutive_skips: must be >= 0, got {self.max_consecutive_skips}")


@dataclass
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
    #: [3] float64: this rank's policy tokens, sequences and hindsight label targets *before* row selection — the
    #: loss is one mean over all of them (summed over ranks by the caller); with ``grpo.calibration`` [6]: then the
    #: targets of each label (LABELS order), for ``grpo.calibration_balance``
    counts: Tensor
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
    and select the rows the update scores.  ``share_prefix``: the update shares prefixes (rows are sorted so that
    shared prefixes sit side by side); ``drop_failed_groups``: leave out every group with a failed episode.  Pure:
    same inputs, same tensors (on the CPU)."""
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
    if not samples:  # nothing to score on this rank (it still takes part in the step's collectives)
        stats["tokens/zero_advantage_samples"] = stats["tokens/skipped_zero_advantage_samples"] = 0.0
        # the same shape on every rank (the counts are summed over ranks): with calibration, the per-label targets too
        n_counts = 3 + (len(LABELS) if cfg.calibration > 0 else 0)
        return UpdateBatch(lam, returns, internal, terms, groups, None, None,
                           torch.zeros(n_counts, dtype=torch.float64), stats=stats)

    calibrate = cfg.calibration > 0
    data = scoring.collate(samples, pad_id, targets=calibrate)  # [S, L] each (+ the restriction table, targets)
    # the grpo estimator: every policy token of every call of episode i carries Â_i (guidance and action tokens, every
    # step); another estimator may give each step its own
    inputs = rewards.advantage_inputs(episodes, returns, lam, terms, data, cfg)
    adv = grpo.resolve_advantage(cfg.advantage)(inputs).to(data["mask"].device)  # [S, L]
    mask = data["mask"]  # [S, L]
    guidance_tokens = mask & (data["kinds"] == KIND_GUIDANCE)  # [S, L]
    adv = grpo.scale_guidance_advantages(adv, guidance_tokens, cfg.guidance_advantage_scale)  # [S, L]
    stats["tokens/policy"] = float(mask.sum())
    stats["tokens/guidance_share"] = float(guidance_tokens.sum()) / max(stats["tokens/policy"], 1.0)
    # choice tokens with one allowed continuation: no choice was made, so no loss and no place in the mean
    stats["tokens/forced_choice"] = float(sum(s.forced for s in samples))
    stats["tokens/total"] = float(data["attn"].sum())
    # [3] every row, before selection: the token-mean's denominator, and the hindsight targets' count
    targets = (data["target"] >= 0) & mask if calibrate else torch.zeros_like(mask)  # [S, L]
    counts = torch.cat([grpo.policy_counts(mask), torch.tensor([float(targets.sum())], dtype=torch.float64)])
    if calibrate:  # [3] more: the targets of each label (LABELS order), for grpo.calibration_balance's weights
        labels = data["target_label"][targets]  # [T] the label index of each target
        counts = torch.cat([counts, torch.bincount(labels, minlength=len(LABELS)).to(torch.float64)])
        stats["guidance/calibration_targets"] = float(targets.sum())

    zero = grpo.zero_advantage_rows(adv, mask) & ~targets.any(1)  # [S] no advantage and no target: no gradient
    stats["tokens/zero_advantage_samples"] = float(zero.sum())
    left_out = bool(zero.any()) and update.skip_zero_advantage and cfg.kl_coef == 0
    if left_out:
        # no KL: rows with Â = 0 on every policy token add exactly 0 to loss and gradient (they stay in `counts`):
        # no forward/backward for them.  With KL they are computed.
        data, adv = scoring.select_rows(data, ~zero), adv[~zero]
    stats["tokens/skipped_zero_advantage_samples"] = stats["tokens/zero_advantage_samples"] if left_out else 0.0
    return UpdateBatch(lam, returns, internal, terms, groups, data, adv, counts, left_out, stats)
