"""Lock-step batched decoding with a persistent KV cache, driven by per-row *segment programs*.

A program is a list of segments that one row (one episode) must produce in order:

* :class:`Force` — tokens we write (``Label:``, ``Action:``); context, not policy tokens;
* :class:`Free` — tokens the model samples until a stop token or a length cap (policy tokens);
* :class:`Choice` — tokens sampled from the model's distribution restricted, token by token, to a set of allowed
  continuations (three label words, or the admissible actions): still the model's own choice, never a parse failure.

All rows advance one token per forward pass; a finished row feeds a masked pad.  Context blocks of different lengths
(prompts, environment observations) are left-padded *within the block*, so pads can sit in the middle of a row's
cache: they are masked out and positions are counted per row, which makes the result identical (up to float rounding)
to a clean unpadded forward.  Where the blocks' lengths differ a lot, they are fed in stages (:func:`plan_stages`:
all rows up to a cut, then only the rows still longer, on a copy of their cache) instead of padding every row to the
longest.  Rows whose episode ended are dropped from the cache.

What gets recorded for every token: its id (exactly as sampled — nothing is re-tokenised later), whether the policy
wrote it, and its kind (context / guidance / action).  For a policy token also the log-probability of the distribution
it was *actually drawn from*, at the sampling temperature: when sampling was restricted to a set A of tokens (a
``Choice``'s allowed continuations, a ``Free`` segment's banned tokens, top-k), that is the renormalised

    log q(y) = log π(y) − log Σ_{a∈A} π(a)          (A = every token but the banned ones, for an exclusion)

together with the :class:`Restriction` A itself, so that the trainer can score log q_θ over the same set; the
unrestricted log π(y) is kept beside it as a diagnostic.  A ``Choice`` token with a single allowed continuation
involved no choice: it is recorded as context (no policy token, no log-prob), like a forced token.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sglightning.episodes import KIND_ACTION, KIND_CONTEXT, Piece, Restriction


@dataclass
class Force:
    #: ids to write, or a function of the pieces produced so far in this program (e.g. "\nLabel:" vs "Label:")
    ids: Sequence[int] | Callable[[list[Piece]], Sequence[int]]
    kind: int = KIND_CONTEXT


@dataclass
class Free:
    max_tokens: int
    stop_ids: frozenset[int]  # sampling one of these ends the segment (the stop token is kept, as a policy token)
    kind: int = KIND_ACTION
    banned_ids: frozenset[int] = frozenset()  # never sampled in this segment (e.g. end-of-turn inside a reason)
    close_with: Sequence[int] = ()  # forced when the cap is hit without a stop (e.g. a newline)


@dataclass
class Choice:
    options: Sequence[Sequence[int]]  # prefix-free token sequences
    kind: int = KIND_ACTION


Segment = Force | Free | Choice


def log_mass(logp: torch.Tensor, restriction: Restriction) -> torch.Tensor:
    """Log Σ_{a∈A} π(a) for a row of log-probabilities ``logp`` [V] (or rows [R, V] sharing one restriction)."""
    sel = logp[..., list(restriction.ids)]  # [..., K]
    lse = torch.logsumexp(sel, dim=-1)  # [...]
    if not restriction.exclude:
        return lse
    return complement_log_mass(lse)


def complement_log_mass(lse: torch.Tensor) -> torch.Tensor:
    """log(1 − e^lse): the log-mass of everything but a set whose log-mass is ``lse`` (≤ 0), stable near both ends."""
    return torch.log(-torch.expm1(lse.clamp(max=-1e-20)))


def build_trie(options: Sequence[Sequence[int]]) -> dict:
    """Nested dict token -> child; a leaf is ``{}`` and carries the option index under key -1."""
    root: dict = {}
    for idx, opt in enumerate(options):
        if not opt:
            raise ValueError("Choice option with no tokens")
        node = root
        for tok in opt:
            if -1 in node:
                raise ValueError("Choice options are not prefix-free")
            node = node.setdefault(int(tok), {})
        if node and -1 not in node:
            raise ValueError("Choice options are not prefix-free")
        node.setdefault(-1, idx)
    return root


class _RowState:
    def __init__(self, program: list[Segment]):
        self.program = program
        self.seg = 0
        self.pieces: list[Piece] = []
        self.piece: Piece | None = None
        self.force_ids: list[int] = []
        self.node: dict | None = None  # trie node (Choice)
        self.banned: Restriction | None = None  # a Free segment's banned tokens, as a restriction
        # a capped Free segment's closing tokens: set when the cap is hit and written in the same step, so once set
        # the segment ends at the next advance
        self.pending_close: list[int] = []
        self.done = not program

    def start_segment(self) -> None:
        seg = self.program[self.seg]
        self.piece = Piece(kind=seg.kind)
        if isinstance(seg, Force):
            self.force_ids = list(seg.ids(self.pieces) if callable(seg.ids) else seg.ids)
        elif isinstance(seg, Choice):
            self.node = build_trie(seg.options)
        elif isinstance(seg, Free):
            self.banned = Restriction(tuple(sorted(seg.banned_ids)), exclude=True) if seg.banned_ids else None
        self.pending_close = []

    def advance(self) -> None:
        """Close finished segments and open the next one, until a segment wants a token (or none is left); a
        ``Free`` segment that hit its cap without a stop token first asks for its closing tokens (``pending_close``)."""
        while not self.done:
            if self.piece is None:
                self.start_segment()
            seg = self.program[self.seg]
            if isinstance(seg, Force):
                if len(self.piece.ids) < len(self.force_ids):
                    return
            elif isinstance(seg, Free):
                if not (self.pending_close or (self.piece.ids and self.piece.hit_stop)):
                    if sum(self.piece.policy) < seg.max_tokens:
                        return
                    if seg.close_with:
                        self.pending_close = list(seg.close_with)
                        return
            elif -1 not in self.node:  # Choice: not at a leaf yet
                return
            else:
                self.piece.choice_index = self.node[-1]
            self.end_segment()

    def end_segment(self) -> None:
        assert self.piece is not None
        self.pieces.append(self.piece)
        self.piece = None
        self.seg += 1
        self.done = self.seg >= len(self.program)


class Decoder(abc.ABC):
    """What :class:`~sglightning.rollout.Rollout` needs from a generation engine: a batch of rows (one per live
    episode) that context can be appended to and segment programs run on.  A new backend (e.g. a vLLM server with
    adapter sync) subclasses this in one file and is named in the config (``model.decoder``); it is called as
    ``decoder(model, pad_id, temperature, generator, top_k, greedy)`` once per batch of rows and must record, for
    every token, what :class:`Piece` records (the id, the policy flag, the log-prob of the distribution it was drawn
    from and that distribution's restriction)."""

    #: forward passes so far (logged)
    forward_calls: int = 0

    @abc.abstractmethod
    def feed(self, blocks: Sequence[Sequence[int]]) -> None:
        """Append ``blocks[i]`` (token ids, maybe empty) to row i."""

    @abc.abstractmethod
    def select(self, keep: Sequence[int]) -> None:
        """Keep only rows ``keep``, in that order."""

    @abc.abstractmethod
    def run(self, programs: Sequence[list[Segment]]) -> list[list[Piece]]:
        """Run one program per row; return each row's pieces."""

    @abc.abstractmethod
    def length(self, row: int) -> int:
        """Tokens in row ``row`` so far (context included)."""


#: ``decoder(model, pad_id, temperature, generator, top_k, greedy)`` -> a :class:`Decoder` for one batch of rows
DecoderFactory = Callable[[torch.nn.Module, int, float, "torch.Generator | None", int, bool], Decoder]


def plan_stages(lens: Sequence[int], cached: int, copy_cost: float = 1 / 64, pass_cost: float = 48) -> list[int]:
    """How to feed blocks of unequal lengths: cumulative cut widths ``c_1 < … < c_m = max(lens)``.

    One forward over all rows pads every block to the longest, and a padded position costs as much as a real one
    (a turn's observations of 46 to 183 tokens for 16 rows were ~40 % padding in a twc rollout).  Fed in stages,
    stage 1 gives every row its first ``c_1`` tokens and stage ``j`` gives the rows longer than ``c_{j-1}`` their
    next ``c_j - c_{j-1}`` tokens, on a copy of those rows' cache.  Chosen by dynamic programming over the distinct
    lengths to minimise, in units of one position's forward,

        Σ_j n_j · (c_j − c_{j−1})  +  Σ_{j≥2} (n_j · cached · copy_cost + pass_cost)

    with ``n_1`` = all rows and ``n_j`` = rows longer than ``c_{j−1}``: the positions computed, plus copying a
    stage's rows' ``cached`` positions of keys/values (``copy_cost``: a cached position's keys and values across
    the layers are ~1/100 of a position's forward FLOPs in bytes moved, on a memory-bound CPU) and a pass's fixed
    cost (``pass_cost``: every pass reads all the weights; a 16-row decode step of SmolLM2-135M on 2 CPU cores costs
    about as much as 50 prefill positions).  Decode steps (blocks of a few tokens) are therefore fed in one pass;
    a turn's observations are cut where the lengths jump.  Returns ``[max(lens)]`` when one pass is cheapest."""
    n = len(lens)
    top = max(lens)
    points = [0] + sorted({x for x in lens if 0 < x < top}) + [top]
    longer = [sum(1 for x in lens if x > p) for p in points]  # rows still to feed after points[i]
    best = [0.0] + [float("inf")] * (len(points) - 1)
    back = [0] * len(points)
    for j in range(1, len(points)):
        for i in range(j):
            rows = n if i == 0 else longer[i]
            cost = best[i] + rows * (points[j] - points[i]) + (0 if i == 0 else rows * cached * copy_cost + pass_cost)
            if cost < best[j]:
                best[j], back[j] = cost, i
    cuts, j = [], len(points) - 1
    while j > 0:
        cuts.append(points[j])
        j = back[j]
    return cuts[::-1]


def _row_subset_cache_ok(cache) -> bool:
    """Staged feeding needs plain full-attention layers holding ``keys``/``values`` tensors (transformers >= 4.56
    ``DynamicLayer``); sliding-window, quantised or older caches are fed in one pass."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:
        return False
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer and layer.keys is not None for layer in layers)


def _row_subset_cache(cache, idx: torch.Tensor):
    """A new cache holding copies of rows ``idx`` of ``cache``'s keys/values: [n, heads, T, d] per layer."""
    from transformers.cache_utils import DynamicCache

    sub = DynamicCache()
    for i, layer in enumerate(cache.layers):
        sub.update(layer.keys[idx], layer.values[idx], i)
    return sub


def _append_row_subset(cache, sub, idx: torch.Tensor, width: int) -> None:
    """Append the last ``width`` positions of ``sub`` (rows ``idx``) to ``cache``; the other rows get zeros there
    (masked out: they attend to nothing)."""
    for layer, part in zip(cache.layers, sub.layers):
        for name in ("keys", "values"):
            full = getattr(layer, name)  # [B, H, T, d]
            new = getattr(part, name)[:, :, -width:]  # [n, H, W, d]
            slots = full.new_zeros(full.shape[0], full.shape[1], width, full.shape[3])  # [B, H, W, d]
            slots[idx] = new
            setattr(layer, name, torch.cat([full, slots], dim=2))


def shared_prefixes(blocks: Sequence[Sequence[int]], min_shared: int = 8) -> tuple[list[int], list[int]] | None:
    """Group rows whose blocks share a prefix of at least ``min_shared`` tokens, so as to compute the most once.

    Rows are sorted by their ids, so that rows with long common prefixes are neighbours; a cluster is a run of
    neighbours, its shared length the shortest common prefix inside the run, and it saves (rows − 1) × shared length.
    A run is split where that saves more: two tasks' prompts share a system prompt, but each task's G rows share far
    more (the whole task prompt), so ``[system + A] × 4, [system + B] × 4`` becomes two clusters, not one.  A row alone
    is its own cluster (its whole block).  Returns (``cluster_of`` [B]: each row's cluster, numbered in order of
    first appearance; ``cut`` [B]: how many leading tokens of the row come from its cluster's shared prefix), or None
    when sharing would save fewer than ``min_shared`` token computations."""
    n = len(blocks)
    order = sorted(range(n), key=lambda i: tuple(blocks[i]))
    lcp = [_common_prefix(blocks[a], blocks[b]) for a, b in zip(order, order[1:])]  # [n-1] neighbours' prefixes

    def best(lo: int, hi: int) -> tuple[int, list[tuple[int, int, int]]]:
        """Most tokens saved by splitting sorted rows lo..hi into runs, and those runs (first, last, shared)."""
        if lo == hi:
            return 0, [(lo, hi, len(blocks[order[lo]]))]
        k = min(range(lo, hi), key=lambda j: lcp[j])  # the weakest link
        (s_left, left), (s_right, right) = best(lo, k), best(k + 1, hi)
        split = s_left + s_right, left + right
        if lcp[k] < min_shared:
            return split
        whole = (hi - lo) * lcp[k]
        return (whole, [(lo, hi, lcp[k])]) if whole >= split[0] else split

    saved, runs = best(0, n - 1) if n else (0, [])
    if saved < min_shared:
        return None
    run_of, shared = {}, []
    for r, (lo, hi, k) in enumerate(runs):
        shared.append(k)
        for j in range(lo, hi + 1):
            run_of[order[j]] = r
    number: dict[int, int] = {}
    cluster_of = [number.setdefault(run_of[i], len(number)) for i in range(n)]
    cut = [shared[run_of[i]] for i in range(n)]
    return cluster_of, cut


def cluster_heads(cluster_of: Sequence[int]) -> list[int]:
    """The first row of each cluster of :func:`shared_prefixes`, in cluster order (clusters are numbered by first
    appearance): the rows whose prefix is computed for the cluster."""
    heads: dict[int, int] = {}
    for row, c in enumerate(cluster_of):
        heads.setdefault(c, row)
    return [heads[c] for c in range(len(heads))]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    k = 0
    for x, y in zip(a, b):
        if x != y:
            break
        k += 1
    return k


class DecodeSession(Decoder):
    """A batch of rows sharing one KV cache.  ``feed`` appends context; ``run`` executes segment programs.  The
    default :class:`Decoder`: batched forwards of the (peft) model itself."""

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
    ):
        """``share_prefix``: the first :meth:`feed` computes a prefix that several rows share (a group's G episodes
        start from one prompt) once and copies its cache to those rows (:func:`shared_prefixes`); False = every row
        computes its whole block.  ``staged_prefill``: context blocks of unequal lengths are fed in stages (the
        rows still longer than a cut, on a copy of their cache) when :func:`plan_stages` finds that computes fewer
        positions than padding every row to the longest block; False = always one padded pass; None (default) = on
        CPUs only (the cost model is a CPU's, where a padded position costs a real one's FLOPs; on a GPU padding is
        nearly free at these sizes and each extra pass costs latency — not measured there)."""
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.model = model
        self.pad_id = pad_id
        self.temperature = temperature
        self.generator = generator
        self.top_k = top_k
        self.greedy = greedy
        self.cache = None
        self.attn: torch.Tensor | None = None  # [B, T] 1 = real token
        self.next_pos: torch.Tensor | None = None  # [B] position of the next real token
        self.last_logits: torch.Tensor | None = None  # [B, V] logits predicting each row's next token
        self.forward_calls = 0
        self.share_prefix = share_prefix
        self.device = next(model.parameters()).device
        self.staged_prefill = self.device.type == "cpu" if staged_prefill is None else staged_prefill
        self.fed_positions = 0  # row × position slots forwarded by `feed` (padding included): the prefill's work
        self._cache_arg = cache_argument_name(model)

    @property
    def batch_size(self) -> int:
        return 0 if self.attn is None else self.attn.shape[0]

    # ------------------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def feed(self, blocks: Sequence[Sequence[int]]) -> None:
        """Append ``blocks[i]`` to row i (may be empty).  One forward pass for all rows; on the first feed with
        ``share_prefix``, rows sharing a prefix compute it once: one pass over the distinct prefixes, the cache rows
        copied to every row that shares them, one pass over what follows each prefix."""
        if self.attn is None and self.share_prefix:
            plan = shared_prefixes(blocks)
            if plan is not None:
                cluster_of, cut = plan
                self._feed([blocks[i][: cut[i]] for i in cluster_heads(cluster_of)])  # [C rows]
                self.select(cluster_of)  # [B rows]: each row gets a copy of its prefix's keys and values
                self._feed([b[k:] for b, k in zip(blocks, cut)])
                return
        self._feed(blocks)

    def _feed(self, blocks: Sequence[Sequence[int]]) -> None:
        if self.attn is None:
            n = len(blocks)
            self.attn = torch.zeros(n, 0, dtype=torch.long, device=self.device)
            self.next_pos = torch.zeros(n, dtype=torch.long, device=self.device)
        if len(blocks) != self.batch_size:
            raise ValueError(f"feed got {len(blocks)} blocks for {self.batch_size} rows")
        lens = [len(b) for b in blocks]
        if max(lens, default=0) == 0:
            return
        cuts = None
        if self.staged_prefill and self.cache is not None and _row_subset_cache_ok(self.cache):
            cuts = plan_stages(lens, int(self.attn.shape[1]))
        if not cuts or len(cuts) == 1:
            self._forward(None, blocks)
            return
        # stage 1: every row, its first cuts[0] tokens; stage j: the rows still longer than cuts[j-1], their next
        # cuts[j] - cuts[j-1] tokens, forwarded on a copy of those rows' cache (see plan_stages)
        self._forward(None, [b[: cuts[0]] for b in blocks])
        for lo, hi in zip(cuts, cuts[1:]):
            rows = [i for i, n in enumerate(lens) if n > lo]
            self._forward(rows, [blocks[i][lo:hi] for i in rows])

    def _forward(self, rows: list[int] | None, blocks: Sequence[Sequence[int]]) -> None:
        """One forward pass appending ``blocks[k]`` to row ``rows[k]`` (``rows`` None: every row, in order).  A row
        subset runs on a copy of its rows' keys/values; the other rows get masked empty slots, so the cache stays
        rectangular."""
        width = max(len(b) for b in blocks)
        n = len(blocks)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)  # [n, W] left-padded within the block
        mask = torch.zeros(n, width, dtype=torch.long)  # [n, W]
        pos = torch.zeros(n, width, dtype=torch.long)  # [n, W]
        lens = torch.tensor([len(b) for b in blocks], dtype=torch.long)  # [n]
        idx = None if rows is None else torch.as_tensor(rows, dtype=torch.long, device=self.device)
        start = (self.next_pos if idx is None else self.next_pos[idx]).cpu()
        for i, b in enumerate(blocks):
            if b:
                ids[i, width - len(b) :] = torch.as_tensor(list(b), dtype=torch.long)
                mask[i, width - len(b) :] = 1
                pos[i, width - len(b) :] = start[i] + torch.arange(len(b))
            pos[i, : width - len(b)] = start[i]  # pads: any valid position, they are masked out
        ids, mask, pos = ids.to(self.device), mask.to(self.device), pos.to(self.device)
        self.fed_positions += n * width
        if idx is None:
            attn = torch.cat([self.attn, mask], dim=1)  # [B, T+W]
            cache = self.cache
        else:
            attn = torch.cat([self.attn[idx], mask], dim=1)  # [n, T+W]
            cache = _row_subset_cache(self.cache, idx)
        # the last position's logits only.  For a block (width > 1) as an index tensor: the model then gathers a
        # contiguous [n, 1, H] for its LM head, where the slice `logits_to_keep=1` takes is strided and torch's matmul
        # falls back to a batched product over n copies of the [H, V] head weight (measured on SmolLM2: 250 ms per
        # fed block in fp32, 4 s in bf16)
        keep = 1 if width == 1 else torch.tensor([width - 1], device=self.device)
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=keep,
                         **{self._cache_arg: cache})
        self.forward_calls += 1
        logits = out.logits[:, -1].float()  # [n, V]
        fed = (lens > 0).to(self.device)  # [n]
        if idx is None:
            self.cache = getattr(out, self._cache_arg)
            self.last_logits = logits if self.last_logits is None else torch.where(fed[:, None], logits,
                                                                                   self.last_logits)
            self.attn = attn
            self.next_pos = self.next_pos + lens.to(self.device)
            return
        _append_row_subset(self.cache, getattr(out, self._cache_arg), idx, width)
        full_mask = torch.zeros(self.batch_size, width, dtype=self.attn.dtype, device=self.device)  # [B, W]
        full_mask[idx] = mask
        self.attn = torch.cat([self.attn, full_mask], dim=1)
        self.last_logits[idx] = torch.where(fed[:, None], logits, self.last_logits[idx])
        self.next_pos[idx] += lens.to(self.device)

    def length(self, row: int) -> int:
        return 0 if self.next_pos is None else int(self.next_pos[row])

    def select(self, keep: Sequence[int]) -> None:
        """Keep only rows ``keep`` (in that order), dropping the others from the cache."""
        idx = torch.as_tensor(list(keep), dtype=torch.long, device=self.device)
        if self.cache is not None:
            self.cache.batch_select_indices(idx)
        self.attn = self.attn[idx]
        self.next_pos = self.next_pos[idx]
        if self.last_logits is not None:
            self.last_logits = self.last_logits[idx]

    # ------------------------------------------------------------------------------------------------------------------
    def _sample(self, logp_row: torch.Tensor, restriction: Restriction | None
                ) -> tuple[int, float, float, Restriction | None]:
        """Sample one token from ``logp_row`` [V] (already temperature-scaled), within ``restriction`` and top-k.

        Returns (token, log q of the distribution it was drawn from, unrestricted log π, the restriction that
        applied — top-k included — or None)."""
        scores = logp_row
        if restriction is not None:
            keep = torch.as_tensor(restriction.ids, dtype=torch.long, device=scores.device)
            if restriction.exclude:
                scores = scores.clone()
                scores[keep] = float("-inf")
            else:
                scores = torch.full_like(scores, float("-inf"))
                scores[keep] = logp_row[keep]
        if self.top_k and (restriction is None or restriction.exclude):
            k = min(self.top_k, int(torch.isfinite(scores).sum()))
            top = torch.topk(scores, k).indices
            restriction = Restriction(tuple(sorted(int(t) for t in top)))  # the set actually sampled from
            scores = torch.full_like(scores, float("-inf"))
            scores[top] = logp_row[top]
        if self.greedy:
            tok = int(torch.argmax(scores))
        else:
            tok = int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=self.generator))
        full = logp_row[tok]
        logq = full - log_mass(logp_row, restriction) if restriction is not None else full
        return tok, float(logq), float(full), restriction

    @torch.no_grad()
    def run(self, programs: Sequence[list[Segment]]) -> list[list[Piece]]:
        """Execute one program per row (all current rows); returns the pieces of each row in order.

        One forward per lock step.  In a step each row appends a block: at most one sampled token (drawn from the
        logits of the previous step, so only as the block's first token), then every token that needs no sampling
        — the rest of a ``Force``, a ``Free`` segment's closing tokens, a ``Choice``'s single-continuation tokens —
        up to the next token that must be sampled.  Forced runs thus cost no extra forward (the samples and their
        log-probs are those of feeding one token per step: every sampled token still sees exactly the context
        before it)."""
        if len(programs) != self.batch_size:
            raise ValueError(f"run got {len(programs)} programs for {self.batch_size} rows")
        if self.last_logits is None:
            raise RuntimeError("feed a prompt before running programs")
        rows = [_RowState(list(p)) for p in programs]
        while True:
            logp = None
            step_tokens: list[list[int]] = [[] for _ in rows]
            for i, st in enumerate(rows):
                block = step_tokens[i]
                while True:
                    st.advance()
                    if st.done:
                        break
                    seg = st.program[st.seg]
                    piece = st.piece
                    if isinstance(seg, Force):
                        rest = st.force_ids[len(piece.ids):]
                        for tok in rest:
                            piece.add(tok, 0.0, False)
                        block.extend(rest)
                        continue
                    if isinstance(seg, Free) and st.pending_close:
                        for tok in st.pending_close:
                            piece.add(tok, 0.0, False)
                        block.extend(st.pending_close)
                        continue
                    if isinstance(seg, Choice):
                        restriction = st.node.get(-2)  # the node's allowed continuations, built once per node
                        if restriction is None:
                            restriction = st.node[-2] = Restriction(tuple(sorted(t for t in st.node if t >= 0)))
                        if len(restriction.ids) == 1:  # one way on: no choice was made, so no policy token
                            tok = restriction.ids[0]
                            piece.add(tok, 0.0, False)
                            piece.forced += 1
                            st.node = st.node[tok]
                            block.append(tok)
                            continue
                    if block:  # a sampled token needs the logits after everything before it: next step
                        break
                    if logp is None:
                        logp = torch.log_softmax(self.last_logits / self.temperature, dim=-1)  # [B, V]
                    if isinstance(seg, Free):
                        tok, logq, full, used = self._sample(logp[i], st.banned)
                        piece.add(tok, logq, True, used, full)
                        if tok in seg.stop_ids:
                            piece.hit_stop = True
                    else:
                        tok, logq, full, used = self._sample(logp[i], restriction)
                        piece.add(tok, logq, True, used, full)
                        st.node = st.node[tok]
                    block.append(tok)
            if not any(step_tokens):
                break
            self.feed(step_tokens)
        return [st.pieces for st in rows]


