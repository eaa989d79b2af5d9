"""Where one training step's time goes: the phases of a step, and how busy the device was in each.

Why: on a GPU the question is whether the rollout and the update keep the chip busy or wait on the host.
``torch.profiler`` records every operation and kernel; its tables list operations, not phases, and a whole fit's
trace is huge.  The code marks its phases with :func:`phase`.  Two things listen, each only when asked:

* :func:`timing` — every training step: each phase's wall seconds, logged as ``time/<parent>_<phase>_s`` (a few
  µs per step);
* :func:`recording` — one step under ``torch.profiler`` (:class:`sglightning.callbacks.StepProfile`);
  :func:`summarise` reduces it to the phases: calls, wall time, and device time (the kernels and copies each phase
  launched).

With neither, a mark is a no-op (0.1 µs).

Reading a profile (docs/performance.md has more): a phase's wall time is host time plus any wait for the device.
On a GPU the rollout's forward is queued without waiting, and the draw that follows waits for it (one copy to the host
per lock step), so ``rollout/decode`` shows the host's launch cost and ``rollout/draw`` absorbs the device's.  A
device busy share well under 100 % in a phase means the host, not the chip, bounds that phase.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping

import torch
from torch.autograd import DeviceType

#: the prefix of every range this package records; the phases a step is split into, in the order a report shows them
PREFIX = "sglightning/"
PHASES = ("step", "rollout", "rollout/prefill", "rollout/decode", "rollout/draw", "rollout/env", "update",
          "update/correction", "update/forward", "update/backward", "update/optimiser")

_OFF = contextlib.nullcontext()


class PhaseTimes:
    """Wall seconds and calls per phase, summed while :func:`timing` is active."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()


_times: PhaseTimes | None = None  # the active timing (phases are marked on the main thread only)


class _Timed:
    """One phase's time added to a :class:`PhaseTimes`, inside a profiler range when one records."""

    __slots__ = ("name", "times", "range", "t0")

    def __init__(self, name: str, times: PhaseTimes, range_: contextlib.AbstractContextManager | None):
        self.name, self.times, self.range, self.t0 = name, times, range_, 0.0

    def __enter__(self) -> None:
        if self.range is not None:
            self.range.__enter__()
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.times.seconds[self.name] += time.perf_counter() - self.t0
        self.times.calls[self.name] += 1
        if self.range is not None:
            self.range.__exit__(*exc)


def phase(name: str) -> contextlib.AbstractContextManager:
    """Mark a phase: its wall time is added to the active :func:`timing`, and a profiler range
    ``sglightning/<name>`` opens while a profiler records.  With neither, a no-op (0.1 µs; a range costs ~6 µs).

    Args:
        name: one of :data:`PHASES`.
    """
    recorded = torch._C._autograd._profiler_enabled()
    if _times is None:
        return torch.profiler.record_function(PREFIX + name) if recorded else _OFF
    return _Timed(name, _times, torch.profiler.record_function(PREFIX + name) if recorded else None)


@contextlib.contextmanager
def timing() -> Iterator[PhaseTimes]:
    """Sum the wall time of every phase marked inside the block (nested timings: the inner one only)."""
    global _times
    outer, _times = _times, PhaseTimes()
    try:
        yield _times
    finally:
        _times = outer


def log_key(name: str) -> str:
    """The logged key of phase ``name``: ``rollout/decode`` → ``time/rollout_decode_s``."""
    return f"time/{name.replace('/', '_')}_s"


def phase_logs(seconds: Mapping[str, float], parent: str) -> dict[str, float]:
    """:func:`log_key` → seconds for each sub-phase of ``parent`` in ``seconds`` (e.g. ``time/rollout_decode_s``).

    Args:
        seconds: wall seconds by phase name (:attr:`PhaseTimes.seconds`).
        parent: ``rollout`` or ``update``.
    """
    return {log_key(name): s for name, s in seconds.items() if name.startswith(parent + "/")}


def _quiet_kineto() -> None:
    # torch's profiler library (kineto) writes two lines to stderr per recording, unasked: level 6 keeps it quiet
    # (read when it first starts; a user's own KINETO_LOG_LEVEL wins)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")


def prepare_for_cuda_graphs() -> None:
    """Start the profiler once, empty, before any CUDA graph is captured: a graph captured before the profiler's
    first start and replayed under it can fail or hang (pytorch/pytorch#75504; torch's own workaround)."""
    _quiet_kineto()
    torch.profiler._utils._init_for_cuda_graphs()


@contextlib.contextmanager
def recording(cuda: bool) -> Iterator[torch.profiler.profile]:
    """``torch.profiler`` over the block (host operations; with ``cuda`` also kernels and copies), with the block
    marked as phase ``step``.  The device is synchronised before the block ends, so every kernel is in.

    Args:
        cuda: record CUDA activity too (the model is on a CUDA device).
    """
    _quiet_kineto()
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    # acc_events: one cycle is recorded, so keeping events across cycles changes nothing; without it torch 2.11 warns
    # on stderr at every start
    with torch.profiler.profile(activities=acts, acc_events=True) as prof:
        with phase("step"):
            yield prof
            if cuda:
                torch.cuda.synchronize()


