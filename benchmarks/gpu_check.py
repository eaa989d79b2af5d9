"""One short GRPO run on whatever accelerator is here, with a random-init model of a realistic size (no download):
prints rollout tokens/s, update tokens/s, peak accelerator memory and the sampler/trainer log-prob gap.

    python benchmarks/gpu_check.py                                  # 0.39 B Qwen2-shaped model, 1 GPU, 3 steps
    python benchmarks/gpu_check.py --strategy fsdp2 --devices 2     # FSDP2 (ModelParallelStrategy) on 2 GPUs
    python benchmarks/gpu_check.py --strategy fsdp1 --devices 2     # FSDP1 (FSDPStrategy) on 2 GPUs
    python benchmarks/gpu_check.py --cpu-smoke                      # the same code path, tiny shapes, on CPU

The model is Qwen2-0.5B-shaped (hidden 896, 24 layers, 14 heads, MLP 4864; embeddings tied) with the in-process test
tokenizer (vocabulary 512 instead of 151 936, so ~0.39 B parameters), LoRA r16 on all linear layers, the household env.
On a GPU the base is bf16 and the LoRA weights fp32 under ``precision="bf16-mixed"`` (the multi-GPU configs' setting).
"""

from __future__ import annotations

import argparse
import functools
import json
import time


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--strategy", choices=["auto", "ddp", "fsdp1", "fsdp2"], default="auto")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--groups", type=int, default=8, help="groups per step (per rank)")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-env-steps", type=int, default=6)
    ap.add_argument("--precision", default=None, help="trainer precision (default: bf16-mixed on GPU, 32-true on CPU)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU: checks the script end to end")
    ap.add_argument("--json", default=None, help="also write the numbers to this file")
    args = ap.parse_args(argv)
    if args.strategy == "fsdp1" and args.devices < 2:
        ap.error("--strategy fsdp1 needs --devices 2 or more: on one process torch's FSDP1 does not shard (NO_SHARD), "
                 "which fails on this model's tied embeddings")
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    import torch
    from lightning.pytorch import Trainer

    from sglightning.data import RolloutConfig
    from sglightning.envs.household import HouseholdEnv
    from sglightning.guidance import GuidanceConfig
    from sglightning.models import PolicyConfig, TinyModelConfig
    from sglightning.module import EvalConfig, GRPOConfig, SelfGuideModule
    from sglightning.update import UpdateConfig

    gpu = torch.cuda.is_available() and not args.cpu_smoke
    shape = (TinyModelConfig() if args.cpu_smoke else
             TinyModelConfig(hidden_size=896, num_layers=24, num_heads=14, intermediate_size=4864))
    groups, size, steps_env = ((1, 2, 2) if args.cpu_smoke else (args.groups, args.group_size, args.max_env_steps))
    module = SelfGuideModule(
        policy=PolicyConfig(name_or_path="embedded:tiny", tiny=shape, lora_r=16, lora_alpha=32,
                          dtype="bfloat16" if gpu else "float32"),
        env=functools.partial(HouseholdEnv, difficulty=1),
        rollout=RolloutConfig(groups_per_step=groups, group_size=size, max_steps=steps_env),
        guidance=GuidanceConfig(action_decoding="admissible", max_guidance_tokens=24, max_action_tokens=24),
        grpo=GRPOConfig(kl_coef=0.01),
        update=UpdateConfig(micro_batch_size=8),
        evaluation=EvalConfig(num_tasks=1),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-5),
    )
    strategy = args.strategy
    if strategy == "fsdp2":
        from sglightning.strategies import FSDP2Strategy

        strategy = FSDP2Strategy()
    elif strategy == "fsdp1":
        from sglightning.strategies import FSDP1Strategy

        strategy = FSDP1Strategy(state_dict_type="sharded")
    import tempfile

    trainer = Trainer(
        default_root_dir=tempfile.mkdtemp(prefix="sgl-gpu-check-"),
        accelerator="gpu" if gpu else "cpu", devices=args.devices, strategy=strategy,
        precision=args.precision or ("bf16-mixed" if gpu else "32-true"), max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0, num_sanity_val_steps=0,
    )
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.fit(module)
    hist = module.history
    rows = hist[1:] or hist  # the first step includes warm-up
    out = {
        "device": torch.cuda.get_device_name(0) if gpu else "cpu",
        "strategy": args.strategy, "devices": args.devices, "steps": len(hist),
        "params_M": _count_params(shape) / 1e6,  # the whole model (under FSDP each rank holds a shard)
        "episodes_per_step": hist[-1]["rollout/episodes"],
        "rollout_tokens_per_s": sum(r["tokens/generated"] for r in rows) / sum(r["time/rollout_s"] for r in rows),
        "update_tokens_per_s": sum(r.get("tokens/total", 0.0) for r in rows) / sum(r["time/update_s"] for r in rows),
        "logprob_gap_sampler_trainer": max(r.get("policy/logprob_gap_sampler_trainer", 0.0) for r in hist),
        "peak_memory_GB": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
        "wall_s": time.perf_counter() - t0,
    }
    if trainer.is_global_zero:
        print(json.dumps(out, indent=2))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)
    return out


def _count_params(shape) -> int:
    import torch

    from sglightning.models import build_tiny_model

    with torch.device("meta"):  # shapes only, no memory
        return sum(p.numel() for p in build_tiny_model(shape, 512).parameters())


if __name__ == "__main__":
    main()
