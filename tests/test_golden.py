"""The same seeds train the same adapters: two fixed tiny-model fits through the CLI, compared with fingerprints
recorded before the trainer's step was re-laid out (tests/fixtures/golden/*.json; the fingerprint of every adapter
tensor and the per-step numbers of the run).

Arm ``kl``: the tiny config as it was (single stream, constrained labels, admissible actions, a KL term).
Arm ``paths``: the other branches of one step — two_call prompts, free guidance and free JSON actions, the
invalid-action penalty, no KL, a guidance advantage scale, two PPO epochs, a reward term that varies within each
group (so the free-text episodes have something to train on), constant trust, dynamic sampling, ``drop_group``, no
shared prefixes, micro-batches of 3.
Arm ``wins``: pick-up tasks, of which the tiny model wins 13-38 % a step (recorded), so groups differ by the env's
reward and the adapters leave the base model. The learning rate is 10x, so the KL term is non-zero from the second
step. It also takes the k3 KL, the per-sequence loss mean, the dual clip, the calibration term and micro-batches by
token budget.

Arm ``kl`` was recorded again once, on purpose: a reason line cut at its cap is closed by one newline before
``Label:``, not two (31 fewer prompt tokens in its first step; nothing else moved: the arm passed with that line
reverted).

A change that alters what these steps compute moves these numbers far past the tolerance, which only absorbs float
rounding across CPUs (fp32). What they do not exercise (read from the recorded numbers): the ``kl`` arm's adapters
never leave the base model (its KL is 0: ``test_update_compute.py`` checks the KL against the base model), no episode
wins, and the ``paths`` arm's actions are all invalid (its penalty is one constant per group, which the advantages
cancel). Arm ``wins`` was added later to cover those. The golden runs guard the plumbing; the maths has by-hand tests
of its own."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from sglightning.cli import cli_main

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "fixtures" / "golden"

BASE = """
trainer:
  max_steps: 3
  accelerator: cpu
  devices: 1
  logger: false
  enable_progress_bar: false
  limit_val_batches: 0
model:
  policy: {name_or_path: "embedded:tiny", lora_r: 8, lora_alpha: 16}
  env:
    class_path: sglightning.envs.household.HouseholdEnv
    init_args: {difficulty: 0, info_actions: false}
  rollout: {groups_per_step: 2, group_size: 4, max_steps: 4, temperature: 1.0}
  guidance: {prompt_mode: single_stream, decoding: constrained, action_decoding: admissible,
             max_guidance_tokens: 8, max_action_tokens: 8}
  grpo: {kl_coef: 0.01}
  update: {micro_batch_size: 8}
  evaluation: {num_tasks: 4, tasks_per_batch: 4}
  optimizer:
    class_path: torch.optim.AdamW
    init_args: {lr: 1.0e-3}
"""

ARMS = {
    "kl": "",
    "paths": """
trainer: {max_steps: 6}
model:
  rollout: {max_steps: 3, dynamic_sampling_rounds: 1, failed_episodes: drop_group}
  guidance: {prompt_mode: two_call, decoding: free, action_decoding: free, actor_format: json}
  grpo: {kl_coef: 0.0, invalid_action_penalty: 0.1, guidance_advantage_scale: 0.5, trust_constant: 1.0, ppo_epochs: 2}
  update: {micro_batch_size: 3, share_prefix: false}
  reward_terms:
    - class_path: fakes.TextLengthBonus
""",
    "wins": """
trainer: {max_steps: 4}
model:
  env: {init_args: {task_types: [pick_up]}}
  grpo: {kl_coef: 0.05, kl_kind: k3, loss_agg: seq_mean_token_mean, dual_clip: 3.0, calibration: 0.5}
  update: {micro_batch_tokens: 1200}
  optimizer: {init_args: {lr: 1.0e-2}}
