"""The in-process engine's host time per lock step: what the CPU spends around each decode step, model aside.

    python benchmarks/engine_host.py                         # 64 and 128 rows, free and constrained decoding
    python benchmarks/engine_host.py --rows 128 --decoding constrained --repeats 5 --json out.json

On a GPU a lock step costs the host's work plus the device's: the step ends in one copy to the host (the sampled
tokens), so the two do not overlap.  This measures the host's part on the static slot-cache path (the GPU's), with the
model's forward replaced by stored random logits of the vocabulary's width: what remains is the program interpreter,
the block and mask building, the draw (its kernels run on this CPU, so this counts them too) and the rollout's
per-turn work (prompts, tokenising, the environment, timed apart).  ``rows / host time per lock step`` is then a
ceiling on generated tokens/s that no device speed lifts.  As in training, one engine and one rollout serve every
round of a configuration (the slot cache allocated once, the environment workers kept), and the garbage collector skips
the objects loaded before the first rollout.

Prints per configuration: lock steps, generated tokens, host ms per lock step (the environment's time left out), the
draw's share of it, and the ceiling in generated tokens/s; medians over ``--repeats`` rounds (new tasks each round).
Then, from one more round, untimed, the torch operations dispatched per lock step outside the model (the stored
logits' copy, standing in for the forward, counts as one): on a GPU each one that launches a kernel or copies to the
device costs the host several microseconds, which a CPU run does not show.  Counts are exact: compare them across
commits.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_throughput import make_rollout  # noqa: E402

from sglightning.console import quiet  # noqa: E402
from sglightning.embedded import EMBEDDED_TINY  # noqa: E402
from sglightning.engines import EngineConfig, builtin  # noqa: E402
from sglightning.envs.household import HouseholdEnv  # noqa: E402
from sglightning.models import PolicyConfig, load_policy  # noqa: E402
from sglightning.rollout import Rollout  # noqa: E402


class Timer:
    """Seconds spent inside the wrapped callables, and their calls."""

    def __init__(self):
        self.seconds, self.calls = 0.0, 0

    def wrap(self, fn):
        @functools.wraps(fn)
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
        return timed


class NullForwardEngine(builtin.BuiltinEngine):
    """The built-in engine on the static slot cache, its forwards replaced by stored logits ``[rows, V]``."""

    def __init__(self, vocab: int, rows: int):
        super().__init__(EngineConfig(compile="static"))
        self.bank = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))  # [P, V]
        self.forward = Timer()

    def session(self, *args, **kwargs):
        s = super().session(*args, **kwargs)
        eager = self.forward.wrap(lambda ids, pos, attn, slots, cache, rows: self.bank[:rows].clone())  # [n, V]
        decode = self.forward.wrap(lambda ids, pos, attn, slots, cache, rows=None: self.bank[: ids.shape[0]].clone())
        s.static = builtin.StaticSession(s.static.pool, eager, decode)
        return s


def rollout(model, tok, engine: NullForwardEngine, group: int, decoding: str, max_new: int) -> Rollout:
    """The rollout ``rollout_throughput.py`` plays (household, ≤ 3 steps), kept across rounds as the trainer keeps its
    own: the environment workers live on."""
    env = functools.partial(HouseholdEnv, difficulty=0, info_actions=False, reveal_contents=True)
    return make_rollout(model, tok, env, group, 3, max_new, engine, constrained=decoding == "constrained")


class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched while active."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def ops_per_lock_step(r: Rollout, engine: NullForwardEngine, rows: int, decoding: str) -> float:
    """Torch operations per lock step in one more rollout (untimed: the counting slows it)."""
    counter = OpCounter()
    with counter:
        run = measure(r, engine, rows, decoding, 20_000)
    return counter.ops / run["lock_steps"]


def measure(r: Rollout, engine: NullForwardEngine, rows: int, decoding: str, round_: int) -> dict:
    """One rollout of ``rows`` episodes (``rows / group`` tasks × ``group``), its host time split."""
    tasks = rows // r.cfg.group_size
    env_timer, draw_timer = Timer(), Timer()
    engine.forward = Timer()
    real_step, real_draw = HouseholdEnv.step, builtin.draw
    HouseholdEnv.step, builtin.draw = env_timer.wrap(real_step), draw_timer.wrap(real_draw)
    try:
        seeds = [round_ * tasks + s for s in range(tasks)]  # new tasks every round
        t0 = time.perf_counter()
        batch = r.run(seeds, generator=torch.Generator().manual_seed(round_))
        seconds = time.perf_counter() - t0
    finally:
        HouseholdEnv.step, builtin.draw = real_step, real_draw
    host = seconds - env_timer.seconds
    steps, tokens = engine.forward.calls, batch.generated_tokens
    return {"rows": rows, "decoding": decoding, "round": round_, "tokens": tokens, "episodes": len(batch.episodes),
            "lock_steps": steps, "seconds": seconds, "env_s": env_timer.seconds, "draw_s": draw_timer.seconds,
            "host_ms_per_lock_step": 1e3 * host / steps, "draw_share": draw_timer.seconds / host,
            "ceiling_tokens_per_s": tokens / host}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128], help="episodes per rollout")
    ap.add_argument("--group", type=int, default=8, help="episodes per task")
    ap.add_argument("--decoding", nargs="+", default=["free", "constrained"], choices=["free", "constrained"])
    ap.add_argument("--max-new", type=int, default=32, help="new tokens per turn (guidance and action)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds (the first is preceded by an untimed warm-up)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--json", help="write every measurement and the medians here")
    args = ap.parse_args(argv)
    quiet()
    torch.set_num_threads(args.threads)
    model, tok = load_policy(PolicyConfig(name_or_path=EMBEDDED_TINY))  # its tokenizer and vocabulary only
    model.eval()
    gc.freeze()  # as the trainer does at its first rollout: collections skip the model's and libraries' objects
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; the forward replaced by stored logits")
    print(f"{'rows':>5} {'decoding':12} {'lock steps':>10} {'tokens':>7} {'host ms/step':>12} {'draw share':>10} "
          f"{'ceiling tok/s':>13} {'ops/step':>8}")
    report: dict = {"args": vars(args), "torch": torch.__version__, "runs": [], "medians": []}
    vocab = model.get_output_embeddings().weight.shape[0]
    with torch.no_grad():
        for rows in args.rows:
            engine = NullForwardEngine(vocab, rows)  # one per batch size, kept across rollouts as in training
            for decoding in args.decoding:
                r = rollout(model, tok, engine, args.group, decoding, args.max_new)
                try:
                    measure(r, engine, rows, decoding, 10_000)  # warm-up: the slot cache grows, the workers start
                    runs = [measure(r, engine, rows, decoding, k) for k in range(args.repeats)]
                    ops = ops_per_lock_step(r, engine, rows, decoding)
                finally:
                    r.close()
                report["runs"] += runs
                med = {k: statistics.median(r[k] for r in runs)
                       for k in ("lock_steps", "tokens", "host_ms_per_lock_step", "draw_share", "ceiling_tokens_per_s")}
                spread = [min(r["host_ms_per_lock_step"] for r in runs), max(r["host_ms_per_lock_step"] for r in runs)]
                report["medians"].append({"rows": rows, "decoding": decoding, **med, "host_ms_range": spread,
                                          "ops_per_lock_step": ops})
                print(f"{rows:5d} {decoding:12} {med['lock_steps']:10.0f} {med['tokens']:7.0f} "
                      f"{med['host_ms_per_lock_step']:8.2f} ({spread[0]:.2f}-{spread[1]:.2f}) "
                      f"{100 * med['draw_share']:9.0f}% {med['ceiling_tokens_per_s']:13,.0f} {ops:8.1f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
