"""The in-process engine's fixed-shape path: a static KV cache with one slot per lock step, and a decode step that
``torch.compile`` can capture as a CUDA graph.

Why.  On a GPU one decode step of a sub-billion model is a few milliseconds of kernels; launched one by one from
Python (and with a cache that grows by concatenation, copying every key and value each step) the launches take
longer than the kernels.  A CUDA graph replays the whole step with one launch, but it needs fixed shapes and fixed
addresses: a batch that does not shrink, a cache that does not move, a mask of fixed width.

How.  The rows advance in lock step, so every row writes the same cache *slot* at each step (a row with nothing to
write there writes a pad, masked out).  :class:`SlotCache` holds per layer keys and values ``[P, H_kv, C, d]`` for P
physical rows and C slots, written in place at the step's slots; the attention mask ``[P, 1, W, C]`` is built here
(a slot is seen if it holds a real token of the row and is not after the query's slot) and handed to the model as a
4-D mask, which transformers passes to attention as it is.  Positions are counted per row, as in the dynamic path.
Rows that end are not dropped: their physical row stays, unread.  P is the rows rounded up to a bucket and C grows
in steps (:func:`slot_capacity`).  The step is traced once with dynamic shapes (rows, slots read and capacity are
symbols; heads and head size are fixed), so a new row count or a longer context costs no new compile; a CUDA graph
is still recorded per distinct shape.

transformers' own ``StaticCache`` assumes one position counter for the whole batch and its update signature has
changed between releases; this cache needs only ``update(keys, values, layer_idx, ...)``, stable across them.
"""

from __future__ import annotations

import math
import types
import warnings
import weakref
from collections.abc import Callable

import torch
from torch._dynamo.utils import counters

from sglightning.compiling import constant_floats
from sglightning.errors import memory_error_within, summary

#: ``model.engine.compile`` values that take this path, and what each compiles
STATIC_MODES = ("static", "default", "reduce-overhead", "graphs")

#: attention reads the slots in use rounded up to a multiple of this (one captured graph per multiple reached),
#: not the whole cache: the cache keeps the longest rollout's capacity, which early steps would read in vain
VIEW_STEP = 256


def resolve_mode(setting: str, device: str, sharding: str | None, attention: str) -> str:
    """The decode step ``model.engine.compile: setting`` means for a model on ``device`` (a device type), under
    ``sharding`` (``fsdp1``, ``fsdp2`` or None), with attention implementation ``attention``: ``auto`` is
    ``reduce-overhead`` on one unsharded CUDA device with SDPA or eager attention, ``off`` elsewhere.  A compiled
    step needs weights that stay where they are (not FSDP's, gathered anew for every rollout) and every static mode
    an attention that takes a 4-D mask: anything else is a ConfigError naming the key."""
    from sglightning.errors import ConfigError

    if setting == "auto":
        ok = device == "cuda" and sharding is None and attention in ("sdpa", "eager")
        return "reduce-overhead" if ok else "off"
    if setting in STATIC_MODES and attention not in ("sdpa", "eager"):
        raise ConfigError(f"model.engine.compile: {setting} needs an attention that takes a 4-D mask (sdpa or eager); "
                          f"the model uses {attention}: set it to off")
    if setting in ("reduce-overhead", "graphs") and device != "cuda":
        raise ConfigError(f"model.engine.compile: {setting} replays CUDA graphs, and the model is on {device}: set it "
                          "to default, static or off")
    if setting in STATIC_MODES and setting != "static" and sharding is not None:
        raise ConfigError(f"model.engine.compile: {setting} captures the weights where they are, but under {sharding} "
                          "they are gathered anew for every rollout: set it to static or off")
    return setting


def _mark(t: torch.Tensor) -> None:
    """A cache tensor for a compiled step: a fixed address (a CUDA graph reads it in place) and sizes that may vary
    in rows and slots (one compile serves every row count and capacity)."""
    torch._dynamo.mark_static_address(t)
    torch._dynamo.mark_static(t, 1)
    torch._dynamo.mark_static(t, 3)


