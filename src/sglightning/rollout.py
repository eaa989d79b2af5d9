"""Multi-turn, lock-step, batched self-guided rollouts (no Lightning import).

``Rollout.run(seeds)`` plays ``len(seeds) × group_size`` episodes at once: every live episode advances one
environment step per round, and each round's model calls are batched across all live episodes.  For each episode we
keep the exact token ids that were fed and sampled (never re-tokenised), which of them the policy wrote, the sampler's
log-probabilities, and which are guidance vs action tokens — the trainer scores these ids directly (re-applying a
chat template to the finished conversation would not give back the ids that were generated turn by turn).

Per step t (the method is written out in ``docs/method.md``):
z_t = guide(task, trajectory ≤ t)  →  a_t = act(…, z_t)  →  o_{t+1}, r^env_t = env.step(a_t)
and the internal reward r_t = g(z_t) ∈ {+0.1, 0, −0.1} (configurable).

Departures from the paper (and why):

* ``single_stream`` prompt mode (default for CPU runs) writes guidance and action in one assistant turn of one growing
  conversation, reusing the KV cache across steps; ``two_call`` is the paper's separate rate and act calls.
* ``constrained`` guidance decoding forces ``Reason:``/``Label:`` and samples the label among the three label words
  from the model's own next-token distribution (the label is the option sampled, never a parse of the text);
  ``admissible`` action decoding restricts sampling, token by token, to the admissible actions.  What was sampled from
  is the restricted, renormalised q = π/Z(A): the sample records A, and the trainer scores q (ratio and gradient of
  the policy that acted, :mod:`sglightning.scoring`); a token that was the only continuation is context, not a policy
  token.  Small models need this (SmolLM2-135M writes no parseable label zero-shot); ``free`` decoding is the
  paper-faithful setting.
* The actor's answer format is ``guidance.actor_format``: ``action_line`` (``Action: …``, our default for small
  models) or the paper's ``json`` / ``think_tags``; with ``admissible`` decoding the thought is free and the action is
  chosen.
* The two_call rate prompt shows the whole trajectory (the paper) unless ``guidance.rate_history_length`` is set, and
  drops its oldest steps when it would exceed ``rollout.max_context_tokens`` (counted per episode).
* At step 1 there is no previous step to judge; the guidance then rates the starting situation (it still conditions
  the first action and still earns r_1).
* An environment that raises, returns the wrong type or hangs past ``rollout.env_step_timeout_s`` ends only its own
  episode (failed, reason recorded, counted); its worker is rebuilt (:mod:`sglightning.envs.pool`).  The failed
  episode stays in its group with the environment return it had reached (0 for a sparse-reward env): its group's
  other episodes still carry a valid comparison, and dropping it would bias the group baseline toward survivors.
  Environment steps of all live episodes run concurrently, one worker (one JVM) per episode slot.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from sglightning.envs.base import ResetResult, StepResult, TextEnv
from sglightning.envs.pool import EnvPool
from sglightning.guidance import (
    LABELS,
    ActorFormat,
    Guidance,
    GuidanceConfig,
    StepView,
    actor_messages,
    match_admissible,
    oracle_guidance,
    parse_action,
    parse_guidance,
    rate_messages,
    stream_first_messages,
    stream_next_user,
)
from sglightning.sampler import (
    KIND_ACTION,
    KIND_CONTEXT,
    KIND_GUIDANCE,
    Choice,
    DecoderFactory,
    DecodeSession,
    Force,
    Free,
    Piece,
    Restriction,
    closing_tokens,
    end_of_turn_ids,
    newline_token_ids,
)

log = logging.getLogger(__name__)


class RolloutAborted(Exception):
    """``Rollout.run``'s ``should_stop`` said stop (e.g. SIGTERM): the partial rollout is discarded."""


