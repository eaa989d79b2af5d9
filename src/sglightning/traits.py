"""What a loaded model does that the sampler, the scorer and the update must match.

The in-process engine samples from the model's own logits; the update scores the same tokens again. The two agree
only if both apply the LM head as the model does and pass the KV cache under the model's keyword. They must also
know whether a layer sees a sliding window, and whether a forward in train mode is random. Each answer comes from
the loaded model: its config, its forward's signature, one 8-token probe. A family's name is never read. Loading
the model is :mod:`sglightning.models`' part.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
import weakref

import torch


def sliding_window(model) -> int | None:
    """The window of ``model``'s sliding-window (or chunked) attention layers, None where every layer sees the whole
    context.  Such layers count cache slots, pads included: padding inside a row shifts their window, so the
    in-process engine and prefix sharing cannot score them exactly (``docs/method.md``)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    config = getattr(config, "text_config", None) or config  # multimodal wrappers keep the text model's config apart
    window = getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None)
    kinds = getattr(config, "layer_types", None)
    if kinds is not None:
        return window if any(k in ("sliding_attention", "chunked_attention") for k in kinds) else None
    local = getattr(config, "attention_layers", None)  # GPT-Neo: "global" and "local" layers, windowed by slot
    if local is not None and "local" in local:
        return getattr(config, "window_size", None)
    return window if getattr(config, "use_sliding_window", True) else None  # Qwen2: a window, switched off



@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    """``model`` in eval mode inside (no dropout: as a sampler runs), the mode it had restored after, even on error."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def head_logits(base: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head on decoder states ``hidden`` [M, H] as the model's forward applies it: the output embedding, then
    what the family does to its logits (tanh soft-capping: Gemma 2 and 3; × ``logit_scale``: Cohere; ÷
    ``logits_scaling``: Granite).  The sampler reads the model's own logits; :func:`head_is_exact` checks this."""
    logits = base.get_output_embeddings()(hidden)  # [M, V]
    cfg = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    if cap := getattr(cfg, "final_logit_softcapping", None):
        logits = torch.tanh(logits / cap) * cap
    if scale := getattr(cfg, "logit_scale", None):
        logits = logits * scale
    if scaling := getattr(cfg, "logits_scaling", None):
        logits = logits / scaling
    return logits


_HEAD_EXACT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@torch.no_grad()
def head_is_exact(policy: torch.nn.Module) -> bool:
    """Whether :func:`head_logits` on the decoder's states gives ``policy``'s own logits (checked once per model, on 8
    tokens, in eval mode).  A family that changes its logits in a way it does not know is scored through the whole
    model instead (``scoring.token_logprobs``: ``logits_to_keep``, no shared prefixes): slower, but what was sampled."""
    if policy not in _HEAD_EXACT:
        base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
        emb = base.get_input_embeddings()
        ids = (torch.arange(1, 9, device=emb.weight.device) % emb.num_embeddings)[None]  # [1, 8]
        with eval_mode(policy):
            want = policy(input_ids=ids, use_cache=False).logits.float()  # [1, 8, V]
            got = head_logits(base, base.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state).float()
        _HEAD_EXACT[policy] = bool(torch.allclose(got, want, rtol=1e-3, atol=1e-4 * float(want.abs().max()) + 1e-6))
    return _HEAD_EXACT[policy]


def drops_out(model: torch.nn.Module) -> bool:
    """Whether a forward in train mode can differ from one in eval mode: a dropout layer with p > 0 (LoRA's
    included), or a rate above 0 in the model's config, its sub-configs included, for dropout, dropped layers
    (LayerDrop, drop path) or noise (attention dropout and a router's jitter are calls, not layers)."""
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    cfg = getattr(model, "config", None)

    def random(d: dict) -> bool:
        for k, v in d.items():
            if isinstance(v, dict) and random(v):
                return True
            rate = isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
            if rate and isinstance(k, str) and any(w in k for w in ("dropout", "pdrop", "jitter", "noise", "layerdrop",
                                                                    "drop_path")):
                return True
        return False

    return random(cfg.to_dict()) if hasattr(cfg, "to_dict") else False


def warn_low_precision_adapters(policy: torch.nn.Module) -> None:
    """Adam steps of ~lr on bf16/fp16 weights round away once |w| ≳ lr / 2⁻⁸ (bf16 keeps 8 significant bits): with
    the paper's lr 1e-6 LoRA A (|w| ~ 1e-2) would never move.  LoRA weights are kept in fp32 (peft casts them up);
    this warns when they are not (e.g. after ``trainer.precision: bf16-true``)."""
    low = sorted({str(p.dtype) for p in policy.parameters() if p.requires_grad
                  and p.dtype in (torch.bfloat16, torch.float16)})
    if low:
        warnings.warn(
            f"the trainable (LoRA) weights are {', '.join(low)}: small optimiser steps are rounded away in half "
            f"precision. Keep them fp32: model.policy.dtype sets only the frozen base; use trainer.precision "
            f"bf16-mixed, not bf16-true (which casts every weight to bf16)",
            RuntimeWarning,
            stacklevel=3,
        )



def cache_argument_name(model: torch.nn.Module) -> str:
    """``cache`` (transformers >= 5.x) or ``past_key_values`` (older): the forward's KV-cache keyword."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft wrapper -> HF model
    params = inspect.signature(type(base).forward).parameters
    return "cache" if "cache" in params else "past_key_values"
