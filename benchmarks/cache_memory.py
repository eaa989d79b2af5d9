"""What the in-process engine's slot caches take, by arithmetic at a shape, and what growing one costs, measured.

    python benchmarks/cache_memory.py                          # the GPU check's shapes at the paper's 128 rows
    python benchmarks/cache_memory.py --rows 64 --rate-slots 2304 --act-slots 1280 --json out.json

A slot cache holds keys and values ``[rows, kv heads, slots, head dim]`` in every layer, whatever each row uses.
Part one prints, per shape, the bf16 bytes of ``two_call``'s two caches (the rate call's and the act call's) at the
slots they need, rounded as the engine rounds them now (powers of two up to 2 048, then steps of 512) and as it did
(doubling), and whether both fit under ``model.engine.cache_memory`` × the card's memory (else one cache serves
both calls).  Part two measures on this machine the peak resident memory of growing a cache by one step: a new
cache beside the old (as before) and in place, one layer at a time (as now), each in a fresh process.  Part three
measures the peak resident memory and time of one long fed block, in one pass and in chunks of
``model.engine.prefill_tokens`` positions, each in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import SHAPES, shape_numbers  # noqa: E402

from sglightning.engines.static import bucket, reserved_slots, slot_capacity  # noqa: E402

GIB = 2**30


def arithmetic(shape: str, rows: int, rate: int, act: int, card_gib: float, share: float) -> dict:
    """``two_call``'s caches at ``shape`` in bf16: GiB now and with doubling, and whether both fit the limit."""
    per_token = shape_numbers(SHAPES[shape])["kv_bytes_per_token"]  # bf16 keys and values of every layer
    asked = [reserved_slots(n) for n in (rate, act)]  # what the engine asks the cache for
    now = [rows * slot_capacity(n) * per_token / GIB for n in asked]
    doubled = [rows * bucket(n, 512) * per_token / GIB for n in asked]
    return {"shape": shape, "rows": rows, "rate_slots": slot_capacity(asked[0]), "act_slots": slot_capacity(asked[1]),
            "rate_GiB": now[0], "act_GiB": now[1], "rate_GiB_doubling": doubled[0], "act_GiB_doubling": doubled[1],
            "limit_GiB": share * card_gib, "both_fit": sum(now) <= share * card_gib}


def _peak_from_here() -> Callable[[], int | None]:
    """The resident memory now; returns a function giving the peak above it since, or None where the peak cannot be
    reset (Linux resets it through /proc/self/clear_refs, so what imports and set-up took before does not count)."""
    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident size
        start = status("VmRSS:")
    except (OSError, StopIteration):  # not Linux, or a sandbox without it: no measurement, not a wrong one
        return lambda: None
    return lambda: status("VmHWM:") - start


def _gib(n: int | None) -> float | None:
    return None if n is None else n / GIB


def grow_peak(arm: str, layers: int, rows: int, slots: int, step: int) -> dict:
    """In this process: allocate a float32 cache of ``rows`` × ``slots`` (kv heads 8, head dim 64), grow it by
    ``step`` slots (``arm``: beside or in_place); the peak resident memory above the start, against the final size."""
    import torch

    from sglightning.engines.static import SlotCache

    shape = (rows, 8, slots, 64)
    (torch.ones(8, 8) @ torch.ones(8, 8)).sum().item()  # torch's lazy set-up (libraries, thread pools) before
    peak = _peak_from_here()
    cache = SlotCache([torch.ones(shape) for _ in range(layers)], [torch.ones(shape) for _ in range(layers)])
    if arm == "beside":
        grown = (rows, 8, slots + step, 64)
        new = SlotCache([torch.zeros(grown) for _ in range(layers)], [torch.zeros(grown) for _ in range(layers)])
        for a, b in zip(new.keys + new.values, cache.keys + cache.values):
            a[:, :, :slots] = b
        cache = new
    else:
        cache.grow(slots + step)
    return {"arm": arm, "final_GiB": cache.nbytes() / GIB, "peak_GiB": _gib(peak())}