@dataclass
class RolloutConfig:
    """How episodes are collected."""

    groups_per_step: int = 2
    """task groups per training step (N); each group is G episodes of one task seed"""
    group_size: int = 4
    """episodes per group (G); GRPO needs >= 2"""
    max_steps: int = 8
    """environment steps per episode"""
    temperature: float = 1.0
    """sampling temperature of training rollouts (the trainer scores tokens at the same temperature)"""
    top_k: int = 0
    """sample among the k most likely tokens only (0 = off); the set is recorded and scored like any restriction"""
    invalid_action_penalty: float = 0.0
    """subtracted from the episode return per invalid action (verl-agent uses 0.1)"""
    max_context_tokens: int = 4096
    """context cap: a single-stream episode whose context grows past it is truncated (counted); a two_call rate
    prompt drops its oldest steps to fit (counted)"""
    seed: int = 0
    """base of all randomness (task seeds, sampling)"""
    split: str = "train"
    """the env split training tasks come from"""
    env_step_timeout_s: float | None = 60.0
    """an env step slower than this fails its episode (seconds; null = wait forever)"""
    env_reset_timeout_s: float | None = 300.0
    """the same for creating an env + ``reset`` (JVM start, task loading)"""
    env_parallel: bool = True
    """step the envs of all live episodes concurrently (one worker thread + env per episode slot); false = serially"""
    failed_episodes: Literal["keep", "drop_group"] = "keep"
    """a group with an episode whose env failed (exception, timeout, dead process): ``keep`` trains on it (the failed
    episode keeps the return it had reached; the others' comparison is intact) or ``drop_group`` leaves the whole
    group out of the update (``rollout/dropped_groups`` counts them)"""
    dynamic_sampling_rounds: int = 0
    """DAPO's dynamic sampling: a group whose returns are all equal carries no gradient; up to this many extra rounds
    of new tasks (the number of groups still missing) top the step up to ``groups_per_step`` informative groups
    (judged with the schedule's λ).  0 = off.  The step's first round is kept whole, so rollout statistics still
    describe the policy; added groups are counted as ``rollout/dynamic_sampling_groups``"""
    env_max_concurrency: int = 0
    """env calls running at once (0 = the number of CPU cores: right for CPU-bound engines such as the JVM ones;
    raise it for envs that mostly wait, e.g. remote env servers)"""

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"rollout.group_size: must be >= 2 for group-relative advantages, got {self.group_size}")
        if self.groups_per_step < 1:
            raise ValueError(f"rollout.groups_per_step: must be >= 1, got {self.groups_per_step}")
        if self.max_steps < 1:
            raise ValueError(f"rollout.max_steps: must be >= 1, got {self.max_steps}")
        if self.temperature <= 0:
            raise ValueError(f"rollout.temperature: must be > 0, got {self.temperature}")
        if self.invalid_action_penalty < 0:
            raise ValueError(f"rollout.invalid_action_penalty: must be >= 0, got {self.invalid_action_penalty}")
        if self.max_context_tokens < 64:
            raise ValueError(f"rollout.max_context_tokens: must be >= 64, got {self.max_context_tokens}")
        if self.failed_episodes not in ("keep", "drop_group"):
            raise ValueError(f"rollout.failed_episodes: {self.failed_episodes!r} is not one of keep, drop_group")
        if self.dynamic_sampling_rounds < 0:
            raise ValueError(f"rollout.dynamic_sampling_rounds: must be >= 0, got {self.dynamic_sampling_rounds}")
        if self.env_max_concurrency < 0:
            raise ValueError(
                f"rollout.env_max_concurrency: must be >= 0 (0 = CPU cores), got {self.env_max_concurrency}")
        for key in ("env_step_timeout_s", "env_reset_timeout_s"):
            v = getattr(self, key)
            if v is not None and v <= 0:
                raise ValueError(f"rollout.{key}: must be > 0 seconds or null (no timeout), got {v}")


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
    penalty: float = 0.0  # invalid-action penalty total (>= 0)
    samples: list[Sample] = field(default_factory=list)
    error: str | None = None  # the environment failed: why
    truncated: bool = False
    done: bool = False
    guided: bool = True
    rate_calls: int = 0  # two_call rate prompts built
    rate_truncations: int = 0  # ... whose trajectory had to be cut to fit rollout.max_context_tokens
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
    group_size: int
    seconds: float = 0.0
    env_seconds: float = 0.0  # wall time spent waiting for environment resets/steps
    generated_tokens: int = 0
    forward_calls: int = 0
    #: row × position slots the decoder's context passes computed, padding included (a prompt shared by a group is
    #: counted once when the decoder shares prefixes; 0 for a decoder that does not count)
    prefill_positions: int = 0
    policy_version: int = 0  # the trainer step whose weights sampled this batch (logged as rollout/policy_lag)
    guided: bool = True
    extra_groups: int = 0  # informative groups added by dynamic sampling (rollout.dynamic_sampling_rounds)
    #: the rollout's peak memory ({"memory/rollout_peak_rss_gb": GB, ...}; filled by the trainer: sglightning.memory)
    peak_memory: dict[str, float] = field(default_factory=dict)

    def add_groups(self, other: RolloutBatch, groups: set[int]) -> None:
        """Append ``other``'s groups ``groups`` (renumbered after this batch's groups and episodes) and its costs."""
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
        self.env_seconds += other.env_seconds
        self.generated_tokens += other.generated_tokens
        self.forward_calls += other.forward_calls
        self.prefill_positions += other.prefill_positions

    @property
    def samples(self) -> list[Sample]:
        return [s for e in self.episodes for s in e.samples]


