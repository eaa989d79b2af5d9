"""What a run reports: the validation report (per-mode statistics of the evaluation episodes, as data and as
Markdown), the end-of-fit summary (:func:`fit_summary`) and one episode as text (:func:`trajectory_markdown`).

A report holds, for each self-guidance mode played (``sg`` = on, ``nosg`` = off, on the same task seeds): the episode
means of :data:`sglightning.metrics.EPISODE_KEYS`, success per task type, the failure-pattern rates of the failed
episodes (:mod:`sglightning.diagnostics`) and every episode as plain data; plus the split, the package versions and
(added by the CLI) the config that produced it.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from sglightning import distributed, memory
from sglightning.calibration import calibration_stats
from sglightning.diagnostics import PATTERNS, WEBSHOP_PATTERNS, episode_summary, failure_pattern_rates
from sglightning.episodes import Episode, RolloutBatch
from sglightning.files import atomic_write_text
from sglightning.guidance import valid_text
from sglightning.metrics import EpisodeMetrics, per_task_type_success
from sglightning.profiling import PHASES, log_key


def mode_stats(means: dict[str, float], episodes: list[Episode]) -> dict[str, Any]:
    """One mode's section: the (already rank-reduced) episode means plus what is computed from the episodes."""
    stats: dict[str, Any] = dict(means)
    if any(e.guided for e in episodes):
        stats.update(calibration_stats(episodes))
    stats["per_task_type_success"] = per_task_type_success(episodes)
    stats["failure_patterns"] = failure_pattern_rates(episodes)
    tries = pass_at_k(episodes)
    if tries:
        stats["pass_at"] = tries
    stats["episodes"] = len(episodes)
    return stats


def pass_at_k(episodes: list[Episode]) -> dict[str, float]:
    r"""The share of tasks solved within k tries, for k = 1, 2, 4, … and the tries every task had (n, the fewest
    episodes of one task seed).  Unbiased over all n tries (Chen et al., 2021):

        pass@k = mean over tasks of 1 − C(n_i − c_i, k) / C(n_i, k)      c_i: the task's won episodes

    Empty with one episode a task (``evaluation.episodes_per_task`` 1): pass@1 is the success rate.

    Args:
        episodes: one validation mode's episodes; a task is a seed.
    """
    wins: dict[int, list[bool]] = {}
    for ep in episodes:
        wins.setdefault(ep.seed, []).append(ep.won)
    n = min((len(w) for w in wins.values()), default=0)
    if n < 2:
        return {}
    ks = sorted({2**i for i in range(n.bit_length())} | {n})  # 2**i <= n for i < n.bit_length()
    return {str(k): sum(1 - math.comb(len(w) - sum(w), k) / math.comb(len(w), k) for w in wins.values()) / len(wins)
            for k in ks}


def sign_test(a: int, b: int) -> float:
    """Two-sided exact sign-test p-value of ``a`` against ``b`` discordant pairs (1.0 when there are none)."""
    n = a + b
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(min(a, b) + 1)) / 2**n) if n else 1.0


def episode_pairs(episodes: dict[str, list[dict]]) -> list[tuple[dict, dict]] | None:
    """(with guidance, without) pairs of episode summaries (a report's ``episodes``, mode → summaries); ``None``
    unless both modes were played. Both modes play the same evaluation tasks with the same seeds, so the k-th episode
    of a seed with guidance and the k-th without form a pair (by seed alone: an episode whose reset failed has no
    task id, and still counts, as lost)."""
    if "sg" not in episodes or "nosg" not in episodes:
        return None

    def keyed(eps: list[dict]) -> dict[tuple, dict]:
        seen: dict[Any, int] = {}
        out = {}
        for e in eps:
            seed = e.get("seed")
            seen[seed] = seen.get(seed, -1) + 1
            out[(seed, seen[seed])] = e
        return out

    on, off = keyed(episodes["sg"]), keyed(episodes["nosg"])
    return [(on[k], off[k]) for k in on if k in off]