def reserved_slots(end: int) -> int:
    """The slots a cache must hold for a block ending at slot ``end``: the slots attention reads (``end`` rounded up
    to :data:`VIEW_STEP`) plus one, so that the view is always shorter than the cache and a compiled step meets one
    case, not two."""
    return -(-end // VIEW_STEP) * VIEW_STEP + 1


def slot_capacity(n: int) -> int:
    """The slots a cache gets for ``n``: a power of two up to 2 048 (at least 512), then a multiple of 512.  Doubling
    past that would leave up to half of a large cache unused (128 rows × 8 192 slots of Qwen3-4B's keys and values
    in bf16 take 144 GiB, where 4 608 slots, 81 GiB, were needed)."""
    return bucket(n, 512) if n <= 2048 else -(-n // 512) * 512


def bucket(n: int, smallest: int = 8) -> int:
    """``n`` rounded up to a power of two (at least ``smallest``): the physical rows or slots for ``n``."""
    b = smallest
    while b < n:
        b *= 2
    return b


try:  # the base class the models check for (transformers >= 4.36); its constructor differs between releases
    from transformers.cache_utils import Cache as _CacheBase
except ImportError:  # pragma: no cover
    _CacheBase = object


class SlotCache(_CacheBase):
    """Keys and values ``[P, H_kv, C, d]`` per layer, written in place at ``slots`` (set before each forward)."""

    is_compileable = True

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):  # noqa: D107
        # Cache.__init__ is not called: its signature differs between transformers releases, and nothing here
        # needs what it sets up (the model only calls update)
        self.keys, self.values = keys, values
        self.slots: torch.Tensor | None = None  # [W] the slots the forward writes
        self.rows: int | None = None  # the forward's rows are the first `rows` physical rows (None: all of them)
        self.view: int | None = None  # attention reads the first `view` slots (the mask's width; None: all)
        self.layers: list = []  # no per-layer objects (code that walks cache.layers finds none)

    @staticmethod
    def _shape(model: torch.nn.Module, rows: int, slots: int) -> tuple[int, tuple[int, int, int, int]]:
        """Layers and the shape of one layer's keys ``[P, H_kv, C, d]`` for ``model``."""
        cfg = model.config
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cfg.num_hidden_layers, (rows, heads, slots, head_dim)

    @classmethod
    def bytes_for(cls, model: torch.nn.Module, rows: int, slots: int, dtype: torch.dtype) -> int:
        """The bytes :meth:`allocate` would take: layers × 2 (keys, values) × P × H_kv × C × d × the dtype's size."""
        layers, shape = cls._shape(model, rows, slots)
        return 2 * layers * math.prod(shape) * dtype.itemsize

    @classmethod
    def allocate(cls, model: torch.nn.Module, rows: int, slots: int, dtype: torch.dtype, device: torch.device
                 ) -> SlotCache:
        """Zeroed buffers for ``rows`` × ``slots`` of ``model``'s shape, marked as static addresses for graphs."""
        layers, shape = cls._shape(model, rows, slots)
        keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        for t in keys + values:
            _mark(t)
        return cls(keys, values)

    @property
    def batch(self) -> int:
        """Physical rows."""
        return self.keys[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the block's keys/values ``[n, H_kv, W, d]`` at ``slots`` (n = ``rows`` or P); return the layer's
        first n rows and first ``view`` slots ``[n, H_kv, view, d]`` (the mask hides what is not to be read)."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self.rows is not None:
            keys, values = keys[: self.rows], values[: self.rows]  # views: written in place
        if self.view is not None:
            keys, values = keys[:, :, : self.view], values[:, :, : self.view]
        keys.index_copy_(2, self.slots, key_states.to(keys.dtype))
        values.index_copy_(2, self.slots, value_states.to(values.dtype))
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.capacity

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.capacity

    def copy_rows(self, dst: torch.Tensor, src: torch.Tensor, width: int) -> None:
        """Rows ``src`` of the first ``width`` slots into rows ``dst`` (a gather first: sources may be overwritten)."""
        for t in self.keys + self.values:
            t[dst, :, :width] = t[src, :, :width]

    def grow(self, slots: int) -> None:
        """Give every layer ``slots`` slots, its keys and values kept in the first ones.  In place and one tensor at
        a time: the old tensor is freed before the next new one is made, so memory peaks at the new size plus one
        layer's keys (a new cache beside the old would hold both whole)."""
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                new = torch.zeros(old.shape[:2] + (slots,) + old.shape[3:], dtype=old.dtype, device=old.device)
                new[:, :, : old.shape[2]] = old
                _mark(new)
                buffers[i] = new
                del old

    def nbytes_grown(self, slots: int) -> int:
        """The bytes :meth:`grow` to ``slots`` adds."""
        return self.nbytes() * (slots - self.capacity) // self.capacity


def block_mask(seen: torch.Tensor, start: int, width: int, additive: torch.dtype | None = None) -> torch.Tensor:
    """The 4-D attention mask of a block fed at slots ``start … start+width-1``: query q of row p sees slot c when
    ``seen[p, c]`` (a real token of the row, this block's included) and c ≤ start + q.  ``seen`` [P, C] bool.
    Returns bool [P, 1, W, C] (True = attend), or with ``additive`` a float mask of that dtype (0 / its minimum),
    for attention implementations that add the mask.

    A decode step (W = 1) takes ``seen`` as it is, a view: the session marks no slot after the block's as seen, so
    the causal condition holds already, and a step builds nothing."""
    if width == 1 and additive is None:
        return seen[:, None, None, :]  # [P, 1, 1, C]
    cols = torch.arange(seen.shape[1], device=seen.device)  # [C]
    rows = torch.arange(start, start + width, device=seen.device)  # [W]
    mask = seen[:, None, None, :] & (cols[None, :] <= rows[:, None])[None, None]  # [P, 1, W, C]
    if additive is None:
        return mask
    return torch.zeros(mask.shape, dtype=additive, device=seen.device).masked_fill_(~mask, torch.finfo(additive).min)


def decode_step(model: torch.nn.Module, cache_arg: str) -> Callable:
    """The forward of one block on a :class:`SlotCache` (its first ``rows`` physical rows, or all), returning the
    last position's logits [n, V] (float32).  Inputs with more rows than ``rows`` are cut here, inside the trace: a
    decode step's inputs keep every physical row, so that its shapes relate the same way whether all rows run or
    only the first few."""

    def step(ids, pos, mask, slots, cache, rows=None):
        if rows is not None:
            ids, pos, mask = ids[:rows], pos[:rows], mask[:rows]
        cache.slots, cache.rows, cache.view = slots, rows, mask.shape[-1]
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                    **{cache_arg: cache})
        return out.logits[:, -1].float()

    return step


def compiled(step: Callable, mode: str) -> CompiledStep:
    """``step`` compiled for ``model.engine.compile`` = ``mode`` (:class:`CompiledStep`)."""
    return CompiledStep(step, mode)


class CompiledStep:
    """``step`` compiled for ``model.engine.compile`` = ``mode``: ``static`` eager (no compile); ``default`` inductor;
    ``reduce-overhead`` inductor + CUDA graphs.  Traced with dynamic shapes (``dynamic=True``; the cache's heads and
    head size are marked static where it is allocated, so that a row count equal to one of them is not fused with
    it): one trace for the whole run.  The model's float attributes (norm epsilons, attention and LoRA scales) are
    traced as the constants they are: dynamic, each would be a CPU scalar input, copied to the GPU at every step and
    splitting its CUDA graph (:class:`sglightning.compiling.constant_floats`).

    Guards.  Before every call of a compiled function torch checks that what it traced still holds: the type and
    attributes of every module the forward touched, every weight's metadata, the inputs' sizes, the global state.
    For a model with LoRA on every projection that is several hundred checks per decoder layer: 1.4–3.1 ms per decode
    step at 24–36 layers on a 2-core Xeon (``benchmarks/step_guards.py``), longer than a GPU's whole step for a small
    model.  Within one call of a session (a ``run`` of programs, a ``feed``) nothing the module checks read changes.
    So a call whose inputs match, in shapes, strides and the rest of :func:`signature`, a call checked since
    :meth:`forget` runs under torch's ``skip_guard_eval_unsafe`` stance.  torch then skips the checks of modules and
    Python values (~97 % of them) and still checks tensor metadata, global state and sizes; where one of those fails
    it raises, and the call is checked instead.  Only while the step has one graph (a cautious rule: torch's
    remaining checks would choose between several).  Sessions call :meth:`forget` at the start of every ``run`` and
    ``feed``.  The stance is process-wide: no other compiled code runs beside a decode step (one rollout thread).

    If torch fails to compile the step (an error of its compiler, not of the step), the run goes on with the step
    uncompiled (the same tokens, slower) and says so once, naming the key: a rollout is not lost to a compiler bug."""

    def __init__(self, step: Callable, mode: str, skip_guards: bool = True):
        """``skip_guards``: False checks them at every call (benchmarks compare the two)."""
        self.step, self.mode, self.skip_guards = step, mode, skip_guards
        self._own = _own_code(step)
        self.fn = step if mode == "static" else torch.compile(self._own, dynamic=True,
                                                              mode=None if mode == "default" else mode)
        self.graphs = 0  # graphs torch traced in its checked calls (a trace broken in two counts twice)
        self.checked = 0  # calls whose guards torch checked
        self.skipped = 0  # calls that skipped most of them
        self._known: set[tuple] = set()  # the inputs' signatures checked since forget()

    def forget(self) -> None:
        """Check the guards again at the next call of each input signature (a new session call begins)."""
        self._known.clear()

    def __call__(self, *args, **kwargs):
        if self.fn is self.step:
            return self.step(*args, **kwargs)
        key = signature(args, kwargs)
        try:
            with constant_floats():
                if self.skip_guards and self.graphs == 1 and key in self._known:
                    try:
                        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                            out = self.fn(*args, **kwargs)
                        self.skipped += 1
                        return out
                    except RuntimeError as err:  # a remaining check failed: raised on entry, before the step ran
                        if "skip_guard_eval_unsafe" not in str(err):
                            raise
                        self._known.clear()
                traced = _traced()
                try:
                    out = self.fn(*args, **kwargs)
                finally:
                    self.graphs += _traced() - traced
                    if self.graphs == 1 and _graphs_held(self._own) not in (None, 1):
                        self.graphs = 2  # a nested frame was traced, not this one: never skip
                self.checked += 1
                self._known.add(key)
                return out
        except torch._dynamo.exc.TorchDynamoException as err:
            if (oom := memory_error_within(err)) is not None:
                raise oom from None  # the rollout's out-of-memory line, not a fallback
            warnings.warn(f"model.engine.compile: {self.mode} could not compile the decode step "
                          f"({summary(err)}); it runs uncompiled from here (set model.engine.compile "
                          "to static to skip the attempt)", RuntimeWarning, stacklevel=2)
            self.fn = self.step  # the cache writes of a failed call are the same ones again: safe to repeat
            return self.step(*args, **kwargs)


class GraphedStep:
    """``model.engine.compile: graphs`` (CUDA): the inductor-compiled step (a :class:`CompiledStep` in ``default``
    mode) captured by the engine as one CUDA graph per input signature, and replayed with nothing of torch's in
    between.  ``reduce-overhead`` replays graphs too, but each call still passes torch's Python: the guards (mostly
    skipped, :class:`CompiledStep`), the gathering of every weight as an input, the graph trees' bookkeeping.  On
    a 2-core CPU that Python outside the compiled code was 0.9–2.5 ms per call at 24–36 layers; here a call is four
    small copies into the graph's input buffers and a replay.  This is how vLLM runs its compiled model.

    A signature's first call in a session call runs the compiled step (it compiles, checks, warms up); its next call
    captures the graph (:class:`CudaGraph`): inputs in buffers of the same layout, the output written into a buffer
    kept outside the graphs (every graph writes the same one, so graphs share a memory pool without holding an
    output each).  A signature captured already replays from its first call.  The graphs read the weights and the
    slot cache where they were: :meth:`forget` (at each session call) drops every graph if a weight or buffer has
    moved, a lookup drops a graph whose cache is gone, and with no graph left the next capture takes a new pool.
    A capture that fails (a step that fell back to eager, a trace in pieces) ends the captures: the compiled step
    runs from then on, with one warning.  Behind its own switch until measured on a GPU (``gpu_session.sh`` part
    10)."""

    def __init__(self, step: CompiledStep, model: torch.nn.Module):  # noqa: D107
        self.step, self.model = step, model
        self.captured = self.replayed = 0
        self.failed = False  # a capture failed: no more captures
        self._entries: dict[tuple, tuple] = {}  # key -> (graph, input buffers, output, cache tensor ref)
        self._warm: dict[tuple, tuple] = {}  # key -> the output's (shape, dtype, device), run once since forget()
        self._outputs: dict[tuple, torch.Tensor] = {}  # (shape, dtype, device) -> the buffer every graph writes
        self._weights: list[int] | None = None  # the addresses of the weights and buffers the graphs read
        self._pool = None  # the graphs' memory pool (a new one once no graph is left)

    def forget(self) -> None:
        """A session call begins: warm-ups count anew, and graphs that would read moved weights go."""
        self.step.forget()
        self._warm.clear()
        where = [t.data_ptr() for t in (*self.model.parameters(), *self.model.buffers())]
        if where != self._weights:
            self._entries.clear()
            self._weights = where

    def __call__(self, ids, pos, mask, slots, cache, rows=None):
        key = (signature((ids, pos, mask, slots, cache, rows), {}), self.model.training, torch.is_autocast_enabled())
        entry = self._entries.get(key)
        if entry is not None and entry[3]() is not cache.keys[0]:  # a new cache where a freed one was
            del self._entries[key]
            entry = None
        if entry is not None:
            for buffer, new in zip(entry[1], (ids, pos, mask, slots)):
                buffer.copy_(new)
            entry[0].replay()
            self.replayed += 1
            return entry[2]
        ready = not self.failed and self.step.fn is not self.step.step and self.step.graphs == 1
        if key not in self._warm or not ready:
            out = self.step(ids, pos, mask, slots, cache, rows)
            self._warm[key] = (out.shape, out.dtype, out.device)
            return out
        return self._capture(key, (ids, pos, mask, slots), cache, rows)

    def _capture(self, key: tuple, inputs: tuple, cache: SlotCache, rows: int | None) -> torch.Tensor:
        """Capture ``key``'s graph.  The capture runs the step once as well (:meth:`CudaGraph.capture`): its output
        is this call's."""
        self._entries = {k: e for k, e in self._entries.items() if e[3]() is not None}  # caches gone: graphs go
        if not self._entries:
            self._pool = None  # a pool whose graphs are all gone is not used again
        buffers = tuple(_same_layout(t) for t in inputs)
        for buffer, new in zip(buffers, inputs):
            buffer.copy_(new)
        shape, dtype, device = self._warm[key]
        out = self._outputs.get((shape, dtype, device))
        if out is None:
            out = self._outputs[(shape, dtype, device)] = torch.empty(shape, dtype=dtype, device=device)
        try:
            if self._pool is None:
                self._pool = graph_pool()
            graph = CudaGraph(self._pool)
            graph.capture(lambda: out.copy_(self.step(*buffers, cache, rows)))
        except Exception as err:  # noqa: BLE001 (any failure of a capture ends the captures, not the rollout)
            self.failed = True
            warnings.warn(f"model.engine.compile: graphs could not capture the decode step ({summary(err)}); the "
                          "compiled step runs from here", RuntimeWarning, stacklevel=3)
            return self.step(*inputs, cache, rows)
        self.captured += 1
        self._entries[key] = (graph, buffers, out, weakref.ref(cache.keys[0]))
        return out


def graph_pool():
    """A new memory pool for CUDA graphs (tests replace it)."""
    return torch.cuda.graph_pool_handle()


class CudaGraph:
    """One ``torch.cuda.CUDAGraph`` in ``pool``.  A capture first runs the function on the capture's own stream (its
    libraries' workspaces made there now, outside the pool; the function's effects done once), then records it.
    torch's ``torch.cuda.graph`` context is not used: it empties the allocator's cache at every capture.  Tests
    replace this class with one that runs the function instead of recording it."""

    _stream = None  # one side stream for every capture

    def __init__(self, pool) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], object]) -> None:
        if CudaGraph._stream is None:
            CudaGraph._stream = torch.cuda.Stream()
        side, current = CudaGraph._stream, torch.cuda.current_stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            fn()
            torch.cuda.synchronize()
            # thread_local: a CUDA call of another thread (a compile worker, a collective's watchdog) does not void it
            self.graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                fn()
            finally:
                self.graph.capture_end()
        current.wait_stream(side)

    def replay(self) -> None:
        self.graph.replay()