class ChatFormat:
    """Renders chat turns to token ids with the tokenizer's own template, incrementally for the single stream.

    ``template_kwargs`` go to ``apply_chat_template`` (e.g. ``enable_thinking``).  A template that knows
    ``enable_thinking`` (Qwen3) gets ``enable_thinking=False`` unless told otherwise: its thinking mode would open a
    ``<think>`` block in every answer, where the actor's first line must be an action and the rate call's budget is
    a few dozen tokens (any think block a model writes anyway is removed before parsing)."""

    _A, _U = "@@SGL_A@@", "@@SGL_U@@"

    def __init__(self, tokenizer, template_kwargs: dict | None = None):
        self.tok = tokenizer
        self.kwargs = dict(template_kwargs or {})
        template = str(getattr(tokenizer, "chat_template", "") or "")
        if "enable_thinking" in template and "enable_thinking" not in self.kwargs:
            self.kwargs["enable_thinking"] = False
        base = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        turn = [{"role": "assistant", "content": self._A}, {"role": "user", "content": self._U}]
        t2 = self._render(base + turn, True)
        a = t2.find(self._A)
        u = t2.find(self._U, a + len(self._A)) if a >= 0 else -1
        if u < 0:
            raise ValueError("the tokenizer's chat template cannot be rendered incrementally (single_stream mode)")
        # what closes an assistant turn and opens a user turn / what closes it and opens the next answer
        self.turn_prefix, self.turn_suffix = t2[a + len(self._A) : u], t2[u + len(self._U) :]
        self.eos_text = tokenizer.eos_token or ""

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.kwargs
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.encode(self._render(messages, True))

    def next_turn_ids(self, user_text: str, turn_closed: bool) -> list[int]:
        """Ids that close the assistant turn (unless the model already did), add a user turn, open the next answer."""
        prefix = self.turn_prefix
        if turn_closed and self.eos_text and prefix.startswith(self.eos_text):
            prefix = prefix[len(self.eos_text) :]
        return self.encode(prefix + user_text + self.turn_suffix)