def paired_outcomes(pairs: list[tuple[dict, dict]]) -> dict[str, Any]:
    """Self-guidance on vs off read as pairs (:func:`episode_pairs`). Only the pairs won one way inform, and under
    "guidance changes nothing" each of them is a fair coin: for a pairs won only with guidance and b only without,
    the two-sided exact sign test (McNemar's exact test) gives

        p = min(1, 2 · Σ_{i ≤ min(a, b)} C(a + b, i) / 2^(a + b))

    which, unlike two success rates side by side, uses that the episodes are the same."""
    only_sg = sum(bool(a.get("won")) and not b.get("won") for a, b in pairs)
    only_nosg = sum(bool(b.get("won")) and not a.get("won") for a, b in pairs)
    return {"pairs": len(pairs), "only_sg": only_sg, "only_nosg": only_nosg,
            "sign_test_p": sign_test(only_sg, only_nosg)}


class Validation(torch.nn.Module):
    """One validation's episodes, per self-guidance mode: collected batch by batch on each rank, merged over ranks at
    the end (every episode once, in seed order; means from torchmetrics; peak memory the maximum over ranks)."""

    def __init__(self, modes: tuple[str, ...] = ("sg", "nosg")) -> None:
        super().__init__()
        self.metrics = torch.nn.ModuleDict({m: EpisodeMetrics() for m in modes})
        self.episodes: dict[str, list[Episode]] = {m: [] for m in modes}
        self.peaks: dict[str, dict[str, float]] = {m: {} for m in modes}  # peak memory per mode (GB)

    def reset(self) -> None:
        for m in self.metrics:
            self.metrics[m].reset()
            self.episodes[m], self.peaks[m] = [], {}

    def add(self, rollouts: dict[str, RolloutBatch]) -> None:
        """One validation batch's rollouts, by mode."""
        for mode, rb in rollouts.items():
            self.metrics[mode].update(rb)
            self.episodes[mode].extend(rb.episodes)
            for key, gb in rb.peak_memory.items():
                self.peaks[mode][key] = max(self.peaks[mode].get(key, 0.0), gb)

    def merged(self, modes: list[str], world_size: int, device: torch.device
               ) -> dict[str, tuple[dict[str, float], list[Episode]]]:
        """Per mode: (the means over every rank's episodes, every rank's episodes without token samples) — what
        :func:`build_report` takes.  A collective: every rank calls it."""
        out = {}
        for mode in modes:
            light = [e.without_samples() for e in self.episodes[mode]]
            episodes = sorted(distributed.gather_objects(light, world_size), key=lambda e: (e.seed, e.index))
            self.episodes[mode] = episodes
            out[mode] = ({**self.metrics[mode].compute(), **_peak_over_ranks(self.peaks[mode], device)}, episodes)
        return out


def _peak_over_ranks(peaks: dict[str, float], device: torch.device) -> dict[str, float]:
    """A validation's peak memory (:mod:`sglightning.memory`), the maximum over ranks (a rank that played only padding
    batches has none: -1 stands for "absent" in the reduction)."""
    keys = (memory.rss_key("validation"), memory.LIFETIME_RSS, memory.accelerator_key("validation"))
    vals = torch.tensor([peaks.get(k, -1.0) for k in keys], dtype=torch.float32, device=device)
    vals = distributed.all_reduce(vals, op=torch.distributed.ReduceOp.MAX).tolist()
    return {k: v for k, v in zip(keys, vals) if v >= 0}


def build_report(step: int, world_size: int, split: str, versions: dict[str, str],
                 modes: dict[str, tuple[dict[str, float], list[Episode]]]) -> dict[str, Any]:
    """The report of one validation run; ``modes`` maps a mode to (episode means, its episodes); with both modes,
    ``paired`` holds :func:`paired_outcomes` of their :func:`episode_pairs`."""
    episodes = {mode: [episode_summary(e) for e in eps] for mode, (_, eps) in modes.items()}
    out = {
        "step": step,
        "world_size": world_size,
        "modes": {mode: mode_stats(means, eps) for mode, (means, eps) in modes.items()},
        "episodes": episodes,
        "split": split,
        "versions": versions,
    }
    pairs = episode_pairs(episodes)
    if pairs is not None:
        out["paired"] = paired_outcomes(pairs)
    return out


