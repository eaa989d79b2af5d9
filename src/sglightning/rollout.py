"""Multi-turn, lock-step, batched self-guided rollouts (no Lightning import).

``Rollout.run(seeds)`` plays ``len(seeds) × group_size`` episodes at once: every live episode advances one
environment step per round, and each round's model calls are batched across all live episodes.  For each episode we
keep the exact token ids that were fed and sampled (never re-tokenised), which of them the policy wrote, the sampler's
log-probabilities, and which are guidance vs action tokens — the trainer scores these ids directly (re-applying a
chat template to the finished conversation would not give back the ids that were generated turn by turn).  What it
returns is a :class:`~sglightning.episodes.RolloutBatch` of the records in :mod:`sglightning.episodes`; returns are
not computed here (an invalid action is flagged; its penalty belongs to the return: :mod:`sglightning.rewards`).

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

import json
import logging
import time
import warnings
from collections.abc import Callable, Sequence

import torch

from sglightning.chat import ChatFormat, closing_tokens, end_of_turn_ids, newline_token_ids, pad_token_id
from sglightning.data import RolloutConfig
from sglightning.engines import make_engine
from sglightning.engines.base import Engine
from sglightning.engines.program import Choice, Force, Free
from sglightning.envs.base import ResetResult, StepResult, TextEnv
from sglightning.envs.pool import EnvPool
from sglightning.episodes import (
    KIND_ACTION,
    KIND_GUIDANCE,
    Episode,
    Piece,
    RolloutBatch,
    Sample,
    StepRecord,
    split_groups,
)
from sglightning.guidance import (
    LABELS,
    ActorFormat,
    Guidance,
    GuidanceConfig,
    StepView,
    action_part_start,
    actor_messages,
    match_admissible,
    oracle_guidance,
    parse_action,
    parse_guidance,
    progress_label,
    rate_messages,
    stream_first_messages,
    stream_next_user,
)
from sglightning.prefixes import common_prefix
from sglightning.profiling import phase, timing
from sglightning.traits import eval_mode

log = logging.getLogger(__name__)


class KeptCall:
    """One of ``two_call``'s calls (rate or act) from one env step to the next: its engine session and, per row,
    the ids the row holds (``rollout.reuse_prefix``)."""

    def __init__(self):
        self.session = None
        self.row: dict[int, int] = {}  # episode index -> session row
        self.held: list[list[int]] = []  # per session row: the prompt and what the call wrote


class RolloutAborted(Exception):
    """``Rollout.run``'s ``should_stop`` said stop (e.g. SIGTERM): the partial rollout is discarded."""


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
        engine: Engine | None = None,
    ):
        """``engine`` opens the sessions (batches of rows) the turns run on (default: the in-process engine,
        batched forwards of ``model`` with a persistent KV cache); any :class:`~sglightning.engines.base.Engine`
        works (started by its owner)."""
        self.model = model
        self.engine = engine if engine is not None else make_engine()
        self.tok = tokenizer
        self.env_factory = env_factory
        self.guidance = guidance
        self.cfg = config
        self.chat = ChatFormat(tokenizer, chat_template_kwargs, incremental=guidance.prompt_mode == "single_stream")
        self.pool = EnvPool(
            env_factory,
            step_timeout_s=config.env_step_timeout_s,
            reset_timeout_s=config.env_reset_timeout_s,
            concurrent=config.env_parallel,
            max_concurrency=config.env_max_concurrency or None,
        )
        self.env_errors = 0
        self._failures_logged: set[tuple[str, ...]] = set()
        self._split_warned = False  # a group whose members reset to different tasks: said once a run
        self._should_stop: Callable[[], bool] | None = None
        self.eot_id = self.chat.turn_end_id  # what closes an admissible action: the template's end of turn
        self.eot = end_of_turn_ids(tokenizer) | {self.eot_id}
        self.newline = newline_token_ids(tokenizer)
        self.label_options = [self.chat.encode(" " + lab) for lab in LABELS]
        self.pad_id = pad_token_id(tokenizer)

    # ------------------------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Close every environment worker (JVMs included)."""
        self.pool.close()

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
        episodes = [Episode(index=k * g + j, group=k, seed=int(s), guided=guided)
                    for k, s in enumerate(seeds) for j in range(g)]
        with timing() as times:  # each phase's wall time (profiling.phase): the batch carries them
            stats = self._play(episodes, split, temperature, guided, generator, greedy)
        for ep in episodes:
            for s in ep.samples:
                s.check()
        return RolloutBatch(
            episodes=episodes,
            seconds=time.perf_counter() - t0,
            phase_seconds=dict(times.seconds),
            generated_tokens=stats["tokens"],
            forward_calls=stats["forward"],
            prefill_positions=stats["prefill"],
            policy_version=policy_version,
            guided=guided,
            engine_counts=dict(stats.get("engine", {})),
        )

    def _play(self, episodes: list[Episode], split: str, temperature: float, guided: bool,
              generator: torch.Generator | None, greedy: bool) -> dict:
        """Reset every episode's environment, then play the episodes to their end.  Returns the engine's counts
        (tokens, forward calls, prefill positions, engine statistics)."""
        with eval_mode(self.model):
            return self._play_episodes(episodes, split, temperature, guided, generator, greedy)

    def _play_episodes(self, episodes: list[Episode], split: str, temperature: float, guided: bool,
                       generator: torch.Generator | None, greedy: bool) -> dict:
        """:meth:`_play`, the model in eval mode."""
        with phase("rollout/env"):
            outcomes = self.pool.reset_many([(ep.index, ep.seed, split) for ep in episodes])
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
        _name_failed_tasks(episodes)
        self._check_groups(episodes)
        stats = {"tokens": 0, "forward": 0, "prefill": 0}
        if self.guidance.prompt_mode == "single_stream":
            self._run_stream(episodes, temperature, guided, generator, greedy, stats)
        else:
            self._run_two_call(episodes, temperature, guided, generator, greedy, stats)
        return stats

    def _check_groups(self, episodes: list[Episode]) -> None:
        """Warn once a run when members of a group reset to different tasks or first observations: the env drew
        its own task, so GRPO's group baseline compares different tasks.  Counted each step as
        ``rollout/split_groups``."""
        if self._split_warned:  # said once a run (batch_stats counts them every step)
            return
        split = split_groups(episodes)
        if not split:
            return
        self._split_warned = True
        first = next(ep for ep in episodes if ep.group == split[0])
        env = self.pool.peek(first.index)
        name = f"{type(env).__name__}.reset" if env is not None else "the env's reset"
        groups = len({ep.group for ep in episodes})
        warnings.warn(f"model.env: {name} gave members of one group different tasks or first observations "
                      f"(seed {first.seed}; {len(split)} of {groups} groups). reset must fix the task by its seed, "
                      "else GRPO compares different tasks (counted as rollout/split_groups)", stacklevel=2)

    # ------------------------------------------------------------------------------------------------------------------
    # programs

    def _guidance_program(self, constrained: bool) -> list:
        cap = self.guidance.max_guidance_tokens
        if not constrained:
            return [Free(cap, self.eot, KIND_GUIDANCE)]

        def label_prefix(pieces: list[Piece]) -> list[int]:
            ended_line = bool(pieces) and bool(pieces[-1].ids) and pieces[-1].ids[-1] in self.newline  # capped too
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
            prog.append(Choice([self.chat.encode_text(" " + a) + [self.eot_id] for a in ep.admissible], KIND_ACTION))
        else:  # free: one line for action_line, the whole answer (thought included) for the thinking formats
            stop = self.eot | self.newline if not fmt.closer else self.eot
            prog.append(Free(self.guidance.max_action_tokens, stop, KIND_ACTION))
        return prog

    def _thought_then_choice(self, ep: Episode, fmt: ActorFormat) -> list:
        """A thinking format with admissible decoding: the opener is forced, the thought is free until the model
        starts the closer (``", "action": "`` / ``</think><action>``) or hits ``max_think_tokens``, the rest of the
        closer is forced, and the action is chosen among the admissible ones (each followed by the format's end)."""
        stops, banned = closing_tokens(self.tok, fmt.closer, json_string=fmt.name == "json")
        encode = self.chat.encode

        def rest_of_closer(pieces: list[Piece]) -> list[int]:
            last = pieces[-1]
            return encode(stops[last.ids[-1]]) if last.hit_stop and last.ids else []

        return [
            Force(encode(fmt.opener)),
            Free(self.guidance.max_think_tokens, frozenset(stops), KIND_ACTION, banned_ids=banned | self.eot,
                 close_with=encode(fmt.closer)),
            Force(rest_of_closer),
            Choice([encode(_written_as(self.chat.defuse(a), fmt) + fmt.end) + [self.eot_id] for a in ep.admissible],
                   KIND_ACTION),
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
        session = self.engine.session(self.model, self.pad_id, temperature, generator, self.cfg.top_k, greedy)
        blocks = []
        for ep in live:
            s = Sample(ep.index)
            msgs = stream_first_messages(ep.task, ep.observation, ep.admissible, env_help[ep.index], guided,
                                         self.guidance.actor_format)
            s.extend_context(self.chat.prompt_ids(msgs))
            ep.samples.append(s)
            blocks.append(s.ids)
        with phase("rollout/prefill"):
            session.feed(blocks)
        # about the most a turn writes: its guidance, thought and action caps, a few forced tokens (markers, label,
        # newlines); a longer admissible action can pass it, which the check after the turn catches
        g = self.guidance
        think = g.max_think_tokens if g.format.closer else 0
        turn_tokens = (g.max_guidance_tokens if guided else 0) + think + g.max_action_tokens + 16
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
                self._label_targets(ep, pieces)
                for p in pieces:
                    ep.samples[0].extend_piece(p, t)
                    stats["tokens"] += sum(p.policy)
                if guided and not constrained and not oracle:
                    _split_free_turn(ep.samples[0], pieces, self.tok)
            self._apply_turns(*self._engine_failures(live, results), guided)
            # next turn: observation for the survivors, drop finished rows from the cache.  A row whose next
            # observation and turn would pass the context cap ends here, truncated (checked before feeding: a long
            # observation would otherwise be fed, and a whole turn generated, past the cap)
            keep, blocks = [], []
            last = t == self.cfg.max_steps - 1  # no action follows: nothing more is fed (the survivors end below)
            for row, ep in enumerate(live):
                if ep.done:
                    continue
                if session.length(row) > self.cfg.max_context_tokens:  # this turn passed the cap
                    ep.truncated, ep.done = True, True
                    continue
                if last:
                    keep.append(row)
                    continue
                ids = self.chat.next_turn_ids(
                    stream_next_user(ep.observation, ep.admissible, env_help[ep.index] if repeat_help else ""),
                    closed_with=ep.samples[0].ids[-1])
                if session.length(row) + len(ids) + turn_tokens > self.cfg.max_context_tokens:
                    ep.truncated, ep.done = True, True
                    continue
                ep.samples[0].extend_context(ids, t + 1)  # the observation that opens step t + 1
                keep.append(row)
                blocks.append(ids)
            stats["forward"] = session.forward_calls
            stats["prefill"] = getattr(session, "fed_positions", 0)
            stats["engine"] = dict(session.engine_stats)
            live = [live[r] for r in keep]
            if not live or last:
                break
            session.select(keep)
            with phase("rollout/prefill"):
                session.feed(blocks)
        for ep in live:
            ep.truncated = True
            ep.done = True
        stats["forward"] = session.forward_calls
        stats["prefill"] = getattr(session, "fed_positions", 0)
        stats["engine"] = dict(session.engine_stats)

    def _run_two_call(self, episodes, temperature, guided, generator, greedy, stats) -> None:
        """two_call (paper): a rate call then an act call per step, each a fresh prompt (no rate call when the
        guidance comes from the oracle).  With ``rollout.reuse_prefix`` each call's session goes on from step to
        step and computes only what a row's new prompt does not share with what it holds (:meth:`_call`)."""
        constrained = self.guidance.decoding == "constrained"
        oracle = self.guidance.source == "oracle"
        hist = self.guidance.history_length
        fmt = self.guidance.actor_format
        views: dict[int, list[StepView]] = {ep.index: [] for ep in episodes}
        live = [ep for ep in episodes if not ep.done]
        reuse = self.cfg.reuse_prefix
        rate_call, act_call = (KeptCall() if reuse else None), (KeptCall() if reuse else None)
        for t in range(self.cfg.max_steps):
            if not live:
                break
            self._check_stop()
            guid: dict[int, list[Piece]] = {}
            if guided and not oracle:
                prompts = [self._rate_prompt(ep, views[ep.index]) for ep in live]
                programs = [self._guidance_program(constrained) for _ in live]
                results = self._call(prompts, programs, temperature, generator, greedy, stats,
                                     rate_call, [ep.index for ep in live])
                for ep, prompt, pieces in zip(live, prompts, results):
                    self._label_targets(ep, pieces)
                    ep.samples.append(_sample_of(ep.index, prompt, pieces, t))
                    guid[ep.index] = pieces
                live = self._engine_failures(live, results)[0]
                if not live:
                    break
            prompts, programs = [], []
            for ep in live:
                g = None
                if guided:
                    g = self._oracle(ep) if oracle else _guidance_from_pieces(guid[ep.index], self.tok)
                prompts.append(self._actor_prompt(ep, views[ep.index], hist, g, fmt))
                free_actor = self.guidance.action_decoding == "free"
                programs.append(self._action_program(ep, force_prefix=not free_actor or constrained))
            results = self._call(prompts, programs, temperature, generator, greedy, stats, act_call,
                                 [ep.index for ep in live])
            for ep, prompt, pieces in zip(live, prompts, results):
                ep.samples.append(_sample_of(ep.index, prompt, pieces, t))
            live, results = self._engine_failures(live, results)
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
        return _longest_that_fits(render, budget, (len(steps) if window is None else min(window, len(steps))) - 1)

    def _actor_prompt(self, ep: Episode, steps: list[StepView], hist: int, guidance, fmt: str) -> list[int]:
        """The actor prompt's ids: ``guidance.history_length`` recent steps, fewer (the oldest cut, counted) when the
        prompt would leave less than ``max_action_tokens`` of ``rollout.max_context_tokens``.  The observation
        itself is never cut: a prompt too long without history goes as it is."""
        budget = self.cfg.max_context_tokens - self.guidance.max_action_tokens - 8

        def render(h: int) -> list[int]:
            return self.chat.prompt_ids(actor_messages(ep.task, ep.observation, ep.admissible, ep.action_help, steps,
                                                       h, guidance, fmt))

        ep.actor_calls += 1
        ids = render(hist)
        shown = min(hist, len(steps))
        if len(ids) <= budget or shown == 0:
            return ids
        ep.actor_truncations += 1
        return _longest_that_fits(render, budget, shown - 1)

    def _check_stop(self) -> None:
        if self._should_stop is not None and self._should_stop():
            raise RolloutAborted("rollout abandoned: stop requested")

    def _call(self, prompts, programs, temperature, generator, greedy, stats, kept: KeptCall | None = None,
              keys: Sequence[int] = ()) -> list[list[Piece]]:
        """One call of ``two_call``: feed ``prompts``, run ``programs``.  With ``kept`` (the same call at the last
        env step, its rows named by ``keys``), its session goes on: each row is rewound to the prefix its new prompt
        shares with what it holds, and only the rest is fed."""
        session, blocks = None, prompts
        if kept is not None and kept.session is not None and all(k in kept.row for k in keys):
            rows = [kept.row[k] for k in keys]
            # at least one token fed per row: its logits predict the first token the program samples
            keep = [min(common_prefix(kept.held[r], p), len(p) - 1) for r, p in zip(rows, prompts)]
            kept.session.select(rows)
            if kept.session.rewind(keep):
                session, blocks = kept.session, [p[k:] for p, k in zip(prompts, keep)]
        if kept is not None and session is None:
            kept.session = None  # its cache is freed before a new one is taken
        if session is None:
            session = self.engine.session(self.model, self.pad_id, temperature, generator, self.cfg.top_k, greedy)
        forward, fed, engine_before = session.forward_calls, getattr(session, "fed_positions", 0), session.engine_stats
        with phase("rollout/prefill"):
            session.feed(blocks)
        out = session.run(programs)
        stats["forward"] += session.forward_calls - forward
        stats["prefill"] += getattr(session, "fed_positions", 0) - fed
        stats["tokens"] += sum(sum(p.policy) for pieces in out for p in pieces)
        engine = stats.setdefault("engine", {})
        for key, value in session.engine_stats.items():
            engine[key] = engine.get(key, 0.0) + value - engine_before.get(key, 0.0)
        if kept is not None:
            held = [list(p) + [t for piece in pieces for t in piece.ids] for p, pieces in zip(prompts, out)]
            # kept only if the session holds exactly these ids (an engine that ends a row early keeps fewer)
            same = all(session.length(i) == len(h) for i, h in enumerate(held))
            kept.session, kept.row, kept.held = (session if same else None), {k: i for i, k in enumerate(keys)}, held
        return out

    def _engine_failures(self, live: list[Episode], results: list[list[Piece]]
                         ) -> tuple[list[Episode], list[list[Piece]]]:
        """Fail the episodes whose turn the engine could not finish (a request that timed out or was refused: that
        episode only, as an environment fault would); return the others with their turns."""
        kept_eps, kept = [], []
        for ep, pieces in zip(live, results):
            error = next((p.error for p in pieces if p.error), None)
            if error:
                self._fail(ep, error)
            else:
                kept_eps.append(ep)
                kept.append(pieces)
        return kept_eps, kept

    # ------------------------------------------------------------------------------------------------------------------
    def _apply_turns(self, live: list[Episode], results: list[list[Piece]], guided: bool) -> None:
        """Parse every live episode's turn, step all their environments concurrently, record the steps."""
        actions = [self._decide(ep, pieces, guided) for ep, pieces in zip(live, results)]
        with phase("rollout/env"):
            outcomes = self.pool.step_many([(ep.index, a or "") for ep, a in zip(live, actions)])
        for ep, action, out in zip(live, actions, outcomes):
            if not out.ok:  # a broken env fails its episode only
                self._fail(ep, out.error or "step failed")
                continue
            try:
                self._record(ep, action, out.value)
            except (TypeError, ValueError) as err:  # e.g. a reward that is not a number
                self._fail(ep, f"step: malformed StepResult: {type(err).__name__}: {err}")
                self.pool.retire(ep.index)

    def _label_targets(self, ep: Episode, pieces: list[Piece]) -> None:
        """The hindsight targets of this turn's sampled label (:func:`label_targets`): the label z_t rates the
        previous action a_{t−1}, whose progress the env has measured by now (nothing at step 1)."""
        if ep.steps:
            label_targets(pieces, ep.steps[-1].progress, self.label_options)

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
        rec = StepRecord(observation=ep.observation, written=sum(sum(p.policy) for p in pieces),
                         capped=any(_capped(p) for p in pieces))
        if guided:
            oracle = self.guidance.source == "oracle"
            g = self._oracle(ep) if oracle else _guidance_from_pieces(pieces[: last_g + 1], self.tok)
            rec.guidance_text, rec.label, rec.reason = g.text, g.label, g.reason
            # the model's label is its reward; the oracle's credit is set once the env has measured this action
            rec.internal_reward = 0.0 if oracle else self.guidance.reward(g.label)
        choice = next((p.choice_index for p in actor if p.kind == KIND_ACTION and p.choice_index is not None), None)
        if choice is not None and ep.admissible:
            action = ep.admissible[choice]
        elif actor and not a_text.strip():
            # the actor wrote nothing: an invalid action (counted), never the guidance text in its place
            action = None
            rec.format_ok = False
        else:
            # free single-stream turns are all guidance pieces (split afterwards): parse the whole turn
            parsed = parse_action(actor_text if actor else g_text, prefer=self.guidance.format.source)
            action = parsed.action
            rec.format_ok = parsed.source == self.guidance.format.source
            if ep.admissible is not None:
                action = match_admissible(action, ep.admissible) or action
        if guided and not actor and (start := action_part_start(g_text)) is not None:
            # a free single-stream turn is one guidance piece: its answer part is the action's text, not guidance
            a_text, rec.guidance_text = g_text[start:], g_text[:start].rstrip()
        rec.action_text = a_text
        rec.action = action
        ep.steps.append(rec)
        return action

    def _record(self, ep: Episode, action: str | None, res: StepResult) -> None:
        rec = ep.steps[-1]
        rec.info = dict(res.info)
        ran = rec.info.get("command")  # what the env ran: an alias it accepts (ALFWorld's put X in/on Y) is valid
        ran = ran if isinstance(ran, str) else action
        rec.invalid = bool(res.invalid_action) or action is None or (
            ep.admissible is not None and match_admissible(ran, ep.admissible) is None
        )
        rec.env_reward = float(res.reward)
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
        if ep.guided and self.guidance.source == "oracle":
            # the oracle credits every action the env measured with the label of its own progress — the last action
            # too, and nothing for an action it could not measure — so among equal outcomes no path earns more by
            # taking longer (the label it showed before this step rated the previous action)
            rec.internal_reward = self.guidance.reward(progress_label(rec.progress))
        if res.done:
            ep.done = True
            ep.won = bool(res.won)
            # the env's own step limit ended it (info["truncated"], the TextEnv convention): a truncation too
            ep.truncated = ep.truncated or (not ep.won and bool(rec.info.get("truncated")))


def _longest_that_fits(render: Callable[[int], list[int]], budget: int, most: int) -> list[int]:
    """``render(w)`` for the most recent steps ``w`` (at most ``most``) whose ids fit ``budget``, found by bisection;
    ``render(0)`` when none does (the prompt without history goes as it is)."""
    lo, hi, best = 1, most, render(0)
    while lo <= hi:
        mid = (lo + hi) // 2
        cand = render(mid)
        if len(cand) <= budget:
            best, lo = cand, mid + 1
        else:
            hi = mid - 1
    return best


#: the task type of an episode whose reset failed and no episode of its seed says what the task was
UNKNOWN_TASK_TYPE = "unknown (reset failed)"


def _name_failed_tasks(episodes: list[Episode]) -> None:
    """An episode whose reset failed takes its task's name, type and id from an episode of the same seed (the seed
    fixes the task) that reset; with none, its type is :data:`UNKNOWN_TASK_TYPE`.  Left as the default type, it made
    up a task type in the per-type success table and left its real type's share short of one episode."""
    known = {ep.seed: ep for ep in episodes if ep.error is None}
    for ep in episodes:
        if ep.error is None:
            continue
        twin = known.get(ep.seed)
        if twin is None:
            ep.task_type = UNKNOWN_TASK_TYPE
            continue
        ep.task, ep.task_type = twin.task, twin.task_type
        if "task_id" in twin.info:
            ep.info["task_id"] = twin.info["task_id"]


def label_targets(pieces: list[Piece], progress: float | None, options: Sequence[Sequence[int]]) -> None:
    """Set ``Piece.targets`` on the label choice among ``pieces`` (``grpo.calibration``): the target label is the
    sign of the rated action's measured ``progress`` (:func:`~sglightning.guidance.progress_label`; nothing when the
    env could not measure it), ``options`` the label words' token sequences in :data:`LABELS` order.  Each policy
    token of the sampled label gets the target label's token at that position while the sampled path still agrees
    with the target's (the logits there are conditioned on the target's own prefix); after the paths diverge, and at
    forced tokens, there is none (−1)."""
    if progress is None:
        return
    label = LABELS.index(progress_label(progress))
    target = options[label]
    for p in pieces:
        if p.kind != KIND_GUIDANCE or p.choice_index is None:
            continue
        targets, agree = [], True
        for k, (tok, pol) in enumerate(zip(p.ids, p.policy)):
            targets.append(int(target[k]) if agree and pol and k < len(target) else -1)
            agree = agree and k < len(target) and tok == target[k]
        p.targets, p.target_label = targets, label


def _clean_admissible(actions) -> list[str] | None:
    """The env's admissible list as unique non-empty strings; None (free-form actions) where it lists none: an empty
    list gave a free action that was then counted invalid, whatever it was."""
    if actions is None:
        return None
    return list(dict.fromkeys(str(a) for a in actions if str(a).strip())) or None


def _written_as(action: str, fmt: ActorFormat) -> str:
    """An admissible action as the answer format writes it: escaped inside the JSON string (``search["red shoe"]``
    read back as ``search[``), as is elsewhere."""
    return json.dumps(action, ensure_ascii=False)[1:-1] if fmt.name == "json" else action


def _capped(piece: Piece) -> bool:
    """Whether ``piece`` is a free segment that the model wrote up to its token cap: sampled tokens, no stop token
    among them, not a choice (whose options end it) and not cut short by an engine error."""
    return any(piece.policy) and not piece.hit_stop and piece.choice_index is None and piece.error is None


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


def _split_free_turn(sample: Sample, pieces: list[Piece], tok) -> None:
    """Free single-stream turns are generated as one guidance piece; re-label the tokens from the one that starts the
    actor's part onwards as action tokens.  Where that part starts is the guidance parser's line rule
    (:func:`~sglightning.guidance.action_part_start`: a line starting ``Action:``, ``{``, ``<action>`` or ``<think>``),
    so "my last action: it was fine" inside a reason line stays guidance.  Works on the sampled ids (decoded prefixes,
    never re-tokenised); the token that holds the line's first character starts the action part."""
    ids = [t for p in pieces for t in p.ids]
    n = len(ids)
    start = len(sample.ids) - n
    offset = action_part_start(tok.decode(ids))
    if offset is None:
        return
    first = next((k for k in range(n) if len(tok.decode(ids[: k + 1])) > offset), None)
    if first is None:
        return
    for k in range(first, n):
        if sample.policy[start + k]:
            sample.kinds[start + k] = KIND_ACTION
    for p in pieces:
        p.kind = KIND_GUIDANCE
