"""Two CPU processes (gloo) under Lightning's DDP, FSDP2 (ModelParallelStrategy + fully_shard) and FSDP1 (FSDPStrategy,
through the CPU-allowed subclass in cpu_fsdp.py): disjoint task seeds, identical adapters on both ranks after training,
logged success = the mean over both ranks' episodes, validation played once across ranks and merged; FSDP2 and FSDP1
(generation included) train to the same adapters as DDP; a bf16 base with fp32 adapters trains under both FSDPs, and
with LoRA dropout (the rollout correction's own pass) under FSDP2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from processes import end_rank, join_gloo, run_whole

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.slow


def _run(out: Path, strategy: str, *extra: str) -> tuple[dict, dict, dict]:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    res = run_whole([sys.executable, str(HERE / "ddp_run.py"), str(out), strategy, *extra], 900, env=env)
    assert res.returncode == 0, res.stderr[-4000:]
    r0 = torch.load(out / "rank0.pt", weights_only=False)
    r0["exported"] = _adapter(out)
    r1 = torch.load(out / "rank1.pt", weights_only=False)
    return r0, r1, json.loads((out / "val_report.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {s: _run(tmp_path_factory.mktemp(s), s) for s in ("ddp", "fsdp2", "fsdp1")}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "fsdp1"])
def test_two_cpu_processes(runs, strategy):
    r0, r1, report = runs[strategy]
    assert r0["rollouts_done"] == r1["rollouts_done"] == 3 and r0["global_step"] == r1["global_step"] == 3
    # one optimiser, one gradient: the adapters are identical on both ranks (and were trained)
    assert r0["params"].keys() == r1["params"].keys()
    for name in r0["params"]:
        assert torch.equal(r0["params"][name], r1["params"][name]), name
    assert any(not torch.equal(r0["params"][n], r0["initial"][n]) for n in r0["params"])
    # the exported peft adapter holds exactly those weights, under peft's saved names (no adapter or wrapper names)
    assert r0["exported"].keys() == {n.replace(".default.", ".") for n in r0["params"]}
    for name, p in r0["params"].items():
        assert torch.equal(r0["exported"][name.replace(".default.", ".")], p), name
    for s0, s1 in zip(r0["steps"], r1["steps"], strict=True):
        assert len(s0["seeds"]) == len(s1["seeds"]) == 2 and not set(s0["seeds"]) & set(s1["seeds"])  # disjoint
        everyone = s0["won"] + s1["won"]
        expected = sum(everyone) / len(everyone)
        assert s0["logged_success"] == pytest.approx(expected) and s1["logged_success"] == pytest.approx(expected)
        assert s0["logged_episodes"] == len(everyone)  # counts are summed over ranks
    # validation: 5 tasks in chunks of 2 over 2 ranks (rank 0 plays 4, rank 1 plays 1 + a padding batch), each once
    assert report["world_size"] == 2
    for mode in ("sg", "nosg"):
        seeds = sorted(e["seed"] for e in report["episodes"][mode])
        assert seeds == [1_000_000 + i for i in range(5)]
        assert report["modes"][mode]["episodes"] == 5
        won = [e["won"] for e in report["episodes"][mode]]
        assert report["modes"][mode]["rollout/success_rate"] == pytest.approx(sum(won) / len(won))


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp1"])
def test_fsdp_trains_to_the_same_adapters_as_ddp(runs, strategy):
    """Same seeds, same sampling, full weights gathered for generation, gradients reduced by FSDP instead of our
    all-reduce: the same update up to float summation order."""
    ddp, fsdp = runs["ddp"][0], runs[strategy][0]
    assert [s["seeds"] for s in ddp["steps"]] == [s["seeds"] for s in fsdp["steps"]]
    assert ddp["params"].keys() == fsdp["params"].keys()  # the exported names carry no FSDP wrapper prefixes
    for name, p in ddp["params"].items():
        assert torch.allclose(p, fsdp["params"][name], atol=1e-5), name


def test_fsdp2_with_compiled_layers_trains_to_the_same_adapters(runs, tmp_path):
    """update.compile under FSDP2: each decoder layer compiled inside its sharded unit (FSDP's hooks gather the
    weights around the compiled forward); the same adapters as the eager FSDP2 run, on both ranks."""
    r0, r1, _ = _run(tmp_path, "fsdp2", "compiled")
    eager = runs["fsdp2"][0]
    assert [s["seeds"] for s in r0["steps"]] == [s["seeds"] for s in eager["steps"]]
    for name, p in eager["params"].items():
        assert torch.equal(r0["params"][name], r1["params"][name]), name
        assert torch.allclose(r0["params"][name], p, atol=1e-5), name


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp1"])
def test_fsdp_bf16_base_keeps_fp32_adapters(tmp_path, strategy):
    """The multi-GPU configs' setting: base weights bf16, LoRA weights fp32 (master weights small steps survive),
    trainer.precision bf16-mixed.  FSDP2 gathers the mixed-dtype units in bf16 (MixedPrecisionPolicy), FSDP1 keeps
    LoRA weights in their own units; both train, agree across ranks, and sample ≈ what they train on."""
    r0, r1, _ = _run(tmp_path, strategy, "bf16")
    assert r0["base_dtypes"] == ["torch.bfloat16"]
    assert {p.dtype for p in r0["params"].values()} == {torch.float32}
    for name in r0["params"]:
        assert torch.equal(r0["params"][name], r1["params"][name]), name
    assert any(not torch.equal(r0["params"][n], r0["initial"][n]) for n in r0["params"])
    gaps = [s["logprob_gap"] for s in r0["steps"]]
    assert all(0.0 <= g < 0.02 for g in gaps), gaps  # bf16 rounding, not a different policy


def test_fsdp2_runs_the_corrections_own_pass_on_every_rank(tmp_path):
    """bf16 with LoRA dropout: the rollout correction runs its own no-grad pass before the update (the first training
    pass drops out, so it cannot serve).  Under FSDP each forward is a collective, and here rank 1 scores no rows at
    all: it runs empty forwards as rank 0 scores.  The run ends, the pass ran at every step on rank 0 (rank 1 has no
    weights to log), and both ranks end with the same adapters."""
    r0, r1, _ = _run(tmp_path, "fsdp2", "bf16", "dropout", "idle1")
    assert len(r0["steps"]) == len(r1["steps"]) == 3
    for step, (mine, idle) in enumerate(zip(r0["steps"], r1["steps"]), 1):
        assert mine["passes"] == idle["passes"] == step  # the separate pass, on both ranks, every step
        assert mine["correction_s"] is not None and mine["correction_s"] > 0
        assert mine["is_weight_rank"] == pytest.approx(1.0, abs=0.05)  # bf16 rounding, not a different policy
        assert idle["is_weight_rank"] is None  # rank 1 scored nothing
    for name in r0["params"]:
        assert torch.equal(r0["params"][name], r1["params"][name]), name
    assert any(not torch.equal(r0["params"][n], r0["initial"][n]) for n in r0["params"])


def _cli_cmd(tmp_path: Path, *args: str, command: str = "fit", devices: int = 2) -> tuple[list[str], dict]:
    """The command line and environment of `sglightning COMMAND --config configs/tiny.yaml ARGS` on 2 processes,
    writing under tmp_path (tests/ on the path for cpu_fsdp)."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "sglightning.cli", command, "--config", str(HERE.parent / "configs" / "tiny.yaml"),
           *args, f"--trainer.devices={devices}", "--trainer.enable_progress_bar=false",
           f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}"]
    return cmd, env


