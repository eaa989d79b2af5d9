"""Memory soak: run the tiny config for N GRPO steps and print the process RSS after every step.

    python benchmarks/memory_soak.py --steps 200

RSS must plateau: rollout buffers, TensorBoard text and environment instances may not accumulate across steps.
The last lines compare the mean RSS of the second quarter of the run with the last quarter.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
from pathlib import Path

from lightning.pytorch import Callback


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


class RSSPrinter(Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.values.append(rss_mb())
        print(f"step {trainer.global_step:5d}  rss {self.values[-1]:8.1f} MB", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"))
    args = ap.parse_args()
    from sglightning.cli import cli_main

    out = tempfile.mkdtemp(prefix="sgl-soak-")
    printer = RSSPrinter()
    import sglightning.module as module_mod

    original = module_mod.SelfGuideModule.configure_callbacks

    def with_printer(self):
        return [*original(self), printer]

    module_mod.SelfGuideModule.configure_callbacks = with_printer
    cli_main([
        "fit", "--config", args.config, f"--trainer.max_steps={args.steps}", f"--trainer.default_root_dir={out}",
        f"--trainer.logger.init_args.save_dir={out}", "--trainer.enable_progress_bar=false",
        "--model.evaluation.num_tasks=1",
    ])
    v = printer.values
    if len(v) >= 8:
        q = len(v) // 4
        early, late = sum(v[q : 2 * q]) / q, sum(v[-q:]) / q
        print(f"mean RSS steps {q}-{2 * q}: {early:.1f} MB; last {q} steps: {late:.1f} MB; "
              f"growth {late - early:+.1f} MB")
    sys.exit(0)


if __name__ == "__main__":
    main()
