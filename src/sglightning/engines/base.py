"""The engine seam: what the rollout asks of whatever generates its tokens, and what the trainer gives it.

Two contracts, both request-level:

* :class:`Session` — one batch of rows (one per live episode) holding the exact token ids of each row's context:
  ``feed`` appends context, ``select`` keeps some rows, ``rewind`` cuts rows back to a prefix, ``run`` executes one
  program per row (:mod:`sglightning.engines.program`) and returns what each row wrote — the ids, which of them the
  policy chose, the log-prob of the distribution each was drawn from and that distribution's restriction;
* :class:`Engine` — what opens sessions, with the lifecycle of a run: ``check`` (before anything starts),
  ``start`` (once), ``sampling`` (around every rollout, given the weights about to sample and their version),
  ``close`` (once).

The rollout, the guidance programs, the environments and the update never learn which engine ran.  The trainer
hands the engine a :class:`Weights` (the policy being trained, no Lightning object), so an engine in this process
samples with the very weights being trained and an engine elsewhere can fetch and verify them.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from sglightning.engines import EngineConfig
    from sglightning.engines.program import Segment
    from sglightning.episodes import Piece


class Session(abc.ABC):
    """One batch of rows sharing whatever the engine keeps per row (a KV cache, a context on a client)."""

    #: forward passes (or requests) so far (logged)
    forward_calls: int = 0

    @property
    def engine_stats(self) -> dict[str, float]:
        """Counters of this session, summed over a rollout's sessions and logged as ``engine/…``."""
        return {}

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

    def rewind(self, keep: Sequence[int]) -> bool:
        """Cut row i back to its first ``keep[i]`` tokens (0 ≤ ``keep[i]`` ≤ ``length(i)``), so that a new prompt
        sharing them computes only the rest; the next ``feed`` must then give every row at least one token.  Returns
        False, changing nothing, where this session cannot (the caller opens a new one)."""
        return False


class Weights(Protocol):
    """The policy being trained, as an engine sees it (the rollout callback hands one over)."""

    #: the optimiser steps these weights took (the adapter version)
    version: int
    #: the peft model (its adapters active)
    model: torch.nn.Module
    #: the policy's tokenizer
    tokenizer: Any
    #: ``"fsdp2"``, ``"fsdp1"`` or None
    sharding: str | None

    def gathered(self) -> contextlib.AbstractContextManager:
        """Whole weights in this process while entered (under FSDP a collective on every rank)."""

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The adapter as full tensors, module-tree names (under FSDP a collective on every rank)."""

    def write_adapter(self, state: dict[str, torch.Tensor], folder) -> None:
        """``state`` as a peft adapter folder (``PeftModel.from_pretrained`` format)."""

    def probe_logprobs(self, ids: list[int]) -> list[float | None]:
        """Log π(ids[i] | ids[:i]) under these weights (None first; under FSDP a collective on every rank)."""


@dataclass
class RunContext:
    """What an engine learns about the run at ``start``."""

    rank: int = 0
    world_size: int = 1
    #: machines the processes run on (``trainer.num_nodes``)
    nodes: int = 1
    #: the policy's config (:class:`~sglightning.models.PolicyConfig`): the base model an external engine serves
    policy: Any = None
    #: the longest context a rollout keeps (``rollout.max_context_tokens``)
    max_context_tokens: int = 4096
    #: where the engine may write logs (None: a temporary folder)
    log_dir: str | None = None
    #: the trainer's device: an external engine serving ``embedded:tiny`` builds it there, as the trainer did (a
    #: random model drawn on CUDA is not the one drawn on the CPU)
    device: str = "cpu"


class Engine(abc.ABC):
    """Generates the tokens of rollouts; one per run, owned by the rollout callback."""

    def __init__(self, cfg: EngineConfig | None = None):
        from sglightning.engines import EngineConfig

        self.cfg = cfg if cfg is not None else EngineConfig()
        #: the version (optimiser steps) of the weights sampling now; None before the first rollout
        self.version: int | None = None

    #: whether its caches hold pads inside a row (left-padded blocks): a sliding window counts them, so under one
    #: (:func:`sglightning.traits.sliding_window`) its log-probs drift and ``grpo.rollout_correction: auto`` is on
    pads_inside_rows: bool = False

    @classmethod
    def samples_in_half_precision(cls, cfg: EngineConfig) -> bool:
        """Whether this engine, configured by ``cfg``, samples with half-precision weights of its own, so that its
        log-probs drift from the trainer's (``grpo.rollout_correction: auto`` is then on).  False here: an engine that
        samples with the trainer's own weights shares the trainer's precision, which the trainer checks itself."""
        return False

    def check(self, policy, rollout, grpo) -> None:  # noqa: B027 (an optional hook: nothing to check)
        """Settings that cannot work with this engine, before anything starts: raise
        :class:`~sglightning.errors.ConfigError` naming the key (``policy``, ``rollout``, ``grpo``: the run's
        configs)."""

    def start(self, run: RunContext) -> None:  # noqa: B027 (an optional hook: nothing to start)
        """Once per run, on every rank, before the first rollout."""

    @contextlib.contextmanager
    def sampling(self, weights: Weights) -> Iterator[dict[str, float]]:
        """Entered around every rollout, on every rank: the rollout inside samples with ``weights`` (version
        ``weights.version``).  Yields numbers for the step's logs (e.g. an adapter sync's time)."""
        self.version = weights.version
        yield {}

    @abc.abstractmethod
    def session(self, model: torch.nn.Module, pad_id: int, temperature: float = 1.0,
                generator: torch.Generator | None = None, top_k: int = 0, greedy: bool = False) -> Session:
        """A new batch of rows: sampling at ``temperature`` (or ``greedy``), within the ``top_k`` most likely
        tokens when ``top_k`` > 0, drawing from ``generator``."""

    def close(self) -> None:  # noqa: B027 (an optional hook: nothing to release)
        """Once, at the end of the run (or when it fails): release what ``start`` took."""