def _same_layout(t: torch.Tensor) -> torch.Tensor:
    """A new tensor laid out as ``t``: shape, strides and offset, within a base of its base's shape (a compiled
    step's guards read a view's base too)."""
    base = t._base if t._base is not None else t
    new = torch.empty_strided(base.shape, base.stride(), dtype=t.dtype, device=t.device)
    return new.as_strided(t.shape, t.stride(), t.storage_offset() - base.storage_offset())


def _own_code(step: Callable) -> Callable:
    """``step`` with a code object of its own.  torch keeps compiled graphs per code object, so steps of other models
    (closures of the same function) would add theirs to this step's: its graph count would not be its own."""
    code = getattr(step, "__code__", None)
    if code is None:
        return step
    return types.FunctionType(code.replace(), step.__globals__, step.__name__, step.__defaults__, step.__closure__)


def _graphs_held(fn: Callable) -> int | None:
    """The graphs torch holds for ``fn``'s code object (None where this torch cannot say)."""
    get = getattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list", None)
    code = getattr(fn, "__code__", None)
    return None if get is None or code is None else len(get(code))


def _traced() -> int:
    """Frames torch has traced in this process (each one a graph)."""
    return counters["frames"]["ok"]


def signature(args: tuple, kwargs: dict) -> tuple:
    """What a compiled step's guards may read of a call, besides the model and the process's state: each tensor's
    shape, strides, offset, dtype and device (and its base's shape and strides, for a view), a slot cache's identity
    and its tensors', every other argument as it is; and the grad and inference modes."""
    out: list = [torch.is_grad_enabled(), torch.is_inference_mode_enabled(), tuple(kwargs)]
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            base = a._base
            out.append((a.shape, a.stride(), a.storage_offset(), a.dtype, a.device,
                        None if base is None else (base.shape, base.stride())))
        elif isinstance(a, SlotCache):
            out.append((id(a), id(a.keys[0]), a.keys[0].shape))
        else:
            out.append(a)
    return tuple(out)
