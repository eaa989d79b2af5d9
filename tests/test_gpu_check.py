"""benchmarks/gpu_check.{sh,py} and gpu_session.sh: shell syntax, argument parsing, the roofline arithmetic, and the
whole check on CPU with tiny shapes, through the same CLI path as ``sglightning fit`` (seeded, validated)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from processes import run_whole

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import gpu_check  # noqa: E402


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_session.sh", "gpu_bundle.sh"])
def test_shell_script_syntax(script):
    assert subprocess.run(["bash", "-n", str(BENCH / script)]).returncode == 0


def test_arguments():
    a = gpu_check.parse(["--strategy", "fsdp2", "--devices", "2", "--steps", "5", "--shape", "qwen3-1.7b"])
    assert (a.strategy, a.devices, a.steps, a.cpu_smoke, a.shape) == ("fsdp2", 2, 5, False, "qwen3-1.7b")
    with pytest.raises(SystemExit):
        gpu_check.parse(["--shape", "qwen9"])
    args = gpu_check.fit_args(gpu_check.parse(["--set", "model.grpo.rollout_correction=null", "--shape", "qwen3-4b"]),
                              gpu=True, root="/tmp/x")
    assert args[0] == "fit" and "--model.grpo.rollout_correction=null" in args
    assert "--model.policy.tiny.num_kv_heads=8" in args and "--model.policy.tiny.arch=qwen3" in args
    assert "--trainer.precision=bf16-mixed" in args and "--model.policy.dtype=bfloat16" in args
    assert gpu_check.parse(["--strategy", "fsdp1", "--devices", "2"]).strategy == "fsdp1"
    with pytest.raises(SystemExit):
        gpu_check.parse(["--strategy", "deepspeed"])
    with pytest.raises(SystemExit):  # FSDP1 on one process does not shard and fails on the tied embeddings
        gpu_check.parse(["--strategy", "fsdp1"])
    # a CPU has no CUDA graphs: the smoke run of a CUDA-graph stage decodes on the same slot cache, eagerly
    assert gpu_check.parse(["--cpu-smoke", "--compile", "reduce-overhead"]).compile == "static"
    assert gpu_check.parse(["--cpu-smoke", "--compile", "default"]).compile == "default"


def test_shapes_count_what_the_real_models_hold():
    """Parameters and KV bytes per token from the shapes alone (vocabulary 512): the first GPU run's 0.39 B probe,
    and Qwen3-1.7B's layers (1.41 B without its 151 k-token embedding; KV: 2 · 28 layers · 8 heads · 128 · 2 B)."""
    probe, q17 = (gpu_check.shape_numbers(gpu_check.SHAPES[k]) for k in ("probe", "qwen3-1.7b"))
    assert 0.38e9 < probe["params"] < 0.40e9 and probe["kv_bytes_per_token"] == 2 * 24 * 14 * 64 * 2
    assert 1.40e9 < q17["params"] < 1.42e9 and q17["kv_bytes_per_token"] == 2 * 28 * 8 * 128 * 2


def test_the_roofline_by_hand():
    """Two steps logged (the first is warm-up): B = 64 rows at L = 1 000 tokens of 84 KB each plus 0.8 GB of
    weights per step at 4 TB/s is 64 / ((0.8e9 + 64·1000·86016) / 4e12) tok/s; MFU = 4·N·tokens/s / peak."""
    step = {"tokens/generated": 640.0, "time/rollout_s": 0.5, "tokens/total": 1e4, "time/update_s": 0.1,
            "engine/rows_per_lock_step": 64.0, "engine/mean_context_tokens": 1000.0}
    out = gpu_check.summarise([dict(step, **{"time/rollout_s": 9.0}), step], gpu_check.SHAPES["probe"], 4e12, 8e14)
    assert out["rollout_tokens_per_s"] == 1280.0 and out["update_tokens_per_s"] == 1e5
    roof = 64 / ((2 * out["params"] + 64 * 1000 * 86016) / 4e12)
    assert out["decode_roofline_tokens_per_s"] == pytest.approx(roof)
    assert out["roofline_share"] == pytest.approx(1280 / roof)
    assert out["update_mfu"] == pytest.approx(4 * out["params"] * 1e5 / 8e14)
    # MFU counts the positions fed (a shared prefix once), 4·N each with a backward and 2·N each without (the KL
    # term's reference pass); update tok/s still counts the rows' own tokens
    fed = dict(step, **{"tokens/update_positions": 6e3})
    out = gpu_check.summarise([fed, fed], gpu_check.SHAPES["probe"], 4e12, 8e14, passes={"backward": 1, "no_grad": 1},
                              devices=2)
    assert out["update_tokens_per_s"] == 1e5 and out["update_positions_per_s"] == 6e4
    assert out["update_flops_per_param_position"] == 6
    assert out["update_mfu"] == pytest.approx(6 * out["params"] * 6e4 / 2 / 8e14)
    # on 2 GPUs the rate is both GPUs' together; the roofline is one GPU's (the logged B and L are rank means)
    assert out["roofline_share"] == pytest.approx(1280 / 2 / out["decode_roofline_tokens_per_s"])