class Rollout:
    """Plays groups of episodes with a policy model.  Environments are created once and reused across calls."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        env_factory: Callable[[], TextEnv],
        guidance: GuidanceConfig,
        config: RolloutConfig,
        chat_template_kwargs: dict | None = None,
        decoder: DecoderFactory = DecodeSession,
    ):
        """``decoder`` builds the generation engine of one batch of rows (default: :class:`DecodeSession`, batched
        HF forwards with a persistent KV cache); any :class:`~sglightning.sampler.Decoder` works."""
        self.model = model
        self.decoder = decoder
        self.tok = tokenizer
        self.env_factory = env_factory
        self.guidance = guidance
        self.cfg = config
        self.chat = ChatFormat(tokenizer, chat_template_kwargs)
        self.pool = EnvPool(
            env_factory,
            step_timeout_s=config.env_step_timeout_s,
            reset_timeout_s=config.env_reset_timeout_s,
            concurrent=config.env_parallel,
            max_concurrency=config.env_max_concurrency or None,
        )
        self.env_errors = 0
        self._failures_logged: set[tuple[str, ...]] = set()
        self._should_stop: Callable[[], bool] | None = None
        self.eot = end_of_turn_ids(tokenizer)
        self.eot_id = tokenizer.eos_token_id
        self.newline = newline_token_ids(tokenizer)
        self.label_options = [self.chat.encode(" " + lab) for lab in LABELS]
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else tokenizer.eos_token_id

    # ------------------------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Close every environment worker (JVMs included)."""
        self.pool.close()

    def env(self, slot: int) -> TextEnv:
        """The environment of episode slot ``slot`` (created now if needed; raises what the env constructor raises)."""
        return self.pool.env(slot)

    def _fail(self, ep: Episode, reason: str) -> None:
        ep.error = reason[:500]
        ep.done = True
        ep.won = False
        self.env_errors += 1
        # one line per distinct failure: a broken env would otherwise print one line per episode
        key = ep.error.split(":", 2)[:2]
        if tuple(key) not in self._failures_logged:
            self._failures_logged.add(tuple(key))
            log.warning("episode %d (seed %d) failed in %s (further episodes failing the same way are counted in "
                        "rollout/env_error_rate, not printed)", ep.index, ep.seed, ep.error)

    # ------------------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def run(
        self,
        seeds: Sequence[int],
        *,
        group_size: int | None = None,
        temperature: float | None = None,
        guided: bool | None = None,
        generator: torch.Generator | None = None,
        greedy: bool = False,
        policy_version: int = 0,
        split: str | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> RolloutBatch:
        """Play ``group_size`` episodes for every task seed (one group per seed, same seed for each member) of the
        env split ``split`` (default ``rollout.split``).  ``should_stop`` is asked before every round; when it says
        true the rollout raises :class:`RolloutAborted` (preemption: abandon the step rather than finish it)."""
        self._should_stop = should_stop
        g = group_size or self.cfg.group_size
        split = split or self.cfg.split
        temperature = temperature or self.cfg.temperature
        guided = self.guidance.enabled if guided is None else guided
        t0 = time.perf_counter()
        was_training = self.model.training
        self.model.eval()
        episodes = [Episode(index=k * g + j, group=k, seed=int(s), guided=guided)
                    for k, s in enumerate(seeds) for j in range(g)]
        self._env_seconds = 0.0
        te = time.perf_counter()
        outcomes = self.pool.reset_many([(ep.index, ep.seed, split) for ep in episodes])
        self._env_seconds += time.perf_counter() - te
        for ep, out in zip(episodes, outcomes):
            if not out.ok:  # a broken env fails its episode only
                self._fail(ep, out.error or "reset failed")
                continue
            res: ResetResult = out.value
            ep.task, ep.task_type = str(res.task), str(res.task_type)
            ep.observation = ep.initial_observation = str(res.observation)
            ep.admissible = _clean_admissible(res.admissible_actions)
            env = self.pool.peek(ep.index)
            ep.action_help = res.action_help if res.action_help is not None else getattr(env, "action_help", "")
            ep.info = dict(res.info) if isinstance(res.info, dict) else {}
            score = getattr(res, "score", None)
            ep.score = ep.initial_score = float(score) if score is not None else None
        stats = {"tokens": 0, "forward": 0, "prefill": 0}
        try:
            if self.guidance.prompt_mode == "single_stream":
                self._run_stream(episodes, temperature, guided, generator, greedy, stats)
            else:
                self._run_two_call(episodes, temperature, guided, generator, greedy, stats)
        finally:
            self.model.train(was_training)
        for ep in episodes:
            for s in ep.samples:
                s.check()
        return RolloutBatch(
            episodes=episodes,
            group_size=g,
            seconds=time.perf_counter() - t0,
            env_seconds=self._env_seconds,
            generated_tokens=stats["tokens"],
            forward_calls=stats["forward"],
            prefill_positions=stats["prefill"],
            policy_version=policy_version,
            guided=guided,
        )

    # ------------------------------------------------------------------------------------------------------------------
    # programs

    def _guidance_program(self, constrained: bool) -> list:
        cap = self.guidance.max_guidance_tokens
        if not constrained:
            return [Free(cap, self.eot, KIND_GUIDANCE)]

        def label_prefix(pieces: list[Piece]) -> list[int]:
            ended_line = bool(pieces) and pieces[-1].hit_stop
            return self.chat.encode("Label:" if ended_line else "\nLabel:")

        return [
            Force(self.chat.encode("Reason:")),
            Free(cap, self.newline, KIND_GUIDANCE, banned_ids=self.eot, close_with=self.chat.encode("\n")),
            Force(label_prefix),
            Choice(self.label_options, KIND_GUIDANCE),
        ]

    def _action_program(self, ep: Episode, force_prefix: bool) -> list:
        """The actor's answer in ``guidance.actor_format``; ``force_prefix`` writes the format's opener for the
        model."""
        fmt = self.guidance.format
        admissible = self.guidance.action_decoding == "admissible" and bool(ep.admissible)
        if admissible and fmt.closer:
            return self._thought_then_choice(ep, fmt)
        prog: list = [Force(self.chat.encode(fmt.opener))] if force_prefix else []
        if admissible:
            prog.append(Choice([self.chat.encode(" " + a) + [self.eot_id] for a in ep.admissible], KIND_ACTION))
        else:  # free: one line for action_line, the whole answer (thought included) for the thinking formats
            stop = self.eot | self.newline if not fmt.closer else self.eot
            prog.append(Free(self.guidance.max_action_tokens, stop, KIND_ACTION))
        return prog

    def _thought_then_choice(self, ep: Episode, fmt: ActorFormat) -> list:
        """A thinking format with admissible decoding: the opener is forced, the thought is free until the model
        starts the closer (``", "action": "`` / ``</think><action>``) or hits ``max_think_tokens``, the rest of the
        closer is forced, and the action is chosen among the admissible ones (each followed by the format's end)."""
        stops, banned = closing_tokens(self.tok, fmt.closer, forbid_newline=fmt.name == "json")
        encode = self.chat.encode

        def rest_of_closer(pieces: list[Piece]) -> list[int]:
            last = pieces[-1]
            return encode(stops[last.ids[-1]]) if last.hit_stop and last.ids else []

        return [
            Force(encode(fmt.opener)),
            Free(self.guidance.max_think_tokens, frozenset(stops), KIND_ACTION, banned_ids=banned | self.eot,
                 close_with=encode(fmt.closer)),
            Force(rest_of_closer),
            Choice([encode(a + fmt.end) + [self.eot_id] for a in ep.admissible], KIND_ACTION),
        ]

    # ------------------------------------------------------------------------------------------------------------------
    def _run_stream(self, episodes, temperature, guided, generator, greedy, stats) -> None:
        """single_stream: one conversation and one cache row per episode."""
        constrained = self.guidance.decoding == "constrained"
        oracle = self.guidance.source == "oracle"
        live = [ep for ep in episodes if not ep.done]
        if not live:
            return
        env_help = {ep.index: ep.action_help for ep in live}
        repeat_help = self.guidance.action_help_every_turn
        session = self.decoder(self.model, self.pad_id, temperature, generator, self.cfg.top_k, greedy)
        blocks = []
        for ep in live:
            s = Sample(ep.index)
            msgs = stream_first_messages(ep.task, ep.observation, ep.admissible, env_help[ep.index], guided,
                                         self.guidance.actor_format)
            s.extend_context(self.chat.prompt_ids(msgs))
            ep.samples.append(s)
            blocks.append(s.ids)
        session.feed(blocks)
        for t in range(self.cfg.max_steps):
            self._check_stop()
            programs = []
            for ep in live:
                if guided and oracle:  # the oracle's guidance is written for the model; the action is its own
                    text = self.chat.encode(self._oracle(ep).text + "\n")
                    programs.append([Force(text, KIND_GUIDANCE)] + self._action_program(ep, force_prefix=True))
                    continue
                if guided and not constrained:
                    # free guidance: the model writes the whole "Reason/Label/Action" turn; split afterwards
                    cap = self.guidance.max_guidance_tokens + self.guidance.max_action_tokens
                    programs.append([Free(cap, self.eot, KIND_GUIDANCE)])
                    continue
                prog: list = []
                if guided:
                    prog += self._guidance_program(constrained) + [Force(self.chat.encode("\n"))]
                programs.append(prog + self._action_program(ep, force_prefix=True))
            results = session.run(programs)
            for ep, pieces in zip(live, results):
                for p in pieces:
                    ep.samples[0].extend_piece(p, t)
                    stats["tokens"] += sum(p.policy)
                if guided and not constrained and not oracle:
                    _split_free_turn(ep.samples[0], pieces, self.tok, self.guidance.format.markers)
            self._apply_turns(live, results, guided)
            # next turn: observation for the survivors, drop finished rows from the cache
            keep, blocks = [], []
            for row, ep in enumerate(live):
                if ep.done:
                    continue
                if session.length(row) > self.cfg.max_context_tokens:
                    ep.truncated, ep.done = True, True
                    continue
                last = ep.samples[0].ids[-1]
                ids = self.chat.next_turn_ids(
                    stream_next_user(ep.observation, ep.admissible, env_help[ep.index] if repeat_help else ""),
                    turn_closed=last in self.eot
                )
                ep.samples[0].extend_context(ids, t + 1)  # the observation that opens step t + 1
                keep.append(row)
                blocks.append(ids)
            stats["forward"] = session.forward_calls
            stats["prefill"] = getattr(session, "fed_positions", 0)
            live = [live[r] for r in keep]
            if not live:
                break
            session.select(keep)
            session.feed(blocks)
        for ep in live:
            ep.truncated = True
            ep.done = True
        stats["forward"] = session.forward_calls
        stats["prefill"] = getattr(session, "fed_positions", 0)

    def _run_two_call(self, episodes, temperature, guided, generator, greedy, stats) -> None:
        """two_call (paper): a rate call then an act call per step, each a fresh prompt (no rate call when the
        guidance comes from the oracle)."""
        constrained = self.guidance.decoding == "constrained"
        oracle = self.guidance.source == "oracle"
        hist = self.guidance.history_length
        fmt = self.guidance.actor_format
        views: dict[int, list[StepView]] = {ep.index: [] for ep in episodes}
        live = [ep for ep in episodes if not ep.done]
        for t in range(self.cfg.max_steps):
            if not live:
                break
            self._check_stop()
            guid: dict[int, list[Piece]] = {}
            if guided and not oracle:
                prompts = [self._rate_prompt(ep, views[ep.index]) for ep in live]
                programs = [self._guidance_program(constrained) for _ in live]
                results = self._call(prompts, programs, temperature, generator, greedy, stats)
                for ep, prompt, pieces in zip(live, prompts, results):
                    ep.samples.append(_sample_of(ep.index, prompt, pieces, t))
                    guid[ep.index] = pieces
            prompts, programs = [], []
            for ep in live:
                g = None
                if guided:
                    g = self._oracle(ep) if oracle else _guidance_from_pieces(guid[ep.index], self.tok)
                messages = actor_messages(ep.task, ep.observation, ep.admissible, ep.action_help,
                                          views[ep.index], hist, g, fmt)
                prompts.append(self.chat.prompt_ids(messages))
                free_actor = self.guidance.action_decoding == "free"
                programs.append(self._action_program(ep, force_prefix=not free_actor or constrained))
            results = self._call(prompts, programs, temperature, generator, greedy, stats)
            for ep, prompt, pieces in zip(live, prompts, results):
                ep.samples.append(_sample_of(ep.index, prompt, pieces, t))
            self._apply_turns(live, [guid.get(ep.index, []) + pieces for ep, pieces in zip(live, results)], guided)
            for ep in live:
                rec = ep.steps[-1]
                views[ep.index].append(StepView(rec.action or rec.action_text, ep.observation, rec.label, rec.reason))
            live = [ep for ep in live if not ep.done]
        for ep in live:
            ep.truncated, ep.done = True, True

    def _rate_prompt(self, ep: Episode, steps: list[StepView]) -> list[int]:
        """The rate prompt's ids: ``guidance.rate_history_length`` steps (None = all of them), the oldest cut when the
        prompt would leave less than ``max_guidance_tokens`` of ``rollout.max_context_tokens`` (counted)."""
        window = self.guidance.rate_history_length
        budget = self.cfg.max_context_tokens - self.guidance.max_guidance_tokens - 8

        def render(w: int | None) -> list[int]:
            return self.chat.prompt_ids(rate_messages(ep.task, ep.initial_observation, steps, w))

        ep.rate_calls += 1
        ids = render(window)
        if len(ids) <= budget:
            return ids
        ep.rate_truncations += 1
        lo, hi = 0, (len(steps) if window is None else min(window, len(steps))) - 1  # the longest window that fits
        best = render(0)
        while lo <= hi:
            mid = (lo + hi) // 2
            cand = render(mid)
            if len(cand) <= budget:
                best, lo = cand, mid + 1
            else:
                hi = mid - 1
        return best

    def _check_stop(self) -> None:
        if self._should_stop is not None and self._should_stop():
            raise RolloutAborted("rollout abandoned: stop requested")

    def _call(self, prompts, programs, temperature, generator, greedy, stats) -> list[list[Piece]]:
        session = self.decoder(self.model, self.pad_id, temperature, generator, self.cfg.top_k, greedy)
        session.feed(prompts)
        out = session.run(programs)
        stats["forward"] += session.forward_calls
        stats["prefill"] += getattr(session, "fed_positions", 0)
        stats["tokens"] += sum(sum(p.policy) for pieces in out for p in pieces)
        return out

    # ------------------------------------------------------------------------------------------------------------------
    def _apply_turns(self, live: list[Episode], results: list[list[Piece]], guided: bool) -> None:
        """Parse every live episode's turn, step all their environments concurrently, record the steps."""
        actions = [self._decide(ep, pieces, guided) for ep, pieces in zip(live, results)]
        te = time.perf_counter()
        outcomes = self.pool.step_many([(ep.index, a or "") for ep, a in zip(live, actions)])
        self._env_seconds += time.perf_counter() - te
        for ep, action, out in zip(live, actions, outcomes):
            if not out.ok:  # a broken env fails its episode only
                self._fail(ep, out.error or "step failed")
                continue
            try:
                self._record(ep, action, out.value)
            except (TypeError, ValueError) as err:  # e.g. a reward that is not a number
                self._fail(ep, f"step: malformed StepResult: {type(err).__name__}: {err}")
                self.pool.retire(ep.index)

    @staticmethod
    def _oracle(ep: Episode) -> Guidance:
        """``guidance.source: oracle``: the label is the sign of the previous action's measured progress."""
        return oracle_guidance(ep.steps[-1].progress if ep.steps else None, first=not ep.steps)

    def _decide(self, ep: Episode, pieces: list[Piece], guided: bool) -> str | None:
        """Parse guidance + action from one turn's pieces, append the step record, return the action to send."""
        decode = self.tok.decode
        g_text = decode([t for p in pieces if p.kind == KIND_GUIDANCE for t in p.ids], skip_special_tokens=True)
        last_g = max((k for k, p in enumerate(pieces) if p.kind == KIND_GUIDANCE), default=-1)
        actor = pieces[last_g + 1 :]  # the actor's answer, forced parts (``Action:``, ``{"think": "``) included
        a_text = decode([t for p in actor if p.kind == KIND_ACTION for t in p.ids], skip_special_tokens=True)
        actor_text = decode([t for p in actor for t in p.ids], skip_special_tokens=True)
        rec = StepRecord(observation=ep.observation)
        if guided:
            oracle = self.guidance.source == "oracle"
            g = self._oracle(ep) if oracle else _guidance_from_pieces(pieces[: last_g + 1], self.tok)
            rec.guidance_text, rec.label, rec.reason = g.text, g.label, g.reason
            rec.internal_reward = self.guidance.reward(g.label)
        choice = next((p.choice_index for p in actor if p.kind == KIND_ACTION and p.choice_index is not None), None)
        if choice is not None and ep.admissible:
            action = ep.admissible[choice]
        else:
            # free single-stream turns are all guidance pieces (split afterwards): parse the whole turn
            parsed = parse_action(actor_text if a_text.strip() else g_text, prefer=self.guidance.format.source)
            action = parsed.action
            rec.format_ok = parsed.source == self.guidance.format.source
            if ep.admissible is not None:
                action = match_admissible(action, ep.admissible) or action
        rec.action_text = a_text
        rec.action = action
        ep.steps.append(rec)
        return action

    def _record(self, ep: Episode, action: str | None, res: StepResult) -> None:
        rec = ep.steps[-1]
        invalid = bool(res.invalid_action) or action is None or (
            ep.admissible is not None and match_admissible(action, ep.admissible) is None
        )
        rec.invalid = invalid
        if invalid:
            ep.penalty += self.cfg.invalid_action_penalty
        rec.env_reward = float(res.reward)
        rec.info = dict(res.info) if isinstance(res.info, dict) else {}
        ep.env_return += float(res.reward)
        ep.observation = str(res.observation)
        ep.admissible = _clean_admissible(res.admissible_actions)
        progress = getattr(res, "progress", None)
        if progress is not None:
            rec.progress = float(progress)
        elif res.score is not None and ep.score is not None:
            rec.progress = float(res.score) - ep.score
        if res.score is not None:
            ep.score = float(res.score)
        if res.done:
            ep.done = True
            ep.won = bool(res.won)