def _cli(tmp_path: Path, *args: str, command: str = "fit", timeout: int = 600, devices: int = 2
         ) -> subprocess.CompletedProcess:
    """Run ``_cli_cmd`` to the end."""
    cmd, env = _cli_cmd(tmp_path, *args, command=command, devices=devices)
    return run_whole(cmd, timeout, env=env)


def test_cli_fit_under_ddp_writes_one_run_folder(tmp_path):
    """The CLI path under DDP: config, checkpoint, adapter and validation before and after training (one rank has
    only a padding batch)."""
    res = _cli(tmp_path, "--trainer.strategy=ddp", "--trainer.max_steps=2", "--model.evaluation.before_fit=true")
    assert res.returncode == 0, res.stderr[-4000:]
    assert res.stderr.strip() == "", res.stderr[-4000:]  # no rank's "Initializing distributed", no banner
    run = tmp_path / "tiny" / "version_0"
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "adapter" / "adapter_config.json").is_file()
    assert "# package versions of this run" in (run / "config.yaml").read_text()
    assert not (tmp_path / "tiny" / "version_1").exists()  # rank 1 wrote nothing of its own
    line = next(x for x in res.stdout.splitlines() if "validation [self-guidance on] success" in x)
    assert "success before " in line and " -> after " in line, line