def test_cpu_smoke_run_goes_through_fit_with_validation(tmp_path, capsys):
    out = gpu_check.main(["--cpu-smoke", "--steps", "2", "--json", str(tmp_path / "n.json")])
    assert out["steps"] == 2 and out["rollout_tokens_per_s"] > 0 and out["update_tokens_per_s"] > 0
    assert out["logprob_gap_sampler_trainer"] < 1e-4  # sampler and trainer agree on the same weights
    assert out["validation_before"] is not None and out["validation_after"] is not None  # fit's validations ran
    assert out["rows_per_lock_step"] > 0 and out["mean_context_tokens"] > 0  # the engine logged its decode steps
    assert (tmp_path / "n.json").is_file()
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("| tiny | 2 | ")
    # each step was logged as it ended: a check cut short by its timeout is summarised from what it left
    log = tmp_path / "n.json.steps.jsonl"
    lines = log.read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[0])["header"]["shape"] == "tiny"
    cut = tmp_path / "cut.jsonl"
    cut.write_text("\n".join(lines[:2]) + "\n")  # killed during step 2
    part = gpu_check.main(["--from-steps", str(cut), "--json", str(tmp_path / "p.json")])
    assert part["partial"] and part["steps"] == 1 and part["validation_before"] == out["validation_before"]
    assert part["update_flops_per_param_position"] == out["update_flops_per_param_position"] == 6  # 0.01 KL
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("| tiny (cut at step 1) | 2 | ")
    whole = gpu_check.from_steps(str(log))
    assert whole["rollout_tokens_per_s"] == pytest.approx(out["rollout_tokens_per_s"])
    assert whole["update_positions_per_s"] == pytest.approx(out["update_positions_per_s"])
    torn = tmp_path / "torn.jsonl"
    torn.write_text("\n".join(lines[:2]) + "\n" + lines[2][:20])  # killed while writing step 2's line
    assert gpu_check.from_steps(str(torn))["steps"] == 1
    header_only = tmp_path / "h.jsonl"
    header_only.write_text(lines[0] + "\n")
    with pytest.raises(SystemExit, match="no finished step"):
        gpu_check.from_steps(str(header_only))


def test_cpu_smoke_run_profiles_its_last_step_and_leaves_it_out_of_the_times(tmp_path):
    out = gpu_check.main(["--cpu-smoke", "--steps", "3", "--profile", str(tmp_path / "p.md")])
    assert out["steps"] == 3 and out["profile"]["step"] == 3
    phases = out["profile"]["phases"]
    assert {"rollout", "rollout/decode", "rollout/draw", "update", "update/backward"} <= set(phases)
    assert phases["rollout"]["wall_s"] < out["profile"]["wall_s"]
    assert "| rollout/decode |" in (tmp_path / "p.md").read_text()
    # cut after the profiled step (in the validation after it): that step is still left out of the times
    hist = [{"tokens/generated": 100.0, "time/rollout_s": t, "time/update_s": 1.0, "tokens/total": 10.0,
             "rollout/episodes": 2.0, "memory/update_peak_accelerator_gb": g} for t, g in ((9.0, 1.0), (1.0, 2.0),
                                                                                           (7.0, 1.5))]
    log = tmp_path / "cut.jsonl"
    head = {"shape": "tiny", "devices": 1, "profile_step": 3}
    log.write_text("\n".join(json.dumps(x) for x in [{"header": head}, *hist]) + "\n")
    part = gpu_check.from_steps(str(log))
    assert part["rollout_s_per_step"] == 1.0 and part["steps"] == 3
    assert part["peak_memory_GB"] == pytest.approx(2.0)  # GB (1e9 bytes), as logged
    with pytest.raises(SystemExit):  # step 1 warms up, the profiled step is not timed: nothing would be left
        gpu_check.parse(["--profile", "x.md", "--steps", "2"])