def _clean_admissible(actions) -> list[str] | None:
    """The env's admissible list as unique non-empty strings (None stays None: free-form actions)."""
    if actions is None:
        return None
    return list(dict.fromkeys(str(a) for a in actions if str(a).strip()))


def _sample_of(episode: int, prompt: list[int], pieces: list[Piece], step: int) -> Sample:
    s = Sample(episode)
    s.extend_context(prompt, step)
    for p in pieces:
        s.extend_piece(p, step)
    return s


def _guidance_from_pieces(pieces: list[Piece], tok) -> Guidance:
    """The guidance of one turn.  Constrained decoding: the label is the option the sampler chose (the token that
    is trained and rewarded), the reason is the free reason line; nothing the model wrote inside the reason can
    override the choice.  Free decoding: :func:`parse_guidance` on the text (last label line after the reason)."""
    text = tok.decode([t for p in pieces if p.kind == KIND_GUIDANCE for t in p.ids], skip_special_tokens=True)
    choice = next((p for p in pieces if p.kind == KIND_GUIDANCE and p.choice_index is not None), None)
    if choice is not None:
        reason = next((p for p in pieces if p.kind == KIND_GUIDANCE and p.choice_index is None), None)
        reason_text = tok.decode(reason.ids, skip_special_tokens=True) if reason is not None else ""
        return Guidance(LABELS[choice.choice_index], " ".join(reason_text.split())[:500], text)
    forced = tok.decode([t for p in pieces for t in p.ids], skip_special_tokens=True)
    g = parse_guidance(forced)
    g.text = text
    return g


def _split_free_turn(sample: Sample, pieces: list[Piece], tok, markers: Sequence[str] = ("action:",)) -> None:
    """Free single-stream turns are generated as one guidance piece; re-label the tokens from the one that starts the
    action part (``Action:``, or the thinking format's ``{`` / ``<think>``) onwards as action tokens (on the sampled
    ids: decoding prefixes, never re-tokenising)."""
    ids = [t for p in pieces for t in p.ids]
    n = len(ids)
    start = len(sample.ids) - n

    def has_marker(k0: int, k1: int) -> bool:
        text = tok.decode(ids[k0:k1]).lower()
        return any(m in text for m in markers)

    boundary = next((k for k in range(n) if has_marker(0, k + 1)), None)
    if boundary is None:
        return
    # the run of tokens spelling the marker may start before the token that completed it: the latest start that
    # still spells it
    first = boundary
    while first > 0 and not has_marker(first, boundary + 1):
        first -= 1
    for k in range(first, n):
        if sample.policy[start + k]:
            sample.kinds[start + k] = KIND_ACTION
    for p in pieces:
        p.kind = KIND_GUIDANCE
