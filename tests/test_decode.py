"""The in-process engine's GPU-grade parts, checked on CPU: the batched draw against row-by-row sampling, the slot
cache (static shapes, one slot per lock step) against the dynamic cache, the compiled decode step, the mask by hand,
and which decode step ``model.engine.compile`` chooses where."""

from __future__ import annotations

import contextlib
import functools
import types

import pytest
import torch

from sglightning.data import RolloutConfig
from sglightning.embedded import TinyModelConfig
from sglightning.engines import EngineConfig
from sglightning.engines.builtin import BuiltinEngine, SlotPool
from sglightning.engines.draw import RestrictionTable, draw
from sglightning.engines.program import Free
from sglightning.engines.static import SlotCache, block_mask, bucket, resolve_mode, slot_capacity
from sglightning.envs.household import HouseholdEnv
from sglightning.episodes import Restriction
from sglightning.errors import ConfigError
from sglightning.guidance import GuidanceConfig
from sglightning.metrics import engine_logs
from sglightning.models import PolicyConfig, load_policy
from sglightning.rollout import Rollout


class EndsEarlyEnv(HouseholdEnv):
    """The household, ended (lost) after ``seed % 3 + 1`` steps: rows of one batch end at different steps."""

    def reset(self, seed: int, split: str = "train"):
        self._left = seed % 3 + 1
        return super().reset(seed, split)

    def step(self, action: str):
        out = super().step(action)
        self._left -= 1
        if self._left <= 0 and not out.done:
            out.done = True
        return out


ENV = functools.partial(EndsEarlyEnv, difficulty=0, info_actions=False)


@pytest.fixture(scope="module")
def tiny():
    return load_policy(PolicyConfig(name_or_path="embedded:tiny"))


def _row_by_row(logp_row: torch.Tensor, r: Restriction | None, top_k: int, gen: torch.Generator):
    """One row sampled the plain way (what the engine did before its draws were batched)."""
    scores = logp_row.clone()
    if r is not None:
        listed = torch.zeros_like(scores, dtype=torch.bool)
        listed[list(r.ids)] = True
        scores[listed if r.exclude else ~listed] = float("-inf")
    if top_k and (r is None or r.exclude):
        k = min(top_k, int(torch.isfinite(scores).sum()))
        top = torch.topk(scores, k).indices
        r = Restriction(tuple(sorted(int(t) for t in top)))
        keep = torch.full_like(scores, float("-inf"))
        keep[top] = logp_row[top]
        scores = keep
    tok = int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=gen))
    full = float(logp_row[tok])
    if r is None:
        return tok, full, full, None
    mass = torch.logsumexp(scores if r.exclude else logp_row[list(r.ids)], dim=0)  # log Z(A), summed over A
    return tok, full - float(mass), full, r


@pytest.mark.parametrize("top_k", [0, 5])
def test_a_batched_draw_is_row_by_row_sampling(top_k):
    """Rows with no restriction, a choice among a few tokens, an exclusion of many, and top-k: the batched draw
    takes the tokens row-by-row sampling takes from the same generator (bit for bit on CPU), the same log q and
    log π (1e-6), and records the same restriction (top-k: the set actually sampled from)."""
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(9, 300, generator=g) * 3, dim=-1)  # [R, V]
    choice, ban = Restriction((3, 17, 250)), Restriction(tuple(range(0, 300, 2)), exclude=True)
    rs = [None, choice, ban, None, Restriction((42,)), ban, choice, None, Restriction(tuple(range(10)), True)]
    every = [choice, ban, Restriction((42,)), ban, choice, ban, choice, choice, Restriction(tuple(range(10)), True)]
    table = RestrictionTable()  # kept across draws, as the engine keeps it (its tables are reused)
    for rows in (rs, every, [ban] * 9, [choice] * 9):  # some rows free; every row restricted; one set for all
        for seed in range(5):
            got = draw(logp, rows, top_k, False, torch.Generator().manual_seed(seed), table)
            gen = torch.Generator().manual_seed(seed)
            want = [_row_by_row(logp[i], r, top_k, gen) for i, r in enumerate(rows)]
            for (t, q, f, r), (t2, q2, f2, r2) in zip(got, want):
                assert t == t2 and r == r2
                assert q == pytest.approx(q2, abs=1e-6) and f == pytest.approx(f2, abs=1e-6)
    assert len(table._tables) == 3  # one per sequence of distinct sets (the first two meet the same four, in order)
    greedy = draw(logp, rs, top_k, True, None)
    assert [t for t, *_ in greedy][:2] == [int(logp[0].argmax()), max((3, 17, 250), key=lambda i: float(logp[1, i]))]


def test_block_mask_by_hand():
    """Query q of a block at slots 3..4 sees the row's real slots up to its own."""
    seen = torch.tensor([[1, 1, 0, 1, 1, 0], [1, 0, 1, 0, 1, 0]], dtype=torch.bool)  # [P=2, C=6]
    m = block_mask(seen, 3, 2)  # [2, 1, 2, 6]
    assert m.shape == (2, 1, 2, 6)
    assert m[0, 0, 0].tolist() == [True, True, False, True, False, False]  # slot 3's query: not slot 4
    assert m[0, 0, 1].tolist() == [True, True, False, True, True, False]
    assert m[1, 0, 0].tolist() == [True, False, True, False, False, False]  # slot 3 is this row's pad
    add = block_mask(seen, 3, 2, torch.float32)
    assert add[0, 0, 0, 0] == 0 and add[0, 0, 0, 2] == torch.finfo(torch.float32).min