# the shipped multi-GPU configs on 2 CPU processes (bf16 base, fp32 LoRA, bf16-mixed, gradient checkpointing, sharded
# checkpoints); FSDP1 through the CPU-allowed subclass of FSDPStrategy (same init args)
SHARDED_CLI = {
    "fsdp2": ["--config", str(HERE.parent / "configs" / "multi_gpu_fsdp2.yaml")],
    "fsdp1": ["--config", str(HERE.parent / "configs" / "multi_gpu_fsdp.yaml")],
    # the same config with Lightning's own FSDPStrategy (its whole-model sharded folders)
    "fsdp1-lightning": ["--config", str(HERE.parent / "configs" / "multi_gpu_fsdp.yaml"),
                        "--trainer.strategy.class_path=cpu_fsdp.CPUFSDPStrategy"],
}


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp1-lightning"])
def test_cli_ends_a_distributed_run_before_interpreter_teardown(tmp_path, strategy):
    """FSDP modules (and DTensor's caches) keep the process group alive after it is destroyed, so gloo's threads met
    interpreter teardown, where a finished run could abort (exit -6, "terminate called without an active exception";
    CI, twice). `sglightning` runs the exit hooks, then ends each rank before teardown, output flushed."""
    cmd, env = _cli_cmd(tmp_path, *SHARDED_CLI[strategy], "--trainer.accelerator=cpu", "--trainer.max_steps=1")
    cmd[1:3] = [str(HERE / "exit_probe.py")]  # `python -m sglightning.cli` -> the probe around the same entry point
    res = run_whole(cmd, 900, env=dict(env, SGL_EXIT_PROBE=str(tmp_path)))
    assert res.returncode == 0, res.stderr[-4000:]
    assert "validation [self-guidance on] success" in res.stdout  # the last printed line survived the early exit
    marks = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("hooks"))
    assert marks == ["hooks0", "hooks1"], marks  # both ranks ran their exit hooks (and neither reached teardown)


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp1", "fsdp1-lightning"])
def test_cli_fsdp_distributed_checkpoint_resumes(tmp_path, strategy):
    """FSDP from the CLI with the shipped multi-GPU config: a sharded `last.ckpt/` folder, the adapter gathered and
    exported, `--ckpt_path last` restores the sharded state and trains on."""
    base = [*SHARDED_CLI[strategy], "--trainer.accelerator=cpu", "--trainer.limit_val_batches=0"]
    res = _cli(tmp_path, *base, "--trainer.max_steps=2")
    assert res.returncode == 0, res.stderr[-4000:]
    run = tmp_path / "tiny" / "version_0"
    assert (run / "checkpoints" / "last.ckpt").is_dir()  # torch.distributed.checkpoint shards
    assert json.loads((run / "adapter" / "sglightning.json").read_text())["global_step"] == 2
    first = _adapter(run)
    stored = _stored_model_keys(run / "checkpoints" / "last.ckpt")
    if strategy == "fsdp1-lightning":  # Lightning's FSDPStrategy: the whole sharded model
        assert any("lora_" not in k for k in stored)
    else:  # sglightning's strategies: adapters only (the frozen base is reloaded), swapped in whole (no leftovers)
        assert stored and all("lora_" in k for k in stored), sorted(stored)[:3]
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.ckpt"]
    # resuming a finished run: the folder's loop state says there is nothing to train; one line, nothing rewritten
    config = (run / "config.yaml").read_text()
    res = _cli(tmp_path, *base, "--trainer.max_steps=2", "--ckpt_path=last")
    assert res.returncode == 0, res.stderr[-4000:]
    assert "holds 2 trained steps and trainer.max_steps is 2: nothing to train" in res.stderr, res.stderr[-2000:]
    assert (run / "config.yaml").read_text() == config
    restored = _adapter(run)
    assert restored.keys() == first.keys() and all(torch.equal(restored[k], first[k]) for k in first)
    res = _cli(tmp_path, *base, "--trainer.max_steps=3", "--ckpt_path=last")
    assert res.returncode == 0, res.stderr[-4000:]
    # one line of ours says where the run continues; Lightning's two restore lines are dropped as noise
    assert "resuming from" in res.stderr and "Restored all states" not in res.stdout + res.stderr
    assert json.loads((run / "adapter" / "sglightning.json").read_text())["global_step"] == 3
    second = _adapter(run)
    # peft's own names, no FSDP wrapper prefixes; the third step changed the restored adapter
    assert first and first.keys() == second.keys()
    assert all(re.fullmatch(r"base_model\.model\.model\.layers\.\d+\.\w+\.\w+\.lora_[AB]\.weight", k)
               for k in first), sorted(first)
    assert any(not torch.equal(first[k], second[k]) for k in first)


