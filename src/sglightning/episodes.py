"""The records one training step is made of, from the engine's tokens to the played episodes (ground floor:
dataclasses only, no torch, no model, no Lightning).

Every layer names these and none of them runs anything, so a module that only reads episodes (rewards, metrics,
reports, a user's reward term) imports this file and never the rollout engine.

* :class:`Piece` — what one segment of a turn's program produced for one row: token ids, which of them the policy
  sampled, their log-probs and the :class:`Restriction` each was drawn from (the engine's output);
* :class:`Sample` — one token sequence the trainer scores (one call, or a whole single-stream episode), built from
  context ids and pieces, with a kind (``KIND_CONTEXT`` / ``KIND_GUIDANCE`` / ``KIND_ACTION``) and an episode step
  per token;
* :class:`StepRecord` — one environment step as played: observation, guidance (label, reason), action, reward, the
  progress the environment measured;
* :class:`Episode` — one episode: its task, steps, outcome and samples;
* :class:`RolloutBatch` — one rollout: the episodes of every group and what producing them cost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

#: token kinds (``Sample.kinds``): written by the prompt or the environment, by the guide, by the actor
KIND_CONTEXT = 0
KIND_GUIDANCE = 1
KIND_ACTION = 2


@dataclass(frozen=True)
class Restriction:
    """The token set A a sampled token was drawn from, when that was not the whole vocabulary.

    ``exclude=False``: A = ``ids`` (a ``Choice``'s allowed continuations, the top-k);  ``exclude=True``: A = every
    token except ``ids`` (a ``Free`` segment's banned tokens).  ``ids`` are sorted and unique."""

    ids: tuple[int, ...]
    exclude: bool = False
    #: the hash, computed once (a banned set holds thousands of ids, and the engine and the update look sets up
    #: in dicts at every token)
    _hash: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.ids, self.exclude)))

    def __hash__(self) -> int:
        return self._hash


@dataclass
class Piece:
    """What one segment produced for one row."""

    kind: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # log q of the (restricted) sampling distribution
    policy: list[bool] = field(default_factory=list)
    restrictions: list[Restriction | None] = field(default_factory=list)  # what each policy token was drawn from
    full_logprobs: list[float] = field(default_factory=list)  # unrestricted log π (diagnostic)
    choice_index: int | None = None  # for Choice: which option was taken
    hit_stop: bool = False  # for Free: ended on a stop token (not on the cap)
    forced: int = 0  # Choice tokens that had a single allowed continuation (recorded as context)
    error: str | None = None  # the engine failed this row's turn here (its episode fails; the pieces are partial)
    #: hindsight label targets, per token: the token the label that describes the rated action's measured progress
    #: takes at this position (where the sampled path still agrees with it), −1 elsewhere; empty = none
    targets: list[int] = field(default_factory=list)
    #: which label (index in :data:`~sglightning.guidance.LABELS`) ``targets`` spell; −1 = none
    target_label: int = -1

    def add(
        self, tok: int, logprob: float, policy: bool, restriction: Restriction | None = None,
        full_logprob: float | None = None,
    ) -> None:
        self.ids.append(tok)
        self.logprobs.append(logprob)
        self.policy.append(policy)
        self.restrictions.append(restriction)
        self.full_logprobs.append(logprob if full_logprob is None else full_logprob)


