"""Two CPU processes (gloo) under Lightning's DDP: disjoint task seeds, identical adapters on both ranks after training,
logged success = the mean over both ranks' episodes, validation played once across ranks and merged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.slow


def _run(tmp_path: Path, strategy: str) -> tuple[dict, dict, dict]:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(HERE))
    out = subprocess.run([sys.executable, str(HERE / "ddp_run.py"), str(tmp_path), strategy], env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=False)
    return r0, r1, json.loads((tmp_path / "val_report.json").read_text())


def test_ddp_two_cpu_processes(tmp_path):
    r0, r1, report = _run(tmp_path, "ddp")
    assert r0["rollouts_done"] == r1["rollouts_done"] == 3 and r0["global_step"] == r1["global_step"] == 3
    # one optimiser, one gradient: the adapters are identical on both ranks (and were trained)
    assert r0["params"].keys() == r1["params"].keys()
    for name in r0["params"]:
        assert torch.equal(r0["params"][name], r1["params"][name]), name
    assert any(not torch.equal(r0["params"][n], r0["initial"][n]) for n in r0["params"])  # and they were trained
    for s0, s1 in zip(r0["steps"], r1["steps"], strict=True):
        assert len(s0["seeds"]) == len(s1["seeds"]) == 2 and not set(s0["seeds"]) & set(s1["seeds"])  # disjoint
        everyone = s0["won"] + s1["won"]
        expected = sum(everyone) / len(everyone)
        assert s0["logged_success"] == pytest.approx(expected) and s1["logged_success"] == pytest.approx(expected)
        assert s0["logged_episodes"] == len(everyone)  # counts are summed over ranks
    # validation: 5 tasks split over 2 ranks (chunks of 2: rank 0 plays 4, rank 1 plays 1), each exactly once
    assert report["world_size"] == 2
    for mode in ("sg", "nosg"):
        seeds = sorted(e["seed"] for e in report["episodes"][mode])
        assert seeds == [1_000_000 + i for i in range(5)]
        assert report["modes"][mode]["episodes"] == 5
        won = [e["won"] for e in report["episodes"][mode]]
        assert report["modes"][mode]["rollout/success_rate"] == pytest.approx(sum(won) / len(won))
