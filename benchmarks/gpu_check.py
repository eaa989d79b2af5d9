"""A short GRPO run through ``sglightning fit`` (the CLI: seeded rollouts, validation before and after training) on a
random-init model of a real shape (nothing to download), measured against the chip's limits.

    python benchmarks/gpu_check.py                                      # the 0.39 B probe, 8 × 8 episodes, 1 GPU
    python benchmarks/gpu_check.py --shape qwen3-1.7b --groups 16       # the paper's 16 × 8 episodes
    python benchmarks/gpu_check.py --strategy fsdp2 --devices 2         # FSDP2 on 2 GPUs
    python benchmarks/gpu_check.py --cpu-smoke                          # the same code path, tiny shapes, on CPU

Prints, for the steps after the first (the first compiles): rollout generated tokens/s, the decode roofline for the
shape at the measured batch and mean context and the share of it reached; update tokens/s and MFU; peak memory; the
sampler/trainer log-prob gap; validation success before and after; how often the decode step was compiled and how
often CUDA graphs were skipped (on a GPU the reasons go to the log: torch's recompile and performance-hint messages are
switched on); one table row last.  ``--profile PATH`` profiles the last step (``StepProfile``: each phase's wall and
device time, so how busy the GPU was in the rollout and the update) and leaves it out of the numbers above.

The decode roofline: a decode step reads the weights once and every row's KV cache, so
``tokens/s ≤ B / ((2·N + B·L·kv) / bandwidth)`` with B the rows a lock step advances, L their mean context (both as
the engine logged them), kv = 2 · layers · kv_heads · head_dim · 2 bytes per token, N the parameters, bandwidth a
device-to-device copy measured here (bytes read + written).  On several GPUs the rates are their total, the roofline
one GPU's, and its share the rate per GPU over it.  MFU counts the positions the update's forwards feed
(``tokens/update_positions``: pads included, a shared prefix once), 4·N FLOPs each for a pass with a backward
(forward and input gradients; the frozen base takes no weight gradients) and 2·N for a pass without (the KL term's
reference, the rollout correction's pass where the model drops out), against a bf16 matrix product measured here;
attention's own FLOPs are left out.  ``update tok/s`` counts the rows' own tokens (``tokens/total``): with shared
prefixes it exceeds the positions computed.

Each step's logs go to ``--json``'s path + ``.steps.jsonl`` as the run goes (after a first line of the machine's
numbers); ``--from-steps`` summarises such a file, so a stage cut short by its timeout still gives its numbers.

Shapes (``--shape``), all with the in-process test tokenizer (vocabulary 512 instead of ~150 k, so the LM head is
negligible and N is the transformer's), LoRA r16 on every linear layer, bf16 base, fp32 adapters, ``bf16-mixed``:

* ``probe`` — the first GPU run's 0.39 B model: Qwen2-0.5B's layers with full multi-head attention (14 kv heads);
* ``qwen2.5-0.5b`` — the same with Qwen2.5's grouped-query attention (2 kv heads);
* ``qwen3-1.7b``, ``qwen3-4b`` — Qwen3's layers (q/k norms, 8 kv heads of 128).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings
from pathlib import Path

from lightning.pytorch import Callback

SHAPES = {
    "tiny": dict(),
    "probe": dict(hidden_size=896, num_layers=24, num_heads=14, intermediate_size=4864),
    "qwen2.5-0.5b": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864),
    "qwen3-1.7b": dict(hidden_size=2048, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                       intermediate_size=6144, arch="qwen3"),
    "qwen3-4b": dict(hidden_size=2560, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                     intermediate_size=9728, arch="qwen3"),
}


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="probe")
    ap.add_argument("--strategy", choices=["auto", "ddp", "fsdp1", "fsdp2"], default="auto")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--groups", type=int, default=8, help="groups per step (per rank)")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-env-steps", type=int, default=6)
    ap.add_argument("--val-tasks", type=int, default=8, help="validation tasks, before and after training (0: none)")
    ap.add_argument("--compile", default="auto", help="model.engine.compile (auto, off, static, default, "
                    "reduce-overhead, graphs)")
    ap.add_argument("--precision", default=None, help="trainer precision (default: bf16-mixed on GPU, 32-true on CPU)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="any other sglightning fit key, e.g. --set model.grpo.rollout_correction=null (repeatable)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU: checks the script end to end")
    ap.add_argument("--json", default=None, help="also write the numbers to this file (and each step's logs, as the "
                    "run goes, to this path + .steps.jsonl)")
    ap.add_argument("--from-steps", default=None, metavar="PATH",
                    help="run nothing: summarise a .steps.jsonl an interrupted check left (marked partial)")
    ap.add_argument("--profile", default=None, metavar="PATH",
                    help="profile the last step (sglightning.callbacks.StepProfile), write its phases to PATH "
                         "(Markdown) and the JSON; that step is left out of the throughput numbers (needs --steps 3+)")
    args = ap.parse_args(argv)
    if args.profile and args.steps < 3:
        ap.error("--profile needs --steps 3 or more: step 1 warms up and compiles, the profiled step is not timed")
    if args.strategy == "fsdp1" and args.devices < 2:
        ap.error("--strategy fsdp1 needs --devices 2 or more: on one process torch's FSDP1 does not shard (NO_SHARD), "
                 "which fails on this model's tied embeddings")
    if args.cpu_smoke:
        args.shape, args.groups, args.group_size, args.max_env_steps = "tiny", 1, 2, 2
        if args.compile in ("reduce-overhead", "graphs"):  # CUDA graphs need CUDA: the same slot cache, eager
            args.compile = "static"
        args.val_tasks = min(args.val_tasks, 2)
    return args


def fit_args(args, gpu: bool, root: str) -> list[str]:
    """The ``sglightning fit`` command line of this check (the YAML-free form of a config)."""
    shape = [f"--model.policy.tiny.{k}={v}" for k, v in SHAPES[args.shape].items()]
    # a class path goes under strategy.class_path: given as `--trainer.strategy=<path>` Lightning reads a strategy name
    strategy = {"fsdp2": ["--trainer.strategy.class_path=sglightning.strategies.FSDP2Strategy"],
                "fsdp1": ["--trainer.strategy.class_path=sglightning.strategies.FSDP1Strategy",
                          "--trainer.strategy.init_args.state_dict_type=sharded"],
                "ddp": ["--trainer.strategy=ddp"]}.get(args.strategy, [])
    val = (["--model.evaluation.before_fit=true", f"--model.evaluation.num_tasks={args.val_tasks}",
            f"--model.evaluation.tasks_per_batch={args.val_tasks}"] if args.val_tasks else
           ["--trainer.limit_val_batches=0"])
    return [
        "fit", f"--trainer.default_root_dir={root}", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
        f"--trainer.accelerator={'gpu' if gpu else 'cpu'}", f"--trainer.devices={args.devices}",
        f"--trainer.precision={args.precision or ('bf16-mixed' if gpu else '32-true')}",
        f"--trainer.max_steps={args.steps}", "--seed_everything=0", *strategy,
        "--model.policy.name_or_path=embedded:tiny", "--model.policy.lora_r=16", "--model.policy.lora_alpha=32",
        "--model.policy.lora_target_modules=all-linear", f"--model.policy.dtype={'bfloat16' if gpu else 'float32'}",
        *shape,
        "--model.env.class_path=sglightning.envs.household.HouseholdEnv", "--model.env.init_args.difficulty=1",
        f"--model.rollout.groups_per_step={args.groups}", f"--model.rollout.group_size={args.group_size}",
        f"--model.rollout.max_steps={args.max_env_steps}",
        "--model.guidance.action_decoding=admissible", "--model.guidance.max_guidance_tokens=24",
        "--model.guidance.max_action_tokens=24", "--model.grpo.kl_coef=0.01", "--model.update.micro_batch_size=8",
        f"--model.engine.compile={args.compile}", *val,
        "--model.optimizer=torch.optim.AdamW", "--model.optimizer.lr=1e-5",
        *([f"--trainer.callbacks+={{class_path: sglightning.callbacks.StepProfile, init_args: {{step: {args.steps}}}}}"]
          if args.profile else []),
        *(f"--{kv}" for kv in args.set),
    ]


def copy_bandwidth(device) -> float:
    """Bytes per second of a device-to-device copy of 2 GiB (read + written), best of 5."""
    import torch

    x = torch.empty(2**30, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(6):
        torch.cuda.synchronize()
        t = time.perf_counter()
        y.copy_(x)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    del x, y
    return 2 * 2**31 / best


def matmul_flops(device) -> float:
    """FLOP/s of an 8192³ bf16 matrix product on random data (mean of 10 after 3 warm-ups)."""
    import torch

    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 10 * 2 * 8192**3 / (time.perf_counter() - t)


def shape_numbers(shape: dict) -> dict[str, float]:
    """Parameters (all, and those of the transformer layers) and KV bytes per token in bf16, from the shape alone."""
    import torch

    from sglightning.embedded import TinyModelConfig, build_tiny_model

    cfg = TinyModelConfig(**shape)
    with torch.device("meta"):  # shapes only, no memory
        model = build_tiny_model(cfg, 512, "meta")
    params = sum(p.numel() for p in model.parameters())
    kv_heads = cfg.num_kv_heads or cfg.num_heads
    return {"params": float(params), "kv_bytes_per_token": float(2 * cfg.num_layers * kv_heads * cfg.heads_dim * 2)}


def update_passes(module) -> dict[str, int]:
    """The update's passes over its positions per step, from the module's configs: with a backward (one per PPO
    epoch) and without (the KL term's reference pass each epoch; the rollout correction's pass where the model drops
    out)."""
    from sglightning.traits import drops_out

    epochs = module.grpo_cfg.ppo_epochs
    correction = module.policy is not None and bool(module.correction_mode()) and drops_out(module.policy)
    return {"backward": epochs, "no_grad": epochs * (module.grpo_cfg.kl_coef > 0) + int(correction)}


def summarise(hist: list[dict], shape: dict, bandwidth: float | None, flops: float | None, profiled: bool = False,
              passes: dict[str, int] | None = None, devices: int = 1) -> dict:
    """The run's numbers from its per-step logs ``hist``; with ``profiled`` the last step (run under the profiler) is
    left out of the times.  ``passes``: :func:`update_passes` (default one pass with a backward); ``devices``: the
    GPUs the logged counts (summed over ranks) were computed on."""
    rows = (hist[:-1] if profiled else hist)[1:] or hist  # the first step includes warm-up and compilation
    gen = sum(r["tokens/generated"] for r in rows)
    rollout_s = sum(r["time/rollout_s"] for r in rows)
    update_s = max(sum(r["time/update_s"] for r in rows), 1e-9)
    # positions fed per pass (older logs: the rows' own tokens)
    positions = sum(r.get("tokens/update_positions", r.get("tokens/total", 0.0)) for r in rows)
    out = {"rollout_tokens_per_s": gen / rollout_s,
           "rollout_s_per_step": rollout_s / len(rows),
           "update_tokens_per_s": sum(r.get("tokens/total", 0.0) for r in rows) / update_s,
           "update_positions_per_s": positions / update_s,
           "update_s_per_step": sum(r["time/update_s"] for r in rows) / len(rows),
           "steps_timed": len(rows),
           "logprob_gap_sampler_trainer": max(r.get("policy/logprob_gap_sampler_trainer", 0.0) for r in hist)}
    # the sampler/trainer ratio of the first pass, and what the update did with it (rollout correction)
    for key, reduce in (("policy/sampler_ratio_mean", "mean"), ("policy/sampler_ratio_outside_0.9_1.1", "mean"),
                        ("policy/sampler_ratio_max", "max"), ("policy/ratio_mean", "mean"),
                        ("loss/clip_frac", "mean"), ("policy/is_weight_mean", "mean"),
                        ("policy/is_weight_truncated", "mean")):
        vals = [r[key] for r in hist if key in r]
        if vals:
            out[key.split("/", 1)[1]] = max(vals) if reduce == "max" else sum(vals) / len(vals)
    # each phase's wall time per step (on a GPU the draw waits for the decode step: device time shows there)
    out["phase_s"] = {k[len("time/"):-len("_s")]: sum(r.get(k, 0.0) for r in rows) / len(rows)
                      for k in sorted({k for r in rows for k in r}) if k.startswith(("time/rollout_", "time/update_"))}
    b = sum(r.get("engine/rows_per_lock_step", 0.0) for r in rows) / len(rows)
    ctx = sum(r.get("engine/mean_context_tokens", 0.0) for r in rows) / len(rows)
    out.update(rows_per_lock_step=b, mean_context_tokens=ctx, **shape_numbers(shape))
    if bandwidth and b:
        step_bytes = 2 * out["params"] + b * ctx * out["kv_bytes_per_token"]
        out["decode_roofline_tokens_per_s"] = b / (step_bytes / bandwidth)
        # the roofline is one GPU's (B and L are rank means); the rate is every GPU's together
        out["roofline_share"] = out["rollout_tokens_per_s"] / devices / out["decode_roofline_tokens_per_s"]
    passes = passes or {"backward": 1, "no_grad": 0}
    out["update_flops_per_param_position"] = 4 * passes["backward"] + 2 * passes["no_grad"]
    if flops:
        out["update_mfu"] = (out["update_flops_per_param_position"] * out["params"] * out["update_positions_per_s"]
                             / devices / flops)
    return out


def launched_rank() -> bool:
    """Whether this process is a rank Lightning started for a run on several devices (not the one the user ran)."""
    return os.environ.get("LOCAL_RANK", "0") != "0"


class StepLog(Callback):
    """Appends each training step's logs (the module's ``history``) to a JSON-lines file as the run goes, so that a
    check stopped by its timeout still leaves its steps (rank 0 only)."""

    def __init__(self, path: str, header: dict):
        self.path, self.header = Path(path), header
        if not launched_rank():  # an earlier run's steps must not pass for this one's
            self.path.unlink(missing_ok=True)

    def setup(self, trainer, module, stage: str) -> None:
        if trainer.is_global_zero:  # one writer: another rank's header would cut rank 0's lines
            self.path.write_text(json.dumps({"header": self.header}) + "\n")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.is_global_zero and module.history:
            line = dict(module.history[-1], **{"gpu_check/" + k: v for k, v in update_passes(module).items()},
                        **{"gpu_check/validation_before": _success(module.val_report_before)})
            with self.path.open("a") as f:
                f.write(json.dumps(line, default=float) + "\n")


def logged_peaks_GB(hist: list[dict]) -> list[float]:
    """The accelerator peaks the steps logged (``memory/<phase>_peak_accelerator_gb``, in GB: 1e9 bytes).  Each phase
    resets the device's peak counter, so the run's peak is the largest of them, not the counter at the end."""
    return [v for r in hist for k, v in r.items() if k.startswith("memory/") and k.endswith("_accelerator_gb")]


def from_steps(path: str) -> dict:
    """The numbers of an interrupted check from its ``.steps.jsonl`` (:class:`StepLog`): ``partial`` true, no
    validation after training, the peak memory the steps logged; a profiled step, if reached, is not timed."""
    lines = []
    for text in Path(path).read_text().splitlines():
        try:
            lines.append(json.loads(text))
        except json.JSONDecodeError:  # a line cut by the kill
            continue
    if not lines or "header" not in lines[0]:
        raise SystemExit(f"--from-steps: {path} has no header line (not a gpu_check steps log)")
    head, hist = lines[0]["header"], lines[1:]
    if not hist:
        raise SystemExit(f"--from-steps: {path} holds no finished step")
    passes = {k: int(hist[-1].get("gpu_check/" + k, d)) for k, d in (("backward", 1), ("no_grad", 0))}
    profiled = head.get("profile_step") is not None and len(hist) >= head["profile_step"]  # its step is not timed
    peaks = logged_peaks_GB(hist)
    return {**head, "partial": True, "steps": len(hist), "episodes_per_step": hist[-1]["rollout/episodes"],
            **summarise(hist[: head["profile_step"]] if profiled else hist, SHAPES[head["shape"]],
                        head.get("bandwidth"), head.get("flops"), profiled=profiled, passes=passes,
                        devices=head.get("devices", 1)),
            "copy_bandwidth_TBps": head["bandwidth"] / 1e12 if head.get("bandwidth") else None,
            "matmul_TFLOPs": head["flops"] / 1e12 if head.get("flops") else None,
            "peak_memory_GB": max(peaks) if peaks else None,
            "validation_before": hist[0].get("gpu_check/validation_before"),
            "validation_after": None}


def main(argv=None) -> dict:
    args = parse(argv)
    if args.from_steps:
        out = from_steps(args.from_steps)
        print(json.dumps(out, indent=2))
        print(row(out))
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2))
        return out
    import torch

    from sglightning.callbacks import RolloutCallback, StepProfile
    from sglightning.cli import cli_main

    gpu = torch.cuda.is_available() and not args.cpu_smoke
    if gpu:  # why a step was compiled again, or ran without CUDA graphs: in the log, not guessed afterwards
        torch._logging.set_logs(recompiles=True, perf_hints=True)
    from torch._dynamo.utils import counters
    launched = launched_rank()  # rank 0 measures, alone
    bandwidth = copy_bandwidth("cuda") if gpu and not launched else None
    flops = matmul_flops("cuda") if gpu and not launched else None
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    # one run folder for every rank (the ranks Lightning starts inherit it): a sharded checkpoint is written by all
    started = launched and "SGL_GPU_CHECK_ROOT" in os.environ
    root = os.environ["SGL_GPU_CHECK_ROOT"] if started else tempfile.mkdtemp(prefix="sgl-gpu-check-")
    os.environ["SGL_GPU_CHECK_ROOT"] = root
    t0 = time.perf_counter()
    header = {"device": torch.cuda.get_device_name(0) if gpu else "cpu", "shape": args.shape,
              "strategy": args.strategy, "devices": args.devices, "compile": args.compile, "bandwidth": bandwidth,
              "flops": flops, "profile_step": args.steps if args.profile else None}
    steps_log = [StepLog(args.json + ".steps.jsonl", header)] if args.json else []
    # sys.argv stays whole: under DDP / FSDP on several devices Lightning starts the other ranks with this process's
    # argv (trimmed, they ran the default check and the run hung); LightningCLI's warning about it says nothing here
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended to run from within")
        cli = cli_main(fit_args(args, gpu, root), callbacks=steps_log)
    module, trainer = cli.model, cli.trainer
    engine = next(c for c in trainer.callbacks if isinstance(c, RolloutCallback)).engine
    profile = next((c.summary for c in trainer.callbacks if isinstance(c, StepProfile)), None)
    out = {**{k: v for k, v in header.items() if k not in ("bandwidth", "flops", "profile_step")},
           "decode_step": engine.mode(module.peft_model) if hasattr(engine, "mode") else None,
           "compiles": counters["frames"]["ok"], "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
           # CUDA-graph pieces over the compiled graphs (one each when nothing splits them: a host copy would)
           "cudagraph_partitions": counters["inductor"]["cudagraph_partitions"],
           "steps": len(module.history),
           "episodes_per_step": module.history[-1]["rollout/episodes"],
           **summarise(module.history, SHAPES[args.shape], bandwidth, flops, profiled=profile is not None,
                       passes=update_passes(module), devices=args.devices),
           "copy_bandwidth_TBps": bandwidth / 1e12 if bandwidth else None,
           "matmul_TFLOPs": flops / 1e12 if flops else None,
           # the phases reset the counter: the steps' logged peaks, and the counter for what ran after them
           "peak_memory_GB": max([torch.cuda.max_memory_allocated() / 1e9, *logged_peaks_GB(module.history)])
           if gpu else None,
           # the engine closed its caches at the fit's end: the largest a step logged
           "slot_cache_GB": max((h.get("engine/slot_cache_GB", 0.0) for h in module.history), default=None),
           "caches_given_back": engine.slots.given_back if hasattr(engine, "slots") else None,
           # the compiled decode steps' calls: guards checked / skipped (CompiledStep), graphs the engine captured
           # and steps it replayed from them (compile: graphs)
           "decode_calls": getattr(engine, "decode_calls", None),
           "validation_before": _success(module.val_report_before), "validation_after": _success(module.val_report),
           "wall_s": time.perf_counter() - t0}
    if profile is not None:  # the phases' shares and device busy, in the JSON; the whole table in --profile's file
        out["profile"] = {"step": args.steps, "wall_s": profile["wall_s"], "device_busy": profile["device_busy"],
                          "device_events": profile["device_events"],
                          "phases": {p["phase"]: {"wall_s": p["wall_s"], "device_s": p["device_s"], "calls": p["calls"]}
                                     for p in profile["phases"]}}
    if trainer.is_global_zero:
        print(json.dumps(out, indent=2))
        print(row(out))
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2))
        if args.profile and profile is not None:
            from sglightning.profiling import markdown
            Path(args.profile).write_text(markdown(profile, f"{args.shape}, {out['episodes_per_step']:.0f} episodes, "
                                                            f"step {args.steps} of `gpu_check.py` on {out['device']}"))
    return out


def _success(report: dict | None) -> float | None:
    if not report:
        return None
    modes = report.get("modes") or {}
    first = next(iter(modes.values()), None)
    return None if first is None else first.get("rollout/success_rate")


def row(o: dict) -> str:
    """One Markdown table row: shape, episodes, rollout tok/s (share of the roofline), update tok/s (MFU), memory."""
    share = f" ({100 * o['roofline_share']:.1f} % of {o['decode_roofline_tokens_per_s']:,.0f})" \
        if o.get("roofline_share") is not None else ""
    mfu = f" ({100 * o['update_mfu']:.1f} % MFU)" if o.get("update_mfu") is not None else ""
    mem = f"{o['peak_memory_GB']:.1f} GB" if o.get("peak_memory_GB") is not None else "-"
    partial = f" (cut at step {o['steps']})" if o.get("partial") else ""
    return (f"| {o['shape']}{partial} | {o['episodes_per_step']:.0f} | {o['rollout_tokens_per_s']:,.0f}{share} | "
            f"{o['rollout_s_per_step']:.2f} | {o['update_tokens_per_s']:,.0f}{mfu} | {mem} | "
            f"{o['validation_before']} -> {o['validation_after']} |")


if __name__ == "__main__":
    main()
    from sglightning import distributed
    from sglightning.errors import exit_process
    if distributed.group_was_released():  # FSDP: end as `sglightning` does, before teardown (gloo/NCCL threads)
        exit_process(0)