""",
}

#: logged per step and compared (the rollout's counts exactly, the rest to float rounding)
EXACT = ("rollout/episodes", "tokens/policy", "tokens/total", "tokens/zero_advantage_samples",
         "tokens/skipped_zero_advantage_samples", "rollout/dynamic_sampling_groups", "rollout/degenerate_groups")
CLOSE = ("rollout/success_rate", "rollout/invalid_action_rate", "reward/blended_return", "reward/internal_return",
         "loss/policy", "loss/kl", "policy/ratio_mean", "train/grad_norm")
#: compared where a fingerprint has them (recorded with arm ``wins``; the older fingerprints predate them)
LATER = ("loss/calibration", "loss/total", "loss/clip_frac", "loss/dual_clip_frac", "policy/entropy", "reward/lambda",
         "guidance/label_positive", "guidance/calibration_targets")


def fingerprint(module) -> dict:
    """Per adapter tensor: its sum, L2 norm and projection on a fixed random vector (float64); per step: the logged
    numbers above."""
    gen = torch.Generator().manual_seed(1234)
    tensors = {}
    for name, p in sorted(module.policy.named_parameters()):
        if p.requires_grad:
            v = p.detach().double().flatten()
            probe = torch.randn(v.numel(), generator=gen, dtype=torch.float64)
            tensors[name] = [float(v.sum()), float(v.norm()), float(v @ probe)]
    steps = [{k: h[k] for k in (*EXACT, *CLOSE, *LATER) if k in h} for h in module.history]
    return {"tensors": tensors, "steps": steps}


def run_arm(arm: str, tmp_path: Path) -> dict:
    base = tmp_path / "base.yaml"
    base.write_text(BASE)
    args = ["fit", "--config", str(base), f"--trainer.default_root_dir={tmp_path}", "--seed_everything=0"]
    if ARMS[arm]:
        extra = tmp_path / f"{arm}.yaml"
        extra.write_text(ARMS[arm])
        args += ["--config", str(extra)]
    return fingerprint(cli_main(args).model)


@pytest.mark.slow
@pytest.mark.parametrize("arm", sorted(ARMS))
def test_same_seed_same_adapters_as_recorded(arm, tmp_path, capsys):
    got = run_arm(arm, tmp_path)
    if arm == "paths":  # grpo.ppo_epochs 2: the bar counts optimiser steps, the summary says both
        out = capsys.readouterr().out
        assert "sglightning fit: 3 GRPO steps (6 optimiser steps: grpo.ppo_epochs 2)," in out
        assert "  time per GRPO step rollout " in out
    want = json.loads((GOLDEN / f"{arm}.json").read_text())
    assert len(got["steps"]) == len(want["steps"])
    for t, (g, w) in enumerate(zip(got["steps"], want["steps"])):
        assert g.keys() - set(LATER) == w.keys() - set(LATER), t
        assert w.keys() <= g.keys(), t
        for k in EXACT:
            if k in w:
                assert g[k] == w[k], (t, k)
        for k in (*CLOSE, *LATER):
            if k in w:
                assert math.isclose(g[k], w[k], rel_tol=1e-3, abs_tol=1e-6), (t, k, g[k], w[k])
    assert got["tensors"].keys() == want["tensors"].keys()
    moved = 0
    for name, w in want["tensors"].items():
        g = got["tensors"][name]
        for a, b in zip(g, w):
            assert math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-5), (name, g, w)
        moved += "lora_B" in name and w[1] > 0  # LoRA B starts at 0: a non-zero norm is training
    assert moved > 0
    if arm == "wins":  # what the arm is for, read from its record: wins that differ within groups, a KL term
        assert any(s["rollout/success_rate"] > 0 for s in want["steps"])
        assert any(s["rollout/degenerate_groups"] < 2 and s["train/grad_norm"] > 0 for s in want["steps"])
        assert all(s["loss/kl"] > 1e-3 for s in want["steps"][1:])
        assert any(s["loss/calibration"] > 0 for s in want["steps"])


if __name__ == "__main__":  # re-record the fingerprints (only for a change that means to alter what a step computes)
    import sys
    import tempfile

    if sys.argv[1:2] != ["record"] or not set(sys.argv[2:]) <= set(ARMS):
        sys.exit(f"usage: python tests/test_golden.py record [ARM ...]  (arms: {', '.join(sorted(ARMS))}; default all)")
    names = sys.argv[2:] or sorted(ARMS)
    sys.argv = sys.argv[:1]  # the CLI is driven with explicit args
    GOLDEN.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "tests"))  # fakes.TextLengthBonus, as under pytest
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            (GOLDEN / f"{name}.json").write_text(json.dumps(run_arm(name, Path(tmp)), indent=1, sort_keys=True))
        print(f"recorded {GOLDEN / name}.json")