@dataclass
class Sample:
    """One token sequence the trainer scores.  All per-token lists have the same length (checked).

    ``logprobs`` are those of the distribution each policy token was drawn from (renormalised over its
    ``restrictions`` entry when sampling was restricted; see :mod:`sglightning.sampler`): the trainer scores the same
    restricted distribution, so the importance ratio and the gradient are those of the policy that acted."""

    episode: int
    ids: list[int] = field(default_factory=list)
    policy: list[bool] = field(default_factory=list)  # the policy sampled this token
    logprobs: list[float] = field(default_factory=list)  # sampler log q (0.0 where not policy)
    kinds: list[int] = field(default_factory=list)  # KIND_CONTEXT / KIND_GUIDANCE / KIND_ACTION
    restrictions: list[Restriction | None] = field(default_factory=list)  # the set a policy token was drawn from
    full_logprobs: list[float] = field(default_factory=list)  # unrestricted log π (diagnostic; 0.0 where not policy)
    steps: list[int] = field(default_factory=list)
    """the episode step (0-based env step) each token belongs to: the prompt and guidance/action of step t, and the
    observation that opens step t, all carry t — what a step-level advantage estimator needs"""
    forced: int = 0  # choice tokens with a single allowed continuation (context, not policy)
    #: hindsight label targets (:attr:`Piece.targets`) by position: token id the label should have there, for
    #: ``grpo.calibration``
    targets: dict[int, int] = field(default_factory=dict)
    #: the target label (index in :data:`~sglightning.guidance.LABELS`) of each position in ``targets``
    target_labels: dict[int, int] = field(default_factory=dict)

    def extend_context(self, ids: Sequence[int], step: int = 0) -> None:
        n = len(ids)
        self.steps += [step] * n
        self.ids += list(ids)
        self.policy += [False] * n
        self.logprobs += [0.0] * n
        self.kinds += [KIND_CONTEXT] * n
        self.restrictions += [None] * n
        self.full_logprobs += [0.0] * n

    def extend_piece(self, piece: Piece, step: int = 0) -> None:
        start = len(self.ids)
        self.targets.update({start + k: t for k, t in enumerate(piece.targets) if t >= 0})
        self.target_labels.update({start + k: piece.target_label for k, t in enumerate(piece.targets) if t >= 0})
        self.steps += [step] * len(piece.ids)
        self.ids += piece.ids
        self.policy += piece.policy
        self.logprobs += piece.logprobs
        self.kinds += [piece.kind if p else KIND_CONTEXT for p in piece.policy]
        self.restrictions += [r if p else None for r, p in zip(piece.restrictions, piece.policy)]
        self.full_logprobs += piece.full_logprobs
        self.forced += piece.forced

    def check(self) -> None:
        n = len(self.ids)
        lengths = tuple(len(x) for x in (self.policy, self.logprobs, self.kinds, self.restrictions,
                                          self.full_logprobs, self.steps))
        if any(k != n for k in lengths):
            raise AssertionError(
                f"sample of episode {self.episode}: mask/logprob/kind lengths {lengths} differ from ids ({n})")
        if n and self.policy[0]:
            raise AssertionError("the first token of a sample cannot be a policy token (nothing predicts it)")


@dataclass
class StepRecord:
    observation: str  # what the agent saw before acting
    guidance_text: str = ""
    label: str | None = None
    reason: str = ""
    action_text: str = ""  # the raw text the model wrote for the action
    action: str | None = None  # what was sent to the env
    invalid: bool = False
    format_ok: bool = True  # the actor's answer had the configured shape (guidance.actor_format)
    env_reward: float = 0.0
    internal_reward: float = 0.0
    info: dict = field(default_factory=dict)  # the env's step info (e.g. WebShop's purchase flags)
    #: the progress this step's action made, as the env measured it (``StepResult.progress``, else the score
    #: change); None = unknown
    progress: float | None = None
    written: int = 0  # tokens the model sampled this step (guidance and action; forced tokens not counted)
    capped: bool = False  # a free segment of this step ended at its token cap, not on a stop token


@dataclass
class Episode:
    index: int
    group: int
    seed: int
    task: str = ""
    task_type: str = "default"
    steps: list[StepRecord] = field(default_factory=list)
    won: bool = False
    env_return: float = 0.0
    score: float | None = None  # the env's latest score (raw: some envs start above 0)
    initial_score: float | None = None  # the env's score at reset, where it reports one
    samples: list[Sample] = field(default_factory=list)
    error: str | None = None  # the environment failed: why
    truncated: bool = False
    done: bool = False
    guided: bool = True
    rate_calls: int = 0  # two_call rate prompts built
    rate_truncations: int = 0  # ... whose trajectory had to be cut to fit rollout.max_context_tokens
    actor_calls: int = 0  # two_call actor prompts built
    actor_truncations: int = 0  # ... whose recent history had to be cut to fit rollout.max_context_tokens
    # runtime only
    admissible: list[str] | None = None
    observation: str = ""
    initial_observation: str = ""
    action_help: str = ""
    info: dict = field(default_factory=dict)  # the env's reset info (task_id, target_objects, ...)

    @property
    def internal_rewards(self) -> list[float]:
        return [s.internal_reward for s in self.steps]

    def without_samples(self) -> Episode:
        """A copy without the token samples (what crosses ranks and goes into reports)."""
        return dataclasses.replace(self, samples=[])

    @property
    def score_gained(self) -> float | None:
        """The score earned during the episode (final minus the score at reset; None without a score)."""
        if self.score is None:
            return None
        return self.score - (self.initial_score or 0.0)


