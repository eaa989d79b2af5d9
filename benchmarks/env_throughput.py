"""Environment throughput: the worker pool (one thread + one env/JVM per episode slot, steps of a round run
concurrently) vs one worker (the same envs stepped one after another), on the real benchmark simulators; for the
pure-Python simulators (ALFWorld, household) also the pool with each env in a process of its own.

    python benchmarks/env_throughput.py                            # twx twc + scienceworld + household, 16 slots
    python benchmarks/env_throughput.py --envs scienceworld --slots 8 --rounds 30
    python benchmarks/env_throughput.py --alfworld-data /path/with/json_2.1.1   # + ALFWorld games
    python benchmarks/env_throughput.py --envs alfworld --alfworld-data fixtures --slots 8   # the tests' 7 games
    python benchmarks/env_throughput.py --envs remote --latency-ms 50 --max-concurrency 16  # envs that wait (servers)

No model is involved: each round every slot takes one action (a seeded random admissible action where the env lists
them; a fixed mix of ScienceWorld commands otherwise), as a lock-step rollout round does.  Prints env steps/s and
resets/s for both modes.  ``remote`` is the household env behind a fixed per-call latency (a stand-in for env servers
such as WebShop's, where a step mostly waits).  ScienceWorld also compares our direct simulator step with the
package's ``env.step``, which rebuilds the full valid-action list on every call.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import time

from sglightning.envs import build_env
from sglightning.envs.pool import EnvPool

SW_ACTIONS = ["look around", "inventory", "open door to kitchen", "go to kitchen", "look at table",
              "pick up thermometer", "open cupboard", "go to hallway", "wait1", "read book", "focus on thermometer"]


class RemoteHousehold:
    """Household env with a fixed latency per call (built lazily so that the class pickles)."""

    def __new__(cls, latency_s: float):
        from sglightning.envs.household import HouseholdEnv

        class _Remote(HouseholdEnv):
            def reset(self, seed, split="train"):
                time.sleep(latency_s)
                return super().reset(seed, split)

            def step(self, action):
                time.sleep(latency_s)
                return super().step(action)

        return _Remote(difficulty=2)


#: envs whose simulator is pure Python (a process per env is an option for them; the JVM envs are processes already)
PURE_PYTHON = ("alfworld", "household")


def fixture_games() -> str:
    """The tests' hand-written ALFWorld games, made playable by ``alfworld-generate`` in a temporary folder."""
    import sys
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from alfworld_games import build_alfworld_fixture

    return str(build_alfworld_fixture(Path(tempfile.mkdtemp(prefix="alfworld-"))))


def make_factory(name: str, alfworld_data: str | None, latency_ms: float = 50.0):
    if name == "remote":
        return functools.partial(RemoteHousehold, latency_ms / 1000)
    if name == "twx":
        from sglightning.envs.textworld_express import TextWorldExpressEnv

        return functools.partial(TextWorldExpressEnv, "twc")
    if name == "scienceworld":
        from sglightning.envs.scienceworld import ScienceWorldEnv

        return functools.partial(ScienceWorldEnv, ["boil", "find-plant", "use-thermometer", "test-conductivity"])
    if name == "alfworld":
        from sglightning.envs.alfworld import ALFWorldEnv

        return functools.partial(ALFWorldEnv, data_path=alfworld_data, expert=False)
    from sglightning.envs.household import HouseholdEnv

    return functools.partial(HouseholdEnv, difficulty=2)


