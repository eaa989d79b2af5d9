"""Self-guidance on vs off on the same episodes, read as pairs.

    python benchmarks/paired_onoff.py RUN-final/version_0/validation_report.json [MORE_REPORTS ...]

Reads validation reports written with both modes (``sglightning validate ... --model.evaluation.self_guidance=both``,
or ``learning_curves.py --final-both``, whose ``<arm>-seed<k>-final`` runs are such validations). Both modes play the
same evaluation episodes, so each is a pair: won with guidance, without it, both or neither. The pairs won one way
and their exact sign test are computed as the report's own ``paired`` section is
(:func:`sglightning.report.paired_outcomes`), so reports written before it existed are read too; this script puts
several reports side by side and pools them (e.g. one per seed: a valid test of "no effect in any of them", not an
estimate of one effect).

Then how each mode handles a setback: of the actions that lost progress (the env measured progress < 0: an object put
in the wrong place, say), the share taken again, word for word, later in the same episode; and, with guidance, the
labels that rated those actions (the label written before the next action rates the previous one).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from sglightning.report import episode_pairs, paired_outcomes


def pairs(report: dict, where: str) -> list[tuple[dict, dict]]:
    """(with guidance, without) episode summaries of one report; one line naming the file when it has no pairs."""
    matched = episode_pairs(report.get("episodes", {}))
    if matched is None:
        raise SystemExit(f"paired_onoff: {where}: no episodes of both modes (validate with "
                         "--model.evaluation.self_guidance=both)")
    if not matched:
        raise SystemExit(f"paired_onoff: {where}: the two modes share no episode (seed, task id)")
    return matched


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
    paired = paired_outcomes(matched)
    lost_on, again_on, rated = setbacks([a for a, _ in matched])
    lost_off, again_off, _ = setbacks([b for _, b in matched])
    labels = ", ".join(f"{k} {v}" for k, v in sorted(rated.items())) or "–"
    return (f"| {name} | {len(matched)} | {on} | {off} | {paired['only_sg']} | {paired['only_nosg']} | "
            f"{paired['sign_test_p']:.3f} "
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
