"""Episode statistics (pure Python, testable) and their torchmetrics aggregators.

``EpisodeMetrics`` accumulates per-episode statistics across batches (validation) and ranks (torchmetrics syncs under
DDP); ``batch_stats(batch)`` adds the few batch-level numbers that are not per-episode means; ``step_logs`` is what
one training step logs about its rollout and its update preparation.
"""

from __future__ import annotations

import math
from collections import Counter

import torch
from torchmetrics import MeanMetric

from sglightning.calibration import calibration_stats
from sglightning.episodes import Episode, RolloutBatch, split_groups
from sglightning.grpo import degenerate_groups
from sglightning.guidance import LABELS
from sglightning.profiling import phase_logs
from sglightning.update import UpdateBatch

#: statistics averaged per episode
EPISODE_KEYS = (
    "rollout/success_rate",
    "rollout/env_return",
    "rollout/score",
    "rollout/score_gained",
    "rollout/episode_length",
    "rollout/invalid_action_rate",
    "rollout/format_error_rate",
    "rollout/tokens_per_step",
    "rollout/capped_step_rate",
    "rollout/truncated_rate",
    "rollout/env_error_rate",
    "reward/internal_sum",
    "guidance/label_positive",
    "guidance/label_neutral",
    "guidance/label_negative",
    "guidance/label_unparsed",
    "guidance/rate_history_truncated",
    "rollout/actor_history_truncated",
)
LABEL_KEYS = frozenset(k for k in EPISODE_KEYS if k.startswith("guidance/label_"))
#: shares over an episode's steps or rate calls: NaN where it has none (a failed reset, no guidance), left out of the
#: means (a 0 there read as "never invalid", "no label"; where no episode has any, the key is not logged)
PER_STEP_KEYS = LABEL_KEYS | {"rollout/invalid_action_rate", "rollout/format_error_rate", "rollout/tokens_per_step",
                              "rollout/capped_step_rate", "guidance/rate_history_truncated",
                              "rollout/actor_history_truncated"}


#: logged numbers that are counts or rates of the whole run (summed over ranks); everything else is averaged over
#: the ranks that have it
SUM_KEYS = frozenset({"rollout/env_errors", "rollout/episodes", "rollout/groups", "rollout/failed_groups",
                      "rollout/dropped_groups", "rollout/degenerate_groups", "rollout/split_groups", "tokens/generated",
                      "tokens/policy",
                      "tokens/generated_per_s",
                      "tokens/forced_choice", "tokens/total", "tokens/update_positions", "tokens/prefill_positions",
                      "tokens/zero_advantage_samples", "tokens/skipped_zero_advantage_samples",
                      "guidance/calibration_pairs", "guidance/auroc_labels",
                      "rollout/dynamic_sampling_groups", "dynamic_sampling/groups",
                      "dynamic_sampling/degenerate_groups", "engine/requests",
                      "engine/caches_given_back", "guidance/calibration_targets"})


#: TensorBoard's Custom Scalars tab: the charts that say whether Self-Guide is working, several keys to a chart.
#: Category -> chart title -> anchored regexes of scalar tags.  Keys a config does not log leave their line empty
DASHBOARD: dict[str, dict[str, list[str]]] = {
    "self-guide: outcome": {
        "success: training, validation with and without guidance": [
            "^rollout/success_rate$", "^val/(sg|nosg)/(success_rate|pass_at_\\d+)$"],
        "return: blended, internal, environment": [
            "^reward/(blended_return|internal_return)$", "^rollout/env_return$"],
        "trust: lambda paid, its schedule, the guide's reliability": [
            "^reward/(lambda|lambda_schedule)$", "^guidance/reliability$"],
    },
    "self-guide: guidance": {
        "label shares": ["^guidance/label_(positive|neutral|negative|unparsed)$"],
        "calibration: accuracy against the best constant label": [
            "^guidance/label_(accuracy|accuracy_constant|balanced_accuracy|auroc_success)$"],
        "label shares in validation": ["^val/sg/label_(positive|neutral|negative|unparsed)$"],
    },
    "self-guide: collapse": {
        "entropy": ["^policy/entropy(_guidance|_action)?$"],
        "failures a step": ["^rollout/(invalid_action|format_error|capped_step)_rate$"],
        "tokens written a step": ["^rollout/tokens_per_step$"],
        "sampler against trainer": [
            "^policy/logprob_gap_sampler_trainer$", "^policy/sampler_ratio_outside_0\\.9_1\\.1$",
            "^rollout/policy_lag$"],
        "groups without a gradient": ["^rollout/(degenerate|failed|split)_groups$"],
    },
    "self-guide: update": {
        "loss": ["^loss/(total|policy|kl|calibration)$"],
        "gradient and clipping": ["^train/grad_norm$", "^loss/(clip_frac|dual_clip_frac)$"],
        "learning rate": ["^train/lr$"],
    },
    "self-guide: cost": {
        "seconds a step": ["^time/(rollout|update)_s$"],
        "rollout phases": ["^time/rollout_(prefill|decode|draw|env)_s$"],
        "update phases": ["^time/update_(correction|forward|backward|optimiser)_s$"],
        "generated tokens a second": ["^tokens/generated_per_s$"],
        "peak memory": ["^memory/.*_gb$"],
    },
}


