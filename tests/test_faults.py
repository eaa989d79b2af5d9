"""Fault injection through the whole trainer: each fault kind fails its episode only (reason recorded and counted),
the worker is rebuilt, the group is kept or dropped as configured, and training goes on."""

from __future__ import annotations

import functools

import pytest
from tiny import tiny_module, tiny_trainer

from sglightning.data import RolloutConfig, task_seeds
from sglightning.envs.faults import FaultyEnv
from sglightning.envs.household import HouseholdEnv
from sglightning.envs.textworld_express import TextWorldExpressEnv

HOUSE = functools.partial(HouseholdEnv, difficulty=0, info_actions=False)
EXPECTED = {
    "reset_raise": "reset: RuntimeError: injected fault",
    "step_raise": "step: RuntimeError: injected fault",
    "hang": "step: timeout after 1 s",
    "garbage": "expected StepResult",
    "bad_field": "malformed StepResult",
    "die": "step: ProcessLookupError",
}


def _faulty_module(kind: str, inner=HOUSE, policy: str = "keep"):
    probe = tiny_module()
    # the first group of the first training step
    seed = task_seeds(probe.rollout_cfg.seed, 0, probe.rollout_cfg.groups_per_step, 0, 1, probe.eval_cfg.seed_offset)[0]
    env = functools.partial(FaultyEnv, env=inner, faults={seed: kind}, hang_s=30)
    # a 1 s step limit only where a step hangs: a real JVM's step on a loaded box may take longer
    timeout = 1 if kind == "hang" else 60
    rollout = RolloutConfig(groups_per_step=2, group_size=2, max_steps=2, env_step_timeout_s=timeout,
                            failed_episodes=policy)
    return tiny_module(env=env, rollout=rollout)


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_each_fault_fails_its_episodes_only_and_training_goes_on(tmp_path, kind):
    module = _faulty_module(kind)
    module.configure_model()
    collector = module.rollout_callback()
    batch = collector.collect(module)
    bad = [e for e in batch.episodes if e.group == 0]
    good = [e for e in batch.episodes if e.group == 1]
    assert all(e.error and EXPECTED[kind] in e.error and not e.won for e in bad), [e.error for e in bad]
    assert all(e.error is None for e in good)
    collector.engine.close()
    # the same faults inside fit: both steps run, the errors are logged, the run ends normally
    module = _faulty_module(kind)
    tiny_trainer(tmp_path, steps=2).fit(module)
    first, second = module.history
    assert first["rollout/env_error_rate"] == 0.5 and first["rollout/failed_groups"] == 1.0
    assert first["rollout/dropped_groups"] == 0.0  # kept by default
    assert second["rollout/env_error_rate"] == 0.0  # the rebuilt workers are healthy
    assert module.rollouts_done == 2
    from sglightning.report import fit_summary  # the summary says a share of the episodes failed in the env

    assert "episodes failed in the env 0.250" in fit_summary(module.history, 0, None, None, tmp_path, None)


def test_drop_group_leaves_the_failed_group_out_of_the_update(tmp_path):
    keep, drop = _faulty_module("step_raise"), _faulty_module("step_raise", policy="drop_group")
    tiny_trainer(tmp_path / "k", steps=1).fit(keep)
    tiny_trainer(tmp_path / "d", steps=1).fit(drop)
    assert drop.history[0]["rollout/dropped_groups"] == 1.0 and keep.history[0]["rollout/dropped_groups"] == 0.0
    # fewer policy tokens in the update: the failed group's samples were removed
    assert drop.history[0]["tokens/policy"] < keep.history[0]["tokens/policy"]


def test_unknown_fault_kind_names_the_key():
    with pytest.raises(ValueError, match="env.init_args.faults: unknown fault kind"):
        FaultyEnv(faults={1: "explode"})


@pytest.mark.jvm
def test_jvm_killed_mid_episode_through_the_trainer(tmp_path):
    from sglightning.envs.pool import live_java_processes

    before = set(live_java_processes())
    module = _faulty_module("die", inner=TextWorldExpressEnv)
    tiny_trainer(tmp_path, steps=2).fit(module)
    first, second = module.history
    assert first["rollout/env_error_rate"] == 0.5 and second["rollout/env_error_rate"] == 0.0
    module.teardown("fit")
    import time

    deadline = time.time() + 10
    while set(live_java_processes()) - before and time.time() < deadline:
        time.sleep(0.2)
    assert not set(live_java_processes()) - before


