"""Resume: 4 steps straight == 2 steps, checkpoint, fresh process state, 2 more steps (same parameters, same
metrics)."""

from __future__ import annotations

import torch
from tiny import tiny_module, tiny_trainer

from sglightning.grpo import GRPOConfig

KEYS = ("rollout/success_rate", "reward/internal_sum", "reward/lambda", "loss/policy", "loss/kl", "tokens/policy")


def _lora(module):
    return {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}


def test_resume_from_checkpoint_is_exact(tmp_path):
    cfg = dict(grpo=GRPOConfig(kl_coef=0.01, total_steps=4))
    torch.manual_seed(0)
    straight = tiny_module(**cfg)
    tiny_trainer(tmp_path / "a", steps=4).fit(straight)

    torch.manual_seed(0)
    first = tiny_module(**cfg)
    trainer = tiny_trainer(tmp_path / "b", steps=2)
    trainer.fit(first)
    ckpt = tmp_path / "b" / "mid.ckpt"
    trainer.save_checkpoint(ckpt)
    # the checkpoint is plain tensors and containers: loadable with weights_only=True
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert state["sglightning"]["rollouts_done"] == 2 and all("lora_" in k for k in state["state_dict"])

    torch.manual_seed(123)  # a different process state: nothing may depend on it
    resumed = tiny_module(**cfg)
    tiny_trainer(tmp_path / "c", steps=4).fit(resumed, ckpt_path=str(ckpt))

    assert resumed.rollouts_done == 4
    a, b = _lora(straight), _lora(resumed)
    assert a.keys() == b.keys()
    for n in a:
        assert torch.allclose(a[n], b[n], atol=1e-6), n
    for h_straight, h_resumed in zip(straight.history[2:], resumed.history, strict=True):
        for k in KEYS:
            assert h_straight[k] == h_resumed[k] or abs(h_straight[k] - h_resumed[k]) < 1e-6, k
