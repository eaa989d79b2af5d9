"""Per-phase peak memory (sglightning.memory): the peak is the phase's own, not the process's lifetime's."""

from __future__ import annotations

import sys

import pytest
import torch

from sglightning import distributed, memory
from sglightning.report import _memory_lines

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM / clear_refs are Linux's")


def _touch(mb: int) -> torch.Tensor:
    return torch.ones(mb * 2**20 // 4)  # written, so resident


@linux
def test_a_phase_peak_sees_its_own_allocation_and_is_reset_at_the_next_start():
    peak = memory.PhasePeak("cpu")
    peak.start()
    base = peak.read("idle")["memory/idle_peak_rss_gb"]
    peak.start()
    big = _touch(300)
    del big
    grown = peak.read("rollout")["memory/rollout_peak_rss_gb"]
    assert grown > base + 0.25  # the 300 MiB (0.31 GB) that came and went
    peak.start()  # a new phase starts from the resident set now, not from the earlier high-water mark
    small = peak.read("update")["memory/update_peak_rss_gb"]
    assert small < grown - 0.2


def test_without_a_reset_the_lifetime_peak_is_reported_under_its_own_key(monkeypatch, tmp_path):
    monkeypatch.setattr(memory, "_CLEAR_REFS", str(tmp_path / "no" / "such" / "file"))
    peak = memory.PhasePeak("cpu")
    peak.start()
    out = peak.read("rollout")
    assert set(out) == {"memory/lifetime_peak_rss_gb"} and out["memory/lifetime_peak_rss_gb"] > 0.05


def test_ranks_merge_peak_memory_by_maximum(monkeypatch):
    ranks = [{"memory/update_peak_rss_gb": 2.0, "loss/total": 1.0}, {"memory/update_peak_rss_gb": 5.0,
                                                                      "loss/total": 3.0}]
    monkeypatch.setattr(distributed, "is_distributed", lambda: True)

    def gather(out, obj):
        out[:] = ranks

    monkeypatch.setattr(torch.distributed, "all_gather_object", gather)
    merged = distributed.reduce_logs(ranks[0], [], 2)
    assert merged == {"memory/update_peak_rss_gb": 5.0, "loss/total": 2.0}


def test_summary_lines_name_the_phase_peaks_or_say_the_peak_is_the_lifetime_one():
    hist = [{"memory/rollout_peak_rss_gb": 1.25, "memory/update_peak_rss_gb": 3.0},
            {"memory/rollout_peak_rss_gb": 1.5, "memory/update_peak_rss_gb": 2.0}]
    assert _memory_lines(hist) == ["  peak memory       rollout 1.5 GB  update 3.0 GB (RSS of this process)"]
    assert "process lifetime" in _memory_lines([{"memory/lifetime_peak_rss_gb": 4.0}])[0]
    cuda = _memory_lines([{"memory/rollout_peak_rss_gb": 1.0, "memory/update_peak_accelerator_gb": 7.5}])
    assert cuda[1] == "  peak accelerator  update 7.5 GB (allocated by torch)"
    assert _memory_lines([{}]) == []