def test_compile_auto_is_graphs_on_one_cuda_device_only():
    assert resolve_mode("auto", "cpu", None, "sdpa") == "off"
    assert resolve_mode("auto", "cuda", None, "sdpa") == "reduce-overhead"
    assert resolve_mode("auto", "cuda", "fsdp2", "sdpa") == "off"  # gathered weights move every rollout
    assert resolve_mode("auto", "cuda", None, "flash_attention_2") == "off"  # takes no 4-D mask
    assert resolve_mode("static", "cuda", "fsdp2", "sdpa") == "static"
    with pytest.raises(ConfigError, match="model.engine.compile: reduce-overhead captures the weights where they"):
        resolve_mode("reduce-overhead", "cuda", "fsdp1", "sdpa")
    with pytest.raises(ConfigError, match="model.engine.compile: reduce-overhead replays CUDA graphs, and the model is "
                       "on cpu"):
        resolve_mode("reduce-overhead", "cpu", None, "sdpa")
    assert resolve_mode("default", "cpu", None, "sdpa") == "default"
    with pytest.raises(ConfigError, match="model.engine.compile: static needs an attention that takes a 4-D mask"):
        resolve_mode("static", "cuda", None, "flash_attention_2")
    with pytest.raises(ValueError, match="model.engine.compile: 'fast' is not one of auto, off"):
        EngineConfig(compile="fast")
    assert [bucket(n) for n in (1, 8, 9, 100)] == [8, 8, 16, 128]


def test_a_slot_cache_grows_in_place_without_losing_what_it_holds(tiny):
    """``grow`` replaces each layer's tensors in the same cache object (the pool's entry and the session see the new
    ones; memory peaks at the new size plus one layer); its sizes are those ``bytes_for`` and ``nbytes_grown`` say."""
    model, _ = tiny
    cache = SlotCache.allocate(model, 2, 4, torch.float32, torch.device("cpu"))
    assert cache.nbytes() == SlotCache.bytes_for(model, 2, 4, torch.float32)
    for t in cache.keys + cache.values:
        t.normal_()
    before = [t.clone() for t in cache.keys + cache.values]
    added = cache.nbytes_grown(8)
    cache.grow(8)
    assert cache.capacity == 8 and cache.batch == 2 and cache.nbytes() == 2 * added
    assert all(torch.equal(n[:, :, :4], o) and not n[:, :, 4:].any() for n, o in zip(cache.keys + cache.values, before))
    # powers of two up to 2 048, then multiples of 512: 4 353 slots take 4 608, not 8 192
    assert [slot_capacity(n) for n in (1, 512, 513, 2048, 2049, 4353)] == [512, 512, 1024, 2048, 2560, 4608]


def _play(model, tok, engine, mode: str, decoding: str, action: str, top_k: int = 0, seeds=(1, 2, 3)):
    gc = GuidanceConfig(prompt_mode=mode, decoding=decoding, action_decoding=action, max_guidance_tokens=6,
                        max_action_tokens=6)
    r = Rollout(model, tok, ENV, gc, RolloutConfig(group_size=3, max_steps=4, temperature=0.8, top_k=top_k),
                engine=engine)
    try:
        return r.run(list(seeds), generator=torch.Generator().manual_seed(0))
    finally:
        r.close()


def _same(a, b, tol: float = 1e-5) -> None:
    assert len(a.samples) == len(b.samples) > 0
    for x, y in zip(a.samples, b.samples):
        assert x.ids == y.ids and x.policy == y.policy and x.restrictions == y.restrictions
        assert x.logprobs == pytest.approx(y.logprobs, abs=tol)


@pytest.mark.parametrize("mode,decoding,action,top_k", [
    ("single_stream", "constrained", "admissible", 0), ("two_call", "free", "free", 5),
    ("single_stream", "free", "free", 0), ("two_call", "constrained", "admissible", 0)])
def test_slot_cache_rollouts_equal_dynamic_cache_rollouts(tiny, mode, decoding, action, top_k):
    """The slot cache (rows kept, one slot per lock step, prefix copies, rows ending, the cache growing past its
    first capacity) plays the episodes the dynamic cache plays: same tokens, log-probs within 1e-5 (fp32)."""
    model, tok = tiny
    static = BuiltinEngine(EngineConfig(compile="static"))
    a = _play(model, tok, BuiltinEngine(EngineConfig(compile="off")), mode, decoding, action, top_k)
    b = _play(model, tok, static, mode, decoding, action, top_k)
    _same(a, b)
    assert len({len(e.steps) for e in b.episodes}) > 1  # some rows ended while others went on
    caches = static.slots.caches
    assert caches and all(c.capacity > 512 or mode == "two_call" for c in caches)  # single stream grew past 512


