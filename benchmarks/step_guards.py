"""What torch's guard checks cost the compiled decode step at every call, and what checking them once per input
signature and session call saves (``sglightning.engines.static.CompiledStep``).

    python benchmarks/step_guards.py                                       # CPU, inductor, 24 / 28 / 36 layers
    python benchmarks/step_guards.py --device cuda --mode reduce-overhead --graphs  # the GPU's decode steps

Before each call of a compiled function torch checks its guards: the modules the forward touched, every weight's
metadata, the inputs' sizes.  A LoRA model has several hundred per decoder layer.  This script builds random-init
models of Qwen3's layer design with LoRA on every projection (as the trainer does), at the layer counts of the GPU
check's shapes (probe and Qwen2.5-0.5B: 24; Qwen3-1.7B: 28; Qwen3-4B: 36) but a width of 32, so the kernels are cheap
and a call's wall time is the host's.  It times decode steps of ``--rows`` rows on a slot cache, alternating rounds
with the guards checked at every call and once per signature (the engine's way), one process, one step per
model (and one more with ``--graphs``).

Prints per layer count: µs per call each way (median of ``--repeats`` rounds of ``--calls`` calls, range in
brackets), and of it the time outside inductor's compiled code (torch's Python around the call), and the graphs
traced (1: one trace served every call).  ``--graphs`` (CUDA) adds the engine's own CUDA graphs
(``compile: graphs``), which replay with none of torch's Python.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from sglightning.console import quiet
from sglightning.embedded import EMBEDDED_TINY, TinyModelConfig
from sglightning.engines import static
from sglightning.models import PolicyConfig, load_policy
from sglightning.traits import cache_argument_name


class InsideTimer:
    """Seconds spent inside inductor's compiled code (``CompiledFxGraph.__call__``), to tell torch's Python around
    a compiled call from the call's own kernels; a no-op where this torch has no such class."""

    def __init__(self):
        self.seconds = 0.0
        self.cls = getattr(getattr(torch._inductor, "output_code", None), "CompiledFxGraph", None)

    def __enter__(self):
        if self.cls is not None:
            self.real = self.cls.__call__
            timer = self

            def timed(graph, *a, **kw):
                t0 = time.perf_counter()
                try:
                    return timer.real(graph, *a, **kw)
                finally:
                    timer.seconds += time.perf_counter() - t0

            self.cls.__call__ = timed
        return self

    def __exit__(self, *exc):
        if self.cls is not None:
            self.cls.__call__ = self.real


def compiled(step) -> static.CompiledStep:
    """The compiled step of an arm (a GraphedStep's own)."""
    return step.step if isinstance(step, static.GraphedStep) else step


def rounds(arms: dict, model, rows: int, calls: int, repeats: int, device: torch.device) -> dict:
    """Alternating rounds of ``calls`` decode steps of each arm (name -> (step, skip_guards)); per arm, µs per call
    and µs per call outside inductor's compiled code."""
    view = static.VIEW_STEP * 2  # every call reads the same view (one signature), shorter than the cache
    slots = static.slot_capacity(view + 1)
    cache = static.SlotCache.allocate(model, rows, slots, next(model.parameters()).dtype, device)
    ids = torch.ones(rows, 1, dtype=torch.long, device=device)
    pos = torch.zeros(rows, 1, dtype=torch.long, device=device)
    seen = torch.zeros(rows, slots, dtype=torch.bool, device=device)
    at = 0

    def one(step, n: int) -> tuple[float, float]:
        nonlocal at
        step.forget()  # a session call begins
        if device.type == "cuda":
            torch.cuda.synchronize()
        with InsideTimer() as inside:
            t0 = time.perf_counter()
            for _ in range(n):
                seen[:, at] = True
                if device.type == "cuda":
                    torch.compiler.cudagraph_mark_step_begin()
                step(ids, pos + at, static.block_mask(seen[:, :view], at, 1), torch.tensor([at], device=device),
                     cache, rows)
                at = (at + 1) % view
            if device.type == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        return 1e6 * wall / n, 1e6 * (wall - inside.seconds) / n

    out: dict = {arm: {"us": [], "outside_us": []} for arm in arms}
    with torch.no_grad():
        for step, _ in arms.values():
            compiled(step).skip_guards = True
            one(step, 8)  # compile, warm up (and capture)
        for _ in range(repeats):
            for arm, (step, skip) in arms.items():
                compiled(step).skip_guards = skip
                us, outside = one(step, calls)
                out[arm]["us"].append(us)
                out[arm]["outside_us"].append(outside)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[24, 28, 36])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--calls", type=int, default=100, help="decode steps per round")
    ap.add_argument("--repeats", type=int, default=5, help="rounds per arm")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mode", default="default", choices=["default", "reduce-overhead"], help="model.engine.compile")
    ap.add_argument("--graphs", action="store_true", help="also the engine's own CUDA graphs (compile: graphs; CUDA)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args(argv)
    quiet()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    names = {"checked": "guards every call", "once": "guards once", "graphs": "engine's graphs"}
    arms = ["checked", "once"] + (["graphs"] if args.graphs else [])
    print(f"torch {torch.__version__}, {device.type}, model.engine.compile {args.mode}, {args.rows} rows; µs per "
          "decode step, median of rounds (range) [outside inductor's compiled code]")
    print(f"{'layers':>6} " + " ".join(f"{names[a]:>32}" for a in arms) + f" {'traces':>6}")
    report: dict = {"args": vars(args), "torch": torch.__version__, "rows": []}
    for layers in args.layers:
        shape = TinyModelConfig(num_layers=layers, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16,
                                intermediate_size=32, arch="qwen3")
        model, _ = load_policy(PolicyConfig(name_or_path=EMBEDDED_TINY, tiny=shape), device=device)
        model.eval()
        decode = static.decode_step(model, cache_argument_name(model))
        step = static.CompiledStep(decode, args.mode)
        steps = {"checked": (step, False), "once": (step, True)}
        if args.graphs:
            steps["graphs"] = (static.GraphedStep(static.CompiledStep(decode, "default"), model), True)
        times = rounds(steps, model, args.rows, args.calls, args.repeats, device)
        row: dict = {"layers": layers, "traces": step.graphs}
        cells = []
        for arm in arms:
            us, outside = times[arm]["us"], times[arm]["outside_us"]
            # a replay never enters inductor's code: the time outside it means nothing there
            inside_known = arm != "graphs"
            row[arm] = {"us": statistics.median(us), "range": [min(us), max(us)],
                        "outside_us": statistics.median(outside) if inside_known else None}
            bracket = f"{row[arm]['outside_us']:.0f}" if inside_known else "-"
            cells.append(f"{row[arm]['us']:.0f} ({min(us):.0f}-{max(us):.0f}) [{bracket}]")
        report["rows"].append(row)
        print(f"{layers:6d} " + " ".join(f"{c:>32}" for c in cells) + f" {step.graphs:6d}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
