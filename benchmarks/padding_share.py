"""The update's padding: how many of the positions it feeds are pads, by mode, micro-batching and row order.

    python benchmarks/padding_share.py                                     # tiny model, two_call, the paper's 16 x 8
    python benchmarks/padding_share.py --mode single_stream
    python benchmarks/padding_share.py --model smollm2 --tasks 4 --group 4 --steps 4 --json out.json

Why it exists: packing rows into one sequence removes pads, but torch's SDPA has no variable-length kernel.  A packed
row of total length ΣL attends with a block-diagonal mask over all of it, so attention costs (ΣL)² instead of ΣL².
Packing pays only where pads are many.  This script counts them for the trainer's micro-batching
(``scoring.microbatch_rows``): rows in played order, rows longest first (what the trainer does without shared
prefixes), and shared prefixes (a prefix fed once, rests padded), rows ordered by their tokens or as
the trainer orders them (``update.prefix_order``).

One rollout is played (free guidance and actions, so lengths vary as on a GPU config); nothing is timed.  Prints one
line per arm: positions fed, the share of them that are pads, and fed over the rows' own positions (shared prefixes
feed a prefix once, so theirs can be below 1; their pads are not counted apart).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

from sglightning import scoring
from sglightning.console import quiet
from sglightning.data import RolloutConfig
from sglightning.embedded import EMBEDDED_SMOLLM2, EMBEDDED_TINY
from sglightning.envs.household import HouseholdEnv
from sglightning.guidance import GuidanceConfig
from sglightning.models import PolicyConfig, load_policy
from sglightning.rollout import Rollout
from sglightning.update import UpdateConfig, prefix_order

sys.path.insert(0, str(Path(__file__).resolve().parent))
from update_throughput import _fed_positions  # noqa: E402


def fed_whole_rows(samples, micro: int, budget: int | None, longest_first: bool) -> int:
    """Positions the whole-row update feeds: each micro-batch is its rows × its longest row."""
    if longest_first:
        samples = sorted(samples, key=lambda s: -scoring.scored_length(s))
    data = scoring.collate(samples, 0)
    lengths = data["attn"].sum(1)  # [S]
    return sum(int(lengths[sl].numel() * lengths[sl].max()) for sl in scoring.microbatch_rows(data, micro, budget))


def fed_shared(samples, micro: int, trainer_order: bool) -> int:
    """Positions the shared-prefix update feeds: rows ordered by their tokens, or as the trainer orders them
    (:func:`update.prefix_order`: families of rows, longest first, where that feeds fewer)."""
    data = scoring.collate(sorted(samples, key=lambda s: s.ids), 0)
    if trainer_order:
        order = prefix_order(data, UpdateConfig(micro_batch_size=micro))
        data = scoring.select_rows(data, torch.tensor(order, dtype=torch.long))
    return sum(_fed_positions(data["ids"][sl], data["attn"][sl]) for sl in scoring.microbatch_rows(data, micro))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--mode", choices=["two_call", "single_stream"], default="two_call")
    ap.add_argument("--tasks", type=int, default=16, help="groups (task seeds)")
    ap.add_argument("--group", type=int, default=8, help="episodes per task")
    ap.add_argument("--steps", type=int, default=6, help="env steps per episode at most")
    ap.add_argument("--micro", type=int, nargs="+", default=[4, 16], help="update.micro_batch_size values")
    ap.add_argument("--budget", type=int, default=32768, help="update.micro_batch_tokens for the longest-first arm")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    quiet()
    if args.threads:
        torch.set_num_threads(args.threads)
    name = EMBEDDED_SMOLLM2 if args.model == "smollm2" else EMBEDDED_TINY
    model, tok = load_policy(PolicyConfig(name_or_path=name))
    env = functools.partial(HouseholdEnv, difficulty=0, info_actions=False, reveal_contents=True,
                            task_types=["pick_up", "pick_and_place"])
    gc = GuidanceConfig(prompt_mode=args.mode, decoding="free", action_decoding="free", max_guidance_tokens=32,
                        max_action_tokens=16)
    rollout = Rollout(model, tok, env, gc, RolloutConfig(group_size=args.group, max_steps=args.steps))
    batch = rollout.run(list(range(args.tasks)), generator=torch.Generator().manual_seed(0))
    rollout.close()
    samples = [s for s in batch.samples if any(s.policy)]
    lengths = sorted(scoring.scored_length(s) for s in samples)
    own = sum(lengths)
    report: dict = {"args": vars(args), "rows": len(samples), "positions": own,
                    "length_min_median_max": [lengths[0], lengths[len(lengths) // 2], lengths[-1]], "arms": []}
    print(f"{args.model}, {args.mode}: {len(samples)} rows, lengths {lengths[0]}–{lengths[-1]} (median "
          f"{lengths[len(lengths) // 2]}), {own} positions of their own")
    print(f"{'arm':38} {'micro':>5} {'fed':>9} {'pads':>6} {'fed/own':>7}")
    for micro in args.micro:
        arms = {"whole rows, played order": fed_whole_rows(samples, micro, None, False),
                f"whole rows, longest first, {args.budget}": fed_whole_rows(samples, micro, args.budget, True),
                "shared prefixes, by ids": fed_shared(samples, micro, False),
                "shared prefixes, the trainer's order": fed_shared(samples, micro, True)}
        for arm, fed in arms.items():
            pads = None if arm.startswith("shared") else 1 - own / fed  # shared: a prefix is fed once, so no share
            report["arms"].append({"arm": arm, "micro": micro, "fed": fed, "pad_share": pads,
                                   "fed_over_own": fed / own})
            print(f"{arm:38} {micro:5d} {fed:9d} {'-' if pads is None else f'{pads:.3f}':>6} {fed / own:7.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