def prefill_peak(prefill_tokens: int, rows: int, width: int) -> dict:
    """In this process: feed ``rows`` prompts of ``width`` tokens to a 2-layer, 512-wide model on the slot cache,
    in one pass (``prefill_tokens`` 0) or in chunks of that many positions; the peak resident memory above the start
    (the cache allocated first, so the peak is the forward's), and the seconds."""
    import time

    import torch

    from sglightning.embedded import TinyModelConfig
    from sglightning.engines import EngineConfig
    from sglightning.engines.builtin import BuiltinEngine
    from sglightning.models import PolicyConfig, load_policy

    torch.manual_seed(0)
    shape = TinyModelConfig(hidden_size=512, num_layers=2, num_heads=8, intermediate_size=2048)
    model, _ = load_policy(PolicyConfig(name_or_path="embedded:tiny", tiny=shape))
    model.eval()
    engine = BuiltinEngine(EngineConfig(compile="static", prefill_tokens=prefill_tokens or None))
    blocks = [[5 + (r * 31 + j) % 400 for j in range(width)] for r in range(rows)]
    warm = engine.session(model, 0, 1.0, torch.Generator().manual_seed(0))
    warm.feed([[5]] * rows)  # takes the cache (its capacity from the first feed) and warms the kernels
    warm._reserve(width + 300)  # room for the block, so that the cache is not grown inside the measured feed
    del warm
    session = engine.session(model, 0, 1.0, torch.Generator().manual_seed(0))
    peak = _peak_from_here()
    t0 = time.perf_counter()
    with torch.no_grad():
        session.feed(blocks)
    seconds = time.perf_counter() - t0
    return {"prefill_tokens": prefill_tokens, "rows": rows, "width": width, "forwards": session.forward_calls,
            "peak_GiB": _gib(peak()), "seconds": seconds}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["probe", "qwen3-1.7b", "qwen3-4b"], choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, default=128, help="episodes per rollout (the paper's 16 × 8)")
    ap.add_argument("--rate-slots", type=int, default=4096 + 256, help="rate call: prompt cap + rating tokens")
    ap.add_argument("--act-slots", type=int, default=2560 + 1024, help="act call: prompt + action tokens")
    ap.add_argument("--card-gib", type=float, default=140.0, help="the GPU's memory (an H200: ~140 GiB)")
    ap.add_argument("--share", type=float, default=0.5, help="model.engine.cache_memory")
    ap.add_argument("--grow-gib", type=float, default=1.0, help="part two: the cache's size before it grows")
    ap.add_argument("--prefill", type=int, nargs=2, default=[32, 2048], metavar=("ROWS", "WIDTH"),
                    help="part three: the block fed")
    ap.add_argument("--prefill-tokens", type=int, default=16384, help="part three: model.engine.prefill_tokens")
    ap.add_argument("--json", help="write every part here")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)  # arm layers rows slots step: one part-two run
    ap.add_argument("--prefill-child", type=int, nargs=3, help=argparse.SUPPRESS)  # tokens rows width: part three
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(grow_peak(args.child[0], *map(int, args.child[1:]))))
        return {}
    if args.prefill_child:
        print(json.dumps(prefill_peak(*args.prefill_child)))
        return {}
    report: dict = {"args": vars(args), "arithmetic": [], "grow": [], "prefill": []}
    print(f"two_call's slot caches in bf16, {args.rows} rows, limit {args.share} × {args.card_gib:.0f} GiB")
    print(f"{'shape':12} {'rate slots':>10} {'rate GiB':>9} {'act slots':>9} {'act GiB':>8} {'doubling GiB':>13} "
          f"{'both fit':>8}")
    for shape in args.shapes:
        a = arithmetic(shape, args.rows, args.rate_slots, args.act_slots, args.card_gib, args.share)
        report["arithmetic"].append(a)
        print(f"{shape:12} {a['rate_slots']:10d} {a['rate_GiB']:9.1f} {a['act_slots']:9d} {a['act_GiB']:8.1f} "
              f"{a['rate_GiB_doubling'] + a['act_GiB_doubling']:13.1f} {'yes' if a['both_fit'] else 'no':>8}")
    layers, rows, slots = 16, 8, 512
    slots = max(512, int(args.grow_gib * GIB / (2 * layers * rows * 8 * 64 * 4)) // 512 * 512)
    print(f"\ngrowing a float32 cache of {layers} layers × {rows} rows × {slots} slots by 512 slots, on this machine")
    for arm in ("beside", "in_place"):
        out = subprocess.run([sys.executable, __file__, "--child", arm, str(layers), str(rows), str(slots), "512"],
                             capture_output=True, text=True, check=True)
        g = json.loads(out.stdout.strip().splitlines()[-1])
        report["grow"].append(g)
        peak = "not measurable here" if g["peak_GiB"] is None else (
            f"{g['peak_GiB']:.2f} GiB ({g['peak_GiB'] / g['final_GiB']:.2f}× the final size)")
        print(f"{arm:9} final {g['final_GiB']:.2f} GiB, peak {peak}")
    rows, width = args.prefill
    print(f"\nfeeding {rows} rows × {width} tokens to a 2-layer, 512-wide model (slot cache), on this machine")
    for tokens in (0, args.prefill_tokens):
        out = subprocess.run([sys.executable, __file__, "--prefill-child", str(tokens), str(rows), str(width)],
                             capture_output=True, text=True, check=True)
        p = json.loads(out.stdout.strip().splitlines()[-1])
        report["prefill"].append(p)
        name = f"chunks of {tokens} positions" if tokens else "one pass"
        peak = "not measurable here" if p["peak_GiB"] is None else f"{p['peak_GiB']:.2f} GiB above the cache"
        print(f"{name:26} {p['forwards']:3d} forwards, peak {peak}, "
              f"{p['seconds']:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
