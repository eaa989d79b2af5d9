"""Peak memory of one phase of a training step (the rollout, the update), for TensorBoard and the fit summary.

* Host: the peak resident set of this process (Linux: ``VmHWM`` in ``/proc/self/status``), reset to the current
  resident set when the phase starts by writing ``5`` to ``/proc/self/clear_refs``.  Where that file cannot be written
  (not Linux, a locked-down container) no phase peak can be taken: the process's lifetime peak (``ru_maxrss``) is
  reported instead, under its own key, so a number is never passed off as what it is not.  A phase's peak is at
  least the resident set it starts with, which includes memory the allocator kept after an earlier phase freed it
  (glibc keeps large freed blocks): after the first update, the rollout's peak is mostly the update's leftovers.
* Accelerator (CUDA): torch's peak of allocated memory on the module's device, reset the same way
  (``torch.cuda.reset_peak_memory_stats``); the caching allocator's reserve is not included.

Not counted: other processes — environment workers of a process pool, the Java processes behind TextWorldExpress and
ScienceWorld, other ranks (each rank logs its own; the step logs take the maximum over ranks).

Keys (GB = 1e9 bytes): ``memory/<phase>_peak_rss_gb`` or, without a reset, ``memory/lifetime_peak_rss_gb``;
``memory/<phase>_peak_accelerator_gb`` on CUDA.
"""

from __future__ import annotations

import resource
import sys

import torch

_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"

#: every key this module writes starts with it (the step logs take the maximum over ranks of these)
PREFIX = "memory/"
#: the process's lifetime peak, where no per-phase peak can be taken
LIFETIME_RSS = PREFIX + "lifetime_peak_rss_gb"


def rss_key(phase: str) -> str:
    return f"{PREFIX}{phase}_peak_rss_gb"


def accelerator_key(phase: str) -> str:
    return f"{PREFIX}{phase}_peak_accelerator_gb"


def _vm_hwm_kb() -> int | None:
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _reset_hwm() -> bool:
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _lifetime_peak_gb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * (1 if sys.platform == "darwin" else 1024) / 1e9  # bytes on macOS, KiB on Linux


class PhasePeak:
    """``start()`` at the beginning of a phase, ``read(phase)`` at its end: ``{key: GB}`` for the step logs."""

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._reset = False

    def start(self) -> None:
        self._reset = _reset_hwm()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def read(self, phase: str) -> dict[str, float]:
        out: dict[str, float] = {}
        hwm = _vm_hwm_kb() if self._reset else None
        if hwm is not None:
            out[rss_key(phase)] = hwm * 1024 / 1e9
        else:
            out[LIFETIME_RSS] = _lifetime_peak_gb()
        if self.device.type == "cuda":
            out[accelerator_key(phase)] = torch.cuda.max_memory_allocated(self.device) / 1e9
        return out