def _stored_model_keys(ckpt: Path) -> set[str]:
    """The model entries of a torch.distributed.checkpoint folder (read from its metadata, no process group):
    ModelParallelStrategy stores the model under "state_dict.", FSDPStrategy under "model."."""
    from sglightning.strategies import _stored_keys

    return _stored_keys(ckpt, "state_dict.") | _stored_keys(ckpt, "model.")


def _adapter(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "adapter" / "adapter_model.safetensors")


def test_cli_rejects_tensor_parallel_mesh(tmp_path):
    """Lightning's ModelParallelStrategy with its "auto" sizes on one node means tensor parallelism (dp 1 × tp 2),
    which this trainer does not implement: one line naming trainer.strategy, exit 2 — not a silently replicated run —
    before any process is launched or run folder written."""
    res = _cli(tmp_path, "--trainer.strategy.class_path=lightning.pytorch.strategies.ModelParallelStrategy",
               timeout=900)
    assert res.returncode == 2
    assert "trainer.strategy: tensor_parallel_size=2" in res.stderr and "FSDP2Strategy" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "tiny").exists()  # refused in the preflight


@pytest.mark.parametrize("dp, tp, devices, refused", [
    ("auto", "auto", 2, True), ("auto", "auto", 1, False), (1, 2, 2, True), (2, 1, 2, False)])
