"""A tiny fit alone and beside busy processes, with torch's default threads and with the thread budget.

    python benchmarks/thread_contention.py                      # configs/tiny.yaml, 3 steps, 1 busy process
    python benchmarks/thread_contention.py --hogs 2 --repeats 2 --steps 5

Each arm runs ``sglightning fit`` as a fresh process (the real CLI: imports, model build, rollouts, updates) and
reports its wall time; arms alternate so that drift of the box hits them alike. A "hog" is another busy process on
the box: by default another torch job with torch's default threads (a second experiment), or (``--hog spin``) a
one-core busy loop: the situations in which torch's default of one thread per core collapses. Printed: wall seconds
per arm (min over repeats) and the ratios that matter: each setting beside the hogs vs alone, and the budget vs
torch's default. Arms that run past ``--timeout`` are reported as ``>timeout``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"default": "null", "budget": "auto"}  # --threads values: torch's own default vs sglightning's budget


HOGS = {
    # one core at 100 %: a single-threaded job
    "spin": "while True: pass",
    # another torch job with torch's default threads (one per core): a second experiment on the same box
    "torch": "import torch\na = torch.randn(256, 256)\nwhile True: a @ a",
}


def _hog(kind: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HOGS[kind]], env={k: v for k, v in os.environ.items()
                                                                     if k != "OMP_NUM_THREADS"})


def run_fit(config: str, steps: int, threads: str, hogs: int, timeout: float, workdir: Path,
            hog_kind: str = "spin") -> float | None:
    """Wall seconds of one ``sglightning fit`` (None past ``timeout``)."""
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)  # the arms set the threads themselves
    cmd = [sys.executable, "-m", "sglightning.cli", "fit", "--config", config, f"--trainer.max_steps={steps}",
           "--trainer.enable_progress_bar=false", f"--threads={threads}",
           f"--trainer.logger.init_args.save_dir={workdir}", f"--trainer.default_root_dir={workdir}"]
    procs = [_hog(hog_kind) for _ in range(hogs)]
    try:
        time.sleep(0.5 if hogs else 0)
        t0 = time.perf_counter()
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=workdir)
        except subprocess.TimeoutExpired:
            return None
        wall = time.perf_counter() - t0
    finally:
        for p in procs:
            p.kill()
            p.wait()
    if res.returncode != 0:
        raise SystemExit(f"fit failed (threads={threads}, hogs={hogs}):\n{res.stderr[-3000:]}")
    return wall


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny.yaml"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--hogs", type=int, default=1, help="busy processes beside the fit")
    ap.add_argument("--hog", choices=sorted(HOGS), default="torch",
                    help="torch: another torch job with its default threads; spin: a one-core busy loop")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds before an arm counts as collapsed")
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args(argv)

    import torch

    from sglightning.threads import available_cpus, resolve

    hog_arm = f"{args.hogs} hog" + ("s" if args.hogs > 1 else "")
    walls: dict[str, list[float | None]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for setting, flag in SETTINGS.items():
                for hogs in (0, args.hogs):
                    arm = f"{setting}/{'alone' if hogs == 0 else hog_arm}"
                    workdir = Path(tmp) / f"{arm}-{r}".replace("/", "_").replace(" ", "_")
                    workdir.mkdir()
                    wall = run_fit(args.config, args.steps, flag, hogs, args.timeout, workdir, args.hog)
                    walls.setdefault(arm, []).append(wall)
                    shown = f">{args.timeout:.0f}" if wall is None else f"{wall:.1f}"
                    print(f"  {arm:<18} {shown} s", flush=True)

    def best(arm: str) -> float:
        done = [w for w in walls[arm] if w is not None]
        return min(done) if done else float("inf")

    out = {
        "box": {"cpus": available_cpus(), "torch": torch.__version__, "torch_default_threads": torch.get_num_threads(),
                "budget_threads": resolve("auto"), "date": time.strftime("%Y-%m-%d")},
        "config": args.config, "steps": args.steps, "hogs": args.hogs, "hog": args.hog, "repeats": args.repeats,
        "wall_s": {arm: best(arm) for arm in walls},
        "wall_s_all": walls,
    }
    out["ratios"] = {
        "default: beside hogs / alone": best(f"default/{hog_arm}") / best("default/alone"),
        "budget: beside hogs / alone": best(f"budget/{hog_arm}") / best("budget/alone"),
        "alone: budget / default": best("budget/alone") / best("default/alone"),
        "beside hogs: default / budget": best(f"default/{hog_arm}") / best(f"budget/{hog_arm}"),
    }
    print(f"box: {out['box']}")
    for k, v in out["ratios"].items():
        print(f"  {k:<32} {v:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