def test_summary_leaves_the_profiled_step_out():
    hist = [{"tokens/generated": 100.0, "time/rollout_s": t, "time/update_s": 1.0, "tokens/total": 10.0}
            for t in (9.0, 1.0, 7.0)]
    assert gpu_check.summarise(hist, {}, None, None)["rollout_s_per_step"] == 4.0  # steps 2 and 3
    assert gpu_check.summarise(hist, {}, None, None, profiled=True)["rollout_s_per_step"] == 1.0  # step 2 only
    hist[1]["time/rollout_draw_s"] = 0.5
    phases = gpu_check.summarise(hist, {}, None, None, profiled=True)["phase_s"]  # each phase's seconds per step
    assert phases == {"rollout": 1.0, "rollout_draw": 0.5, "update": 1.0}


def test_cpu_smoke_run_under_fsdp2_on_one_device(capfd):
    """``--strategy fsdp2`` (the GPU session compares it with the plain probe) reaches the FSDP2 strategy — given as
    a strategy name Lightning refused it — and the run prints nothing on stderr (no LightningCLI argv warning)."""
    import os

    saved = dict(os.environ)  # Lightning writes MASTER_ADDR / MASTER_PORT here: later tests' subprocesses would
    try:  # inherit this run's port
        out = gpu_check.main(["--cpu-smoke", "--steps", "2", "--strategy", "fsdp2", "--devices", "1"])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert out["strategy"] == "fsdp2" and out["steps"] == 2 and out["update_tokens_per_s"] > 0
    assert out["logprob_gap_sampler_trainer"] < 1e-4
    assert capfd.readouterr().err.strip() == ""


@pytest.mark.slow
def test_cpu_smoke_run_with_a_compiled_decode_step_compiles_it_once():
    """``--compile default`` (inductor; on a GPU ``reduce-overhead`` traces the same step): training rollouts of 10
    rows and validation rollouts of 2 (16 and 8 physical rows) share one compile of the decode step, and the check
    reports it (before, each row count compiled the step again)."""
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # an earlier test's trace of the same step would serve this one: count from nothing
    before = counters["frames"]["ok"]
    out = gpu_check.main(["--cpu-smoke", "--steps", "2", "--compile", "default",
                          "--set", "model.rollout.groups_per_step=5"])
    assert out["decode_step"] == "default" and out["episodes_per_step"] == 10
    assert out["validation_before"] is not None and out["validation_after"] is not None
    assert out["compiles"] - before == 1 and out["cudagraph_skips"] == 0