def test_tensor_parallel_sizes_are_checked_before_launch(dp, tp, devices, refused):
    """The preflight's reading of ModelParallelStrategy's sizes: "auto" tensor parallelism = one node's processes."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from sglightning.errors import ConfigError
    from sglightning.strategies import check_tensor_parallel

    strategy = ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp)
    strategy.parallel_devices = [torch.device("cpu")] * devices
    if refused:
        with pytest.raises(ConfigError, match="trainer.strategy: tensor_parallel_size=2"):
            check_tensor_parallel(strategy)
    else:
        check_tensor_parallel(strategy)
    check_tensor_parallel(None)  # any other strategy: nothing to check


def test_cli_rejects_qlora_under_fsdp(tmp_path):
    """4-bit base + FSDP fails deep inside bitsandbytes/FSDP (seen on CPU for both FSDP versions): refused up front,
    before the model loads, with one line naming model.policy.quantization."""
    res = _cli(tmp_path, *SHARDED_CLI["fsdp2"], "--trainer.accelerator=cpu", "--model.policy.quantization=4bit",
               timeout=900)
    assert res.returncode == 2
    assert "model.policy.quantization: 4bit under FSDP2Strategy" in res.stderr and "Traceback" not in res.stderr


def test_cli_validate_under_ddp_reports_every_episode_once(tmp_path):
    """`sglightning validate` on 2 processes: 5 evaluation tasks split over the ranks (one rank gets a padding batch),
    one report with all 5 episodes per mode, printed once, written once."""
    res = _cli(tmp_path, "--trainer.strategy=ddp", "--model.evaluation.num_tasks=5",
               "--model.evaluation.tasks_per_batch=2", command="validate", timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    assert res.stdout.count("| self-guidance | episodes |") == 1
    reports = list(tmp_path.rglob("validation_report.json"))
    assert len(reports) == 1
    report = json.loads(reports[0].read_text())
    for mode in ("sg", "nosg"):
        assert sorted(e["seed"] for e in report["episodes"][mode]) == [1_000_000 + i for i in range(5)]
    # one process plays the same draws: validation is seeded per batch of tasks, not per rank
    one = _cli(tmp_path / "one", "--model.evaluation.num_tasks=5", "--model.evaluation.tasks_per_batch=2",
               command="validate", timeout=900, devices=1)
    assert one.returncode == 0, one.stderr[-4000:]
    single = json.loads(next((tmp_path / "one").rglob("validation_report.json")).read_text())
    for mode in ("sg", "nosg"):
        by_seed = {e["seed"]: (e["actions"], e["labels"]) for e in single["episodes"][mode]}
        assert {e["seed"]: (e["actions"], e["labels"]) for e in report["episodes"][mode]} == by_seed, mode


def test_checkpoint_swap_cut_in_half_is_undone(tmp_path):
    """FSDP2Strategy swaps a finished save in with two renames (last.ckpt -> .last.ckpt.old, partial -> last.ckpt); a
    kill between them leaves only .last.ckpt.old: `--ckpt_path last` puts it back and resumes from it, and ignores
    a half-written .last.ckpt.partial."""
    from sglightning.runs import find_last_checkpoint

    ckpts = tmp_path / "runs" / "x" / "version_0" / "checkpoints"
    (ckpts / ".last.ckpt.old").mkdir(parents=True)
    (ckpts / ".last.ckpt.old" / "meta.pt").write_bytes(b"previous")
    (ckpts / ".last.ckpt.partial").mkdir()
    cfg = {"trainer": {"logger": {"init_args": {"save_dir": str(tmp_path / "runs"), "name": "x"}}}}
    found = find_last_checkpoint(cfg)
    assert found == ((ckpts / "last.ckpt").resolve(), "version_0")
    assert (ckpts / "last.ckpt" / "meta.pt").read_bytes() == b"previous" and not (ckpts / ".last.ckpt.old").exists()


def test_cli_rejects_unsharded_fsdp1_with_tied_embeddings(tmp_path):
    """FSDP1 on one process switches to NO_SHARD, and torch's FSDP1 then fails on tied embeddings (the tiny model,
    Qwen2-0.5B): one line naming trainer.strategy instead of an assertion deep inside FSDP."""
    res = _cli(tmp_path, *SHARDED_CLI["fsdp1"], "--trainer.accelerator=cpu", devices=1, timeout=900)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "trainer.strategy: FSDPStrategy without sharding" in res.stderr and "Traceback" not in res.stderr


def test_sigterm_under_ddp_saves_a_whole_step_and_resumes(tmp_path):
    """Preemption on 2 processes: SIGTERM to the launching process reaches both ranks; the run saves after a whole
    number of steps, exits 0, and the same command with `--ckpt_path last` finishes the run in the same folder."""
    import signal
    import time

    from sglightning.checkpointing import load_checkpoint_file

    args = ["--trainer.strategy=ddp", "--trainer.limit_val_batches=0", "--model.rollout.max_steps=4"]
    cmd, env = _cli_cmd(tmp_path, *args, "--trainer.max_steps=30")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ckpt = tmp_path / "tiny" / "version_0" / "checkpoints" / "last.ckpt"
    deadline = time.time() + 300
    while not ckpt.is_file() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert ckpt.is_file(), "no checkpoint before the deadline"
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the ranks did not stop within 180 s of SIGTERM") from None
    assert proc.returncode == 0, err[-3000:]
    assert "SIGTERM received" in err
    state = load_checkpoint_file(ckpt)
    done = state["sglightning"]["rollouts_done"]
    assert 1 <= done < 30 and state["global_step"] == done
    res = _cli(tmp_path, *args, f"--trainer.max_steps={done + 1}", "--ckpt_path=last")
    assert res.returncode == 0, res.stderr[-3000:]
    assert load_checkpoint_file(ckpt)["global_step"] == done + 1
    assert not (tmp_path / "tiny" / "version_1").exists()


def test_ckpt_path_last_never_resumes_another_runs_checkpoint(tmp_path):
    """`--ckpt_path last` with a named logger looks only in that logger's run folders: a checkpoint of a run with
    another name — in the same save_dir, or anywhere under default_root_dir — is not taken (a study of several arms
    in one folder must not continue arm B from arm A's adapters)."""
    from sglightning.runs import find_last_checkpoint

    other = tmp_path / "runs" / "arm_a" / "version_0" / "checkpoints"
    other.mkdir(parents=True)
    (other / "last.ckpt").write_bytes(b"arm a")
    named = {"default_root_dir": str(tmp_path),
             "logger": {"init_args": {"save_dir": str(tmp_path / "runs"), "name": "arm_b"}}}
    assert find_last_checkpoint({"trainer": named}) is None
    mine = tmp_path / "runs" / "arm_b" / "version_1" / "checkpoints"
    mine.mkdir(parents=True)
    (mine / "last.ckpt").write_bytes(b"arm b")
    assert find_last_checkpoint({"trainer": named}) == ((mine / "last.ckpt").resolve(), "version_1")
    # a run's checkpoint given by its path is resumed in its own folder too (it started a new version_N)
    from sglightning.runs import version_of_checkpoint

    assert version_of_checkpoint(mine / "last.ckpt", {"trainer": named}) == "version_1"
    assert version_of_checkpoint(mine / "step=50.ckpt", {"trainer": named}) is None  # an older one: a branch
    assert version_of_checkpoint(other / "last.ckpt", {"trainer": named}) is None  # another arm's: no folder pinned
    assert version_of_checkpoint(tmp_path / "loose.ckpt", {"trainer": named}) is None
    # no logger: default_root_dir's own checkpoints/ (Lightning's folder when logger=False), not deeper
    plain = tmp_path / "plain"
    (plain / "deep" / "x" / "y" / "checkpoints").mkdir(parents=True)
    (plain / "deep" / "x" / "y" / "checkpoints" / "last.ckpt").write_bytes(b"deep")
    (plain / "arm_a" / "version_0" / "checkpoints").mkdir(parents=True)  # another config's run, with a logger
    (plain / "arm_a" / "version_0" / "checkpoints" / "last.ckpt").write_bytes(b"arm a")
    cfg = {"trainer": {"default_root_dir": str(plain), "logger": False}}
    assert find_last_checkpoint(cfg) is None
    (plain / "checkpoints").mkdir()
    (plain / "checkpoints" / "last.ckpt").write_bytes(b"plain")
    assert find_last_checkpoint(cfg) == ((plain / "checkpoints" / "last.ckpt").resolve(), None)
    # a ModelCheckpoint of one's own keeps last.ckpt (and a stop saves it) in its dirpath: found there
    own = tmp_path / "mine"
    own.mkdir()
    keeper = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"dirpath": str(own)}}
    cfg["trainer"]["callbacks"] = [keeper]
    time.sleep(0.01)
    (own / "last.ckpt").write_bytes(b"own")
    assert find_last_checkpoint(cfg) == ((own / "last.ckpt").resolve(), None)
    # trainer.logger null is Lightning's default logger, as true is (it was searched as no logger: every requeue
    # started fresh); a version the config fixes is looked for in that folder; a TensorBoard name "" has its
    # versions in the save_dir itself
    default = tmp_path / "dflt"
    (default / "lightning_logs" / "version_3" / "checkpoints").mkdir(parents=True)
    (default / "lightning_logs" / "version_3" / "checkpoints" / "last.ckpt").write_bytes(b"default")
    for logger in (None, True):
        assert find_last_checkpoint({"trainer": {"default_root_dir": str(default), "logger": logger}}) == (
            (default / "lightning_logs" / "version_3" / "checkpoints" / "last.ckpt").resolve(), "version_3")
    runs = tmp_path / "runs"
    (runs / "arm_b" / "myrun" / "checkpoints").mkdir(parents=True)
    (runs / "arm_b" / "myrun" / "checkpoints" / "last.ckpt").write_bytes(b"named version")
    fixed = {"logger": {"init_args": {"save_dir": str(runs), "name": "arm_b", "version": "myrun"}}}
    assert find_last_checkpoint({"trainer": fixed}) == (
        (runs / "arm_b" / "myrun" / "checkpoints" / "last.ckpt").resolve(), "myrun")
    (runs / "version_0" / "checkpoints").mkdir(parents=True)
    (runs / "version_0" / "checkpoints" / "last.ckpt").write_bytes(b"no name")
    for name in ("", None):  # Lightning's TensorBoard and CSV loggers read a null name as ""
        unnamed = {"logger": {"init_args": {"save_dir": str(runs), "name": name}}}
        assert find_last_checkpoint({"trainer": unnamed}) == (
            (runs / "version_0" / "checkpoints" / "last.ckpt").resolve(), "version_0")