@pytest.mark.parametrize("arch,kv,head_dim", [("qwen2", 2, None), ("qwen3", 2, 32)])
def test_slot_cache_rollouts_equal_dynamic_cache_rollouts_with_grouped_query_attention(arch, kv, head_dim):
    """The GPU check's layer designs, small: Qwen2's (biases) and Qwen3's (q/k norms, a head size that is not
    hidden / heads) with fewer key/value heads than query heads.  The slot cache holds the key/value heads only
    and plays the dynamic cache's episodes (same tokens, log-probs within 1e-5)."""
    shape = TinyModelConfig(hidden_size=64, num_heads=4, num_kv_heads=kv, head_dim=head_dim, arch=arch)
    model, tok = load_policy(PolicyConfig(name_or_path="embedded:tiny", tiny=shape))
    static = BuiltinEngine(EngineConfig(compile="static"))
    a = _play(model, tok, BuiltinEngine(EngineConfig(compile="off")), "single_stream", "constrained", "admissible")
    b = _play(model, tok, static, "single_stream", "constrained", "admissible")
    _same(a, b)
    cache = static.slots.caches[0]
    assert cache.keys[0].shape[1] == kv and cache.keys[0].shape[3] == (head_dim or 64 // 4)


@pytest.mark.slow
def test_a_compiled_decode_step_plays_the_same_episodes_and_compiles_once(tiny, monkeypatch):
    """``model.engine.compile: default`` (inductor, on CPU here; on CUDA ``reduce-overhead`` adds graphs to the same
    traced step): the same tokens as the eager dynamic cache, over rollouts of 9 and then 30 rows (16 and 32
    physical rows), the contexts crossing several attention views and the cache growing.  The step is compiled once,
    with dynamic shapes: compiled for fixed shapes it was recompiled for each new row count, view and cache size
    (torch stops compiling a function after eight, and on a GPU each compile of a billion-parameter step takes tens
    of seconds).  Its guards are checked at the first call of each input signature in a session call, then skipped.
    No graph input is a CPU scalar: traced with dynamic shapes, the model's float attributes (norm
    epsilons, scales) became float64 inputs on the CPU, copied to the GPU at every step, each splitting the CUDA
    graph."""
    from torch._dynamo.utils import counters

    inputs = []
    real = torch._TorchCompileInductorWrapper.__call__

    def spy(self, graph, example_inputs, *a, **kw):
        inputs.extend(example_inputs)
        return real(self, graph, example_inputs, *a, **kw)

    monkeypatch.setattr(torch._TorchCompileInductorWrapper, "__call__", spy)
    model, tok = tiny
    engine = BuiltinEngine(EngineConfig(compile="default"))
    compiled_before = counters["frames"]["ok"]
    weights = types.SimpleNamespace(version=0, sharding=None, gathered=contextlib.nullcontext)
    for seeds in [(1, 2, 3), tuple(range(4, 14)), (1, 2, 3)]:
        plain = _play(model, tok, BuiltinEngine(EngineConfig(compile="off")), "single_stream", "constrained",
                      "admissible", seeds=seeds)
        before = dict(engine.decode_calls)
        with engine.sampling(weights) as stats:  # as the rollout callback plays
            _same(plain, _play(model, tok, engine, "single_stream", "constrained", "admissible", seeds=seeds))
        checked, skipped = (engine.decode_calls[k] - before[k] for k in ("checked", "skipped"))
        assert engine_logs(stats)["engine/decode_guard_checks"] == checked / (checked + skipped) < 0.5
    assert engine.mode(model) == "default" and len(engine._steps) == 2
    assert {c.batch for c in engine.slots.caches} == {16, 32}
    assert max(c.capacity for c in engine.slots.caches) > 512
    assert counters["frames"]["ok"] - compiled_before == 1
    step = engine._steps[(id(model), "default")]
    assert step.graphs == 1 and step.skipped > 2 * step.checked  # guards checked once per signature and run
    assert inputs and not [t for t in inputs if isinstance(t, torch.Tensor) and t.dim() == 0], inputs


def test_a_compiled_step_checks_its_guards_once_per_input_signature_within_a_session_call():
    """Torch checks a compiled function's guards at every call (~90 µs per decoder layer of a LoRA model on a CPU).
    The step checks them at the first call of each input signature (shapes, strides, offsets, dtypes, grad mode)
    since ``forget``, and skips them at the calls after.  With a second graph (here: float64 inputs) it checks every
    call.  Where torch's remaining checks refuse a skip (here: its graphs dropped), the call is checked.  Every result
    is the eager one."""
    from sglightning.engines.static import CompiledStep, signature

    step = CompiledStep(lambda x, y: x * 2 + y, "default")
    a, b, wide = torch.ones(3, 2), torch.arange(10.0).view(5, 2), torch.ones(2, 3)

    def call(x, y):
        checked, skipped = step.checked, step.skipped
        assert torch.equal(step(x, y), x * 2 + y)
        return "checked" if step.checked > checked else "skipped" if step.skipped > skipped else "neither"

    with torch.no_grad():  # as the engine calls it
        assert [call(a, a), call(a, a), call(b, b), call(b, b), call(a, a)] == [
            "checked", "skipped", "checked", "skipped", "skipped"]
        assert step.graphs == 1  # one trace with dynamic shapes serves both row counts
        step.forget()
        assert [call(a, a), call(a, a)] == ["checked", "skipped"]
        assert call(a.double(), a.double()) == "checked" and step.graphs == 2
        assert [call(a, a), call(a, a)] == ["checked", "checked"]  # two graphs: every call checked
        fresh = CompiledStep(lambda x: x - 1, "default")
        assert [fresh(a).sum().item(), fresh(a).sum().item()] == [0.0, 0.0] and fresh.skipped == 1
        torch._dynamo.reset()  # its graph gone: torch's remaining checks refuse the skip, and the call is checked
        assert torch.equal(fresh(a), a - 1) and (fresh.checked, fresh.skipped) == (2, 1)
        no_grad = signature((a,), {})
    assert signature((a,), {}) != no_grad
    assert signature((wide.t(),), {}) != signature((wide.t().contiguous(),), {})  # same shape, other strides
    assert signature((a[1:],), {}) != signature((a[:2],), {})  # views at other offsets of one base
    assert signature((a,), {"rows": 3}) != signature((a,), {"rows": 2}) != signature((a, 2), {})


class HostGraph:
    """A CUDA graph's stand-in on a CPU: a capture runs the function and keeps it, a replay runs it again (on CUDA a
    capture records the kernels and a replay runs them: the same reads and writes of the same buffers).  As a CUDA
    graph reads the weights at the addresses it recorded, a replay reads the tensors that held ``model``'s weights at
    the capture, even where the model has been given new ones since."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def capture(self, fn) -> None:
        self.fn = fn
        self.held = [(p, p.data) for p in self.model.parameters()]
        fn()

    def replay(self) -> None:
        now = [(p, p.data) for p, _ in self.held]
        for p, t in self.held:
            p.data = t
        try:
            self.fn()
        finally:
            for p, t in now:
                p.data = t


@pytest.mark.slow
def test_engine_captured_graphs_play_the_uncompiled_steps_episodes(tiny, monkeypatch):
    """``model.engine.compile: graphs`` captures the compiled step per input signature and replays it from buffers
    of the same layout (here with a stand-in graph on this CPU).  Rollouts of 3 and 10 tasks (contexts crossing
    attention views, the cache growing, few rows running alone, two_call's two caches) play the uncompiled step's
    tokens.  Most decode steps are replays.  A weight that moves (a new tensor, as a load might make) drops every
    graph, and the next rollout plays with the new weights."""
    from sglightning.engines import builtin, static

    resolve = builtin.resolve_mode  # graphs on this CPU, every other mode as it resolves
    monkeypatch.setattr(builtin, "resolve_mode", lambda setting, *a: setting if setting == "graphs" else
                        resolve(setting, *a))
    model, tok = tiny
    monkeypatch.setattr(static, "CudaGraph", lambda pool: HostGraph(model))
    monkeypatch.setattr(static, "graph_pool", lambda: None)
    engine = BuiltinEngine(EngineConfig(compile="graphs"))
    plain = BuiltinEngine(EngineConfig(compile="off"))
    for seeds, mode, decoding, action in [((1, 2, 3), "single_stream", "constrained", "admissible"),
                                          (tuple(range(4, 14)), "single_stream", "constrained", "admissible"),
                                          ((1, 2, 3), "two_call", "free", "free")]:
        _same(_play(model, tok, plain, mode, decoding, action, seeds=seeds),
              _play(model, tok, engine, mode, decoding, action, seeds=seeds))
    [step] = [s for s in engine._steps.values() if isinstance(s, static.GraphedStep)]
    assert step.captured >= 3 and step.replayed > 3 * step.captured
    assert max(c.capacity for c in engine.slots.caches) > 512
    lora = next(p for n, p in model.named_parameters() if "lora_B" in n)
    before = step.captured
    with torch.no_grad():
        lora.data = lora.data + 0.05  # moved, and other values: a graph on the old address would read stale ones
    _same(_play(model, tok, plain, "single_stream", "constrained", "admissible"),
          _play(model, tok, engine, "single_stream", "constrained", "admissible"))
    assert step.captured > before


@pytest.mark.slow
def test_a_capture_that_fails_ends_the_captures_with_one_warning_and_the_same_episodes(tiny, monkeypatch):
    """A capture can fail on a GPU (a step that fell back to eager and syncs, a trace in pieces).  The step then runs
    compiled from there on: the uncompiled step's tokens, one warning naming the key, no second attempt."""
    import warnings

    from sglightning.engines import builtin, static

    class Refusing(HostGraph):
        def capture(self, fn) -> None:
            self.attempts.append(1)
            raise RuntimeError("operation not permitted when stream is capturing")

    model, tok = tiny
    Refusing.attempts = []
    resolve = builtin.resolve_mode
    monkeypatch.setattr(builtin, "resolve_mode", lambda setting, *a: setting if setting == "graphs" else
                        resolve(setting, *a))
    monkeypatch.setattr(static, "CudaGraph", lambda pool: Refusing(model))
    monkeypatch.setattr(static, "graph_pool", lambda: None)
    engine = BuiltinEngine(EngineConfig(compile="graphs"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for seeds in [(1, 2, 3), (4, 5, 6)]:
            _same(_play(model, tok, BuiltinEngine(EngineConfig(compile="off")), "single_stream", "constrained",
                        "admissible", seeds=seeds),
                  _play(model, tok, engine, "single_stream", "constrained", "admissible", seeds=seeds))
    said = [str(w.message) for w in seen if "could not capture" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("model.engine.compile: graphs could not capture the decode step")
    [step] = [s for s in engine._steps.values() if isinstance(s, static.GraphedStep)]
    assert step.failed and Refusing.attempts == [1] and step.captured == step.replayed == 0


def test_running_out_of_memory_while_compiling_is_an_out_of_memory_error(monkeypatch):
    """The compiler wraps an error raised while it compiles or captures (``BackendCompilerFailed``); one that ran
    out of accelerator memory is raised as the out-of-memory error it is (the rollout's one line names the keys that
    shrink it), not taken for a compiler bug and run uncompiled into the same wall."""
    import warnings

    from sglightning.engines.static import compiled
    from sglightning.errors import memory_error_within

    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    wrapped = torch._dynamo.exc.BackendCompilerFailed(lambda *a: None, oom, None)
    assert memory_error_within(wrapped) is oom
    try:
        raise RuntimeError("graph capture failed") from oom
    except RuntimeError as chained:
        assert memory_error_within(chained) is oom
    try:
        try:
            raise oom
        except torch.OutOfMemoryError:
            raise RuntimeError("a compiler bug met while handling it") from None
    except RuntimeError as other:
        assert memory_error_within(other) is None
    assert memory_error_within(torch._dynamo.exc.InternalTorchDynamoError("a compiler bug")) is None
    try:  # how dynamo re-raises an error met while it traces: from None, the original only in __context__
        try:
            raise oom
        except torch.OutOfMemoryError:
            raise torch._dynamo.exc.InternalTorchDynamoError("OutOfMemoryError: CUDA out of memory") from None
    except torch._dynamo.exc.InternalTorchDynamoError as traced:
        assert memory_error_within(traced) is oom

    def broken(fn, **kwargs):
        def call(*args, **kw):
            raise wrapped
        return call

    monkeypatch.setattr(torch, "compile", broken)
    step = compiled(lambda x: x + 1, "default")
    with warnings.catch_warnings(record=True) as seen, pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
        warnings.simplefilter("always")
        step(torch.zeros(1))
    assert not [w for w in seen if "model.engine.compile" in str(w.message)]


def test_a_step_torch_cannot_compile_runs_uncompiled_and_says_so_once(tiny, monkeypatch):
    """A compiler failure (here simulated: every compiled call raises torch's compiler error) costs speed, not the
    rollout: the same episodes as the uncompiled step, and one warning naming the key."""
    import warnings

    def broken(fn, **kwargs):
        def call(*args, **kw):
            raise torch._dynamo.exc.InternalTorchDynamoError("simulated compiler failure\nsecond line")
        return call

    model, tok = tiny
    plain = _play(model, tok, BuiltinEngine(EngineConfig(compile="off")), "single_stream", "constrained", "admissible")
    monkeypatch.setattr(torch, "compile", broken)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _same(plain, _play(model, tok, BuiltinEngine(EngineConfig(compile="default")), "single_stream", "constrained",
                           "admissible"))
    said = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    assert len(said) == 1 and said[0].startswith("model.engine.compile: default could not compile the decode step "
                                                 "(InternalTorchDynamoError: simulated compiler failure)")


def test_kept_slots_moves_each_rows_first_tokens_to_the_front_by_hand():
    """Row 0 holds real tokens at slots 1, 2, 4 (pads at 0 and 3) and keeps 2; row 1 holds 0, 1, 2 and keeps 3."""
    from sglightning.engines.rewind import gather_slots, kept_slots

    seen = torch.tensor([[0, 1, 1, 0, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    index, valid = kept_slots(seen, torch.tensor([2, 3]), 3)
    assert valid.tolist() == [[False, True, True], [True, True, True]]
    assert index[0, 1:].tolist() == [1, 2] and index[1].tolist() == [0, 1, 2]
    keys = torch.arange(10.0).view(2, 1, 5, 1)  # [R, H, T, d]: row r, slot c holds 5r + c
    assert gather_slots(keys, index)[:, 0, :, 0][valid].tolist() == [1.0, 2.0, 5.0, 6.0, 7.0]


def _program_run(session, seed: int):
    session.generator.manual_seed(seed)
    return session.run([[Free(6, frozenset())] for _ in range(session.batch_size)])


@pytest.mark.parametrize("compile_mode", ["off", "static"])
def test_a_rewound_session_goes_on_as_a_fresh_session_of_the_new_prompts(tiny, compile_mode):
    """Rows fed, sampled, fed again, one dropped and the rest reordered, then rewound to prefixes of what they hold
    (of different lengths: 4 and 9 tokens) and given new endings: the logits and the next samples are those of a
    new session fed the new prompts whole (log-probs within 1e-5, fp32); only the new endings were computed."""
    model, _ = tiny
    engine = BuiltinEngine(EngineConfig(compile=compile_mode))
    prompts = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 20, 21], [5, 6, 30]]
    s = engine.session(model, 0, 1.0, torch.Generator().manual_seed(1))
    s.feed(prompts)
    held = [p + [t for piece in out for t in piece.ids] for p, out in zip(prompts, _program_run(s, 1))]
    more = [[40, 41], [42], [43, 44, 45]]
    s.feed(more)
    held = [h + m for h, m in zip(held, more)]
    s.select([2, 0])
    new = [held[2][:4] + [50, 51], held[0][:9] + [52]]
    assert s.rewind([4, 9]) and [s.length(0), s.length(1)] == [4, 9]
    fed = s.fed_positions
    s.feed([[50, 51], [52]])
    assert s.fed_positions - fed <= 2 * 2 + (8 if compile_mode == "static" else 0)  # only the new endings
    fresh = engine.session(model, 0, 1.0, torch.Generator())
    fresh.feed(new)
    a, b = s.last_logits[s._rows([0, 1])], fresh.last_logits[fresh._rows([0, 1])]
    assert torch.allclose(a, b, atol=1e-5)
    for x, y in zip(_program_run(s, 7), _program_run(fresh, 7)):
        assert [p.ids for p in x] == [p.ids for p in y]
        assert x[0].logprobs == pytest.approx(y[0].logprobs, abs=1e-5)


def test_rewind_refuses_what_it_cannot_do(tiny):
    model, _ = tiny
    s = BuiltinEngine(EngineConfig(compile="off")).session(model, 0, 1.0, torch.Generator().manual_seed(1))
    assert not s.rewind([])  # nothing fed yet
    s.feed([[5, 6, 7], [8, 9]])
    with pytest.raises(ValueError, match="rewind got 1 lengths for 2 rows"):
        s.rewind([1])
    with pytest.raises(ValueError, match="rewind: row 1 holds 2 tokens, cannot keep 3"):
        s.rewind([1, 3])
    assert not s.rewind([0, 0]) and s.length(0) == 3  # nothing would be kept: unchanged
    assert s.rewind([1, 2])
    with pytest.raises(RuntimeError, match="feed a prompt before running programs"):
        s.run([[Free(2, frozenset())]] * 2)
    with pytest.raises(ValueError, match="feed after rewind: every row needs at least one token"):
        s.feed([[5], []])
    s.feed([[5], [6]])
    assert [s.length(0), s.length(1)] == [2, 3]


def test_two_live_sessions_never_share_a_slot_cache(tiny):
    """two_call keeps its rate session open while its act session runs: each holds its own cache; a session that
    ended hands its cache to the next one (the compiled step keeps its addresses)."""
    model, _ = tiny
    engine = BuiltinEngine(EngineConfig(compile="static"))
    a = engine.session(model, 0, 1.0, torch.Generator().manual_seed(1))
    a.feed([[5, 6, 7]] * 3)
    b = engine.session(model, 0, 1.0, torch.Generator().manual_seed(1))
    b.feed([[8, 9]] * 3)
    assert a.cache is not b.cache and len(engine.slots.caches) == 2
    kept = b.cache
    del b
    c = engine.session(model, 0, 1.0, torch.Generator().manual_seed(1))
    c.feed([[8, 9]] * 3)
    assert c.cache is kept and len(engine.slots.caches) == 2


def _two_call(model, tok, engine, decoding: str, action: str, reuse: bool, top_k: int = 0):
    gc = GuidanceConfig(prompt_mode="two_call", decoding=decoding, action_decoding=action, max_guidance_tokens=6,
                        max_action_tokens=6)
    cfg = RolloutConfig(group_size=3, max_steps=5, temperature=0.8, top_k=top_k, reuse_prefix=reuse)
    r = Rollout(model, tok, functools.partial(HouseholdEnv, difficulty=0, info_actions=False), gc, cfg, engine=engine)
    try:
        return r.run([1, 2, 3], generator=torch.Generator().manual_seed(0))
    finally:
        r.close()


@pytest.mark.parametrize("compile_mode,decoding,action,top_k", [
    ("off", "free", "free", 5), ("off", "constrained", "admissible", 0), ("static", "constrained", "admissible", 0)])
def test_two_call_keeps_each_calls_cache_and_plays_the_same_episodes(tiny, compile_mode, decoding, action, top_k):
    """``rollout.reuse_prefix``: the rate and act calls go on from the last env step's sessions, each row rewound to
    what its new prompt shares.  The same episodes as fresh sessions (tokens equal, log-probs within 1e-5), with
    fewer prefill positions computed."""
    model, tok = tiny
    fresh = _two_call(model, tok, BuiltinEngine(EngineConfig(compile=compile_mode)), decoding, action, False, top_k)
    kept = _two_call(model, tok, BuiltinEngine(EngineConfig(compile=compile_mode)), decoding, action, True, top_k)
    _same(fresh, kept)
    assert max(len(e.steps) for e in kept.episodes) >= 3
    assert kept.prefill_positions < 0.85 * fresh.prefill_positions


def _limited(model, share_of_one: float, rows: int = 16) -> BuiltinEngine:
    """A slot-cache engine whose pool may hold ``share_of_one`` × one cache of ``rows`` rows and 512 slots."""
    engine = BuiltinEngine(EngineConfig(compile="static"))
    one = SlotCache.bytes_for(model, rows, 512, torch.float32)
    engine.slots = SlotPool(limit_bytes=int(share_of_one * one))
    return engine


def test_under_a_memory_limit_two_call_gives_its_kept_cache_away_and_plays_the_same_episodes(tiny, monkeypatch):
    """``model.engine.cache_memory``: where two caches do not fit, the act call takes the rate call's kept cache
    (and back): one cache serves both, every prompt is prefilled anew, and the episodes are those of fresh sessions.
    Where they fit, nothing is given back and the prefill is the kept arm's."""
    model, tok = tiny
    fresh = _two_call(model, tok, BuiltinEngine(EngineConfig(compile="static")), "constrained", "admissible", False)
    tight = _limited(model, 1.5)
    allocated = []
    real = SlotCache.allocate.__func__
    monkeypatch.setattr(SlotCache, "allocate", classmethod(lambda cls, *a: allocated.append(a) or real(cls, *a)))
    weights = types.SimpleNamespace(version=0, sharding=None, gathered=contextlib.nullcontext)
    with tight.sampling(weights) as stats:  # as the rollout callback plays: the engine's numbers filled on exit
        short = _two_call(model, tok, tight, "constrained", "admissible", True)
    _same(fresh, short)
    assert tight.slots.given_back > 0 and len(tight.slots.caches) == 1
    assert len(allocated) == 1  # one cache, handed from call to call (same addresses: no new graphs on a GPU)
    logs = engine_logs({**short.engine_counts, **stats})  # the rollout's numbers and the engine's
    assert logs["engine/caches_given_back"] == tight.slots.given_back
    assert logs["engine/slot_cache_GB"] == tight.slots.caches[0].nbytes() / 1e9
    assert short.prefill_positions == fresh.prefill_positions
    roomy = _limited(model, 4)
    kept = _two_call(model, tok, roomy, "constrained", "admissible", True)
    _same(fresh, kept)
    assert roomy.slots.given_back == 0 and len(roomy.slots.caches) == 2
    assert kept.prefill_positions < 0.85 * fresh.prefill_positions


def test_under_a_memory_limit_idle_caches_go_before_a_live_sessions(tiny):
    """Room is made from idle caches first; a live session's cache is taken only when that is not enough.  The
    session that gave its cache away cannot be rewound, and feeding it says why."""
    model, _ = tiny
    engine = _limited(model, 1.8)  # the 8-row caches are half the 16-row one
    a = engine.session(model, 0, 1.0, torch.Generator().manual_seed(1))
    a.feed([[5, 6, 7]] * 3)
    b = engine.session(model, 0, 1.0, torch.Generator().manual_seed(1))
    b.feed([[8, 9]] * 3)
    del b  # its cache is idle now
    c = engine.session(model, 0, 1.0, torch.Generator().manual_seed(1))
    c.feed([[5, 6]] * 9)  # 16 physical rows: with a and b, past the limit
    assert not a.given_back and engine.slots.given_back == 0
    assert sorted(x.batch for x in engine.slots.caches) == [8, 16]  # b's idle cache was freed, a's kept
    d = engine.session(model, 0, 1.0, torch.Generator().manual_seed(1))
    held = a.cache
    d.feed([[5]] * 3)  # the limit is reached: a's cache (same shape) is handed over, not freed and made anew
    assert d.cache is held and a.cache is None
    assert a.given_back and engine.slots.given_back == 1 and len(engine.slots.caches) == 2
    a.select([0, 1, 2])
    assert not a.rewind([1, 1, 1])
    with pytest.raises(RuntimeError, match="model.engine.cache_memory"):
        a.feed([[5]] * 3)


def test_under_a_memory_limit_the_caches_of_other_row_counts_are_kept(tiny):
    """Training and validation rollouts of different sizes each keep their caches while they fit (the compiled
    step keeps its addresses); without a limit at most two idle caches are kept, and two_call's four do not stay."""
    model, tok = tiny

    def rounds(engine) -> list[set[int]]:
        alive, caches = [], []  # the caches held here, so that no id is reused
        for seeds in [(1, 2, 3), tuple(range(4, 14)), (1, 2, 3)]:  # 9 rows (16 physical), 30 (32), 9 again
            _play(model, tok, engine, "two_call", "constrained", "admissible", seeds=seeds)
            alive += engine.slots.caches
            caches.append({id(c) for c in engine.slots.caches if c.batch == 16})
        return caches

    limited = rounds(_limited(model, 10, rows=32))
    assert len(limited[0]) == 2 and limited[2] == limited[0]  # the 9-row rollout's two caches, again
    unlimited = rounds(BuiltinEngine(EngineConfig(compile="static")))
    assert len(unlimited[0]) == 2 and unlimited[2] != unlimited[0]  # one at least freed for the 30-row rollout's


@pytest.mark.parametrize("compile_mode", ["off", "static"])
def test_a_block_fed_in_chunks_is_the_one_pass_result(tiny, compile_mode):
    """``model.engine.prefill_tokens``: a block of more positions than that goes in column chunks (rows of unequal
    lengths, left-padded, some rows empty in the first chunks): the same logits and then the same samples as one
    pass, in more forwards; in a rollout (shared prefixes, two_call's rewinds), the same episodes."""
    model, tok = tiny
    blocks = [[5 + (i * 7 + j) % 40 for j in range(n)] for i, n in enumerate([41, 3, 17, 41, 1, 29, 8, 33, 12])]

    def fed(prefill_tokens):
        engine = BuiltinEngine(EngineConfig(compile=compile_mode, prefill_tokens=prefill_tokens))
        s = engine.session(model, 0, 1.0, torch.Generator().manual_seed(3))
        s.feed(blocks)
        logits, calls = s.last_logits[s._rows(range(9))].clone(), s.forward_calls
        pieces = s.run([[Free(5, frozenset())]] * 9)
        return logits, calls, [p.ids for row in pieces for p in row]

    # 64 positions: 11 chunks of 3-4 columns (static: 16 physical rows) or 6 of 6-7; 8 positions: 41 chunks of one
    # column (fewer positions than rows), each through the decode step
    one, chunked, columns = fed(None), fed(64), fed(8)
    assert torch.allclose(one[0], chunked[0], atol=1e-5) and torch.allclose(one[0], columns[0], atol=1e-5)
    assert (one[1], chunked[1], columns[1]) == (1, 11 if compile_mode == "static" else 6, 41)
    assert one[2] == chunked[2] == columns[2]
    for mode in ("single_stream", "two_call"):
        a = _play(model, tok, BuiltinEngine(EngineConfig(compile=compile_mode, prefill_tokens=None)), mode,
                  "constrained", "admissible")
        _same(a, _play(model, tok, BuiltinEngine(EngineConfig(compile=compile_mode, prefill_tokens=48)), mode,
                       "constrained", "admissible"))
    with pytest.raises(ValueError, match="model.engine.prefill_tokens: 0 is not a positive count"):
        EngineConfig(prefill_tokens=0)


def test_a_session_holding_other_ids_than_the_rollout_thinks_is_not_kept(tiny, monkeypatch):
    """The rollout keeps a call's session only when each row holds exactly the prompt and what the call wrote;
    here every row claims one token more, so every call starts a fresh session (the same prefill as without reuse)."""
    from sglightning.engines.builtin import DecodeSession

    model, tok = tiny
    fresh = _two_call(model, tok, BuiltinEngine(EngineConfig(compile="off")), "constrained", "admissible", False)
    monkeypatch.setattr(DecodeSession, "length", lambda self, row: self.next_pos[row] + 1)
    kept = _two_call(model, tok, BuiltinEngine(EngineConfig(compile="off")), "constrained", "admissible", True)
    _same(fresh, kept)
    assert kept.prefill_positions == fresh.prefill_positions


def test_a_free_segment_counts_its_cap_from_the_piece_whoever_writes_it():
    """The vLLM engine writes a ``Free`` segment's tokens into the piece itself (a whole request's worth), not
    through ``take``: the cap must be read from the piece, or a capped segment would ask for more tokens forever."""
    from sglightning.engines.program import Force, ProgramState

    def capped() -> ProgramState:
        st = ProgramState([Free(3, frozenset({9}), close_with=(7,)), Force([8])])
        assert st.written() == [] and st.restriction() is None
        for tok in (1, 2, 3):  # as VLLMSession._run_row adds a request's tokens
            st.piece.add(tok, -1.0, True)
        return st

    st = capped()
    st.advance()  # the vLLM engine's walk
    assert st.pending_close == [7]  # the cap was hit without the stop token: its closing tokens come next
    st = capped()
    assert st.written() == [7, 8] and st.done  # the built-in engine's walk
    assert [p.ids for p in st.pieces] == [[1, 2, 3, 7], [8]]
    assert [p.policy for p in st.pieces] == [[True, True, True, False], [False]]


def test_the_reuse_benchmark_plays_the_same_episodes_in_both_arms():
    """benchmarks/two_call_reuse.py: both arms play the same tokens, and the kept arm computes fewer positions."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import two_call_reuse

    report = two_call_reuse.main(["--model", "tiny", "--tasks", "1", "--group", "2", "--steps", "4", "--repeats", "1",
                                  "--threads", "1"])
    (row,) = report["rounds"]
    assert row["same_tokens"] and row["fresh"]["tokens"] == row["kept"]["tokens"] > 0
    assert row["kept"]["prefill_positions"] < row["fresh"]["prefill_positions"]


def test_a_rewound_slot_session_runs_fewer_physical_rows_when_rows_end(tiny):
    """Ten rows (16 physical) of which three go on: after the rewind they sit in the first physical rows and a
    decode step runs 8 of them, not 16 (a step reads every row it runs), in the same cache (the compiled step keeps
    its addresses); the logits and samples are a fresh session's."""
    model, _ = tiny
    engine = BuiltinEngine(EngineConfig(compile="static"))
    prompts = [[5, 6, 7 + i, 8, 9 + i] for i in range(10)]
    s = engine.session(model, 0, 1.0, torch.Generator().manual_seed(1))
    s.feed(prompts)
    held = [p + [t for piece in out for t in piece.ids] for p, out in zip(prompts, _program_run(s, 1))]
    big = s.cache
    assert big.batch == 16
    s.select([7, 2, 9])
    new = [held[7][:6] + [50], held[2][:3] + [51, 52], held[9][:7] + [53]]
    assert s.rewind([6, 3, 7])
    s.feed([[50], [51, 52], [53]])
    assert s.cache is big and s.phys == [0, 1, 2]
    fresh = engine.session(model, 0, 1.0, torch.Generator())
    fresh.feed(new)
    assert torch.allclose(s.last_logits[s._rows([0, 1, 2])], fresh.last_logits[fresh._rows([0, 1, 2])], atol=1e-5)
    fed, steps = s.fed_positions, s.lock_steps
    for x, y in zip(_program_run(s, 3), _program_run(fresh, 3)):
        assert [p.ids for p in x] == [p.ids for p in y]
    assert s.lock_steps > steps and s.fed_positions - fed == 8 * (s.lock_steps - steps)  # 8 rows a step, not 16


def _stragglers(model, compile_mode: str, few: bool):
    """Twelve rows of which two write long turns: after a few lock steps only those two run.  Two turns, a block
    fed between them, so the second turn reads what the first left in the cache."""
    engine = BuiltinEngine(EngineConfig(compile=compile_mode), few_rows_alone=few)
    s = engine.session(model, 0, 1.0, torch.Generator().manual_seed(3))
    s.feed([[5, 6, 7 + i, 8][: 2 + i % 3] for i in range(12)])
    turns = []
    for turn in range(2):
        programs = [[Free(14 if i in (3, 8 + turn) else 2, frozenset())] for i in range(12)]
        turns.append(s.run(programs))
        s.feed([[40 + i] for i in range(12)])
    turns.append(s.run([[Free(3, frozenset())] for _ in range(12)]))
    return turns, s.fed_positions


@pytest.mark.parametrize("compile_mode", ["off", "static"])
def test_when_few_rows_still_run_their_steps_run_without_the_others(tiny, compile_mode):
    """Once at most a quarter of the rows still run, the lock steps left run those rows only: on the slot cache they
    move to the first physical rows and the step runs those; on the dynamic cache a session of those rows runs them
    and is joined back.  The same tokens and log-probs (1e-5) as running every row, in that turn and the ones after
    (the cache left behind is the same), with fewer positions computed."""
    model, _ = tiny
    plain, plain_fed = _stragglers(model, compile_mode, False)
    few, few_fed = _stragglers(model, compile_mode, True)
    for a, b in zip(plain, few):
        for x, y in zip(a, b):
            assert [p.ids for p in x] == [p.ids for p in y]
            assert x[0].logprobs == pytest.approx(y[0].logprobs, abs=1e-5)
    assert max(len(x[0].ids) for x in plain[0]) >= 10  # the long rows ran on after the others
    assert few_fed < plain_fed


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts the calls that copy a tensor's values to the host (on CUDA each waits for the device)."""

    #: ``.to("cpu")`` is not among them: on a CPU-only machine every copy to the model's device looks like one
    READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero"}

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            self.reads += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("decoding,action", [("constrained", "admissible"), ("free", "free")])
def test_the_slot_cache_path_reads_the_device_once_per_lock_step_at_most(tiny, monkeypatch, decoding, action):
    """The GPU path's budget: all rows' tokens come to the host in one copy per lock step (``draw``'s), nothing else
    inside a session's ``run`` waits for the device.  A read added per row or per step would break it."""
    from sglightning.engines.builtin import DecodeSession

    model, tok = tiny
    counter, lock_steps = _HostReads(), [0]
    real = DecodeSession.run

    def counted(self, programs):
        before = self.lock_steps
        with counter:
            out = real(self, programs)
        lock_steps[0] += self.lock_steps - before
        return out

    monkeypatch.setattr(DecodeSession, "run", counted)
    gc = GuidanceConfig(decoding=decoding, action_decoding=action, max_guidance_tokens=8, max_action_tokens=8)
    r = Rollout(model, tok, functools.partial(HouseholdEnv, difficulty=0, info_actions=False), gc,
                RolloutConfig(group_size=4, max_steps=3, temperature=1.0),
                engine=BuiltinEngine(EngineConfig(compile="static")))
    try:
        r.run([1, 2, 3, 4], generator=torch.Generator().manual_seed(0))
    finally:
        r.close()
    assert lock_steps[0] > 20
    assert counter.reads <= lock_steps[0], (counter.reads, lock_steps[0])
