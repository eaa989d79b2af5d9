"""The update's decoder layers compiled (``model.update.compile``): why, and why only there.

In eager mode each decoder layer of a training forward and backward runs dozens of small element-wise kernels: the
RMSNorms, the rotary embedding, SiLU times the up projection, LoRA's scale-and-add on every adapted projection, the
residual adds.  Each reads and writes a whole ``[B, L, H]`` (or ``[B, L, I]``) tensor, so on a CPU they cost as much
as a third of an update, and on a GPU, where the matrix products run on tensor cores, more.  ``torch.compile``
(inductor) fuses them.  Every layer of a model reuses one graph per kind of call (their parameters are inputs of the
graph, not constants), traced with dynamic shapes so that a new micro-batch length costs no new compile.

Shared prefixes (``update.share_prefix``) pass a prefix's keys and values to each layer through transformers' cache
object.  Traced as it is, the cache's ``update(keys, values, layer_idx)`` indexes a list by the layer's index, so
torch would guard on that index and compile one graph per layer.  Instead, each compiled layer sees a
:class:`LayerCache`: its own layer's earlier keys and values as plain tensors, looked up before the call.  The keys
and values its attention used become the real cache's after the call, outside the graph.  The rollout is untouched:
the layers are swapped in for the update and swapped back after it (the engine compiles its own decode step:
``model.engine.compile``).

A compiler error (not an error of the layer) falls back to the eager layers for the rest of the run, with one
warning naming the key: an update is not lost to a compiler bug.  More kinds of call than ``_RECOMPILE_LIMIT`` graphs:
the new kinds run eagerly, also said once.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Iterator

import torch

from sglightning.errors import memory_error_within, summary

#: the attribute of a layer that holds its compiled forward (made once, reused by every update)
_COMPILED = "_sglightning_compiled_forward"


class constant_floats:  # noqa: N801 (a context manager, used as a function)
    """Within the block, torch.compile traces Python floats (a norm's epsilon, attention and LoRA scales) as
    constants.  With ``dynamic=True`` it would make each a graph input, a CPU float64 scalar, ~10 per decoder layer.
    Inductor then copies each to the GPU at every call, and with graph partitioning (its default) each copy splits
    the CUDA graph: many pieces with host work between them instead of one replay (without partitioning, no graph
    at all).  Entered at every decode step, so it uses torch's low-overhead patcher (~2 µs; ``config.patch`` takes
    ~14 µs).  One instance may be entered again inside itself."""

    _change = None

    def __init__(self) -> None:
        self._reverts: list[Callable[[], None]] = []

    def __enter__(self) -> None:
        if constant_floats._change is None:
            config = torch._dynamo.config
            maker = getattr(config, "_make_closure_patcher", None)
            constant_floats._change = (maker(specialize_float=True) if maker is not None
                                       else lambda: _patched(config.patch(specialize_float=True)))
        self._reverts.append(constant_floats._change())

    def __exit__(self, *exc) -> None:
        self._reverts.pop()()


def _patched(patch) -> Callable[[], None]:
    """``patch`` entered; returns its exit (torch releases without the closure patcher)."""
    patch.__enter__()
    return lambda: patch.__exit__(None, None, None)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a causal LM however it is wrapped (peft, FSDP1, activation checkpointing): the modules
    whose class name ends in ``DecoderLayer`` (transformers' naming for every decoder family)."""
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


#: the keyword a decoder layer takes its cache by (transformers >= 5.20: ``cache``; before: ``past_key_values``)
_CACHE_KEYWORDS = ("cache", "past_key_values")


class LayerCache:
    """One layer's view of a KV cache, as a compiled layer sees it: no layer index, no list of layers.

    ``update(keys, values, layer_idx, ...)`` returns the earlier keys/values ``[B, kv heads, P, d]`` (None: none yet)
    concatenated with the new ones ``[B, kv heads, T, d]`` along positions, as transformers' dynamic layer does, and
    keeps that result in ``full`` for :func:`_cached_call` to put in the real cache.  The index is ignored, so a trace
    never reads it and every layer reuses one graph."""

    def __init__(self, keys: torch.Tensor | None, values: torch.Tensor | None) -> None:
        self.keys, self.values = keys, values
        self.full: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is not None:
            keys, values = torch.cat([self.keys, keys], dim=-2), torch.cat([self.values, values], dim=-2)
        self.full = (keys, values)
        return keys, values