def test_sigterm_on_one_rank_stops_every_rank_at_the_same_point(tmp_path):
    """SIGTERM reaching one rank only (here rank 1, not the launcher) is noted by the handler without any collective
    — Lightning's own handler broadcasts from inside the signal handler, which collides with whatever collective the
    other rank is in and hangs the run — and every rank learns it at the next agreement point, together."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    res = run_whole([sys.executable, str(HERE / "sigterm_ranks.py"), str(tmp_path), "1"], 300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["before"] is r1["before"] is False  # no signal yet: nobody stops
    assert r1["own_flag_after_signal"] is False  # noted, not acted on alone (Lightning's loop would stop rank 1 here)
    assert r0["all_reduce"] == r1["all_reduce"] == 2.0  # the collective after the signal was not disturbed
    assert r0["agreed"] is r1["agreed"] is True and r0["flag_after_agreement"] is r1["flag_after_agreement"] is True


def _no_rows_anywhere(rank: int, out: str) -> None:
    """One rank of a DDP step in which no rank had rows: no backward ran, every gradient is None."""
    from sglightning.distributed import finish_gradients

    join_gloo(rank, out)
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-2)
    lin(torch.randn(2, 4)).sum().backward()  # a first step: AdamW has momentum
    opt.step()
    opt.zero_grad()
    before = lin.weight.detach().clone()
    if rank == 1:  # one rank has a bias gradient: it is summed (zeros from the other rank)
        lin.bias.grad = torch.ones(4)
    finish_gradients(lin, list(lin.parameters()), None, True, 100.0)
    grads = [p.grad is not None for p in lin.parameters()]
    opt.step()
    moved = float((lin.weight - before).abs().max())
    Path(out, f"rank{rank}.json").write_text(json.dumps({"grads": grads, "moved": moved,
                                                         "bias_grad": lin.bias.grad.tolist()}))
    end_rank()


def test_a_gradient_no_rank_has_stays_none_under_ddp(tmp_path):
    """DDP zero-filled the gradients no rank had before its sum: AdamW then moved the adapters by their momentum
    on a step with no rows anywhere (one device leaves them)."""
    import torch.multiprocessing as mp

    mp.spawn(_no_rows_anywhere, args=(str(tmp_path),), nprocs=2)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["grads"] == [False, True] and got["moved"] == 0.0, got
        assert got["bias_grad"] == [1.0] * 4


def _fsdp2_after_a_rollout(rank: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from sglightning.distributed import generation_weights

    join_gloo(rank, out)
    mesh = init_device_mesh("cpu", (2,))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    for layer in model[:2]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    def reshards() -> list[bool]:  # [root, layer 0, layer 1]: resharded after forward?
        return [m._get_fsdp_state()._fsdp_param_groups[0].post_forward_mesh_info is not None
                for m in (model, model[0], model[1])]

    model(torch.randn(2, 4)).sum().backward()  # lazy init: the root's own default
    first = reshards()
    with generation_weights(model, "fsdp2"):
        model(torch.randn(2, 4))
    Path(out, f"rank{rank}.json").write_text(json.dumps({"first": first, "after": reshards()}))
    end_rank()


def test_fsdp2_rollouts_leave_the_root_unsharded_after_forward(tmp_path):
    """The rollout's all-gathered weights set every unit to keep its weights; switching back set the root to
    reshard after forward too, for the rest of the run (1-2 more all-gathers of embeddings and head per micro-batch)."""
    import torch.multiprocessing as mp

    mp.spawn(_fsdp2_after_a_rollout, args=(str(tmp_path),), nprocs=2)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["first"] == [False, True, True] and got["after"] == got["first"], got