def scalars(report: dict[str, Any]) -> dict[str, float]:
    """The report's numbers as flat ``val/<mode>/<name>`` scalars (TensorBoard)."""
    out: dict[str, float] = {"val/global_step": float(report["step"])}  # the optimiser steps the adapters had taken
    for mode, stats in report["modes"].items():
        for k, v in stats.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v:  # not NaN; `episodes` is int
                out[f"val/{mode}/{k.split('/', 1)[-1]}"] = v
        for k, v in stats["failure_patterns"].items():
            if k != "failed_episodes":
                out[f"val/{mode}/failure_{k}"] = float(v)
        for k, v in stats["per_task_type_success"].items():
            out[f"val/{mode}/success_{k}"] = float(v)
        for k, v in (stats.get("pass_at") or {}).items():
            out[f"val/{mode}/pass_at_{k}"] = float(v)
    for k, v in (report.get("paired") or {}).items():  # with both modes: on vs off on the same episodes
        out[f"val/paired/{k}"] = float(v)
    return out


def validation_line(report: dict[str, Any], seconds: float | None = None, before_training: bool = False) -> str:
    """A validation in one line (what a run writes to a log that is not a terminal): the step it evaluated, each
    mode's success rate (and pass@n with n episodes a task), the episodes per mode and the time it took."""
    modes = report["modes"]
    parts = []
    for mode, stats in modes.items():
        part = f"{'off' if mode == 'nosg' else 'on'} success={stats.get('rollout/success_rate', float('nan')):.3f}"
        if stats.get("pass_at"):  # k ascending: the last is n, every try a task had
            n, rate = list(stats["pass_at"].items())[-1]
            part += f" pass@{n}={rate:.3f}"
        parts.append(part)
    episodes = max((stats.get("episodes", 0) for stats in modes.values()), default=0)
    when = f"before training at step {report['step']}" if before_training else f"at step {report['step']}"
    took = f", {seconds:.1f} s" if seconds is not None else ""
    each = " each" if len(modes) > 1 else ""
    return f"validation {when}: self-guidance {', '.join(parts)} ({episodes} episodes{each}{took})"


def report_markdown(report: dict[str, Any]) -> str:
    cols = [
        ("success", "rollout/success_rate"),
        ("score", "rollout/score"),
        ("gained", "rollout/score_gained"),
        ("steps", "rollout/episode_length"),
        ("invalid", "rollout/invalid_action_rate"),
        ("format err", "rollout/format_error_rate"),
        ("unparsed", "guidance/label_unparsed"),
        ("pos", "guidance/label_positive"),
        ("neu", "guidance/label_neutral"),
        ("neg", "guidance/label_negative"),
        ("label acc", "guidance/label_accuracy"),
        ("label AUROC", "guidance/label_auroc_success"),
    ]
    cfg = report.get("config", {})
    split = report.get("split")
    lines = [
        f"### validation — {cfg.get('model', '')} on {cfg.get('env', '')}" + (f" ({split} split)" if split else ""),
        "",
        "| self-guidance | episodes | " + " | ".join(c for c, _ in cols) + " |",
        "|---|---|" + "---|" * len(cols),
    ]
    modes = report["modes"]
    name = {"sg": "on", "nosg": "off"}
    for mode, stats in modes.items():
        vals = " | ".join(f"{stats[k]:.3f}" if k in stats else "–" for _, k in cols)  # – : not measured
        lines.append(f"| {name.get(mode, mode)} | {stats.get('episodes', 0)} | {vals} |")
    paired = report.get("paired")
    if paired:
        lines += ["", f"The same {paired['pairs']} episodes with and without self-guidance: won only with it "
                      f"{paired['only_sg']}, only without it {paired['only_nosg']} (exact sign test p = "
                      f"{paired['sign_test_p']:.3f})."]
    for mode, stats in modes.items():
        if stats.get("pass_at"):
            solved = ", ".join(f"{k} {v:.3f}" for k, v in stats["pass_at"].items())
            lines += ["", f"Tasks solved within k tries, self-guidance {name.get(mode, mode)} (pass@k): {solved}."]
    types = sorted({t for st in modes.values() for t in (st.get("per_task_type_success") or {})})
    if types:  # also for a single task type: the table says which type the episodes were
        lines += ["", "Success per task type:", "", "| self-guidance | " + " | ".join(types) + " |",
                  "|---|" + "---|" * len(types)]
        for mode, stats in modes.items():
            per = stats.get("per_task_type_success") or {}
            lines.append(f"| {name.get(mode, mode)} | " + " | ".join(
                f"{per[t]:.2f}" if t in per else "–" for t in types) + " |")
    patterns = [p for p in (*PATTERNS, *WEBSHOP_PATTERNS)
                if any(p in (st.get("failure_patterns") or {}) for st in modes.values())]
    if patterns:
        lines += ["", "Failure patterns (share of failed episodes; definitions in sglightning.diagnostics):", "",
                  "| self-guidance | failed | " + " | ".join(p.replace("_", " ") for p in patterns) + " |",
                  "|---|---|" + "---|" * len(patterns)]
        for mode, stats in modes.items():
            fp = stats.get("failure_patterns") or {}
            lines.append(f"| {name.get(mode, mode)} | {fp.get('failed_episodes', 0)} | " + " | ".join(
                f"{fp[p]:.2f}" if p in fp else "–" for p in patterns) + " |")
    versions = report.get("versions") or {}
    if versions:
        lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items())]
    return "\n".join(lines) + "\n"


