"""How many CPU threads torch may use: the ``threads`` key of ``sglightning fit | validate``.

Why a budget at all: torch's intra-op pool defaults to one thread per core, and its threads wait for each other at the
end of every parallel region (thousands per decoded token on a small model). When another busy process holds one of
the cores, every region waits for the thread that is not scheduled, and a rollout that takes seconds alone takes
minutes (measured on a 2-core box: a tiny fit 9 s alone, 308 s beside one busy process; the same fit with one torch
thread hardly slowed down). The env workers of this trainer (threads stepping simulators, ScienceWorld's and
TextWorldExpress' JVMs, the tokenizer) compete for the same cores.

``auto`` (the default) therefore leaves one core of each process's share to everything that is not a matmul:

    cores = CPUs this process may run on (affinity mask and cgroup quota), divided by the processes of this run on
            this machine (``trainer.devices`` under DDP/FSDP on CPU or per GPU)
    threads = max(1, cores - 1)

so a 2-core box shared with other work runs one torch thread (what survives a neighbour), an 8-core laptop seven, a
16-core GPU node's process fifteen.  One exception: a single process whose share is exactly 2 cores takes both when
the machine is idle as it starts (fewer than 0.5 CPUs busy over 0.3 s, read from ``/proc/stat``; the 1-minute load
average where that file is missing — it stays high for a minute after a job ends, so it would give a run started
right after another one a single thread) — there, leaving a core free made the quickstart's
steps 1.43× slower (measured alone on a 2-core box), while the protection matters against neighbours that are
already running.  A neighbour that starts later still hurts such a run; pass ``--threads 1`` on a shared 2-core box.
``OMP_NUM_THREADS`` in the environment wins over ``auto`` (it is the user's explicit choice); an
integer sets the count; ``null`` leaves torch's own default.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Literal

Threads = int | Literal["auto"] | None


def available_cpus() -> int:
    """CPUs this process may use: the affinity mask (``taskset``, Slurm) capped by a cgroup v2 CPU quota
    (containers started with ``--cpus``)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, int(int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def local_processes(trainer: dict[str, Any] | None) -> int:
    """Processes a run starts on this machine, from the trainer config: one per device in ``trainer.devices`` (an
    int or a list); ``auto``/``-1`` on GPUs counts the visible GPUs; otherwise one."""
    trainer = trainer or {}
    devices = trainer.get("devices", "auto")
    if isinstance(devices, (list, tuple)):
        return max(1, len(devices))
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, int) and devices > 0:
        return devices
    accelerator = str(trainer.get("accelerator", "auto"))
    import torch  # here, not at the top: the command checks OMP_NUM_THREADS through this file before torch loads

    if accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available():
        return max(1, torch.cuda.device_count())
    return 1


IDLE_LOAD = 0.5  # busy cores (measured now, else the 1-minute load average) below which the machine counts as idle
BUSY_WINDOW_S = 0.3  # how long the CPU counters are watched


def _cpu_counters() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot, from ``/proc/stat`` (None where there is none)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 5:
        return None
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest time is inside user)
    return total - fields[3] - fields[4], total


def busy_cpus(window: float = BUSY_WINDOW_S) -> float | None:
    """How many CPUs are busy right now: the machine's busy share over ``window`` seconds × its CPU count (None where
    ``/proc/stat`` is missing).  Unlike the 1-minute load average it is not still high a minute after a job ended."""
    a = _cpu_counters()
    if a is None:
        return None
    time.sleep(window)
    b = _cpu_counters()
    if b is None or b[1] <= a[1]:
        return None
    return (b[0] - a[0]) / (b[1] - a[1]) * (os.cpu_count() or 1)


def machine_load() -> float:
    """Busy CPUs now (:func:`busy_cpus`), else the 1-minute load average, else infinity (assume busy: the cautious
    budget)."""
    busy = busy_cpus()
    if busy is not None:
        return busy
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return float("inf")


def check_environment() -> None:
    """``OMP_NUM_THREADS``, when set, must be a positive integer (torch would otherwise ignore it or fail later):
    ``ConfigError`` naming the variable."""
    from sglightning.errors import ConfigError

    value = os.environ.get("OMP_NUM_THREADS")
    if value is not None and not (value.strip().isdigit() and int(value) >= 1):
        raise ConfigError(f"OMP_NUM_THREADS: {value!r} is not a positive integer (unset it, or give the threads per "
                          "process; --threads auto leaves a core free by itself)")


def resolve(setting: Threads, processes: int = 1, cpus: int | None = None, load: float | None = None) -> int | None:
    """The torch thread count for ``setting`` (``None``: leave torch's default). ``auto`` → max(1, cpus/processes − 1),
    or 2 for one process with a share of exactly 2 cores on an idle machine (``load``: the busy CPUs,
    :func:`machine_load`, measured when not given); unless ``OMP_NUM_THREADS`` is set (then torch already follows
    it)."""
    if setting is None:
        return None
    if setting == "auto":
        if os.environ.get("OMP_NUM_THREADS"):
            return None
        share = (cpus or available_cpus()) // max(1, processes)
        if share == 2 and processes == 1 and (machine_load() if load is None else load) < IDLE_LOAD:
            return 2
        return max(1, share - 1)
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ValueError(f"threads: must be auto, null or an integer >= 1, got {setting!r}")
    return setting


def launched(trainer: dict[str, Any] | None) -> bool:
    """Whether Lightning starts this run through a launcher: several processes on this machine, several nodes, or a
    distributed strategy (DDP, FSDP) even on one device.  Its launcher sets every rank's threads to cores ÷ local
    processes unless ``OMP_NUM_THREADS`` is set."""
    trainer = trainer or {}
    if local_processes(trainer) > 1:
        return True
    nodes = trainer.get("num_nodes", 1)
    if str(nodes).strip().isdigit() and int(nodes) > 1:
        return True
    strategy = trainer.get("strategy") or "auto"
    if hasattr(strategy, "get"):  # class_path and init_args (a config's mapping)
        strategy = strategy.get("class_path") or "auto"
    elif not isinstance(strategy, str):  # an instance
        strategy = type(strategy).__name__
    return strategy not in ("auto", "single_device") and "SingleDevice" not in strategy


def apply(setting: Threads, trainer: dict[str, Any] | None = None) -> int:
    """Set torch's intra-op threads for this process; returns the count in force.  Where Lightning's launcher will
    run (:func:`launched`), the count goes to ``OMP_NUM_THREADS`` too: otherwise the launcher replaces it with cores
    ÷ local processes in every rank (all the cores: the oversubscription ``auto`` leaves a core free against, and a
    user's ``--threads 1`` lost), and the ranks it starts inherit it."""
    import torch

    n = resolve(setting, local_processes(trainer))
    if n is not None and n != torch.get_num_threads():
        torch.set_num_threads(n)
    if n is not None and launched(trainer):
        os.environ["OMP_NUM_THREADS"] = str(n)
    return torch.get_num_threads()