def _layer_index(layer: torch.nn.Module) -> int | None:
    """The index the layer's attention passes to the cache (``self_attn.layer_idx`` in transformers)."""
    for m in layer.modules():
        idx = getattr(m, "layer_idx", None)
        if isinstance(idx, int):
            return idx
    return None


def _plain_layer(cache, idx: int):
    """The cache's layer ``idx`` when it is transformers' plain dynamic layer (keys grow by concatenation), else
    None: a sliding-window, quantised or offloaded layer keeps the eager path."""
    layers = getattr(cache, "layers", None)
    if getattr(cache, "offloading", False) or not isinstance(layers, list) or idx >= len(layers):
        return None
    layer = layers[idx]
    return layer if type(layer).__name__ == "DynamicLayer" else None


def _cache_keyword(layer: torch.nn.Module) -> str | None:
    """The keyword the layer's forward takes a cache by, or None."""
    params = inspect.signature(type(layer).forward).parameters
    return next((k for k in _CACHE_KEYWORDS if k in params), None)


def _cached_call(layer: torch.nn.Module, compiled, eager):
    """``layer``'s compiled forward, its cache passed as a :class:`LayerCache` of this layer; what the layer's
    attention made of it (earlier and new keys/values) becomes the real cache's layer after the call.  The tensors are
    the ones attention keeps for the backward, so the cache costs no second copy.  A cache layer of another kind
    (sliding window, quantised, offloaded): the eager forward."""
    idx, key = _layer_index(layer), _cache_keyword(layer)
    if idx is None or key is None:
        return compiled

    def run(*args, **kwargs):
        cache = kwargs.get(key)
        if cache is None:
            return compiled(*args, **kwargs)
        held = _plain_layer(cache, idx)
        if held is None:
            return eager(*args, **kwargs)
        keys = getattr(held, "keys", None) if getattr(held, "is_initialized", True) else None
        seen = keys is not None and keys.numel() > 0
        view = LayerCache(keys if seen else None, held.values if seen else None)
        out = compiled(*args, **{**kwargs, key: view})
        if view.full is not None:
            if not getattr(held, "is_initialized", True):
                held.lazy_initialization(*view.full)
            held.keys, held.values = view.full
        return out

    return run


#: graphs the layers' forward may compile (torch's default is 8).  Each kind of call is one: first layer or later
#: (the first one's input needs no gradient), prefix or continuation, training or a no-grad pass, a batch of one row
#: or more (torch specialises sizes 0 and 1)
_RECOMPILE_LIMIT = 32


class _Fallback:
    """Shared by one model's layers: after a compiler error every layer runs eagerly, and one warning says so."""

    def __init__(self) -> None:
        self.failed = False  # a compiler error: every layer eager from here
        self.full = False  # the graph limit reached: new kinds of input eager (said once)

    def wrap(self, compiled, eager):
        def run(*args, **kwargs):
            if self.failed:
                return eager(*args, **kwargs)
            limit = max(_RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit)
            # past the limit torch runs new kinds of call uncompiled and prints a paragraph; here: one warning
            loud = not torch._dynamo.config.suppress_errors
            try:
                with torch._dynamo.config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=loud), \
                        constant_floats():
                    return compiled(*args, **kwargs)
            except torch._dynamo.exc.FailOnRecompileLimitHit:
                if not self.full:
                    self.full = True
                    warnings.warn(f"model.update.compile: the decoder layers met more kinds of input than {limit} "
                                  "compiled graphs hold; inputs of new kinds run uncompiled", RuntimeWarning,
                                  stacklevel=2)
                return eager(*args, **kwargs)
            except torch._dynamo.exc.TorchDynamoException as err:
                if (oom := memory_error_within(err)) is not None:
                    raise oom from None  # the update's out-of-memory line, not a fallback
                self.failed = True
                warnings.warn(f"model.update.compile: torch could not compile the decoder layers "
                              f"({summary(err)}); the update runs them uncompiled from here (set "
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
            compiled = fallback.wrap(torch.compile(eager, dynamic=True), eager)
            layer.__dict__[_COMPILED] = _cached_call(layer, compiled, eager)
        layer.forward = layer.__dict__[_COMPILED]
    try:
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