def trajectory_markdown(ep: Episode) -> str:
    """One episode as Markdown (observations, guidance, actions) for TensorBoard's text panel."""

    def quote(text: str) -> str:
        return "\n".join("    " + line for line in str(text).splitlines()) or "    (empty)"

    lines = [
        f"**task** ({ep.task_type}, seed {ep.seed}, group {ep.group}): {ep.task}",
        f"**result**: {'success' if ep.won else 'failure'}, env return {ep.env_return:g}, "
        f"{len(ep.steps)} steps" + (f", error: {ep.error}" if ep.error else "")
        + (", truncated" if ep.truncated else ""),
        "",
    ]
    for t, s in enumerate(ep.steps, start=1):
        lines.append(f"**step {t}** observation:")
        lines.append(quote(s.observation))
        if ep.guided:
            lines.append(f"guidance: label **{s.label or 'unparsed'}** (r={s.internal_reward:+g}), reason:")
            lines.append(quote(s.reason or s.guidance_text))
        flag = " (invalid)" if s.invalid else ""
        lines.append(f"action{flag}: `{(s.action or s.action_text or '').replace('`', '')}`")
        lines.append("")
    return valid_text("\n".join(lines))  # the guidance text is the model's, as it wrote it


def _phase_lines(hist: list[dict], mean) -> list[str]:
    """Label shares and episode length per phase of the trust weight λ: a constant positive label turns λ·Σr_t into a
    bonus for length, which shows here as longer episodes while λ > 0."""
    phases = {"λ = 0": [r for r in hist if r.get("reward/lambda", 0.0) == 0.0],
              "0 < λ < 1": [r for r in hist if 0.0 < r.get("reward/lambda", 0.0) < 1.0],
              "λ = 1": [r for r in hist if r.get("reward/lambda", 0.0) == 1.0]}
    cells = [f"{name}: {len(rows)} step{'s' * (len(rows) != 1)}, positive "
             f"{mean('guidance/label_positive', rows):.2f}, negative {mean('guidance/label_negative', rows):.2f}, "
             f"length {mean('rollout/episode_length', rows):.1f}"
             for name, rows in phases.items() if rows]
    return ["  by trust phase    " + " | ".join(cells)] if cells else []


