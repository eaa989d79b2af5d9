"""The program language every engine runs: what one row (one episode's turn) must produce, segment by segment.

A program is a list of segments that one row produces in order:

* :class:`Force` — tokens we write (``Label:``, ``Action:``); context, not policy tokens;
* :class:`Free` — tokens the model samples until a stop token or a length cap (policy tokens);
* :class:`Choice` — tokens sampled from the model's distribution restricted, token by token, to a set of allowed
  continuations (three label words, or the admissible actions): still the model's own choice, never a parse failure.

:class:`ProgramState` walks one row's program: it says which token comes next (forced, or sampled within which
:class:`~sglightning.episodes.Restriction`) and records what was written in :class:`~sglightning.episodes.Piece` s.
Engines share it, so that they agree on every rule: a ``Choice`` token with a single allowed continuation involved
no choice and is recorded as context; a ``Free`` segment cut by its cap writes its closing tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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


def build_trie(options: Sequence[Sequence[int]]) -> dict:
    """Nested dict token -> child; a leaf is ``{}`` and carries the option index under key -1.  Built once per
    distinct option list (:func:`_trie`): a group's episodes meet the same admissible actions, turn after turn."""
    return _trie(tuple(tuple(int(t) for t in opt) for opt in options))


@functools.lru_cache(maxsize=4096)
def _trie(options: tuple[tuple[int, ...], ...]) -> dict:
    """:func:`build_trie` of hashable options.  The tries are shared, so nothing may change them but the restrictions
    :func:`node_restriction` keeps in them, which are the same for every holder."""
    if not options:
        raise ValueError("Choice with no options")
    root: dict = {}
    for idx, opt in enumerate(options):
        if not opt:
            raise ValueError("Choice option with no tokens")
        node = root
        for tok in opt:
            if -1 in node:
                raise ValueError("Choice options are not prefix-free")
            node = node.setdefault(tok, {})
        if node and -1 not in node:
            raise ValueError("Choice options are not prefix-free")
        node.setdefault(-1, idx)
    return root


@functools.lru_cache(maxsize=256)
def banned_restriction(banned: frozenset[int]) -> Restriction:
    """A ``Free`` segment's banned tokens as one shared restriction object (built once per set: sorting thousands of
    ids at every segment, and comparing equal copies in the engine's lookups, cost more than a GPU decode step)."""
    return Restriction(tuple(sorted(banned)), exclude=True)


def node_restriction(node: dict) -> Restriction:
    """A trie node's allowed continuations as a restriction (built once per node, kept under key -2)."""
    restriction = node.get(-2)
    if restriction is None:
        # list(node): one C-level copy under the GIL (vLLM rows run in threads over shared tries: iterating the dict
        # while another row adds its -2 key raised "dictionary changed size during iteration")
        restriction = node[-2] = Restriction(tuple(sorted(t for t in list(node) if t >= 0)))
    return restriction


class ProgramState:
    """Where one row stands in its program: the open segment, its piece, the trie node of a ``Choice``."""

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

    @property
    def segment(self) -> Segment:
        return self.program[self.seg]

    def start_segment(self) -> None:
        seg = self.program[self.seg]
        self.piece = Piece(kind=seg.kind)
        if isinstance(seg, Force):
            self.force_ids = list(seg.ids(self.pieces) if callable(seg.ids) else seg.ids)
        elif isinstance(seg, Choice):
            self.node = build_trie(seg.options)
        elif isinstance(seg, Free):
            self.banned = banned_restriction(seg.banned_ids) if seg.banned_ids else None
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
                    # every token of an open Free piece before its cap is a policy token: its length is their count
                    # (not summed at every step; engines that add tokens to the piece themselves stay counted)
                    if len(self.piece.ids) < seg.max_tokens:
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

    def written(self) -> list[int]:
        """Advance and write every token that needs no sampling — the rest of a ``Force``, a capped ``Free``
        segment's closing tokens, a ``Choice``'s single-continuation tokens — up to the next token to sample (or the
        program's end).  Returns the tokens written (recorded as context)."""
        out: list[int] = []
        while True:
            self.advance()
            if self.done:
                return out
            seg, piece = self.program[self.seg], self.piece
            if isinstance(seg, Force):
                rest = self.force_ids[len(piece.ids):]
            elif isinstance(seg, Free) and self.pending_close:
                rest = self.pending_close
            elif isinstance(seg, Choice) and len(node_restriction(self.node).ids) == 1:
                tok = node_restriction(self.node).ids[0]  # one way on: no choice was made, so no policy token
                piece.add(tok, 0.0, False)
                piece.forced += 1
                self.node = self.node[tok]
                out.append(tok)
                continue
            else:
                return out  # a token to sample
            for tok in rest:
                piece.add(tok, 0.0, False)
            out.extend(rest)

    def restriction(self) -> Restriction | None:
        """The set the next sampled token is drawn from (None: the whole vocabulary); call after :meth:`written`."""
        seg = self.program[self.seg]
        return node_restriction(self.node) if isinstance(seg, Choice) else self.banned

    def take(self, tok: int, logq: float, full: float, used: Restriction | None) -> None:
        """Record the sampled token ``tok``: log q of the distribution it was drawn from, unrestricted log π, the
        restriction that applied (top-k included)."""
        seg, piece = self.program[self.seg], self.piece
        piece.add(tok, logq, True, used, full)
        if isinstance(seg, Free):
            if tok in seg.stop_ids:
                piece.hit_stop = True
        else:
            self.node = self.node[tok]