def _episode_values(ep: Episode) -> dict[str, float]:
    n = len(ep.steps)
    labels = Counter(s.label if s.label in LABELS else "unparsed" for s in ep.steps) if ep.guided else Counter()
    score = ep.score if ep.score is not None else 100.0 * float(ep.won)
    gained = ep.score_gained if ep.score_gained is not None else score
    out = {
        "rollout/success_rate": float(ep.won),
        "rollout/env_return": ep.env_return,
        "rollout/score": score,
        "rollout/score_gained": gained,
        "rollout/episode_length": float(n),
        "rollout/invalid_action_rate": sum(s.invalid for s in ep.steps) / n if n else math.nan,
        # the actor's answer did not have the configured shape (guidance.actor_format), whether or not an action
        # could still be recovered from it
        "rollout/format_error_rate": sum(not s.format_ok for s in ep.steps) / n if n else math.nan,
        # what the model writes a step, and how often a free segment runs to its cap: a policy that collapses into
        # long or endless output shows here first, not in tokens/generated (a total over more or longer episodes)
        "rollout/tokens_per_step": sum(s.written for s in ep.steps) / n if n else math.nan,
        "rollout/capped_step_rate": sum(s.capped for s in ep.steps) / n if n else math.nan,
        "guidance/rate_history_truncated": ep.rate_truncations / ep.rate_calls if ep.rate_calls else math.nan,
        "rollout/actor_history_truncated": ep.actor_truncations / ep.actor_calls if ep.actor_calls else math.nan,
        "rollout/truncated_rate": float(ep.truncated),
        "rollout/env_error_rate": float(ep.error is not None),
        "reward/internal_sum": sum(ep.internal_rewards),
    }
    for lab in (*LABELS, "unparsed"):  # an episode without guidance or steps has no labels: NaN, left out
        out[f"guidance/label_{lab}"] = labels[lab] / n if n and ep.guided else math.nan
    return out


def batch_stats(batch: RolloutBatch) -> dict[str, float]:
    """Batch-level statistics that are not per-episode means (those go through :class:`EpisodeMetrics`)."""
    eps = batch.episodes
    if not eps:
        return {}
    stats = {
        "rollout/env_errors": float(sum(e.error is not None for e in eps)),
        "rollout/episodes": float(len(eps)),
        # groups whose members reset to different tasks: an env that draws its own task (should stay 0)
        "rollout/split_groups": float(len(split_groups(eps))),
    }
    if not batch.guided:  # no labels: nothing below is measured
        return stats
    # does the guidance know? share of positive labels in won vs lost episodes
    positive = [_episode_values(e)["guidance/label_positive"] for e in eps]
    won = [v for v, e in zip(positive, eps) if e.won and not math.isnan(v)]
    lost = [v for v, e in zip(positive, eps) if not e.won and not math.isnan(v)]  # a failed reset: no labels
    if won and lost:
        stats["guidance/positive_gap_won_minus_lost"] = sum(won) / len(won) - sum(lost) / len(lost)
    stats.update(calibration_stats(eps))  # do the labels describe the measured progress, do they know the outcome?
    return stats


