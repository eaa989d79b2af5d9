"""What torch's guard checks cost the compiled decode step at every call, and what checking them once per input
signature and session call saves (``sglightning.engines.static.CompiledStep``).

    python benchmarks/step_guards.py                                       # CPU, inductor, 24 / 28 / 36 layers
    python benchmarks/step_guards.py --device cuda --mode reduce-overhead  # the GPU's decode step

Before each call of a compiled function torch checks its guards: the modules the forward touched, every weight's
metadata, the inputs' sizes.  A LoRA model has several hundred per decoder layer.  This script builds random-init
models of Qwen3's layer design with LoRA on every projection (as the trainer does), at the layer counts of the GPU
check's shapes (probe and Qwen2.5-0.5B: 24; Qwen3-1.7B: 28; Qwen3-4B: 36) but a width of 32, so the kernels are cheap
and a call's wall time is the host's.  It times decode steps of ``--rows`` rows on a slot cache, alternating rounds
with the guards checked at every call and once per signature (the engine's way), one process, one step per model.

Prints per layer count: µs per call each way (median of ``--repeats`` rounds of ``--calls`` calls, range in
brackets), the saving, and the graphs compiled (1: one trace served every call).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from sglightning.console import quiet
from sglightning.engines import static
from sglightning.models import EMBEDDED_TINY, PolicyConfig, TinyModelConfig, cache_argument_name, load_policy


def rounds(step: static.CompiledStep, model, rows: int, calls: int, repeats: int, device: torch.device) -> dict:
    """Alternating rounds of ``calls`` decode steps, guards checked every call and once; µs per call of each."""
    view = static.VIEW_STEP * 2  # every call reads the same view (one signature), shorter than the cache
    slots = static.slot_capacity(view + 1)
    cache = static.SlotCache.allocate(model, rows, slots, next(model.parameters()).dtype, device)
    ids = torch.ones(rows, 1, dtype=torch.long, device=device)
    pos = torch.zeros(rows, 1, dtype=torch.long, device=device)
    seen = torch.zeros(rows, slots, dtype=torch.bool, device=device)
    at = 0

    def one(n: int) -> float:
        nonlocal at
        step.forget()  # a session call begins
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            seen[:, at] = True
            if device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()
            step(ids, pos + at, static.block_mask(seen[:, :view], at, 1), torch.tensor([at], device=device), cache,
                 rows)
            at = (at + 1) % view
        if device.type == "cuda":
            torch.cuda.synchronize()
        return 1e6 * (time.perf_counter() - t0) / n

    out = {"checked": [], "once": []}
    with torch.no_grad():
        step.skip_guards = True
        one(8)  # compile, warm up
        for _ in range(repeats):
            for arm, skip in (("checked", False), ("once", True)):
                step.skip_guards = skip
                out[arm].append(one(calls))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[24, 28, 36])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--calls", type=int, default=100, help="decode steps per round")
    ap.add_argument("--repeats", type=int, default=5, help="rounds per arm")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mode", default="default", choices=["default", "reduce-overhead"], help="model.engine.compile")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args(argv)
    quiet()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, {device.type}, model.engine.compile {args.mode}, {args.rows} rows; "
          "µs per decode step (median of rounds, range)")
    print(f"{'layers':>6} {'guards every call':>22} {'guards once':>22} {'saved':>7} {'graphs':>6}")
    report: dict = {"args": vars(args), "torch": torch.__version__, "rows": []}
    for layers in args.layers:
        shape = TinyModelConfig(num_layers=layers, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16,
                                intermediate_size=32, arch="qwen3")
        model, _ = load_policy(PolicyConfig(name_or_path=EMBEDDED_TINY, tiny=shape), device=device)
        model.eval()
        step = static.CompiledStep(static.decode_step(model, cache_argument_name(model)), args.mode)
        times = rounds(step, model, args.rows, args.calls, args.repeats, device)
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"layers": layers, **{f"{k}_us": med[k] for k in med}, "ranges": {k: [min(v), max(v)]
               for k, v in times.items()}, "saved_us": med["checked"] - med["once"], "graphs": step.graphs}
        report["rows"].append(row)
        cells = [f"{med[k]:8.0f} ({min(times[k]):.0f}-{max(times[k]):.0f})" for k in ("checked", "once")]
        print(f"{layers:6d} {cells[0]:>22} {cells[1]:>22} {row['saved_us']:7.0f} {step.graphs:6d}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
