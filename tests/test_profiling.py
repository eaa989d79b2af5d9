"""One step's profile (``sglightning.profiling``, ``StepProfile``): the phase ranges cost nothing unless a profiler
records; a recorded step is reduced to its phases; a fit with the callback profiles the step asked for, from before
its rollout, and prints nothing on stderr."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sglightning.callbacks import RolloutCallback, StepProfile
from sglightning.errors import ConfigError
from sglightning.profiling import PHASES, markdown, phase, recording, summarise
from tests.tiny import tiny_module, tiny_trainer

ROOT = Path(__file__).resolve().parents[1]


def test_a_phase_is_a_no_op_unless_a_profiler_records():
    assert phase("rollout") is phase("update")  # the one shared null context: no range, no allocation
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with phase("rollout"):
            torch.ones(3).sum()
    assert "sglightning/rollout" in {e.key for e in prof.key_averages()}


def test_a_recorded_step_is_reduced_to_its_phases():
    a = torch.randn(256, 256)
    with recording(cuda=False) as prof:
        with phase("rollout"):
            for _ in range(3):
                with phase("rollout/decode"):
                    a @ a
        with phase("update"):
            with phase("update/forward"), torch.profiler.record_function("a user's range"):
                (a @ a).sum()
    s = summarise(prof, top=3)
    by = {p["phase"]: p for p in s["phases"]}
    assert list(by) == ["step", "rollout", "rollout/decode", "update", "update/forward"]  # PHASES' order
    assert by["rollout/decode"]["calls"] == 3 and by["update"]["calls"] == 1
    assert by["rollout"]["wall_s"] >= by["rollout/decode"]["wall_s"] > 0
    assert s["wall_s"] >= by["rollout"]["wall_s"] + by["update"]["wall_s"]
    assert s["device_s"] == 0 and s["top_kernels"] == [] and s["device_events"] == 0  # a CPU run launches no kernels
    assert "No kernel or copy was recorded" not in markdown(s, "CPU")
    assert s["cuda"] is False
    assert "device times are unknown" in markdown({**s, "cuda": True}, "t")  # on a GPU: unknown, not idle
    assert len(s["top_host_ops"]) == 3 and "aten::mm" in {h["name"] for h in s["top_host_ops"]}
    assert not any(h["name"].startswith("sglightning/") for h in s["top_host_ops"])  # phases are not operations
    assert "a user's range" not in {h["name"] for h in summarise(prof, top=50)["top_host_ops"]}  # nor other ranges
    text = markdown(s, "t")
    assert "| rollout/rest | - |" in text and "| update/rest | - |" in text  # each parent's time outside its phases
    assert "| host operation |" in text and "| host operation |" not in markdown(s, "t", details=False)


def test_a_profile_without_the_step_range_is_refused():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(2).sum()
    with pytest.raises(ValueError, match="sglightning/step"):
        summarise(prof)


def test_step_profile_profiles_the_asked_step_from_before_its_rollout(tmp_path, capsys):
    """Given after the rollout callback in the Trainer's list, the callback moves itself before it (or the rollout
    would run before the profiler starts, and its phases would be missing)."""
    module = tiny_module()
    prof = StepProfile(step=2)
    trainer = tiny_trainer(tmp_path, steps=3, callbacks=[module.rollout_callback(), prof])
    trainer.fit(module)
    cbs = trainer.callbacks
    assert cbs.index(prof) < next(i for i, c in enumerate(cbs) if isinstance(c, RolloutCallback))
    by = {p["phase"]: p for p in prof.summary["phases"]}
    for name in ("rollout", "rollout/prefill", "rollout/decode", "rollout/draw", "rollout/env", "update",
                 "update/forward", "update/backward", "update/optimiser"):
        assert name in by, name
    assert set(by) <= set(PHASES)
    assert by["rollout/decode"]["calls"] >= by["rollout/draw"]["calls"] >= 1
    assert by["rollout"]["wall_s"] + by["update"]["wall_s"] <= prof.summary["wall_s"]
    assert prof.path.name == "profile-step2.md"
    assert "| rollout/decode |" in prof.path.read_text()
    assert json.loads(prof.path.with_suffix(".json").read_text())["phases"] == prof.summary["phases"]
    assert "Profile of training step 2 (cpu: CPU)" in capsys.readouterr().out


def test_step_profile_says_when_its_step_did_not_run(tmp_path, capsys):
    module = tiny_module()
    prof = StepProfile(step=5)
    tiny_trainer(tmp_path, steps=2, callbacks=[prof]).fit(module)
    assert prof.summary is None and prof.path is None
    assert "StepProfile: step 5 did not run (this fit ended after step 2)" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="StepProfile.step: 0"):
        StepProfile(step=0)


def test_a_profile_that_fails_costs_the_profile_not_the_run(tmp_path, capsys, monkeypatch):
    import sglightning.callbacks as cb

    def broken(prof, top=10):
        raise RuntimeError("simulated: no events")

    monkeypatch.setattr(cb, "summarise", broken)
    module = tiny_module()
    prof = StepProfile(step=1)
    tiny_trainer(tmp_path, steps=2, callbacks=[prof]).fit(module)
    assert module.rollouts_done == 2 and prof.summary is None  # both steps trained
    assert not torch._C._autograd._profiler_enabled()  # the profiler was stopped
    out = capsys.readouterr().out
    assert "StepProfile: step 1 could not be profiled (RuntimeError: simulated: no events)" in out


@pytest.mark.slow
def test_a_profiled_cli_run_prints_its_table_and_nothing_on_stderr(tmp_path):
    """The profiler library (kineto) writes two lines to stderr per recording unless told not to."""
    run = subprocess.run(
        [sys.executable, "-m", "sglightning", "fit", "--config", str(ROOT / "configs" / "tiny.yaml"),
         f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}",
         "--trainer.callbacks+={class_path: sglightning.callbacks.StepProfile, init_args: {step: 2}}"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""
    assert "# Profile of training step 2" in run.stdout and "| rollout/draw |" in run.stdout
    assert list(tmp_path.glob("**/profile-step2.md"))


def test_every_step_logs_each_phase_wall_time_within_its_parent(tmp_path):
    """No profiler: the rollout and the update time their own phases (time/<parent>_<phase>_s)."""
    module = tiny_module()
    tiny_trainer(tmp_path, steps=2).fit(module)
    for h in module.history:
        rollout = [h[f"time/rollout_{p}_s"] for p in ("prefill", "decode", "draw", "env")]
        update = [h[f"time/update_{p}_s"] for p in ("forward", "backward", "optimiser")]
        assert all(t > 0 for t in rollout + update), h
        assert sum(rollout) <= h["time/rollout_s"] and sum(update) <= h["time/update_s"]
    assert not torch._C._autograd._profiler_enabled()


def test_timing_sums_phases_and_restores_the_outer_timing():
    from sglightning.profiling import phase_logs, timing

    with timing() as outer:
        with phase("rollout/draw"):
            pass
        with timing() as inner:
            for _ in range(3):
                with phase("rollout/decode"):
                    torch.ones(10).sum()
        with phase("update/forward"):
            pass
    assert inner.calls == {"rollout/decode": 3} and inner.seconds["rollout/decode"] > 0
    assert outer.calls == {"rollout/draw": 1, "update/forward": 1}  # the inner block's phases went to the inner one
    assert set(phase_logs(outer.seconds, "update")) == {"time/update_forward_s"}
    assert phase("rollout/decode") is phase("update/forward")  # outside any timing: the shared no-op again


def test_device_time_counts_each_kernel_once():
    """On CUDA the profiler lists a kernel twice: as a device event and in the host operation that launched it. The
    step's device time summed both (a busy share above 100 % was possible); torch's own table counts device events.
    The events below are what torch's parser makes of an eager 10 ms kernel and a 5 ms kernel replayed from a graph
    inside a phase range."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import EventList, FunctionEvent

    def event(i, name, start, end, device=DeviceType.CPU, annotation=False):
        return FunctionEvent(id=i, name=name, thread=1, start_us=start, end_us=end, fwd_thread=1, input_shapes=[],
                             stack=[], scope=0, use_device="cuda", device_type=device, is_user_annotation=annotation)

    step = event(1, "sglightning/step", 0, 100_000, annotation=True)
    decode = event(2, "sglightning/rollout/decode", 10, 50_000, annotation=True)
    matmul = event(3, "aten::mm", 60_000, 70_000)
    matmul.append_kernel("sgemm", 0, 10_000)
    decode.append_kernel("graph_kernel", 0, 5_000)
    events = EventList([step, decode, matmul, event(4, "sgemm", 60_000, 70_000, DeviceType.CUDA),
                        event(5, "graph_kernel", 10, 5_010, DeviceType.CUDA)], use_device="cuda")
    events._build_tree()

    class Recorded:
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]

        def key_averages(self):
            return events.key_averages()

    s = summarise(Recorded())
    assert s["device_s"] == pytest.approx(0.015) and s["device_events"] == 2
    assert [k["name"] for k in s["top_kernels"]] == ["sgemm", "graph_kernel"]
    assert s["device_busy"] == pytest.approx(0.15)
