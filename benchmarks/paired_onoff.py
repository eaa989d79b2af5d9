"""Self-guidance on vs off on the same episodes, read as pairs.

    python benchmarks/paired_onoff.py RUN-final/version_0/validation_report.json [MORE_REPORTS ...]

Reads validation reports written with both modes (``sglightning validate ... --model.evaluation.self_guidance=both``,
or ``learning_curves.py --final-both``, whose ``<arm>-seed<k>-final`` runs are such validations). Both modes play the
same evaluation episodes (same tasks, same seeds), so each episode is a pair: won with guidance, without it, both or
neither. Only the discordant pairs say anything about the guidance, and under "guidance changes nothing" each of them
is a fair coin: the two-sided exact sign test over them (McNemar's exact test) gives

    p = min(1, 2 · Σ_{i ≤ min(a, b)} C(a + b, i) / 2^(a + b))

for a pairs won only with guidance and b only without. With several reports (e.g. one per seed) a pooled row follows;
pooling is a valid test of "no effect in any of them", not an estimate of one effect.

Then how each mode handles a setback: of the actions that lost progress (the env measured progress < 0: an object put
in the wrong place, say), the share taken again, word for word, later in the same episode; and, with guidance, the
labels that rated those actions (the label written before the next action rates the previous one).
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from pathlib import Path


def sign_test(a: int, b: int) -> float:
    """Two-sided exact sign-test p-value of a vs b discordant pairs (1.0 when there are none)."""
    n = a + b
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(min(a, b) + 1)) / 2**n) if n else 1.0


def pairs(report: dict, where: str) -> list[tuple[dict, dict]]:
    """(with guidance, without) episode summaries of one report, matched by (seed, task id)."""
    episodes = report.get("episodes", {})
    if "sg" not in episodes or "nosg" not in episodes:
        raise SystemExit(f"paired_onoff: {where}: no episodes of both modes (validate with "
                         "--model.evaluation.self_guidance=both)")
    off = {(e["seed"], e.get("task_id")): e for e in episodes["nosg"]}
    out = [(e, off[(e["seed"], e.get("task_id"))]) for e in episodes["sg"] if (e["seed"], e.get("task_id")) in off]
    if not out:
        raise SystemExit(f"paired_onoff: {where}: the two modes share no episode (seed, task id)")
    return out


def setbacks(episodes: list[dict]) -> tuple[int, int, Counter]:
    """(actions that lost progress, of them taken again later in the episode, the labels that rated them)."""
    lost = again = 0
    rated: Counter = Counter()
    for e in episodes:
        actions, progress, labels = e["actions"], e["progress"], e.get("labels")
        for i, p in enumerate(progress):
            if p is None or p >= 0:
                continue
            lost += 1
            again += actions[i] in actions[i + 1:]
            if labels and i + 1 < len(labels) and labels[i + 1] is not None:
                rated[labels[i + 1]] += 1
    return lost, again, rated


def row(name: str, matched: list[tuple[dict, dict]]) -> str:
    on = sum(a["won"] for a, _ in matched)
    off = sum(b["won"] for _, b in matched)
    only_on = sum(a["won"] and not b["won"] for a, b in matched)
    only_off = sum(b["won"] and not a["won"] for a, b in matched)
    lost_on, again_on, rated = setbacks([a for a, _ in matched])
    lost_off, again_off, _ = setbacks([b for _, b in matched])
    labels = ", ".join(f"{k} {v}" for k, v in sorted(rated.items())) or "–"
    return (f"| {name} | {len(matched)} | {on} | {off} | {only_on} | {only_off} | {sign_test(only_on, only_off):.3f} "
            f"| {again_on} of {lost_on} | {again_off} of {lost_off} | {labels} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+", metavar="REPORT", help="validation_report.json with both modes")
    args = ap.parse_args(argv)
    rows, pooled = [], []
    for path in args.reports:
        p = Path(path)
        try:
            report = json.loads(p.read_text())
        except (OSError, ValueError) as err:
            raise SystemExit(f"paired_onoff: {path}: not a readable validation report ({err})") from None
        matched = pairs(report, path)
        pooled += matched
        # a learning_curves final validation lives in <arm>-seed<k>-final/version_<n>/: name it by that folder
        rows.append(row(p.parent.parent.name if p.parent.name.startswith("version_") else p.parent.name, matched))
    if len(args.reports) > 1:
        rows.append(row("pooled", pooled))
    print("| report | pairs | won with SG | won without | only with | only without | sign test p | setbacks repeated, "
          "with SG | without | labels rating a setback |")
    print("|---" * 10 + "|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
