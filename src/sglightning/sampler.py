"""Lock-step batched decoding with a persistent KV cache, driven by per-row *segment programs*.

A program is a list of segments that one row (one episode) must produce in order:

* :class:`Force` — tokens we write (``Label:``, ``Action:``); context, not policy tokens;
* :class:`Free` — tokens the model samples until a stop token or a length cap (policy tokens);
* :class:`Choice` — tokens sampled from the model's distribution restricted, token by token, to a set of allowed
  continuations (three label words, or the admissible actions): still the model's own choice, never a parse failure.

All rows advance one token per forward pass; a finished row feeds a masked pad.  Context blocks of different lengths
(prompts, environment observations) are fed in one pass, left-padded *within the block*, so pads can sit in the middle
of a row's cache: they are masked out and positions are counted per row, which makes the result identical (up to float
rounding) to a clean unpadded forward.  Rows whose episode ended are dropped from the cache.

What gets recorded for every token: its id (exactly as sampled — nothing is re-tokenised later), whether the policy
wrote it, the log-probability of the *temperature-scaled, unrestricted* distribution (the quantity the trainer
recomputes; for ``Choice`` tokens the restriction is a sampling-time mask — see rollout.py for why), and its kind
(context / guidance / action).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

KIND_CONTEXT = 0
KIND_GUIDANCE = 1
KIND_ACTION = 2


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


@dataclass
class Piece:
    """What one segment produced for one row."""

    kind: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy: list[bool] = field(default_factory=list)
    choice_index: int | None = None  # for Choice: which option was taken
    hit_stop: bool = False  # for Free: ended on a stop token (not on the cap)

    def add(self, tok: int, logprob: float, policy: bool) -> None:
        self.ids.append(tok)
        self.logprobs.append(logprob)
        self.policy.append(policy)


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
        self.pending_close: list[int] = []
        self.done = not program

    def start_segment(self) -> None:
        seg = self.program[self.seg]
        self.piece = Piece(kind=seg.kind)
        if isinstance(seg, Force):
            self.force_ids = list(seg.ids(self.pieces) if callable(seg.ids) else seg.ids)
        elif isinstance(seg, Choice):
            self.node = build_trie(seg.options)
        self.pending_close = []

    def end_segment(self) -> None:
        assert self.piece is not None
        self.pieces.append(self.piece)
        self.piece = None
        self.seg += 1
        self.done = self.seg >= len(self.program)


class DecodeSession:
    """A batch of rows sharing one KV cache.  ``feed`` appends context; ``run`` executes segment programs."""

    def __init__(
        self,
        model: torch.nn.Module,
        pad_id: int,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
        top_k: int = 0,
        greedy: bool = False,
    ):
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
        self.device = next(model.parameters()).device
        self._cache_arg = cache_argument_name(model)

    @property
    def batch_size(self) -> int:
        return 0 if self.attn is None else self.attn.shape[0]

    # ------------------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def feed(self, blocks: Sequence[Sequence[int]]) -> None:
        """Append ``blocks[i]`` to row i (may be empty).  One forward pass for all rows."""
        if self.attn is None:
            n = len(blocks)
            self.attn = torch.zeros(n, 0, dtype=torch.long, device=self.device)
            self.next_pos = torch.zeros(n, dtype=torch.long, device=self.device)
        if len(blocks) != self.batch_size:
            raise ValueError(f"feed got {len(blocks)} blocks for {self.batch_size} rows")
        width = max((len(b) for b in blocks), default=0)
        if width == 0:
            return
        n = len(blocks)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)  # [B, W] left-padded within the block
        mask = torch.zeros(n, width, dtype=torch.long)  # [B, W]
        pos = torch.zeros(n, width, dtype=torch.long)  # [B, W]
        lens = torch.tensor([len(b) for b in blocks], dtype=torch.long)
        start = self.next_pos.cpu()
        for i, b in enumerate(blocks):
            if b:
                ids[i, width - len(b) :] = torch.as_tensor(list(b), dtype=torch.long)
                mask[i, width - len(b) :] = 1
                pos[i, width - len(b) :] = start[i] + torch.arange(len(b))
            pos[i, : width - len(b)] = start[i]  # pads: any valid position, they are masked out
        ids, mask, pos = ids.to(self.device), mask.to(self.device), pos.to(self.device)
        attn = torch.cat([self.attn, mask], dim=1)  # [B, T+W]
        cache_kw = {self._cache_arg: self.cache}
        out = self.model(
            input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1, **cache_kw
        )
        self.forward_calls += 1
        self.cache = getattr(out, self._cache_arg)
        logits = out.logits[:, -1].float()  # [B, V]
        if self.last_logits is None:
            self.last_logits = logits
        else:
            fed = (lens > 0).to(self.device)
            self.last_logits = torch.where(fed[:, None], logits, self.last_logits)
        self.attn = attn
        self.next_pos = self.next_pos + lens.to(self.device)

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
    def _sample(self, logp_row: torch.Tensor, allowed: Sequence[int] | None, banned: frozenset[int]) -> int:
        """Sample one token from ``logp_row`` [V] (already temperature-scaled), optionally restricted."""
        scores = logp_row
        if allowed is not None:
            keep = torch.as_tensor(list(allowed), dtype=torch.long, device=scores.device)
            restricted = torch.full_like(scores, float("-inf"))
            restricted[keep] = scores[keep]
            scores = restricted
        elif banned:
            scores = scores.clone()
            scores[list(banned)] = float("-inf")
        if self.top_k and allowed is None:
            kth = torch.topk(scores, min(self.top_k, scores.numel())).values[-1]
            scores = torch.where(scores < kth, torch.full_like(scores, float("-inf")), scores)
        if self.greedy:
            return int(torch.argmax(scores))
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    @torch.no_grad()
    def run(self, programs: Sequence[list[Segment]]) -> list[list[Piece]]:
        """Execute one program per row (all current rows); returns the pieces of each row in order."""
        if len(programs) != self.batch_size:
            raise ValueError(f"run got {len(programs)} programs for {self.batch_size} rows")
        if self.last_logits is None:
            raise RuntimeError("feed a prompt before running programs")
        rows = [_RowState(list(p)) for p in programs]
        while True:
            logp = None
            step_tokens: list[list[int]] = [[] for _ in rows]
            for i, st in enumerate(rows):
                while not st.done:
                    if st.piece is None:
                        st.start_segment()
                    seg = st.program[st.seg]
                    if isinstance(seg, Force):
                        if len(st.piece.ids) < len(st.force_ids):
                            break
                        st.end_segment()
                    elif isinstance(seg, Free):
                        if st.pending_close or (len(st.piece.ids) and st.piece.hit_stop):
                            st.end_segment()
                        elif sum(st.piece.policy) >= seg.max_tokens:
                            if seg.close_with and not st.pending_close:
                                st.pending_close = list(seg.close_with)
                                break
                            st.end_segment()
                        else:
                            break
                    else:  # Choice
                        if -1 in st.node:
                            st.piece.choice_index = st.node[-1]
                            st.end_segment()
                        else:
                            break
                if st.done:
                    continue
                seg = st.program[st.seg]
                piece = st.piece
                if isinstance(seg, Force):
                    tok = st.force_ids[len(piece.ids)]
                    piece.add(tok, 0.0, False)
                elif isinstance(seg, Free) and st.pending_close:
                    for tok in st.pending_close:
                        piece.add(tok, 0.0, False)
                    step_tokens[i] = list(st.pending_close)
                    continue
                else:
                    if logp is None:
                        logp = torch.log_softmax(self.last_logits / self.temperature, dim=-1)  # [B, V]
                    if isinstance(seg, Free):
                        tok = self._sample(logp[i], None, seg.banned_ids)
                        piece.add(tok, float(logp[i, tok]), True)
                        if tok in seg.stop_ids:
                            piece.hit_stop = True
                    else:
                        allowed = [t for t in st.node if t != -1]
                        tok = self._sample(logp[i], allowed, frozenset())
                        piece.add(tok, float(logp[i, tok]), True)
                        st.node = st.node[tok]
                step_tokens[i] = [tok]
            if not any(step_tokens):
                break
            self.feed(step_tokens)
        return [st.pieces for st in rows]


def newline_token_ids(tokenizer) -> frozenset[int]:
    """Ids of all vocabulary tokens whose text contains a newline (cached on the tokenizer object)."""
    cached = getattr(tokenizer, "_sglightning_newline_ids", None)
    if cached is not None:
        return cached
    ids = frozenset(i for i in range(len(tokenizer)) if "\n" in tokenizer.decode([i]))
    try:
        tokenizer._sglightning_newline_ids = ids
    except AttributeError:
        pass
    return ids


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
