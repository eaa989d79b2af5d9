"""benchmarks/gpu_check.{sh,py}: shell syntax, argument parsing, and the whole script on CPU with tiny shapes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import gpu_check  # noqa: E402


def test_shell_script_syntax():
    assert subprocess.run(["bash", "-n", str(BENCH / "gpu_check.sh")]).returncode == 0


def test_arguments():
    a = gpu_check.parse(["--strategy", "fsdp2", "--devices", "2", "--steps", "5"])
    assert (a.strategy, a.devices, a.steps, a.cpu_smoke) == ("fsdp2", 2, 5, False)
    assert gpu_check.parse(["--strategy", "fsdp1", "--devices", "2"]).strategy == "fsdp1"
    with pytest.raises(SystemExit):
        gpu_check.parse(["--strategy", "deepspeed"])
    with pytest.raises(SystemExit):  # FSDP1 on one process does not shard and fails on the tied embeddings
        gpu_check.parse(["--strategy", "fsdp1"])


def test_cpu_smoke_run_prints_the_numbers(tmp_path):
    out = gpu_check.main(["--cpu-smoke", "--steps", "2", "--json", str(tmp_path / "n.json")])
    assert out["steps"] == 2 and out["rollout_tokens_per_s"] > 0 and out["update_tokens_per_s"] > 0
    assert out["logprob_gap_sampler_trainer"] < 1e-4  # sampler and trainer agree on the same weights
    assert (tmp_path / "n.json").is_file()
    assert 0.05 < out["params_M"] < 50  # the whole tiny model, counted from its shapes