def summarise(prof: torch.profiler.profile, top: int = 10) -> dict:
    """One recorded step as numbers (seconds): the step's wall time and device time, then per phase of :data:`PHASES`
    that ran: calls, wall (inclusive) and device time; the ``top`` kernels by device time and host operations by
    self time.

    Device time is the sum of the kernels' and copies' durations (overlapping streams count twice; this package uses
    one stream).  ``device_busy`` = device / wall.  A CPU run has no device time: its device fields are 0.

    Args:
        prof: a finished :func:`recording`.
        top: how many kernels and host operations to list.
    """
    events = prof.key_averages()
    # a range is a host event; on CUDA the profiler also lists its span on the device (a user annotation), skipped
    stats = {e.key: e for e in events if e.key.startswith(PREFIX) and e.device_type == DeviceType.CPU}
    if PREFIX + "step" not in stats:
        raise ValueError("the profile holds no sglightning/step range: record it with sglightning.profiling.recording")
    step = stats[PREFIX + "step"]
    wall = step.cpu_time_total / 1e6
    # operations, kernels and copies only: ranges (ours, torch.compile's, a user's) are spans; on CUDA each also has
    # a span on the device, whose duration would count the kernels inside it twice
    own = [e for e in events if not e.key.startswith(PREFIX) and not getattr(e, "is_user_annotation", False)]
    # the kernels and copies themselves: the host operation that launched a kernel carries its time too (counted once,
    # as torch's own table does)
    on_device = [e for e in own if e.device_type != DeviceType.CPU]
    device = sum(e.self_device_time_total for e in on_device) / 1e6
    phases = []
    for name in PHASES:
        e = stats.get(PREFIX + name)
        if e is None:
            continue
        phases.append({"phase": name, "calls": int(e.count), "wall_s": e.cpu_time_total / 1e6,
                       "device_s": e.device_time_total / 1e6})
    kernels = sorted((e for e in on_device if e.self_device_time_total > 0), key=lambda e: -e.self_device_time_total)
    host = sorted(own, key=lambda e: -e.self_cpu_time_total)
    return {
        "cuda": torch.profiler.ProfilerActivity.CUDA in prof.activities,  # the device's activity was asked for
        "wall_s": wall, "device_s": device, "device_busy": device / wall if wall > 0 else 0.0,
        # kernels and copies recorded: 0 on CUDA means the profiler saw no device activity (e.g. no access to CUPTI),
        # so the device times are unknown, not zero
        "device_events": int(sum(e.count for e in kernels)),
        "phases": phases,
        "top_kernels": [{"name": e.key, "calls": int(e.count), "device_s": e.self_device_time_total / 1e6}
                        for e in kernels[:top]],
        "top_host_ops": [{"name": e.key, "calls": int(e.count), "self_s": e.self_cpu_time_total / 1e6}
                         for e in host[:top]],
    }


def markdown(summary: dict, title: str, details: bool = True) -> str:
    """:func:`summarise`'s numbers as Markdown: the phase table, then the top kernels and host operations.

    Args:
        summary: from :func:`summarise`.
        title: the heading (which step, which device).
        details: list the top kernels and host operations after the phase table.
    """
    wall = summary["wall_s"] or 1e-12
    dev = summary["device_s"]

    def busy(d: float, w: float) -> str:
        return f"{100 * d / w:.0f} %" if dev > 0 and w > 0 else "-"

    lines = [f"# {title}", "",
             f"Step: {summary['wall_s']:.3f} s wall, {dev:.3f} s device time (busy {busy(dev, wall)}).", "",
             *(["No kernel or copy was recorded: on a GPU the device times are unknown (is CUPTI available?).", ""]
               if summary["cuda"] and not summary["device_events"] else []),
             "| phase | calls | wall s | share of the step | device s | device busy |", "|---|---|---|---|---|---|"]
    for p in _with_rest(summary["phases"]):
        lines.append(f"| {p['phase']} | {p['calls']} | {p['wall_s']:.3f} | {100 * p['wall_s'] / wall:.1f} % | "
                     f"{p['device_s']:.3f} | {busy(p['device_s'], p['wall_s'])} |")
    if not details:
        return "\n".join(lines) + "\n"
    if summary["top_kernels"]:
        lines += ["", "| kernel or copy | calls | device s | share of device time |", "|---|---|---|---|"]
        lines += [f"| `{k['name'][:90]}` | {k['calls']} | {k['device_s']:.3f} | {100 * k['device_s'] / dev:.1f} % |"
                  for k in summary["top_kernels"]]
    lines += ["", "| host operation | calls | self s | share of the step |", "|---|---|---|---|"]
    lines += [f"| `{h['name'][:90]}` | {h['calls']} | {h['self_s']:.3f} | {100 * h['self_s'] / wall:.1f} % |"
              for h in summary["top_host_ops"]]
    return "\n".join(lines) + "\n"


def _with_rest(phases: list[dict]) -> list[dict]:
    """The phases, each parent followed by its sub-phases and ``<parent>/rest``: its time outside them (e.g. the
    rollout's prompts, parsing and episode records).  A sub-phase recorded without its parent stands alone."""
    names = {p["phase"] for p in phases}
    out = []
    for parent in phases:
        name = parent["phase"]
        if "/" in name and name.split("/")[0] in names:
            continue  # listed under its parent
        children = [c for c in phases if c["phase"].startswith(name + "/")]
        out += [parent, *children]
        if children:
            out.append({"phase": f"{name}/rest", "calls": "-",
                        "wall_s": max(parent["wall_s"] - sum(c["wall_s"] for c in children), 0.0),
                        "device_s": max(parent["device_s"] - sum(c["device_s"] for c in children), 0.0)})
    return out
