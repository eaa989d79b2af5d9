"""The update's decoder layers compiled (``model.update.compile``): why, and why only there.

In eager mode each decoder layer of a training forward and backward runs dozens of small element-wise kernels: the
RMSNorms, the rotary embedding, SiLU times the up projection, LoRA's scale-and-add on every adapted projection, the
residual adds.  Each reads and writes a whole ``[B, L, H]`` (or ``[B, L, I]``) tensor, so on a CPU they cost as much
as a third of an update, and on a GPU, where the matrix products run on tensor cores, more.  ``torch.compile``
(inductor) fuses them: one compile per layer *kind*, reused by every layer (their parameters are inputs of the graph,
not constants), traced with dynamic shapes so that a new micro-batch length costs no new compile.

Only where the rows are computed whole: with ``update.share_prefix`` a prefix's keys and values pass through
transformers' cache object into each layer, and the layer index it carries would make a graph per layer.  The
rollout is untouched: the layers are swapped in for the update and swapped back after it (the engine compiles its
own decode step: ``model.engine.compile``).

A compiler error (not an error of the layer) falls back to the eager layers for the rest of the run, with one
warning naming the key: an update is not lost to a compiler bug.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

#: the attribute of a layer that holds its compiled forward (made once, reused by every update)
_COMPILED = "_sglightning_compiled_forward"


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a causal LM however it is wrapped (peft, FSDP1, activation checkpointing): the modules
    whose class name ends in ``DecoderLayer`` (transformers' naming for every decoder family)."""
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


class _Fallback:
    """Shared by one model's layers: after a compiler error every layer runs eagerly, and one warning says so."""

    def __init__(self) -> None:
        self.failed = False

    def wrap(self, compiled, eager):
        def run(*args, **kwargs):
            if self.failed:
                return eager(*args, **kwargs)
            try:
                return compiled(*args, **kwargs)
            except torch._dynamo.exc.TorchDynamoException as err:
                self.failed = True
                first = (str(err).strip().splitlines() or [""])[0][:200]
                warnings.warn(f"model.update.compile: torch could not compile the decoder layers "
                              f"({type(err).__name__}: {first}); the update runs them uncompiled from here (set "
                              "model.update.compile to false to skip the attempt)", RuntimeWarning, stacklevel=2)
                return eager(*args, **kwargs)

        return run


@contextlib.contextmanager
def compiled_layers(model: torch.nn.Module, on: bool) -> Iterator[None]:
    """Within the block, each decoder layer of ``model`` runs its forward compiled (inductor, dynamic shapes); on
    exit the eager forwards are back.  ``on`` false: nothing changes.  The compiled forwards are made on first use
    and kept on the layers."""
    if not on:
        yield
        return
    layers = decoder_layers(model)
    fallback = getattr(model, "_sglightning_compile_fallback", None) or _Fallback()
    model._sglightning_compile_fallback = fallback
    for layer in layers:
        if _COMPILED not in layer.__dict__:
            eager = type(layer).forward.__get__(layer)
            layer.__dict__[_COMPILED] = fallback.wrap(torch.compile(eager, dynamic=True), eager)
        layer.forward = layer.__dict__[_COMPILED]
    try:
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