def _guidance_lines(hist: list[dict], mean) -> list[str]:
    """The guidance labels' shares, their calibration against measured progress (over the run, and its first and
    last third: did training make the guide more accurate?), and both per trust phase.  A number no step measured
    reads ``n/a``."""
    third = max(1, len(hist) // 3)
    accuracy, auroc = mean("guidance/label_accuracy"), mean("guidance/label_auroc_success")
    return [
        "  labels            "
        + "  ".join(f"{k} {_num(mean(f'guidance/label_{k}'))}" for k in ("positive", "neutral", "negative",
                                                                             "unparsed")),
        f"  label calibration accuracy vs measured progress {_num(accuracy)}   AUROC vs success {_num(auroc)}"
        + ("   (n/a: the env or the episodes could not tell)" if math.isnan(accuracy) or math.isnan(auroc) else ""),
        f"  label accuracy    first third {_num(mean('guidance/label_accuracy', hist[:third]))} -> last third "
        f"{_num(mean('guidance/label_accuracy', hist[-third:]))}   (one constant label: "
        f"{_num(mean('guidance/label_accuracy_constant'))})"
        + (f"   hindsight label loss {mean('loss/calibration'):.3f}" if any("loss/calibration" in r for r in hist)
           else ""),
        f"  balanced accuracy first third {_num(mean('guidance/label_balanced_accuracy', hist[:third]))} -> last "
        f"third {_num(mean('guidance/label_balanced_accuracy', hist[-third:]))}   (mean recall over the kinds of "
        "progress; any constant label: 1/K)",
        *_phase_lines(hist, mean),
    ]


def _num(value: float) -> str:
    """``value`` with two decimals; ``n/a`` when nothing measured it (NaN)."""
    return "n/a" if math.isnan(value) else f"{value:.2f}"


def _phase_time_lines(hist: list[dict[str, float]], mean) -> list[str]:
    """Where a step's time went, by phase (``time/<parent>_<phase>_s``; sglightning.profiling), in seconds."""
    parts = []
    for parent in ("rollout", "update"):
        keys = [(p.split("/")[1], log_key(p)) for p in PHASES if p.startswith(parent + "/")]
        got = [f"{n} {mean(k):.1f}" for n, k in keys if any(k in r for r in hist)]
        if got:
            parts.append(f"{parent}: " + "  ".join(got))
    return [f"  by phase (s)      {' | '.join(parts)}"] if parts else []


def run_settings(module, checkpoint: str | None = None) -> dict[str, Any]:
    """What a validation report records of the run that played it: the environment, the model and adapter, the
    ``checkpoint`` validated (None: the weights in memory), the episodes per mode asked for (each mode's
    ``episodes`` counts those played: fewer where ``limit_val_batches`` cut the run) and how they were played.
    ``module``: the :class:`~sglightning.module.SelfGuideModule`."""
    return {
        "env": module.env_name(),
        "model": module.policy_cfg.name_or_path,
        "adapter": module.adapter_path,
        "checkpoint": checkpoint,
        "episodes_per_mode": module.eval_cfg.num_tasks * module.eval_cfg.episodes_per_task,
        "temperature": module.eval_cfg.temperature,
        "max_steps": module.rollout_cfg.max_steps,
        "guidance": {k: getattr(module.guidance_cfg, k)
                     for k in ("prompt_mode", "decoding", "action_decoding", "actor_format")},
    }


def write_validation_report(report: dict[str, Any], folder: Path) -> tuple[Path, str]:
    """Writes ``report`` to ``folder`` as ``validation_report.json`` and ``.md``, each atomically (a kill keeps the
    previous report whole); returns the JSON's path and the Markdown."""
    text = report_markdown(report)
    atomic_write_text(folder / "validation_report.json", json.dumps(report, indent=2, default=str))
    atomic_write_text(folder / "validation_report.md", text)
    return folder / "validation_report.json", text


def fit_summary(hist: list[dict[str, float]], skipped_updates: int, before: dict | None, after: dict | None,
                tensorboard_dir: Path | None, adapter_dir: Path | None, report_path: Path | None = None,
                terms: Sequence[str] = (), ppo_epochs: int = 1) -> str:
    """The end-of-fit summary: the per-step logs ``hist`` averaged (all steps, first and last third), the validation
    reports before and after training (``evaluation.before_fit``), and where the TensorBoard logs, the adapter and the
    last validation's report (``report_path``) are (a None is a line left out: no TensorBoard logger, nothing
    written).  ``terms``: the names of ``model.reward_terms`` (each logged as ``reward/<name>``, weighted).
    ``ppo_epochs``: optimiser steps per GRPO step; above 1, the lines say which step they count (the progress bar
    counts optimiser steps, this summary GRPO steps: one rollout each)."""
    if not hist:
        return "sglightning: no training step ran"

    def mean(key: str, rows=hist) -> float:
        vals = [r[key] for r in rows if key in r]
        return sum(vals) / len(vals) if vals else float("nan")

    third = max(1, len(hist) // 3)  # the rise: first vs last third of the steps
    guided = any("guidance/label_positive" in r for r in hist)  # labels were measured (none without guidance)
    lines = [
        "",
        f"sglightning fit: {len(hist)} GRPO steps"
        + (f" ({len(hist) * ppo_epochs} optimiser steps: grpo.ppo_epochs {ppo_epochs})" if ppo_epochs > 1 else "")
        + f", {int(sum(r.get('rollout/episodes', 0) for r in hist))} episodes",
        f"  success rate      all {mean('rollout/success_rate'):.3f}"
        f" | first third {mean('rollout/success_rate', hist[:third]):.3f}"
        f" | last third {mean('rollout/success_rate', hist[-third:]):.3f}",
        f"  mean env return   {mean('rollout/env_return'):.3f}"
        + (f"   internal sum {mean('reward/internal_sum'):+.3f}" if guided else ""),
        *(_guidance_lines(hist, mean) if guided else []),
        *(["  reward terms      " + "   ".join(
            f"{t} {mean(f'reward/{t}'):+.3f} (first third {mean(f'reward/{t}', hist[:third]):+.3f}, last third "
            f"{mean(f'reward/{t}', hist[-third:]):+.3f})" for t in terms)] if terms else []),
        f"  invalid actions   {mean('rollout/invalid_action_rate'):.3f}   skipped updates {skipped_updates}"
        + (f"   episodes failed in the env {env_errors:.3f}" if (env_errors := mean("rollout/env_error_rate")) > 0
           else ""),
        *_signal_lines(hist),
        f"  {'time per GRPO step' if ppo_epochs > 1 else 'time per step':<17} rollout {mean('time/rollout_s'):.1f}s"
        f"  update {mean('time/update_s'):.1f}s",
        *_phase_time_lines(hist, mean),
        *_memory_lines(hist),
    ]
    lines += _validation_lines(before, after)
    if tensorboard_dir is not None:  # pastes into a shell
        lines.append(f"  TensorBoard       tensorboard --logdir {shlex.quote(str(tensorboard_dir))}")
    if adapter_dir is not None:
        lines.append(f"  adapter           {adapter_dir}")
    if report_path is not None:
        lines.append(f"  report            {report_path}")
    return "\n".join(lines)


def history_state(hist: list[dict[str, float]]) -> dict[str, Any]:
    """The per-step logs as a checkpoint keeps them, so a resumed fit's summary covers every step: the keys once, the
    values as a ``[steps, keys]`` float64 tensor and a mask of what each step logged (some keys are logged on some
    steps only).

    Args:
        hist: one dict of floats per training step.
    """
    keys = sorted({k for r in hist for k in r})
    shape = (len(hist), len(keys))
    values = torch.tensor([[r.get(k, 0.0) for k in keys] for r in hist], dtype=torch.float64).reshape(shape)
    logged = torch.tensor([[k in r for k in keys] for r in hist], dtype=torch.bool).reshape(shape)
    return {"keys": keys, "values": values, "logged": logged}


def plain(report: dict[str, Any] | None) -> dict[str, Any] | None:
    """``report`` as JSON would hold it (an env's own types, e.g. a numpy task id, as text): a checkpoint, loaded with
    ``weights_only``, holds plain containers only.

    Args:
        report: a validation report, or None.
    """
    return None if report is None else json.loads(json.dumps(report, default=str))


def history_from_state(state: dict[str, Any] | None) -> list[dict[str, float]]:
    """The per-step logs back from :func:`history_state` (a checkpoint without them: none).

    Args:
        state: what :func:`history_state` returned, or None.
    """
    if not state:
        return []
    keys, values, logged = state["keys"], state["values"].tolist(), state["logged"].tolist()
    return [{k: v for k, v, m in zip(keys, row, mask) if m} for row, mask in zip(values, logged)]


#: the per-step logs :func:`group_signal` reads
SIGNAL_KEYS = ("rollout/degenerate_groups", "rollout/groups", "rollout/dynamic_sampling_groups",
               "dynamic_sampling/degenerate_groups", "dynamic_sampling/groups")


def group_signal(steps: Sequence[dict[str, float]]) -> tuple[float, float, int, int] | None:
    """What training steps had to learn from: the degenerate groups among those trained on (all returns equal: their
    advantage is 0, nothing for the policy gradient), the groups trained on, the steps on which no group was
    informative, and the steps counted.  With dynamic sampling the trained batch's groups count, not the first
    round's.  None: no step logged the counts (a checkpoint from before they were).

    Args:
        steps: one dict of logged numbers per training step (:data:`SIGNAL_KEYS` are read).
    """
    counts = []
    for r in steps:
        if "rollout/degenerate_groups" not in r or "rollout/groups" not in r:
            continue
        # dynamic_sampling/… only where groups were added (older TensorBoard events repeat them at later steps)
        trained = "dynamic_sampling" if r.get("rollout/dynamic_sampling_groups", 0.0) > 0 else "rollout"
        counts.append((r[f"{trained}/degenerate_groups"], r[f"{trained}/groups"]))
    if not counts:
        return None
    still = sum(1 for degenerate, groups in counts if degenerate >= groups)
    return sum(d for d, _ in counts), sum(g for _, g in counts), still, len(counts)


def _signal_lines(hist: list[dict]) -> list[str]:
    """:func:`group_signal`'s counts in a line: a run whose success stays flat shows whether it had anything to learn
    from."""
    if (signal := group_signal(hist)) is None:
        return []
    degenerate, groups, still, steps = signal
    return [f"  degenerate groups {degenerate:.0f} of {groups:.0f} (equal returns, advantage 0)   steps without an "
            f"informative group {still} of {steps}"]


def _memory_lines(hist: list[dict]) -> list[str]:
    """The largest per-phase peak of the run (host RSS of the trainer process; accelerator memory on CUDA)."""
    def peak(key: str) -> float | None:
        vals = [r[key] for r in hist if key in r]
        return max(vals) if vals else None

    def per_phase(key_of) -> list[str]:
        return [f"{phase} {v:.1f} GB" for phase in ("rollout", "update") if (v := peak(key_of(phase))) is not None]

    parts = per_phase(memory.rss_key)
    if not parts and (v := peak(memory.LIFETIME_RSS)) is not None:
        parts = [f"{v:.1f} GB (process lifetime; this system cannot reset the peak per phase)"]
    lines = [f"  peak memory       {'  '.join(parts)} (RSS of this process)"] if parts else []
    acc = per_phase(memory.accelerator_key)
    if acc:
        lines.append(f"  peak accelerator  {'  '.join(acc)} (allocated by torch)")
    return lines


def _validation_lines(before: dict | None, after: dict | None) -> list[str]:
    """One summary line per guidance mode: the success of the end-of-fit validation, preceded by the one before
    training when ``evaluation.before_fit`` ran it ("before 0.125 -> after 0.406", same held-out tasks)."""
    lines = []
    for mode in dict.fromkeys([*(before or {}).get("modes", {}), *(after or {}).get("modes", {})]):
        parts, episodes = [], 0
        for rep, word in ((before, "before"), (after, "after")):
            stats = (rep or {}).get("modes", {}).get(mode)
            if stats is None:
                continue
            rate = f"{stats.get('rollout/success_rate', float('nan')):.3f}"
            if before is not None:  # label the two numbers; a lone end-of-fit validation needs no label
                at = f" (step {rep['step']})" if word == "before" and rep.get("step") else ""
                rate = f"{word}{at} {rate}"
            parts.append(rate)
            episodes = stats.get("episodes", 0)
        guidance = "self-guidance on" if mode == "sg" else "self-guidance off"
        lines.append(f"  validation [{guidance}] success {' -> '.join(parts)} over {episodes} episodes")
    return lines