def _cached(tokenizer, key: str, build):
    cached = getattr(tokenizer, key, None)
    if cached is not None:
        return cached
    value = build()
    try:
        setattr(tokenizer, key, value)
    except AttributeError:
        pass
    return value


def token_texts(tokenizer) -> list[str]:
    """The text of every vocabulary token, decoded alone (cached on the tokenizer object)."""
    return _cached(tokenizer, "_sglightning_token_texts",
                   lambda: [tokenizer.decode([i]) for i in range(len(tokenizer))])


def newline_token_ids(tokenizer) -> frozenset[int]:
    """Ids of all vocabulary tokens whose text contains a newline (cached on the tokenizer object)."""
    return _cached(tokenizer, "_sglightning_newline_ids",
                   lambda: frozenset(i for i, t in enumerate(token_texts(tokenizer)) if "\n" in t))


def closing_tokens(tokenizer, closer: str, forbid_newline: bool = False) -> tuple[dict[int, str], frozenset[int]]:
    r"""How a free segment (a thought) can end with ``closer`` (e.g. ``", "action": "`` or ``</think><action>``).

    Returns ``(stops, banned)``: ``stops`` maps each token whose text, from its first ``closer[0]`` on, is a prefix
    of ``closer`` to the rest of ``closer`` still to be written (a token ``",`` leaves `` "action": "``); ``banned``
    holds every other token containing ``closer[0]`` (or an escaped one: ``\"``), so that the thought can only end
    by starting ``closer``, and, with ``forbid_newline``, the tokens containing a newline (JSON strings hold none).
    Cached on the tokenizer per (closer, forbid_newline)."""

    def build():
        first = closer[0]
        stops: dict[int, str] = {}
        banned: set[int] = set()
        for i, text in enumerate(token_texts(tokenizer)):
            if forbid_newline and "\n" in text.split(first, 1)[0]:
                banned.add(i)
                continue
            k = text.find(first)
            if k < 0:
                continue
            suffix = text[k:]
            if closer.startswith(suffix) and not (k > 0 and text[k - 1] == "\\"):
                stops[i] = closer[len(suffix):]
            else:
                banned.add(i)
        return stops, frozenset(banned)

    cache = _cached(tokenizer, "_sglightning_closers", dict)
    key = (closer, forbid_newline)
    if key not in cache:
        cache[key] = build()
    return cache[key]


def end_of_turn_ids(tokenizer) -> frozenset[int]:
    ids = {tokenizer.eos_token_id}
    for tok in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None and tid >= 0:
            ids.add(tid)
    return frozenset(i for i in ids if i is not None)


def cache_argument_name(model: torch.nn.Module) -> str:
    """``cache`` (transformers >= 5.x) or ``past_key_values`` (older): the forward's KV-cache keyword."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft wrapper -> HF model
    params = inspect.signature(type(base).forward).parameters
    return "cache" if "cache" in params else "past_key_values"