@pytest.mark.parametrize("phase,wrapped", [("rollout", False), ("update", False), ("update", True)])
def test_running_out_of_accelerator_memory_is_one_line_naming_the_keys_and_the_last_whole_step(tmp_path, capsys,
                                                                                              monkeypatch, phase,
                                                                                              wrapped):
    """A CUDA out-of-memory error (raised here on CPU, where it is the same class) in the second step's rollout or
    update: one line naming the phase, the step, the keys that shrink it and last.ckpt (which holds step 1), exit 1.
    ``wrapped``: as torch's compiler raises it when a compiled backward runs out of memory while it compiles."""
    from pathlib import Path

    import torch

    from sglightning.callbacks import RolloutCallback
    from sglightning.cli import cli_main
    from sglightning.module import SelfGuideModule

    cls, name = (RolloutCallback, "collect") if phase == "rollout" else (SelfGuideModule, "update")
    real, calls = getattr(cls, name), []

    def fails_the_second_time(self, *a, **kw):
        calls.append(1)
        if len(calls) == 2:
            oom = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                                              "capacity of 139.81 GiB")
            raise torch._dynamo.exc.BackendCompilerFailed(lambda *a: None, oom, None) if wrapped else oom
        return real(self, *a, **kw)

    monkeypatch.setattr(cls, name, fails_the_second_time)
    root = Path(__file__).resolve().parents[1]
    with pytest.raises(SystemExit) as exc:
        cli_main(["fit", "--config", str(root / "configs" / "tiny.yaml"), f"--trainer.default_root_dir={tmp_path}",
                  f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.enable_progress_bar=false",
                  "--trainer.limit_val_batches=0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 1 and len(err) == 1, err
    line = err[0]
    assert f"out of accelerator memory in the {phase} of step 2 (CUDA out of memory" in line, line
    keys = "rollout.groups_per_step" if phase == "rollout" else "update.micro_batch_size"
    assert keys in line and "holds the last whole step: resume with --ckpt_path last" in line, line
    ckpt = torch.load(next(tmp_path.rglob("last.ckpt")), map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 1


@pytest.mark.parametrize("ending", ["returns", "exits"])
def test_the_cli_releases_the_process_group_on_every_ending(monkeypatch, ending):
    """A run's process group is destroyed before the interpreter tears down, whatever the ending: left to teardown,
    gloo's worker threads abort a finished run ("terminate called without an active exception", exit -6)."""
    import torch.distributed as dist
    from lightning.pytorch.cli import LightningCLI

    from sglightning.cli import SGLightningCLI

    def run(self, subcommand):
        assert dist.is_initialized()
        if ending == "exits":
            raise SystemExit(1)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    monkeypatch.setattr(LightningCLI, "_run_subcommand", run)
    cli = SGLightningCLI.__new__(SGLightningCLI)  # only the subcommand wrapper runs: no parser, no trainer
    try:
        if ending == "exits":
            with pytest.raises(SystemExit):
                cli._run_subcommand("fit")
        else:
            cli._run_subcommand("fit")
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


_ENDING = """
import atexit, ctypes, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import torch.distributed as dist
from sglightning import cli, distributed

out, stop = Path(sys.argv[1]), sys.argv[2]
libc = ctypes.CDLL(None)
libc.__cxa_atexit(ctypes.cast(libc.abort, ctypes.c_void_p), None, None)  # teardown reached: exit -6

def run():  # a CLI run that made a process group (which the CLI then releases), then ends as `stop` says
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    distributed.release_process_group()
    atexit.register(lambda: (out / "hook").write_text("ran"))
    threading.Thread(target=lambda: (time.sleep(0.3), (out / "thread").write_text("ran"))).start()
    # an idle pool worker (inductor's compile threads are one): non-daemon, it stops only when exit tells its pool
    global pool  # kept: a pool collected as garbage would stop its workers itself
    pool = ThreadPoolExecutor(2)
    pool.submit(lambda: (out / "pool").write_text("ran")).result()
    print("last words", end="")
    if stop == "crash":
        raise RuntimeError("boom")
    if stop != "returns":
        sys.exit(int(stop) if stop.isdigit() else stop)

cli.cli_main = run
sys.exit(cli.main())
"""


@pytest.mark.parametrize(("stop", "code", "err"), [("returns", 0, ""), ("2", 2, ""), ("bad key", 1, "bad key"),
                                                 ("crash", 1, "RuntimeError: boom")])
def test_a_process_that_ran_a_group_exits_like_a_normal_exit(tmp_path, stop, code, err):
    """`sglightning` ends a process that ran a process group with os._exit (no teardown, where gloo's threads can
    abort it; a C exit handler aborts here if teardown is reached), after what a normal exit does: the same exit
    status (a crash: its traceback, then 1), non-daemon threads joined (an idle thread pool's too: it hung, waiting
    for workers that only exit's hooks stop), exit hooks run, the output flushed."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", _ENDING, str(tmp_path), stop], capture_output=True, text=True,
                         timeout=120)
    assert (res.returncode, res.stdout) == (code, "last words"), res.stderr[-2000:]
    assert res.stderr.strip().endswith(err) and ("Traceback" in res.stderr) == (stop == "crash"), res.stderr[-2000:]
    assert (tmp_path / "hook").read_text() == "ran" and (tmp_path / "thread").read_text() == "ran"
    assert (tmp_path / "pool").read_text() == "ran"


def test_the_exit_status_of_a_distributed_run_follows_pythons_rule(capsys):
    """What `_report_exit` returns and prints for each `sys.exit` argument: None and ints as they are (nothing
    printed), any other object printed on stderr with status 1, as Python's own exit does."""
    from sglightning.cli import _report_exit

    assert [_report_exit(SystemExit(c)) for c in (None, 0, 3, True)] == [0, 0, 3, 1]
    assert capsys.readouterr().err == ""
    assert _report_exit(SystemExit("bad key")) == 1 and _report_exit(SystemExit(2.5)) == 1
    assert capsys.readouterr().err == "bad key\n2.5\n"


def test_running_out_of_accelerator_memory_in_a_validation_is_one_line_naming_its_keys(tmp_path, capsys, monkeypatch):
    """``sglightning validate`` whose rollout runs out of accelerator memory: one line naming the validation and the
    keys that shrink it (evaluation.tasks_per_batch first), no traceback."""
    from pathlib import Path

    import torch

    from sglightning.cli import cli_main
    from sglightning.rollout import Rollout

    def out_of_memory(self, *a, **kw):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(Rollout, "run", out_of_memory)
    root = Path(__file__).resolve().parents[1]
    with pytest.raises(SystemExit) as exc:
        cli_main(["validate", "--config", str(root / "configs" / "tiny.yaml"), f"--trainer.default_root_dir={tmp_path}",
                  f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.enable_progress_bar=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 1 and len(err) == 1, err
    assert "out of accelerator memory in the validation of step 0 (CUDA out of memory" in err[0], err
    assert "lower evaluation.tasks_per_batch, evaluation.episodes_per_task" in err[0] and "Traceback" not in err[0]


@pytest.mark.parametrize("left", ["old_beside", "old_alone", "legacy_old_alone", "temp"])
def test_an_adapter_export_killed_midway_is_mended_by_the_next(tmp_path, left):
    """The export swaps a finished folder in: ``adapter`` → ``.adapter.old``, the temp folder → ``adapter``, the old
    one removed.  A kill after the second rename left the old one beside ``adapter``, and every later export (every
    checkpoint save) failed renaming onto it, so the run could not resume.  A kill between the renames left only
    the old one (``adapter.old`` in earlier releases); one while writing, a temp folder nothing removed.  The next
    save mends each and the run goes on."""
    import shutil

    from safetensors.torch import load_file

    tiny_trainer(tmp_path, steps=1, enable_checkpointing=True).fit(tiny_module())
    adapter, old = tmp_path / "adapter", tmp_path / ".adapter.old"
    if left == "old_beside":
        shutil.copytree(adapter, old)
    elif left == "old_alone":
        adapter.rename(old)
    elif left == "legacy_old_alone":
        adapter.rename(tmp_path / "adapter.old")
    else:
        shutil.copytree(adapter, tmp_path / ".adapter-k1ll3d")
    module = tiny_module()
    tiny_trainer(tmp_path, steps=2, enable_checkpointing=True).fit(module, ckpt_path=str(tmp_path / "checkpoints" /
                                                                                       "last.ckpt"))
    assert module.rollouts_done == 2
    assert sorted(p.name for p in tmp_path.iterdir() if "adapter" in p.name) == ["adapter"]
    assert any("lora_B" in k for k in load_file(adapter / "adapter_model.safetensors"))  # a whole adapter


def test_restoring_a_swap_cut_in_half_is_safe_when_every_rank_tries(tmp_path, monkeypatch):
    """Under torchrun every rank resolves ``--ckpt_path last`` and restores ``.last.ckpt.old``: a rank that found it
    an instant before another moved it crashed in os.replace (FileNotFoundError)."""
    import os

    from sglightning.checkpointing import restore_old

    target = tmp_path / "last.ckpt"
    (tmp_path / ".last.ckpt.old").mkdir()
    real = os.replace

    def another_rank_first(src, dst):
        real(src, dst)  # the other rank's move ...
        raise FileNotFoundError(src)  # ... and this rank's, finding the source gone

    monkeypatch.setattr(os, "replace", another_rank_first)
    assert restore_old(target) is False and target.is_dir()
    monkeypatch.setattr(os, "replace", real)
    assert restore_old(target) is False  # nothing left to restore


def test_one_task_whose_reset_fails_fails_its_group_not_the_run(tmp_path):
    """A step of one group (``groups_per_step`` 1) whose task cannot reset: its episodes fail and training goes on.
    The check for a split without playable tasks took it for one (every episode failed in reset) and ended the run;
    it now needs several tasks, none started."""
    probe = tiny_module()
    seed = task_seeds(probe.rollout_cfg.seed, 0, 1, 0, 1, probe.eval_cfg.seed_offset)[0]
    env = functools.partial(FaultyEnv, env=HOUSE, faults={seed: "reset_raise"})
    module = tiny_module(env=env, rollout=RolloutConfig(groups_per_step=1, group_size=2, max_steps=2))
    tiny_trainer(tmp_path, steps=2).fit(module)
    assert module.rollouts_done == 2 and module.history[0]["rollout/env_error_rate"] == 1.0