@pytest.mark.slow
def test_the_cache_memory_benchmark_by_hand_and_measured(tmp_path):
    """benchmarks/cache_memory.py: Qwen3-4B's two_call caches at 128 rows by hand (36 layers × 8 kv heads × 128 ×
    2 bytes × 2 per token); growing in place peaks lower than a new cache beside the old, and a block fed in chunks
    lower than in one pass."""
    import cache_memory

    # 1 GiB: each layer's tensors (40 MB) above glibc's largest mmap threshold, so a freed one leaves the process
    # at once (smaller ones may stay in its heap, and the resident size would not show the in-place saving)
    out = cache_memory.main(["--shapes", "qwen3-4b", "--grow-gib", "1", "--prefill", "16", "1024",
                             "--prefill-tokens", "4096", "--json", str(tmp_path / "m.json")])
    a = out["arithmetic"][0]
    per_token = 36 * 8 * 128 * 2 * 2
    assert (a["rate_slots"], a["act_slots"]) == (4608, 4096)  # 3 584 slots read, plus one: the next capacity
    assert a["rate_GiB"] == 128 * 4608 * per_token / 2**30 and a["rate_GiB_doubling"] == 128 * 8192 * per_token / 2**30
    assert not a["both_fit"]  # 81 + 72 GiB over 70
    beside, in_place = out["grow"]
    one, chunked = out["prefill"]
    assert in_place["final_GiB"] == beside["final_GiB"]
    assert (one["forwards"], chunked["forwards"]) == (1, 4)
    if beside["peak_GiB"] is None:  # this kernel or sandbox cannot reset a process's peak: nothing measured
        pytest.skip("/proc/self/clear_refs cannot reset the peak resident size here")
    assert in_place["peak_GiB"] < 0.8 * beside["peak_GiB"]
    assert chunked["peak_GiB"] < 0.6 * one["peak_GiB"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy,devices", [("fsdp2", 1), ("ddp", 2), ("fsdp2", 2)])
def test_the_check_as_a_script_ends_its_processes_on_their_own(tmp_path, strategy, devices):
    """On the first GPU run ``--strategy fsdp2 --devices 1`` finished its steps but its process had not ended 60 s
    later.  As a script, as the session runs it, it must end by itself with its table row; on two devices the rank
    Lightning starts runs the same check (it was started with the default arguments, and the run hung)."""
    import os

    env = dict(os.environ, PYTHONPATH=str(BENCH.parent / "src"))
    env.pop("SGL_GPU_CHECK_ROOT", None)
    res = run_whole([sys.executable, str(BENCH / "gpu_check.py"), "--cpu-smoke", "--steps", "2", "--strategy",
                     strategy, "--devices", str(devices), "--json", str(tmp_path / "f.json")], 900,
                    env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1].startswith(f"| tiny | {2 * devices} | ")
    out = json.loads((tmp_path / "f.json").read_text())
    assert (out["strategy"], out["devices"], out["steps"]) == (strategy, devices, 2)
    assert len((tmp_path / "f.json.steps.jsonl").read_text().splitlines()) == 3  # the header and rank 0's steps


@pytest.mark.slow
def test_the_session_script_runs_its_first_part_on_a_cpu(tmp_path):
    """``CPU_SMOKE=1 bash benchmarks/gpu_session.sh 1``: every stage of the GPU session's first part, with tiny shapes,
    ends with exit 0, and the table has a row per check (a broken stage would cost device minutes to find)."""
    import os

    out = tmp_path / "out"
    env = dict(os.environ, CPU_SMOKE="1", PY=sys.executable, OUT=str(out),
               PYTHONPATH=os.pathsep.join([str(BENCH.parent / "src"), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run(["bash", str(BENCH / "gpu_session.sh"), "1"], capture_output=True, text=True, timeout=900,
                         env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    stages = (out / "stages.md").read_text()
    for name in ("cuda_tests", "probe_8x8", "qwen3-1.7b_16x8"):
        assert f"| {name} | 0 |" in stages, stages
    table = (out / "table.md").read_text()
    rows = [line.split(" | ")[0] for line in table.splitlines() if " | tiny | 2 | " in line]
    assert rows == ["| probe_8x8", "| qwen3-1.7b_16x8"], table
    assert (out / "probe_8x8.profile.md").is_file()


@pytest.mark.slow
def test_the_step_guards_benchmark_times_both_arms_on_one_trace(tmp_path):
    """``benchmarks/step_guards.py`` on this CPU, small: every arm timed, the time outside inductor's code within
    the whole, one trace per model (the script's numbers are published; this checks the script, not a speed)."""
    import step_guards

    out = tmp_path / "guards.json"
    report = step_guards.main(["--layers", "2", "--calls", "5", "--repeats", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    [row] = report["rows"]
    assert row["layers"] == 2 and row["traces"] == 1 and "graphs" not in row  # --graphs: CUDA only
    for arm in ("checked", "once"):
        assert 0 < row[arm]["outside_us"] < row[arm]["us"]