@dataclass
class RolloutBatch:
    episodes: list[Episode]
    seconds: float = 0.0
    #: wall seconds per marked phase of the rollout (``rollout/prefill``, ``/decode``, ``/draw``, ``/env``:
    #: sglightning.profiling); logged as ``time/rollout_<phase>_s``
    phase_seconds: dict[str, float] = field(default_factory=dict)
    generated_tokens: int = 0
    forward_calls: int = 0
    #: row × position slots the engine's context passes computed, padding included (a prompt shared by a group is
    #: counted once when the engine shares prefixes; 0 for an engine that does not count)
    prefill_positions: int = 0
    policy_version: int = 0  # the trainer step whose weights sampled this batch (logged as rollout/policy_lag)
    guided: bool = True
    extra_groups: int = 0  # informative groups added by dynamic sampling (rollout.dynamic_sampling_rounds)
    #: how many of ``episodes`` the first round played (the policy's own draw); None = all of them (nothing added)
    first_round: int | None = None
    #: the rollout's peak memory ({"memory/rollout_peak_rss_gb": GB, ...}; filled by the trainer: sglightning.memory)
    peak_memory: dict[str, float] = field(default_factory=dict)
    #: the engine's counters: the vLLM engine's requests, prompt_tokens, cached_tokens and its adapter sync's sync_s,
    #: sync_gap, loaded_adapters; the in-process engine's slot_cache_GB, caches_given_back and decode_guard_checks
    engine_counts: dict[str, float] = field(default_factory=dict)

    def add_groups(self, other: RolloutBatch, groups: set[int]) -> None:
        """Append ``other``'s groups ``groups`` (renumbered after this batch's groups and episodes) and its costs."""
        if self.first_round is None:
            self.first_round = len(self.episodes)
        next_index = max((e.index for e in self.episodes), default=-1) + 1
        next_group = max((e.group for e in self.episodes), default=-1) + 1
        renumber = {g: next_group + k for k, g in enumerate(sorted(groups))}
        for ep in other.episodes:
            if ep.group in renumber:
                ep.group, ep.index = renumber[ep.group], next_index
                for s in ep.samples:
                    s.episode = next_index
                next_index += 1
                self.episodes.append(ep)
        self.extra_groups += len(renumber)
        self.seconds += other.seconds
        for key, s in other.phase_seconds.items():
            self.phase_seconds[key] = self.phase_seconds.get(key, 0.0) + s
        self.generated_tokens += other.generated_tokens
        self.forward_calls += other.forward_calls
        self.prefill_positions += other.prefill_positions
        for key in ("requests", "prompt_tokens", "cached_tokens", "caches_given_back", "lock_steps", "row_steps",
                    "context_tokens"):  # counts (engine/rows_per_lock_step and kin are ratios of them)
            if key in other.engine_counts:
                self.engine_counts[key] = self.engine_counts.get(key, 0.0) + other.engine_counts[key]

    @property
    def samples(self) -> list[Sample]:
        return [s for e in self.episodes for s in e.samples]

    def policy_round(self) -> RolloutBatch:
        """The first round alone: what describes the policy (dynamic sampling's added groups were *selected* for
        having unequal returns, so they are not a draw of the policy's success or labels)."""
        if self.first_round is None:
            return self
        return dataclasses.replace(self, episodes=self.episodes[: self.first_round], extra_groups=0, first_round=None)


def split_groups(episodes: Sequence[Episode]) -> list[int]:
    """The groups whose members reset to different tasks or first observations (episodes whose reset failed are
    left out).  An env that draws its own task in ``reset`` makes them; the seed must fix both.

    Args:
        episodes: the episodes of one rollout, each with its ``group``.
    """
    seen: dict[int, set[tuple[str, str]]] = {}
    for ep in episodes:
        if ep.error is None or ep.steps:  # a reset that failed has no task of its own
            seen.setdefault(ep.group, set()).add((ep.task, ep.initial_observation))
    return sorted(g for g, starts in seen.items() if len(starts) > 1)
