"""The validation report: per-mode statistics of the evaluation episodes, as data (JSON) and as Markdown.

A report holds, for each self-guidance mode played (``sg`` = on, ``nosg`` = off, on the same task seeds): the episode
means of :data:`sglightning.metrics.EPISODE_KEYS`, success per task type, the failure-pattern rates of the failed
episodes (:mod:`sglightning.diagnostics`) and every episode as plain data; plus the split, the package versions and
(added by the CLI) the config that produced it.
"""

from __future__ import annotations

from typing import Any

from sglightning.calibration import calibration_stats
from sglightning.diagnostics import PATTERNS, WEBSHOP_PATTERNS, episode_summary, failure_pattern_rates
from sglightning.metrics import per_task_type_success
from sglightning.rollout import Episode


def mode_stats(means: dict[str, float], episodes: list[Episode]) -> dict[str, Any]:
    """One mode's section: the (already rank-reduced) episode means plus what is computed from the episodes."""
    stats: dict[str, Any] = dict(means)
    if any(e.guided for e in episodes):
        stats.update(calibration_stats(episodes))
    stats["per_task_type_success"] = per_task_type_success(episodes)
    stats["failure_patterns"] = failure_pattern_rates(episodes)
    stats["episodes"] = len(episodes)
    return stats


def build_report(step: int, world_size: int, split: str, versions: dict[str, str],
                 modes: dict[str, tuple[dict[str, float], list[Episode]]]) -> dict[str, Any]:
    """The report of one validation run; ``modes`` maps a mode to (episode means, its episodes)."""
    return {
        "step": step,
        "world_size": world_size,
        "modes": {mode: mode_stats(means, eps) for mode, (means, eps) in modes.items()},
        "episodes": {mode: [episode_summary(e) for e in eps] for mode, (_, eps) in modes.items()},
        "split": split,
        "versions": versions,
    }


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
    return out


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