def play(pool: EnvPool, slots: int, rounds: int, seed: int, split: str) -> dict[str, float]:
    rng = random.Random(seed)
    t0 = time.perf_counter()
    outs = pool.reset_many([(i, seed + i // 2, split) for i in range(slots)])
    reset_s = time.perf_counter() - t0
    adm = {i: o.value.admissible_actions for i, o in enumerate(outs) if o.ok}
    steps, errors = 0, sum(not o.ok for o in outs)
    t0 = time.perf_counter()
    for _ in range(rounds):
        calls = [(i, rng.choice(adm[i]) if adm[i] else rng.choice(SW_ACTIONS)) for i in sorted(adm)]
        if not calls:
            break
        for (i, _), o in zip(calls, pool.step_many(calls)):
            if not o.ok:
                errors += 1
                adm.pop(i)
                continue
            steps += 1
            if o.value.done:
                adm.pop(i)
            else:
                adm[i] = o.value.admissible_actions
    step_s = time.perf_counter() - t0
    return {"steps": steps, "steps_per_s": steps / max(step_s, 1e-9), "resets_per_s": slots / max(reset_s, 1e-9),
            "errors": errors}


def official_scienceworld_step_rate(n: int = 40) -> float:
    from scienceworld import ScienceWorldEnv as Official

    env = Official("", envStepLimit=100_000)
    env.load("use-thermometer", 0)
    env.reset()
    t0 = time.perf_counter()
    for k in range(n):
        env.step(SW_ACTIONS[k % len(SW_ACTIONS)])
    rate = n / (time.perf_counter() - t0)
    env.close()
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--envs", nargs="+", default=["twx", "scienceworld", "household"],
                    choices=["twx", "scienceworld", "alfworld", "household", "remote"])
    ap.add_argument("--latency-ms", type=float, default=50.0, help="per-call latency of the `remote` env")
    ap.add_argument("--max-concurrency", type=int, default=None, help="env calls at once (default: CPU cores)")
    ap.add_argument("--slots", type=int, default=16, help="concurrent episodes (= envs = JVMs)")
    ap.add_argument("--rounds", type=int, default=20, help="steps per episode")
    ap.add_argument("--alfworld-data", default=None, help="the folder holding json_2.1.1, or `fixtures`")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.alfworld_data and "alfworld" not in args.envs:
        args.envs.append("alfworld")
    if args.alfworld_data == "fixtures":
        args.alfworld_data = fixture_games()
    print(f"{os.cpu_count()} CPU cores; {args.slots} slots × {args.rounds} rounds")
    print(f"{'env':14s} {'mode':10s} {'steps':>6s} {'steps/s':>9s} {'resets/s':>9s} {'errors':>6s}")
    for name in args.envs:
        factory = make_factory(name, args.alfworld_data, args.latency_ms)
        results = {}
        modes = [("pool", True, False), ("one worker", False, False)]
        if name in PURE_PYTHON:
            modes.append(("processes", True, True))
        for mode, concurrent, processes in modes:
            built = functools.partial(build_env, factory, processes)
            with EnvPool(built, concurrent=concurrent, max_concurrency=args.max_concurrency) as pool:
                for i in range(args.slots):  # start every env first: JVM start-up is not throughput
                    pool.env(i)
                play(pool, args.slots, 2, args.seed + 1000, "train")  # warm-up (class loading, JIT)
                r = play(pool, args.slots, args.rounds, args.seed, "train")
            results[mode] = r
            print(f"{name:14s} {mode:10s} {r['steps']:6d} {r['steps_per_s']:9.1f} {r['resets_per_s']:9.1f} "
                  f"{r['errors']:6d}")
        speed = results["pool"]["steps_per_s"] / max(results["one worker"]["steps_per_s"], 1e-9)
        print(f"{name:14s} pool / one worker: steps ×{speed:.2f}, resets "
              f"×{results['pool']['resets_per_s'] / max(results['one worker']['resets_per_s'], 1e-9):.2f}")
        if "processes" in results:
            print(f"{name:14s} processes / pool: steps "
                  f"×{results['processes']['steps_per_s'] / max(results['pool']['steps_per_s'], 1e-9):.2f}")
        if name == "scienceworld":
            print(f"{name:14s} package env.step (valid-action list every call): "
                  f"{official_scienceworld_step_rate():.1f} steps/s, one env")


if __name__ == "__main__":
    main()