def step_logs(batch: RolloutBatch, prepared: UpdateBatch, global_step: int) -> dict[str, float]:
    """What one training step logs about its rollout and its prepared update (the per-episode means come from
    :class:`EpisodeMetrics`; the loss terms from the update): the batch-level rollout numbers, λ, blended and
    internal returns, extra reward terms, degenerate groups (every return equal: no gradient), the policy lag, the
    generation speed, and the rows and tokens the update scores.

    ``rollout/…`` and ``guidance/…`` describe the policy: the first round only.  With dynamic sampling the trained
    batch also holds groups selected for having unequal returns; those are described under ``dynamic_sampling/…``
    (and ``reward/…`` is the return of every episode trained on)."""
    policy = batch.policy_round()
    n = len(policy.episodes)
    returns, groups = prepared.returns, prepared.groups  # [N], [N] (every episode trained on)
    logs = {
        **batch_stats(policy),
        "reward/lambda": prepared.lam,
        "reward/blended_return": float(returns.mean()),
        # the spread GRPO compares within groups: a narrow one (or min = max) leaves little to learn from
        "reward/blended_return_std": float(returns.std(unbiased=False)) if returns.numel() else 0.0,
        "reward/blended_return_min": float(returns.min()) if returns.numel() else 0.0,
        "reward/blended_return_max": float(returns.max()) if returns.numel() else 0.0,
        "reward/internal_return": float(prepared.internal.mean()),  # S_i as blended (sum, or mean over steps)
        **{f"reward/{name}": float(v.mean()) for name, v in prepared.terms.items()},
        "rollout/degenerate_groups": float(degenerate_groups(returns[:n], groups[:n])),
        # the trainer's step minus the adapter version the engine holds (0 = on-policy). The shipped engines record a
        # version only once it is in place (vLLM: after its probe matched), so it is 0 there by construction; a stale
        # adapter stops the step at the probe instead. An engine of your own that skips a sync shows here
        "rollout/policy_lag": float(global_step - batch.policy_version),
        "rollout/groups": float(groups[:n].unique().numel()),
        "time/rollout_s": batch.seconds,
        **phase_logs(batch.phase_seconds, "rollout"),  # time/rollout_{prefill,decode,draw,env}_s
        "tokens/generated": float(batch.generated_tokens),
        "tokens/generated_per_s": batch.generated_tokens / max(batch.seconds, 1e-9),
        "tokens/prefill_positions": float(batch.prefill_positions),
        "rollout/dynamic_sampling_groups": float(batch.extra_groups),
        **batch.peak_memory,
        **prepared.stats,
    }
    logs.update(engine_logs(batch.engine_counts))
    if batch.first_round is not None:  # dynamic sampling added groups: the trained batch, described on its own
        eps = batch.episodes
        logs["dynamic_sampling/success_rate"] = sum(e.won for e in eps) / len(eps)
        logs["dynamic_sampling/groups"] = float(groups.unique().numel())
        logs["dynamic_sampling/degenerate_groups"] = float(degenerate_groups(returns, groups))
    return logs


def engine_logs(engine: dict[str, float]) -> dict[str, float]:
    """The engine's numbers.  The in-process engine: the rows a lock step advanced and their mean context (what a
    decode step reads, beside the weights), its slot caches' size, the caches it took from kept sessions and the
    share of compiled decode steps whose guards torch checked.  An
    external engine: requests, the share of prompt tokens its prefix cache served, and the adapter sync (seconds,
    the probe's log-prob gap, adapters loaded)."""
    out: dict[str, float] = {}
    if engine.get("lock_steps"):
        out["engine/rows_per_lock_step"] = engine["row_steps"] / engine["lock_steps"]
        out["engine/mean_context_tokens"] = engine["context_tokens"] / max(engine["row_steps"], 1.0)
    if "requests" in engine:
        out["engine/requests"] = engine["requests"]
    if engine.get("prompt_tokens"):
        out["engine/prefix_cache_hit_rate"] = engine.get("cached_tokens", 0.0) / engine["prompt_tokens"]
    for key in ("sync_s", "sync_gap", "loaded_adapters", "slot_cache_GB", "caches_given_back", "decode_guard_checks"):
        if key in engine:
            out[f"engine/{key}"] = engine[key]
    return out


def per_task_type_success(episodes: list[Episode]) -> dict[str, float]:
    by: dict[str, list[bool]] = {}
    for e in episodes:
        by.setdefault(e.task_type, []).append(e.won)
    return {k: sum(v) / len(v) for k, v in sorted(by.items())}


class EpisodeMetrics(torch.nn.Module):
    """Episode-weighted means of :data:`EPISODE_KEYS`, one ``MeanMetric`` each (synced across ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.names = list(EPISODE_KEYS)
        # per-step shares are NaN for episodes without steps or labels: those are skipped, not averaged in
        self.means = torch.nn.ModuleList([MeanMetric(nan_strategy="ignore" if n in PER_STEP_KEYS else "warn")
                                          for n in self.names])

    def update(self, batch: RolloutBatch) -> None:
        """One update per key with every episode's value (on CUDA, one copy per key: not one per episode and key,
        which took ~2 000 synchronising copies a step at 16 × 8 episodes, inside the update's timer)."""
        if not batch.episodes:
            return
        rows = [_episode_values(ep) for ep in batch.episodes]
        for name, metric in zip(self.names, self.means):
            metric.update(torch.tensor([r[name] for r in rows], dtype=torch.float32, device=metric.device))

    def compute(self) -> dict[str, float]:
        """Means over every rank's episodes.  Every metric is computed on every rank, updated or not (the sync is a
        collective: a rank that played no episode, e.g. a validation padding batch, must still take part); metrics
        with no episode anywhere (NaN) are left out."""
        import warnings

        out = {}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*compute.*before.*update.*")
            for n, m in zip(self.names, self.means):
                v = float(m.compute())
                if not math.isnan(v):
                    out[n] = v
        return out

    def reset(self) -> None:
        for m in self.means:
            m.reset()
