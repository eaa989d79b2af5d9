"""The in-process engine (the default and the reference): batched forwards of the trainer's own (peft) model with a
persistent KV cache, sampling with the very weights being trained — nothing to export, no version to lose.

All rows advance one token per forward pass (lock step); a finished row feeds a masked pad.  Context blocks of
different lengths (prompts, environment observations) are left-padded *within the block*, so pads can sit in the
middle of a row's cache: they are masked out and positions are counted per row, which makes the result identical
(up to float rounding) to a clean unpadded forward.  Where the blocks' lengths differ a lot, they are fed in stages
(:func:`plan_stages`: all rows up to a cut, then only the rows still longer, on a copy of their cache) instead of
padding every row to the longest.  Rows whose episode ended are dropped from the cache.

Each lock step samples every row that needs a token at once (:func:`draw`): the rows' restrictions become masks on
the model's device, one batched draw uses the seeded generator, log q and log π are gathered there, and one copy to
the host brings back the step's tokens and log-probs.  Drawn in row order from one generator, the tokens are those of
drawing row by row (on CPU bit for bit).

What gets recorded for every token: its id (exactly as sampled — nothing is re-tokenised later), whether the policy
wrote it, and its kind (context / guidance / action).  For a policy token also the log-probability of the distribution
it was *actually drawn from*, at the sampling temperature: when sampling was restricted to a set A of tokens (a
``Choice``'s allowed continuations, a ``Free`` segment's banned tokens, top-k), that is the renormalised

    log q(y) = log π(y) − log Σ_{a∈A} π(a)          (A = every token but the banned ones, for an exclusion)

together with the :class:`~sglightning.episodes.Restriction` A itself, so that the trainer scores log q_θ over the
same set (with the same sums, :func:`~sglightning.scoring.restricted_log_mass`); the unrestricted log π(y) is kept
beside it as a diagnostic.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence

import torch

from sglightning.engines.base import Engine, Session, Weights
from sglightning.engines.draw import RestrictionTable, draw
from sglightning.engines.prefill import append_row_subset, plan_stages, row_subset_cache, row_subset_cache_ok
from sglightning.engines.program import ProgramState, Segment
from sglightning.engines.rewind import gather_slots, kept_slots
from sglightning.engines.static import (
    CompiledStep,
    GraphedStep,
    SlotCache,
    block_mask,
    bucket,
    compiled,
    decode_step,
    reserved_slots,
    resolve_mode,
    slot_capacity,
)
from sglightning.episodes import Piece
from sglightning.prefixes import cluster_heads, shared_prefixes
from sglightning.profiling import phase
from sglightning.traits import cache_argument_name


class BuiltinEngine(Engine):
    """Sessions of :class:`DecodeSession` on the policy in this process; a rollout samples inside the policy's
    ``gathered()`` weights (a collective under FSDP).  ``model.engine.compile`` chooses the decode step: the
    dynamic cache (``off``, CPUs) or the static slot cache, compiled or not (:mod:`sglightning.engines.static`)."""

    pads_inside_rows = True  # blocks are left-padded within the block

    def __init__(self, cfg=None, *, share_prefix: bool = True, staged_prefill: bool | None = None,
                 few_rows_alone: bool | None = None):
        """``share_prefix``, ``staged_prefill`` and ``few_rows_alone``: see :class:`DecodeSession` (benchmarks switch
        them off; ``few_rows_alone`` None = ``model.engine.few_rows_alone``)."""
        super().__init__(cfg)
        self.share_prefix = share_prefix
        self.staged_prefill = staged_prefill
        self.few_rows_alone = self.cfg.few_rows_alone if few_rows_alone is None else few_rows_alone
        self._restrictions = RestrictionTable()
        self.slots = SlotPool(share=self.cfg.cache_memory)
        self.sharding: str | None = None
        self._steps: dict[tuple[int, str], object] = {}  # (id(model), mode) -> the (compiled) decode step
        #: the compiled decode steps' calls over the engine's rollouts (kept past close): guards "checked" and
        #: "skipped", graphs "captured" and steps "replayed" (``compile: graphs``)
        self.decode_calls = dict.fromkeys(("checked", "skipped", "captured", "replayed"), 0)

    @contextlib.contextmanager
    def sampling(self, weights: Weights) -> Iterator[dict[str, float]]:
        self.version = weights.version
        self.sharding = weights.sharding
        stats: dict[str, float] = {}
        before = self._decode_calls()
        with weights.gathered():
            yield stats
        if self.slots.caches:  # filled on exit, read by the rollout's caller after it
            stats["slot_cache_GB"] = self.slots.nbytes() / 1e9  # GB, as the memory logs
        calls = {k: v - before[k] for k, v in self._decode_calls().items()}
        for k, v in calls.items():
            self.decode_calls[k] += v
        if calls["checked"] + calls["skipped"] > 0:
            stats["decode_guard_checks"] = calls["checked"] / (calls["checked"] + calls["skipped"])

    def _decode_calls(self) -> dict[str, int]:
        """The compiled decode steps' calls so far: guards checked, guards skipped (:class:`CompiledStep`); graphs
        captured, steps replayed from them (``compile: graphs``, :class:`GraphedStep`)."""
        steps = list(self._steps.values())
        graphed = [s for s in steps if isinstance(s, GraphedStep)]
        compiled = [s for s in steps if isinstance(s, CompiledStep)] + [s.step for s in graphed]
        return {"checked": sum(s.checked for s in compiled), "skipped": sum(s.skipped for s in compiled),
                "captured": sum(s.captured for s in graphed), "replayed": sum(s.replayed for s in graphed)}

    def mode(self, model: torch.nn.Module) -> str:
        """The decode step for ``model``: ``model.engine.compile`` resolved (:func:`resolve_mode`)."""
        attention = getattr(getattr(model, "config", None), "_attn_implementation", None) or "sdpa"
        return resolve_mode(self.cfg.compile, next(model.parameters()).device.type, self.sharding, attention)

    def step(self, model: torch.nn.Module, mode: str):
        """The decode step of ``model`` for ``mode`` (compiled once, kept)."""
        key = (id(model), mode)
        if key not in self._steps:
            self._steps = {k: v for k, v in self._steps.items() if k[0] == id(model)}  # a new model: drop the old
            step = decode_step(model, cache_argument_name(model))
            self._steps[key] = (GraphedStep(compiled(step, "default"), model) if mode == "graphs"
                                else compiled(step, mode))
        return self._steps[key]

    def session(self, model, pad_id, temperature=1.0, generator=None, top_k=0, greedy=False) -> DecodeSession:
        mode = self.mode(model)
        static = None
        if mode != "off":
            static = StaticSession(self.slots, self.step(model, "static"), self.step(model, mode))
        return DecodeSession(model, pad_id, temperature, generator, top_k, greedy, share_prefix=self.share_prefix,
                             staged_prefill=self.staged_prefill, restrictions=self._restrictions, static=static,
                             few_rows_alone=self.few_rows_alone, prefill_tokens=self.cfg.prefill_tokens)

    def close(self) -> None:
        self.slots.clear()
        self._steps = {}


class SlotPool:
    """The static caches of the sessions, kept across rollouts by physical row count (a new allocation would give
    the compiled step new addresses).  A cache serves one session at a time (``two_call`` keeps two open).

    Idle caches (no session holds them): without a limit, at most ``keep``.  With one (on CUDA,
    ``model.engine.cache_memory`` × the GPU's memory), as many as fit under it, so the memory left is the update's.
    When a new or grown cache would pass the limit, idle caches are freed first, oldest first; then those of other
    sessions, which cannot be running (one rollout runs one call at a time): a ``two_call`` call kept between env steps
    loses its cache, and its next prompt is prefilled anew.  Such a cache of the right shape is taken over, not
    freed.  One cache alone may pass the limit."""

    def __init__(self, keep: int = 2, share: float | None = None, limit_bytes: int | None = None):
        """``share``: of a CUDA device's memory, the caches' limit (None: no limit); ``limit_bytes``: a limit in
        bytes on any device (tests)."""
        self.keep = keep
        self.share = share
        self.limit_bytes = limit_bytes
        self.given_back = 0  # how many sessions gave their cache back while they lived (their reuse lost)
        self._entries: list[tuple[tuple, SlotCache, weakref.ref | None]] = []  # (key, cache, holder), oldest first

    @staticmethod
    def _held(entry) -> bool:
        return entry[2] is not None and entry[2]() is not None

    def limit(self, device: torch.device) -> int | None:
        """The bytes the caches may hold together on ``device`` (None: no limit)."""
        if self.limit_bytes is not None:
            return self.limit_bytes
        if self.share is None or device.type != "cuda":
            return None
        return int(self.share * torch.cuda.get_device_properties(device).total_memory)

    def nbytes(self) -> int:
        """The bytes of every cache kept, held or not."""
        return sum(e[1].nbytes() for e in self._entries)

    def get(self, holder: object, model: torch.nn.Module, rows: int, slots: int, dtype: torch.dtype,
            device: torch.device) -> SlotCache:
        """A cache of ``rows`` × at least ``slots`` for ``holder`` (a session), which holds it while it lives."""
        key = (id(model), rows, dtype, device)
        free = [e for e in self._entries if e[0] == key and not self._held(e)]
        cache = free[-1][1] if free else None  # the most recent
        del free  # no reference left to a cache dropped below
        if cache is not None:
            self._entries = [e for e in self._entries if e[1] is not cache]
        if cache is None or cache.capacity < slots:  # a smaller one is dropped: room made, maybe a cache taken over
            cache = self._make_room(holder, SlotCache.bytes_for(model, rows, slots, dtype), device, key, slots)
            if cache is None:
                cache = SlotCache.allocate(model, rows, slots, dtype, device)
        self._entries.append((key, cache, weakref.ref(holder)))  # most recent last
        return cache

    def grow(self, holder: object, cache: SlotCache, slots: int) -> None:
        """``holder``'s ``cache`` grown to ``slots`` slots, in place, room made first."""
        self._make_room(holder, cache.nbytes_grown(slots), cache.keys[0].device)
        cache.grow(slots)

    def _make_room(self, holder: object, need: int, device: torch.device, key: tuple | None = None,
                   slots: int = 0) -> SlotCache | None:
        """Free caches until ``need`` more bytes fit (see the class); a cache of ``key`` with ``slots`` slots taken
        from another session on the way is returned, for ``holder`` to take instead of allocating."""
        limit = self.limit(device)
        idle = [e for e in self._entries if not self._held(e)]
        if limit is None:
            while key is not None and len(idle) >= self.keep:  # a new cache: at most `keep` - 1 idle ones stay
                self._entries.remove(idle.pop(0))
            return None
        while idle and self.nbytes() + need > limit:
            self._entries.remove(idle.pop(0))
        # other sessions' caches (strong references while this runs), oldest first, one that would serve first
        others = [(e, e[2]()) for e in self._entries if self._held(e) and e[2]() is not holder]
        others.sort(key=lambda o: not (o[0][0] == key and o[0][1].capacity >= slots))
        while others and self.nbytes() + need > limit:
            entry, session = others.pop(0)
            session.give_back_cache()
            self._entries.remove(entry)
            self.given_back += 1
            holder.caches_taken += 1
            if key is not None and entry[0] == key and entry[1].capacity >= slots:
                return entry[1]
        return None

    def clear(self) -> None:
        self._entries = []

    @property
    def caches(self) -> list[SlotCache]:
        """The caches kept, held or not, oldest first."""
        return [e[1] for e in self._entries]


class StaticSession:
    """What a :class:`DecodeSession` on the static path holds: the pool it takes its cache from, the eager step (any
    width) and the decode step (width 1, compiled per ``model.engine.compile``)."""

    def __init__(self, pool: SlotPool, eager, decode):
        self.pool, self.eager, self.decode = pool, eager, decode

    def begin(self) -> None:
        """A session call (``run``, ``feed``) begins: the compiled step checks its guards again
        (:class:`~sglightning.engines.static.CompiledStep`)."""
        forget = getattr(self.decode, "forget", None)  # a benchmark's stand-in step has none
        if forget is not None:
            forget()


class DecodeSession(Session):
    """A batch of rows sharing one KV cache.  ``feed`` appends context; ``run`` executes segment programs.

    Two caches: transformers' dynamic cache (grown by concatenation; finished rows dropped; blocks of unequal
    lengths fed in stages on CPUs), or with ``static`` the slot cache of :mod:`sglightning.engines.static` (fixed
    shapes: rows kept, one slot per lock step, the decode step compiled)."""

    def __init__(
        self,
        model: torch.nn.Module,
        pad_id: int,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
        top_k: int = 0,
        greedy: bool = False,
        share_prefix: bool = True,
        staged_prefill: bool | None = None,
        restrictions: RestrictionTable | None = None,
        static: StaticSession | None = None,
        few_rows_alone: bool = True,
        prefill_tokens: int | None = None,
    ):
        """``share_prefix``: the first :meth:`feed` computes a prefix that several rows share (a group's G episodes
        start from one prompt) once and copies its cache to those rows (:func:`~sglightning.prefixes.shared_prefixes`);
        False = every row computes its whole block.  ``staged_prefill``: context blocks of unequal lengths are fed in
        stages (the rows still longer than a cut, on a copy of their cache) when :func:`plan_stages` finds that
        computes fewer positions than padding every row to the longest block; False = always one padded pass; None
        (default) = on CPUs only (the cost model is a CPU's, where a padded position costs a real one's FLOPs; on a
        GPU padding is nearly free at these sizes and each extra pass costs latency).  ``static``: the slot cache
        and its steps (None: the dynamic cache).  ``few_rows_alone``: once at most a quarter of the rows still run their
        program, the lock steps left run those rows only (:meth:`_front`, :meth:`_split`); False = every row to the
        end.  ``prefill_tokens``: a fed block of more positions (rows × width) goes in column chunks of at most that
        many (None: one pass)."""
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.model = model
        self.pad_id = pad_id
        self.temperature = temperature
        self.generator = generator
        self.top_k = top_k
        self.greedy = greedy
        self.cache = None
        self.device = next(model.parameters()).device
        check_generator(generator, self.device)
        self.static = static
        self._mask: torch.Tensor | None = None  # [P, capacity] 1 = real token; columns [:width] are in use
        self.width = 0  # cache positions (slots) in use, pads included
        self.phys: list[int] = []  # the physical cache row of each row (the identity on the dynamic path)
        self.next_pos: list[int] = []  # position of each row's next real token (kept on the host)
        self.last_logits: torch.Tensor | None = None  # [P, V] logits predicting each physical row's next token
        self.forward_calls = 0
        self.share_prefix = share_prefix
        self.staged_prefill = (self.device.type == "cpu" if staged_prefill is None else staged_prefill) and not static
        self.fed_positions = 0  # row × position slots forwarded by `feed` (padding included): the prefill's work
        # the lock steps `run` fed, the rows they advanced, and those rows' contexts summed (tokens held per row)
        self.lock_steps = self.row_steps = self.context_tokens = 0
        self._cache_arg = cache_argument_name(model)
        self._table = restrictions or RestrictionTable()
        self._must_feed = False  # a rewind happened: the next feed must give every row a token
        self._active: int | None = None  # slot cache: the physical rows decode steps run, while few rows run
        self._running = False  # inside run: its lock steps feed through feed, all one session call
        self._bound: int | None = None  # slot cache: the physical rows holding rows since a rewind (None: all)
        self.few_rows_alone = few_rows_alone
        self.prefill_tokens = prefill_tokens
        self.given_back = False  # the pool took the slot cache for another session (give_back_cache)
        self.caches_taken = 0  # caches the pool took from other sessions for this one
        self._additive = None
        if static is not None and getattr(model.config, "_attn_implementation", "sdpa") == "eager":
            self._additive = model.get_input_embeddings().weight.dtype  # eager attention adds its mask

    @property
    def batch_size(self) -> int:
        return len(self.phys)

    @property
    def engine_stats(self) -> dict[str, float]:
        """The decode steps' shape (summed over sessions by the rollout): lock steps, rows they advanced, context;
        on the slot cache also the caches this session took from others (``model.engine.cache_memory``)."""
        stats = {"lock_steps": float(self.lock_steps), "row_steps": float(self.row_steps),
                 "context_tokens": float(self.context_tokens)}
        if self.static is not None:
            stats["caches_given_back"] = float(self.caches_taken)
        return stats

    @property
    def attn(self) -> torch.Tensor | None:
        """[B, T] the attention mask of each row's cache (1 = real token)."""
        if self._mask is None:
            return None
        return self._mask[self._rows(range(len(self.phys))), : self.width]

    def _rows(self, rows) -> torch.Tensor | slice:
        """The physical rows of ``rows`` as an index on the device (a slice when they are all rows in order)."""
        phys = [self.phys[i] for i in rows]
        if self._mask is not None and phys == list(range(self._mask.shape[0])):
            return slice(None)
        return self._to_device(torch.as_tensor(phys, dtype=torch.long))

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the model's device without waiting for the device (pinned, asynchronous on CUDA)."""
        if self.device.type == "cpu":
            return t
        return (t.pin_memory() if self.device.type == "cuda" else t).to(self.device, non_blocking=True)

    def _mask_columns(self, n: int, zero: bool = True) -> torch.Tensor:
        """The next ``n`` columns of the mask buffer (grown by doubling), zeroed unless ``zero`` is False (the caller
        writes every row); ``width`` advances by ``n``."""
        need = self.width + n
        if need > self._mask.shape[1]:
            grown = torch.zeros(self._mask.shape[0], max(need, 2 * self._mask.shape[1], 64), dtype=self._mask.dtype,
                                device=self.device)  # [P, capacity]
            grown[:, : self.width] = self._mask[:, : self.width]
            self._mask = grown
        cols = self._mask[:, self.width : need]
        if zero:
            cols.zero_()
        self.width = need
        return cols

    def _open(self, n: int) -> None:
        """The session's first rows: ``n`` of them (on the static path the physical rows are ``n`` rounded up)."""
        self.phys = list(range(n))
        self.next_pos = [0] * n
        if self.static is None:
            self._mask = torch.zeros(n, 64, dtype=torch.long, device=self.device)
            return
        rows = bucket(n)
        self.cache = None  # taken from the pool at the first forward, when the slots needed are known
        self._mask = torch.zeros(rows, 256, dtype=torch.bool, device=self.device)  # [P, C] seen

    # ------------------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def feed(self, blocks: Sequence[Sequence[int]]) -> None:
        """Append ``blocks[i]`` to row i (may be empty).  One forward pass for all rows (or column chunks of
        ``prefill_tokens`` positions); on the first feed with ``share_prefix``, rows sharing a prefix compute it once:
        one pass over the distinct prefixes, the cache rows copied to every row that shares them, one pass over what
        follows each prefix."""
        self._check_cache()
        if self.static is not None and not self._running:  # a lock step of `run` is part of that call
            self.static.begin()
        if self._mask is None:
            self._open(len(blocks))
            if self.share_prefix:
                plan = shared_prefixes(blocks)
                if plan is not None:
                    cluster_of, cut = plan
                    heads = cluster_heads(cluster_of)
                    if self.static is None:
                        self._open(len(heads))
                    else:  # the physical rows stay those of every row
                        self.phys, self.next_pos = self.phys[: len(heads)], self.next_pos[: len(heads)]
                    self._feed([blocks[i][: cut[i]] for i in heads])  # [C rows]
                    self.select(cluster_of)  # [B rows]: each row gets a copy of its prefix's keys and values
                    self._feed([b[k:] for b, k in zip(blocks, cut)])
                    return
        self._feed(blocks)

    def _feed(self, blocks: Sequence[Sequence[int]]) -> None:
        if len(blocks) != self.batch_size:
            raise ValueError(f"feed got {len(blocks)} blocks for {self.batch_size} rows")
        lens = [len(b) for b in blocks]
        if self._must_feed:  # after a rewind the logits of a row's last token are gone until it is fed again
            if min(lens, default=0) == 0:
                raise ValueError("feed after rewind: every row needs at least one token")
            self._must_feed = False
        if max(lens, default=0) == 0:
            return
        width = max(lens)
        rows = len(blocks) if self.static is None else self._mask.shape[0]  # the rows one forward computes
        chunk = max(1, self.prefill_tokens // rows) if self.prefill_tokens else width
        if width <= chunk:
            self._feed_block(blocks, lens)
            return
        if self.static is not None:  # room for the whole block at once: not a grown cache (a copy) per chunk
            self._reserve(reserved_slots(self.width + width))
        n = -(-width // chunk)
        cuts = [width * k // n for k in range(n + 1)]  # n column chunks of the blocks left-padded to `width`
        for lo, hi in zip(cuts, cuts[1:]):
            part = [b[max(0, lo - width + m) : max(0, hi - width + m)] for b, m in zip(blocks, lens)]
            self._feed_block(part, [len(b) for b in part])

    def _feed_block(self, blocks: Sequence[Sequence[int]], lens: list[int]) -> None:
        """One block (at most ``model.engine.prefill_tokens`` positions): one forward pass, or stages on CPUs."""
        if self.static is not None:
            self._forward_static(blocks)
            return
        cuts = None
        if self.staged_prefill and self.cache is not None and row_subset_cache_ok(self.cache):
            cuts = plan_stages(lens, self.width)
        if not cuts or len(cuts) == 1:
            self._forward(None, blocks)
            return
        # stage 1: every row, its first cuts[0] tokens; stage j: the rows still longer than cuts[j-1], their next
        # cuts[j] - cuts[j-1] tokens, forwarded on a copy of those rows' cache (see plan_stages)
        self._forward(None, [b[: cuts[0]] for b in blocks])
        for lo, hi in zip(cuts, cuts[1:]):
            rows = [i for i, n in enumerate(lens) if n > lo]
            self._forward(rows, [blocks[i][lo:hi] for i in rows])

    def _block(self, rows, n: int, width: int):
        """Host tensors of one block: ids, mask and positions ``[n, W]`` (see :meth:`_block_lists`)."""
        return tuple(torch.tensor(x, dtype=torch.long).view(n, width) for x in self._block_lists(rows, n, width))

    def _block_lists(self, rows, n: int, width: int) -> tuple[list[int], list[int], list[int]]:
        """One block's ids, mask and positions as flat row-major lists ``[n · W]``, left-padded within the block,
        from ``rows``: (line, row, block) triples; advances each row's next position.  Lists, converted once: per-row
        tensor writes cost more than a GPU's decode step at a hundred rows."""
        ids = [self.pad_id] * (n * width)  # [n * W], row-major
        mask = [0] * (n * width)  # [n * W]
        pos = [0] * (n * width)  # [n * W]
        for line, r, b in rows:
            start, k = self.next_pos[r], len(b)
            lo, mid, hi = line * width, line * width + width - k, (line + 1) * width
            pos[lo:mid] = [start] * (mid - lo)  # pads: any valid position, they are masked out
            if k:
                ids[mid:hi] = b
                mask[mid:hi] = [1] * k
                pos[mid:hi] = range(start, start + k)
            self.next_pos[r] = start + k
        return ids, mask, pos

    def _forward(self, rows: list[int] | None, blocks: Sequence[Sequence[int]]) -> None:
        """One forward pass appending ``blocks[k]`` to row ``rows[k]`` (``rows`` None: every row, in order).  A row
        subset runs on a copy of its rows' keys/values; the other rows get masked empty slots, so the cache stays
        rectangular."""
        width = max(len(b) for b in blocks)
        n = len(blocks)
        row_ids = range(n) if rows is None else rows
        ids, mask, pos = self._block(zip(range(n), row_ids, blocks), n, width)
        fed = torch.tensor([len(b) > 0 for b in blocks])  # [n]
        ids, mask, pos, fed = (self._to_device(t) for t in (ids, mask, pos, fed))
        self.fed_positions += n * width
        idx = None if rows is None else self._to_device(torch.as_tensor(rows, dtype=torch.long))
        if idx is None:
            before = self.width
            self._mask_columns(width).copy_(mask)
            attn = self._mask[:, : before + width]  # [B, T+W]
            cache = self.cache
        else:
            attn = torch.cat([self._mask[idx, : self.width], mask], dim=1)  # [n, T+W]
            cache = row_subset_cache(self.cache, idx)
        # the last position's logits only.  For a block (width > 1) as an index tensor: the model then gathers a
        # contiguous [n, 1, H] for its LM head, where the slice `logits_to_keep=1` takes is strided and torch's matmul
        # falls back to a batched product over n copies of the [H, V] head weight (measured on SmolLM2: 250 ms per
        # fed block in fp32, 4 s in bf16)
        keep = 1 if width == 1 else self._to_device(torch.tensor([width - 1]))
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=keep,
                         **{self._cache_arg: cache})
        self.forward_calls += 1
        logits = out.logits[:, -1].float()  # [n, V]
        if idx is None:
            self.cache = getattr(out, self._cache_arg)
            self.last_logits = logits if self.last_logits is None else torch.where(fed[:, None], logits,
                                                                                   self.last_logits)
            return
        append_row_subset(self.cache, getattr(out, self._cache_arg), idx, width)
        self._mask_columns(width)[idx] = mask
        self.last_logits[idx] = torch.where(fed[:, None], logits, self.last_logits[idx])

    def _forward_static(self, blocks: Sequence[Sequence[int]]) -> None:
        """One forward on the slot cache, at slots ``width … width+W-1``: a decode step (W = 1) runs every physical
        row (fixed shapes, the compiled step), or only the first ones while they hold every row that runs (after a
        rewind, or :meth:`_front`); a wider block the physical rows up to the last one in use.  Physical rows no row
        uses see their own pads.  A row's leading pads (a block shorter than the widest, in a row with no earlier
        token) see nothing: their queries are fully masked, and SDPA gives them 0 (its math path's safe softmax; the
        fused kernels do the same), nothing that any real token reads."""
        width = max(len(b) for b in blocks)
        if width == 1:
            rows = self._mask.shape[0]
        elif self._active is not None:  # few rows still run, in the first physical rows (`_front`)
            rows = max(p for p, b in zip(self.phys, blocks) if b) + 1
        else:
            rows = max(self.phys) + 1
        n = rows * width
        ids, mask, pos = self._block_lists(((p, r, b) for r, (p, b) in enumerate(zip(self.phys, blocks)) if p < rows),
                                           rows, width)
        live = set(self.phys)
        for p in range(rows):
            if p not in live:
                mask[p * width : (p + 1) * width] = [1] * width
        fed = [0] * rows  # [n]
        for p, b in zip(self.phys, blocks):
            if b:
                fed[p] = 1
        # one host-to-device copy of the step's inputs: ids, mask, positions [n · W] each, then fed [n]
        packed = self._to_device(torch.tensor(ids + mask + pos + fed, dtype=torch.long))
        ids, mask, pos = (packed[k * n : (k + 1) * n].view(rows, width) for k in range(3))
        fed = packed[3 * n :] > 0  # [n]
        start = self.width
        need = reserved_slots(start + width)
        self._reserve(need)
        view = need - 1  # slots attention reads
        every_row = rows == self._mask.shape[0]  # a decode step: every physical row is written
        self._mask_columns(width, zero=not every_row)[:rows] = mask  # copied as bool
        slots = torch.arange(start, start + width, device=self.device)  # [W]
        attn = block_mask(self._mask[:rows, :view], start, width, self._additive)  # [n, 1, W, view]
        if width == 1:
            # the inputs keep every physical row (one trace serves both cases), the step runs the first `ran`
            ran = min(self._active or rows, self._bound or rows)
            if hasattr(torch, "compiler"):
                torch.compiler.cudagraph_mark_step_begin()
            logits = self.static.decode(ids, pos, attn, slots, self.cache, ran)  # [ran, V]
        else:
            ran = rows
            logits = self.static.eager(ids, pos, attn, slots, self.cache, rows)  # [n, V]
        self.fed_positions += ran * width
        self.forward_calls += 1
        if self.last_logits is None:
            self.last_logits = torch.zeros(self._mask.shape[0], logits.shape[1], device=self.device)  # [P, V]
        if ran == self._mask.shape[0]:  # a new tensor, no copy back
            self.last_logits = torch.where(fed[:, None], logits, self.last_logits)  # [P, V]
        else:
            self.last_logits[:ran] = torch.where(fed[:ran, None], logits, self.last_logits[:ran])

    def _reserve(self, slots: int) -> None:
        """A slot cache with room for ``slots`` slots (from the pool, or this one grown: :func:`slot_capacity`)."""
        pool = self.static.pool
        if self.cache is None:
            dtype = self.model.get_input_embeddings().weight.dtype
            self.cache = pool.get(self, self.model, self._mask.shape[0], slot_capacity(slots), dtype, self.device)
        elif slots > self.cache.capacity:
            pool.grow(self, self.cache, slot_capacity(slots))
        if self._mask.shape[1] < self.cache.capacity:
            grown = torch.zeros(self._mask.shape[0], self.cache.capacity, dtype=torch.bool, device=self.device)
            grown[:, : self.width] = self._mask[:, : self.width]
            self._mask = grown

    def length(self, row: int) -> int:
        return self.next_pos[row] if self.next_pos else 0

    def give_back_cache(self) -> None:
        """The pool takes this session's slot cache for another (its memory limit, :class:`SlotPool`): the session
        holds nothing from now on; :meth:`rewind` says it cannot, and feeding or running it is an error."""
        self.cache, self._mask, self.last_logits = None, None, None
        self.phys, self.next_pos, self.width = [], [], 0
        self.given_back = True

    def _check_cache(self) -> None:
        if self.given_back:
            raise RuntimeError("this session's slot cache was given to another session (model.engine.cache_memory): "
                               "open a new session")

    @torch.no_grad()
    def rewind(self, keep: Sequence[int]) -> bool:
        """Cut row i back to its first ``keep[i]`` tokens (:mod:`sglightning.engines.rewind`): one gather per layer
        moves the kept keys and values to the first slots.  False where the cache cannot be cut (a sliding-window,
        quantised or older dynamic cache) or nothing would be kept."""
        if self.given_back:
            return False
        keep = [int(k) for k in keep]
        if len(keep) != self.batch_size:
            raise ValueError(f"rewind got {len(keep)} lengths for {self.batch_size} rows")
        for i, (k, n) in enumerate(zip(keep, self.next_pos)):
            if not 0 <= k <= n:
                raise ValueError(f"rewind: row {i} holds {n} tokens, cannot keep {k}")
        width = max(keep, default=0)
        if self._mask is None or width == 0:
            return False
        if self.static is None:
            if self.cache is None or not row_subset_cache_ok(self.cache):
                return False
            index, valid = kept_slots(self._mask[:, : self.width] > 0, self._to_device(torch.tensor(keep)), width)
            for layer in self.cache.layers:
                layer.keys, layer.values = gather_slots(layer.keys, index), gather_slots(layer.values, index)
            self._mask = torch.zeros(self._mask.shape[0], max(64, width), dtype=torch.long, device=self.device)
            self._mask[:, :width] = valid
        else:
            self._rewind_static(keep, width)
        self.width = width
        self.next_pos = keep
        self._must_feed = True
        return True

    def _rewind_static(self, keep: list[int], width: int) -> None:
        """:meth:`rewind` on the slot cache: the rows move to the first physical rows too, and from then on decode
        steps run only those, rounded up to a power of two (a step runs every physical row it is given and reads
        each one's keys and values).  The cache stays: a new one would give the compiled step new addresses."""
        n = len(keep)
        src = self._to_device(torch.tensor(self.phys))  # [n]
        index, valid = kept_slots(self._mask[src, : self.width], self._to_device(torch.tensor(keep)), width)
        for t in self.cache.keys + self.cache.values:
            # the slots in use only (the capacity may be far more); in place: the compiled step's addresses stay
            t[:n, :, :width] = gather_slots(t[src, :, : self.width], index)
        self._mask[:, : self.width] = False
        self._mask[:n, :width] = valid
        self.phys = list(range(n))
        self._bound = bucket(n)

    def _copy_rows(self, dst: list[int], src: list[int]) -> None:
        """Slot cache: physical rows ``src`` copied onto rows ``dst`` (mask, keys and values, logits), each source read
        before anything is written, so ``dst`` and ``src`` may overlap (a swap is ``a + b`` onto ``b + a``)."""
        s, d = (self._to_device(torch.as_tensor(x, dtype=torch.long)) for x in (src, dst))
        self._mask[d] = self._mask[s]
        if self.cache is not None:
            self.cache.copy_rows(d, s, self.width)
        if self.last_logits is not None:
            self.last_logits[d] = self.last_logits[s]

    def select(self, keep: Sequence[int]) -> None:
        """Keep only rows ``keep`` (in that order).  The dynamic cache drops the others; the slot cache keeps its
        physical rows and only copies where a row is kept twice (a shared prefix handed to several rows)."""
        if self.given_back:
            return  # nothing held: the next rewind says so
        keep = list(keep)
        self.next_pos = [self.next_pos[i] for i in keep]
        if self.static is not None:
            src = [self.phys[i] for i in keep]
            if len(set(src)) == len(src):
                self.phys = src
                return
            dst = list(range(len(keep)))
            self._bound = None  # the copies may land past it
            self._copy_rows(dst, src)
            self.phys = dst
            return
        idx = self._to_device(torch.as_tensor(keep, dtype=torch.long))
        if self.cache is not None:
            self.cache.batch_select_indices(idx)
        self._mask = self._mask[idx]
        self.phys = list(range(len(keep)))
        if self.last_logits is not None:
            self.last_logits = self.last_logits[idx]

    # ------------------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def run(self, programs: Sequence[list[Segment]]) -> list[list[Piece]]:
        """Execute one program per row (all current rows); returns the pieces of each row in order.

        One forward per lock step.  In a step each row appends a block: at most one sampled token (drawn from the
        logits of the previous step, so only as the block's first token), then every token that needs no sampling
        — the rest of a ``Force``, a ``Free`` segment's closing tokens, a ``Choice``'s single-continuation tokens —
        up to the next token that must be sampled.  Forced runs thus cost no extra forward (the samples and their
        log-probs are those of feeding one token per step: every sampled token still sees exactly the context
        before it).  The step's samples are drawn together (:func:`draw`).  Once at most a quarter of the rows still
        run their program, the steps left run those rows only (``few_rows_alone``: :meth:`_front`, :meth:`_split`)."""
        self._check_cache()
        if self.static is not None:
            self.static.begin()
        if len(programs) != self.batch_size:
            raise ValueError(f"run got {len(programs)} programs for {self.batch_size} rows")
        if self.last_logits is None or self._must_feed:
            raise RuntimeError("feed a prompt before running programs")
        rows = [ProgramState(list(p)) for p in programs]
        blocks = [st.written() for st in rows]  # what each row writes before its first sample
        # the session the lock steps feed: this one, or once few rows still run, one of those rows only (`_split`)
        target, where = self, list(range(len(rows)))  # where[i]: row i's row in target
        running, start = [], 0
        self._running = True
        try:
            while True:
                want = [i for i, st in enumerate(rows) if not st.done and not blocks[i]]  # rows that sample now
                if want:
                    logits = target.last_logits[target._rows([where[i] for i in want])]  # [R, V]
                    with phase("rollout/draw"):
                        logp = torch.log_softmax(logits / self.temperature, dim=-1)  # [R, V]
                        drawn = draw(logp, [rows[i].restriction() for i in want], self.top_k, self.greedy,
                                     self.generator, self._table)
                    for i, (tok, logq, full, used) in zip(want, drawn):
                        rows[i].take(tok, logq, full, used)
                        blocks[i] = [tok] + rows[i].written()
                if not any(blocks):
                    break
                moving = [i for i, b in enumerate(blocks) if b]
                self.lock_steps += 1
                self.row_steps += len(moving)
                self.context_tokens += sum(target.next_pos[where[i]] for i in moving)
                with phase("rollout/decode"):
                    target.feed(blocks if target is self else [blocks[i] for i in running])
                blocks = [[] for _ in rows]
                if target is self and self._active is None:
                    running = [i for i, st in enumerate(rows) if not st.done]
                    if running and self._few(len(running)):
                        if self.static is not None:
                            self._front(running)
                        else:
                            start, target = self.width, self._split(running)
                            where = {i: k for k, i in enumerate(running)}
            if target is not self:
                self._join(target, running, start)
        finally:
            self._active = None  # the next turn's decode steps run every physical row again
            self._running = False
        return [st.pieces for st in rows]

    # ------------------------------------------------------------------------------------------------------------------
    def _few(self, running: int) -> bool:
        """Whether ``running`` rows are few enough to go on alone: a decode step runs every row of its cache (every
        physical row on the slot cache) and reads each one's keys and values, and most have finished their turn."""
        rows = len(self.phys) if self.static is None else (self._bound or self._mask.shape[0])
        if not (self.few_rows_alone and rows >= 8 and running <= rows // 4):
            return False
        # a dynamic cache must be one that can be cut by rows (not sliding-window or quantised); checked last: every
        # lock step asks, and this walks the layers
        return self.static is not None or row_subset_cache_ok(self.cache)

    def _front(self, rows: list[int]) -> None:
        """Slot cache: ``rows`` move to the first physical rows (each swapped with a row there that is not among
        them) and decode steps run only those, rounded up to a bucket, until :meth:`run` ends.  The rows behind keep
        their keys and values and are masked at the slots they skip."""
        k = len(rows)
        wanted = set(rows)
        out = [i for i, p in enumerate(self.phys) if i in wanted and p >= k]  # to move to the front
        free = sorted(set(range(k)) - {self.phys[i] for i in rows})  # front physical rows to take
        if out:
            owner = {p: i for i, p in enumerate(self.phys)}
            a = [self.phys[i] for i in out]  # physical rows of the rows moving in
            b = free[: len(out)]  # the front physical rows they take
            self._copy_rows(a + b, b + a)  # a swap
            for i, pa, pb in zip(out, a, b):
                if pb in owner:
                    self.phys[owner[pb]] = pa
                self.phys[i] = pb
        self._active = bucket(k)

    def _split(self, rows: list[int]) -> DecodeSession:
        """Dynamic cache: a session of ``rows`` only, holding copies of their keys, values, mask and logits at the
        same slots (the lock steps left run there; :meth:`_join` brings them back)."""
        sub = DecodeSession(self.model, self.pad_id, self.temperature, self.generator, self.top_k, self.greedy,
                            share_prefix=False, staged_prefill=False, restrictions=self._table)
        src = self._to_device(torch.tensor(rows))  # [k] (the dynamic cache's rows are the session's)
        sub.phys, sub.next_pos = list(range(len(rows))), [self.next_pos[i] for i in rows]
        sub.cache, sub._mask = row_subset_cache(self.cache, src), self._mask[src]  # [k, H, T, d], [k, capacity]
        sub.width, sub.last_logits = self.width, self.last_logits[src]
        return sub

    def _join(self, sub: DecodeSession, rows: list[int], start: int) -> None:
        """The lock steps ``sub`` ran for ``rows`` (slots ``start …``) written back: those rows' keys, values, mask
        and logits; every other row gets pads there, as if it had been fed nothing in those steps."""
        steps = sub.width - start
        src = self._to_device(torch.tensor(rows))  # [k]
        if steps:
            append_row_subset(self.cache, sub.cache, src, steps)
            self._mask_columns(steps)[src] = sub._mask[:, start : sub.width]
        self.last_logits[src] = sub.last_logits
        for i, pos in zip(rows, sub.next_pos):
            self.next_pos[i] = pos
        self.forward_calls += sub.forward_calls
        self.fed_positions += sub.fed_positions


def check_generator(generator: torch.Generator | None, device: torch.device) -> None:
    """A sampling generator must live on the model's device (torch refuses a CPU generator for CUDA tensors, deep in
    the first draw): one line naming both, where the generator is first used."""
    if generator is not None and torch.device(generator.device).type != torch.device(device).type:
        raise ValueError(f"the sampling generator is on {generator.device} but the model is on {device}: make it "
                         "with sglightning.data.sampling_generator(..., device=<the model's device>)")
