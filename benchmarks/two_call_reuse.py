"""two_call with and without ``rollout.reuse_prefix``: the same episodes, the prefill they compute, their time.

    python benchmarks/two_call_reuse.py                                   # SmolLM2, 2 tasks × 4, ≤ 8 steps
    python benchmarks/two_call_reuse.py --model tiny --steps 12 --repeats 3 --json out.json

In ``two_call`` mode every env step asks the model twice (rate, then act), each time with a fresh prompt that repeats
most of the last one.  With ``reuse_prefix`` (the default) each call keeps its session from one step to the next
and rewinds each row to what its new prompt shares; without it every call prefills its prompts anew.  Arms
alternated ``--repeats`` times in one process, new tasks every round, both arms of a round the same tasks and
sampling seed.  Prints per round and arm: seconds, prefill positions, generated tokens, and whether both arms
played the same tokens; then the median ratio of seconds (fresh / kept) with its range.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from sglightning.console import quiet
from sglightning.data import RolloutConfig
from sglightning.embedded import EMBEDDED_SMOLLM2, EMBEDDED_TINY
from sglightning.engines import EngineConfig
from sglightning.engines.builtin import BuiltinEngine
from sglightning.envs.household import HouseholdEnv
from sglightning.guidance import GuidanceConfig
from sglightning.models import PolicyConfig, load_policy
from sglightning.rollout import Rollout

MODELS = {"tiny": EMBEDDED_TINY, "smollm2": EMBEDDED_SMOLLM2}


def play(model, tok, args, seeds: list[int], reuse: bool):
    """One two_call rollout of ``seeds`` × ``args.group`` episodes (the quickstart's household and decoding)."""
    env = functools.partial(HouseholdEnv, difficulty=0, info_actions=False, reveal_contents=True,
                            task_types=["pick_up"])
    gc_ = GuidanceConfig(prompt_mode="two_call", decoding="constrained", action_decoding="admissible",
                         max_guidance_tokens=args.max_guidance)
    cfg = RolloutConfig(group_size=args.group, max_steps=args.steps, reuse_prefix=reuse)
    r = Rollout(model, tok, env, gc_, cfg, engine=BuiltinEngine(EngineConfig(compile=args.compile)))
    try:
        t0 = time.perf_counter()
        batch = r.run(seeds, generator=torch.Generator().manual_seed(seeds[0]))
        return batch, time.perf_counter() - t0
    finally:
        r.close()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    ap.add_argument("--tasks", type=int, default=2, help="task groups per rollout")
    ap.add_argument("--group", type=int, default=4, help="episodes per task")
    ap.add_argument("--steps", type=int, default=8, help="env steps per episode")
    ap.add_argument("--max-guidance", type=int, default=24, help="guidance tokens per rate call")
    ap.add_argument("--compile", default="off", help="model.engine.compile (off: the CPU default)")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of the two arms, alternated")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--json", help="write every round here")
    args = ap.parse_args(argv)
    quiet()
    torch.set_num_threads(args.threads)
    model, tok = load_policy(PolicyConfig(name_or_path=MODELS[args.model]))
    model.eval()
    gc.freeze()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {args.model}, {args.tasks} tasks × "
          f"{args.group}, ≤ {args.steps} steps, two_call, constrained guidance, admissible actions")
    print(f"{'round':>5} {'arm':6} {'seconds':>8} {'prefill positions':>17} {'tokens':>7} {'steps':>6} same")
    rounds = []
    with torch.no_grad():
        for k in range(args.repeats):
            seeds = [100 * k + s for s in range(args.tasks)]
            order = [False, True] if k % 2 == 0 else [True, False]  # alternate which arm goes first
            runs = {}
            for reuse in order:
                batch, seconds = play(model, tok, args, seeds, reuse)
                runs[reuse] = (batch, seconds)
            fresh, kept = runs[False][0], runs[True][0]
            same = [s.ids for s in fresh.samples] == [s.ids for s in kept.samples]
            row = {"round": k, "same_tokens": same}
            for reuse, name in ((False, "fresh"), (True, "kept")):
                batch, seconds = runs[reuse]
                steps = sum(len(e.steps) for e in batch.episodes)
                row[name] = {"seconds": seconds, "prefill_positions": batch.prefill_positions,
                             "tokens": batch.generated_tokens, "env_steps": steps}
                print(f"{k:5d} {name:6} {seconds:8.2f} {batch.prefill_positions:17,d} {batch.generated_tokens:7d} "
                      f"{steps:6d} {'yes' if same else 'NO'}", flush=True)
            rounds.append(row)
    ratios = [r["fresh"]["seconds"] / r["kept"]["seconds"] for r in rounds]
    prefill = [r["fresh"]["prefill_positions"] / r["kept"]["prefill_positions"] for r in rounds]
    print(f"fresh / kept: seconds {statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f}), prefill "
          f"positions {statistics.median(prefill):.2f}× ({min(prefill):.2f}–{max(prefill):.2f})")
    report = {"args": vars(args), "torch": torch.__version__, "rounds": rounds}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
