"""Rollout: bookkeeping with a scripted policy, token/mask/log-prob contract with a tiny real model."""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch
from fakes import (
    QWEN3_STYLE_TEMPLATE,
    CrashingEnv,
    FreeFormEnv,
    OwnTaskEnv,
    RecordingEnv,
    ScriptedLM,
    first_admissible,
    scripted_reply,
)

from sglightning.data import RolloutConfig
from sglightning.embedded import build_tiny_tokenizer
from sglightning.engines import EngineConfig
from sglightning.engines.builtin import BuiltinEngine, DecodeSession
from sglightning.envs.household import HouseholdEnv
from sglightning.episodes import KIND_ACTION, KIND_CONTEXT, KIND_GUIDANCE
from sglightning.grpo import GRPOConfig
from sglightning.guidance import GuidanceConfig, parse_action
from sglightning.models import PolicyConfig, load_policy
from sglightning.rewards import episode_returns
from sglightning.rollout import Rollout

ENV = functools.partial(HouseholdEnv, difficulty=0, info_actions=False)


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_policy(PolicyConfig(name_or_path="embedded:tiny"))
    return model, tokenizer


def replay_first_admissible(seed: int, max_steps: int) -> tuple[list[str], bool]:
    env = ENV()
    res = env.reset(seed)
    adm, actions = res.admissible_actions, []
    for _ in range(max_steps):
        a = adm[0]
        actions.append(a)
        out = env.step(a)
        adm = out.admissible_actions
        if out.done:
            return actions, out.won
    return actions, False


# ---------------------------------------------------------------------------------------------------------------- fake


@pytest.mark.parametrize("mode", ["single_stream", "two_call"])
@pytest.mark.parametrize("decoding", ["constrained", "free"])
def test_scripted_policy_trajectories_match_direct_replay(tok, mode, decoding):
    lm = ScriptedLM(tok, scripted_reply("positive"))
    cfg = RolloutConfig(group_size=2, max_steps=5)
    r = Rollout(lm, tok, ENV, GuidanceConfig(prompt_mode=mode, decoding=decoding), cfg)
    batch = r.run([3, 11, 42])
    assert len(batch.episodes) == 6
    for ep in batch.episodes:
        expected, won = replay_first_admissible(ep.seed, 5)
        assert [s.action for s in ep.steps] == expected
        assert ep.won == won and ep.env_return == float(won)
        assert [s.label for s in ep.steps] == ["positive"] * len(expected)
        assert ep.internal_rewards == pytest.approx([0.1] * len(expected))
        assert not any(s.invalid for s in ep.steps)
        assert ep.truncated == (not won)
    # the group shares its task: members are identical under a deterministic policy
    for k in range(3):
        a, b = batch.episodes[2 * k], batch.episodes[2 * k + 1]
        assert a.seed == b.seed and a.task == b.task and [s.action for s in a.steps] == [s.action for s in b.steps]
    # samples: one per episode in the stream, two calls per step otherwise
    for ep in batch.episodes:
        n = 1 if mode == "single_stream" else 2 * len(ep.steps)
        assert len(ep.samples) == n


def test_group_members_get_the_groups_seed(tok):
    RecordingEnv.log = []
    lm = ScriptedLM(tok, scripted_reply())
    r = Rollout(lm, tok, functools.partial(RecordingEnv, difficulty=0), GuidanceConfig(),
                RolloutConfig(group_size=3, max_steps=1))
    r.run([5, 9])
    assert sorted(RecordingEnv.log) == [5, 5, 5, 9, 9, 9]  # resets run concurrently: order is free
    # environments are reused across calls, not recreated per episode
    envs = [r.pool.peek(i) for i in range(6)]
    assert all(e is not None for e in envs)
    r.run([6, 7])
    assert [r.pool.peek(i) for i in range(6)] == envs


def test_a_group_whose_members_reset_to_different_tasks_is_counted_and_said_once(tok):
    """An env that draws its own task in ``reset`` breaks GRPO's group baseline without any error: the rollout
    counts such groups (``rollout/split_groups``) and warns once a run, naming the env.  Control: the same env
    keeping the seed gives 0 and says nothing."""
    import warnings

    from sglightning.metrics import batch_stats

    lm = ScriptedLM(tok, scripted_reply())
    cfg = RolloutConfig(group_size=3, max_steps=1)
    r = Rollout(lm, tok, functools.partial(OwnTaskEnv, difficulty=0), GuidanceConfig(), cfg)
    with pytest.warns(UserWarning, match=r"^model.env: OwnTaskEnv.reset gave members of one group different tasks"
                                         r".*\(seed (5|9); 2 of 2 groups\)"):
        batch = r.run([5, 9])
    assert {len({ep.task for ep in batch.episodes if ep.group == k}) for k in (0, 1)} != {1}
    assert batch_stats(batch)["rollout/split_groups"] == 2.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once a run, counted every step
        assert batch_stats(r.run([5, 9]))["rollout/split_groups"] == 2.0
        control = Rollout(lm, tok, functools.partial(HouseholdEnv, difficulty=0), GuidanceConfig(), cfg).run([5, 9])
    assert batch_stats(control)["rollout/split_groups"] == 0.0


def test_a_failed_reset_does_not_split_its_group(tok):
    """An episode whose reset failed borrows its task's name from a twin and has no first observation: it is left
    out of the comparison rather than counted as a split group.  A member with another first room is counted."""
    from sglightning.episodes import split_groups

    lm = ScriptedLM(tok, scripted_reply())
    env = functools.partial(HouseholdEnv, difficulty=0)
    batch = Rollout(lm, tok, env, GuidanceConfig(), RolloutConfig(group_size=2, max_steps=1)).run([5, 9])
    assert split_groups(batch.episodes) == []
    failed = batch.episodes[0]
    failed.error, failed.initial_observation, failed.steps = "reset failed", "", []
    assert split_groups(batch.episodes) == []
    batch.episodes[3].initial_observation += " (a different room)"
    assert split_groups(batch.episodes) == [1]


def test_an_episode_the_envs_own_step_limit_ends_counts_as_truncated(tok):
    """The env's limit (``info["truncated"]``, HouseholdEnv's and ALFWorld's max_steps) ended episodes that
    ``rollout/truncated_rate`` reported as not truncated: only the rollout's own limit counted."""
    from sglightning.metrics import EpisodeMetrics

    lm = ScriptedLM(tok, scripted_reply())
    env = functools.partial(HouseholdEnv, difficulty=2, info_actions=False, max_steps=2)
    batch = Rollout(lm, tok, env, GuidanceConfig(), RolloutConfig(group_size=2, max_steps=6)).run([3])
    for ep in batch.episodes:
        assert ep.done and not ep.won and len(ep.steps) == 2 and ep.truncated
    metrics = EpisodeMetrics()
    metrics.update(batch)
    assert metrics.compute()["rollout/truncated_rate"] == 1.0


def test_episode_metrics_take_one_update_per_key_and_mean_over_episodes(tok):
    """On CUDA each update is a copy to the device and a sync: one per key a step, not one per episode and key. The
    means are the episodes' means; label shares of episodes without labels (NaN) are left out."""
    from sglightning.metrics import EpisodeMetrics, _episode_values

    guided = GuidanceConfig()
    lm = ScriptedLM(tok, scripted_reply())
    env = functools.partial(HouseholdEnv, difficulty=1, info_actions=False)
    batch = Rollout(lm, tok, env, guided, RolloutConfig(group_size=2, max_steps=3)).run([1, 2])
    batch.episodes[0].steps.clear()  # an episode with no labels: its label shares are NaN
    metrics = EpisodeMetrics()
    calls = {n: 0 for n in metrics.names}
    for name, metric in zip(metrics.names, metrics.means):
        real = metric.update
        metric.update = lambda value, _real=real, _n=name: (calls.__setitem__(_n, calls[_n] + 1), _real(value))[1]
    metrics.update(batch)
    assert set(calls.values()) == {1}
    got = metrics.compute()
    rows = [_episode_values(ep) for ep in batch.episodes]
    for name in metrics.names:
        values = [r[name] for r in rows if not math.isnan(r[name])]
        if values:
            assert got[name] == pytest.approx(sum(values) / len(values), rel=1e-6), name


class _FirstResetOfSeed3Fails(HouseholdEnv):
    """The first reset of seed 3 in the process raises (one member of the group), every other one works."""

    failed = False

    def reset(self, seed, split="train"):
        if seed == 3 and not _FirstResetOfSeed3Fails.failed:
            _FirstResetOfSeed3Fails.failed = True
            raise RuntimeError("injected")
        return super().reset(seed, split)


def test_an_episode_whose_reset_failed_is_named_after_its_task(tok):
    """It kept the default task type: the per-type success table got a made-up type, and its real type's share
    missed one lost episode.  It takes its task from a member of its group that reset (the seed fixes the task);
    with none, its type says the reset failed."""
    from sglightning.envs.faults import FaultyEnv
    from sglightning.metrics import per_task_type_success
    from sglightning.rollout import UNKNOWN_TASK_TYPE

    lm = ScriptedLM(tok, scripted_reply())
    env = functools.partial(_FirstResetOfSeed3Fails, difficulty=0, info_actions=False)
    batch = Rollout(lm, tok, env, GuidanceConfig(), RolloutConfig(group_size=2, max_steps=1)).run([3])
    failed, fine = sorted(batch.episodes, key=lambda e: e.error is None)
    assert failed.error and fine.error is None and _FirstResetOfSeed3Fails.failed
    assert (failed.task, failed.task_type, failed.info["task_id"]) == (fine.task, fine.task_type, fine.info["task_id"])
    assert list(per_task_type_success(batch.episodes)) == [fine.task_type]
    faulty = functools.partial(FaultyEnv, env=ENV, faults={4: "reset_raise"})
    batch = Rollout(lm, tok, faulty, GuidanceConfig(), RolloutConfig(group_size=2, max_steps=1)).run([4])
    assert [e.task_type for e in batch.episodes] == [UNKNOWN_TASK_TYPE] * 2


def test_negative_labels_give_negative_internal_reward_and_penalties(tok):
    lm = ScriptedLM(tok, scripted_reply("negative", action=lambda ctx: "dance wildly"))
    cfg = RolloutConfig(group_size=2, max_steps=3)
    r = Rollout(lm, tok, ENV, GuidanceConfig(decoding="free"), cfg)
    batch = r.run([1])
    returns, _, _ = episode_returns(batch.episodes, 0.0, penalty=0.1)  # P_i = 0.1 per invalid action
    assert returns.tolist() == pytest.approx([-0.3, -0.3])
    for ep in batch.episodes:
        assert len(ep.steps) == 3 and all(s.invalid for s in ep.steps)
        assert ep.internal_rewards == pytest.approx([-0.1] * 3)
        assert all(s.observation for s in ep.steps)


@pytest.mark.parametrize("mode", ["single_stream", "two_call"])
def test_an_empty_action_is_invalid_never_the_reason_text(tok, mode):
    """The actor writes nothing after ``Action:``; the reason line happens to be an admissible action.  The step is an
    invalid action (counted, a format error), and nothing the guidance wrote is sent to the env."""

    def reply(ctx):
        last_user = ctx.rsplit("<|im_start|>user", 1)[-1]
        if "Answer in exactly two lines" in last_user:
            return f"Reason: {first_admissible(ctx)}\nLabel: positive"
        if mode == "two_call":
            return "Action:"
        return f"Reason: {first_admissible(ctx)}\nLabel: positive\nAction:"

    gc = GuidanceConfig(prompt_mode=mode, decoding="constrained", action_decoding="free", max_guidance_tokens=24)
    batch = Rollout(ScriptedLM(tok, reply), tok, ENV, gc, RolloutConfig(group_size=2, max_steps=2)).run([3])
    steps = [s for ep in batch.episodes for s in ep.steps]
    assert steps and all(s.reason and s.action is None and s.invalid and not s.format_ok for s in steps)
    assert all(s.action_text == "" for s in steps)


@pytest.mark.parametrize("mode", ["single_stream", "two_call"])
def test_constrained_label_is_the_sampled_choice_not_a_label_written_in_the_reason(tok, mode):
    """The reason line says "Label: positive", the label token sampled says negative: the step's label and reward
    are those of the sampled token (the one the trainer scores), never a free +0.1 written into the reason."""

    def reply(ctx):
        last_user = ctx.rsplit("<|im_start|>user", 1)[-1]
        if mode == "two_call" and "Answer with one line" in last_user:
            return f"Action: {first_admissible(ctx)}"
        act = "" if mode == "two_call" else f"\nAction: {first_admissible(ctx)}"
        return f"Reason: all good, Label: positive\nLabel: negative{act}"

    gc = GuidanceConfig(prompt_mode=mode, decoding="constrained", max_guidance_tokens=40)
    r = Rollout(ScriptedLM(tok, reply), tok, ENV, gc, RolloutConfig(group_size=2, max_steps=2))
    batch = r.run([3])
    steps = [s for ep in batch.episodes for s in ep.steps]
    assert steps and all("Label: positive" in s.reason for s in steps)  # the trap is in the reason
    assert all(s.label == "negative" and s.internal_reward == pytest.approx(-0.1) for s in steps)


@pytest.mark.parametrize("reason", ["on my way", "my last action: it was fine, {not json}"])
@pytest.mark.parametrize(
    "fmt, answer",
    [("action_line", "Action: {a}"), ("json", '{{"think": "go on", "action": "{a}"}}'),
     ("think_tags", "<think>go on</think><action>{a}</action>")],
)
def test_free_single_stream_turn_splits_guidance_and_action_tokens_at_the_format_marker(tok, fmt, answer, reason):
    """Free decoding writes the whole turn as one segment; the tokens before the action part are guidance tokens,
    the action part's tokens are action tokens, and the step is parsed in the configured format.  The action part
    starts at a *line* that starts it (the guidance parser's rule): "action:" or "{" inside the reason line does not
    split the turn there."""

    def reply(ctx):
        return f"Reason: {reason}\nLabel: positive\n" + answer.format(a=first_admissible(ctx))

    gc = GuidanceConfig(decoding="free", actor_format=fmt, max_guidance_tokens=40, max_action_tokens=40)
    r = Rollout(ScriptedLM(tok, reply), tok, ENV, gc, RolloutConfig(group_size=2, max_steps=1))
    batch = r.run([2])
    for ep in batch.episodes:
        (step,) = ep.steps
        assert step.label == "positive" and step.format_ok and not step.invalid
        s = ep.samples[0]
        guid = tok.decode([t for t, p, k in zip(s.ids, s.policy, s.kinds) if p and k == KIND_GUIDANCE])
        act = tok.decode([t for t, p, k in zip(s.ids, s.policy, s.kinds) if p and k == KIND_ACTION],
                         skip_special_tokens=True)
        assert guid == f"Reason: {reason}\nLabel: positive\n"
        assert act == answer.format(a=step.action)
        assert step.reason == reason
        # the step's texts split there too (the action's text was empty, the guidance text the whole turn)
        assert step.action_text.strip() == act.strip() and step.guidance_text == f"Reason: {reason}\nLabel: positive"


@pytest.mark.parametrize("fmt", ["json", "think_tags"])
def test_thinking_format_with_admissible_actions_writes_the_thought_then_chooses(tok, fmt):
    """The thought is the model's free text, closed where the model closes it (the rest of the closer is forced),
    and the action is chosen among the admissible ones: the sampled text is a well-formed answer in the format."""
    from sglightning.guidance import ACTOR_FORMATS

    f = ACTOR_FORMATS[fmt]

    def reply(ctx):
        last_user = ctx.rsplit("<|im_start|>user", 1)[-1]
        if "Answer in exactly two lines" in last_user:
            return "Reason: fine\nLabel: positive"
        return f"{f.opener}I should go on{f.closer}{first_admissible(ctx)}{f.end}"

    gc = GuidanceConfig(prompt_mode="two_call", decoding="constrained", action_decoding="admissible", actor_format=fmt,
                        max_think_tokens=30)
    r = Rollout(ScriptedLM(tok, reply), tok, ENV, gc, RolloutConfig(group_size=2, max_steps=2))
    batch = r.run([5])
    actions, won = replay_first_admissible(5, 2)
    for ep in batch.episodes:
        assert [s.action for s in ep.steps] == actions[: len(ep.steps)]
        actor_sample = ep.samples[1]  # rate call, then actor call
        text = tok.decode(actor_sample.ids, skip_special_tokens=True)
        answer = text.rsplit("assistant\n", 1)[-1]
        assert answer == f"{f.opener}I should go on{f.closer}{ep.steps[0].action}{f.end}"
        assert parse_action(answer).source == f.source and parse_action(answer).action == ep.steps[0].action


def test_thought_cut_by_its_cap_is_closed_by_the_sampler(tok):
    """A thought that never closes is cut at max_think_tokens and the closer is written for it."""

    def reply(ctx):
        last_user = ctx.rsplit("<|im_start|>user", 1)[-1]
        if "Answer in exactly two lines" in last_user:
            return "Reason: fine\nLabel: positive"
        return '{"think": "' + "and then " * 50

    gc = GuidanceConfig(prompt_mode="two_call", action_decoding="admissible", actor_format="json", max_think_tokens=6)
    r = Rollout(ScriptedLM(tok, reply), tok, ENV, gc, RolloutConfig(group_size=2, max_steps=1))
    batch = r.run([5])
    for ep in batch.episodes:
        answer = tok.decode(ep.samples[1].ids, skip_special_tokens=True).rsplit("assistant\n", 1)[-1]
        p = parse_action(answer)
        assert p.source == "json" and p.action == ep.steps[0].action and not ep.steps[0].invalid


@pytest.fixture()
def qwen3_tok():
    t = build_tiny_tokenizer()
    t.chat_template = QWEN3_STYLE_TEMPLATE
    return t


def test_qwen3_style_template_gets_thinking_off_by_default(qwen3_tok):
    from sglightning.chat import ChatFormat

    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    off = qwen3_tok.decode(ChatFormat(qwen3_tok).prompt_ids(msgs))
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    on = qwen3_tok.decode(ChatFormat(qwen3_tok, {"enable_thinking": True}).prompt_ids(msgs))
    assert on.endswith("<|im_start|>assistant\n") and "<think>" not in on
    # a template without the switch is left alone
    assert "enable_thinking" not in ChatFormat(build_tiny_tokenizer()).kwargs


@pytest.mark.parametrize("mode", ["single_stream", "two_call"])
def test_rollout_with_a_qwen3_style_template(qwen3_tok, mode):
    """The single stream renders turns incrementally even though the template renders old assistant turns
    differently; the actor's first line is the action, not a think block."""
    base = scripted_reply("positive")

    def reply(ctx):
        return "<think>\n\n</think>\n\n" + base(ctx)  # the empty block the prompt opened, then the answer

    gc = GuidanceConfig(prompt_mode=mode, decoding="free", max_guidance_tokens=40, max_action_tokens=40)
    r = Rollout(ScriptedLM(qwen3_tok, reply), qwen3_tok, ENV, gc, RolloutConfig(group_size=2, max_steps=3))
    batch = r.run([6])
    actions, _ = replay_first_admissible(6, 3)
    for ep in batch.episodes:
        assert [s.action for s in ep.steps] == actions[: len(ep.steps)]
        assert all(s.label == "positive" and not s.invalid for s in ep.steps)
        text = qwen3_tok.decode(ep.samples[-1].ids)
        assert text.count("<think>\n\n</think>") >= 1


def test_rate_prompt_keeps_the_whole_trajectory_until_the_context_limit_then_cuts_the_oldest_steps(tok):
    from sglightning.metrics import _episode_values

    gc = GuidanceConfig(prompt_mode="two_call", decoding="free", max_guidance_tokens=16, max_action_tokens=16)
    lm = ScriptedLM(tok, scripted_reply("neutral", action=lambda ctx: "examine nothing"))  # invalid: no progress
    roomy = Rollout(lm, tok, ENV, gc, RolloutConfig(group_size=2, max_steps=6, max_context_tokens=100_000)).run([1])
    for ep in roomy.episodes:
        assert ep.rate_calls == 6 and ep.rate_truncations == 0
        last_rate = tok.decode(ep.samples[-2].ids)
        assert all(f"Step {i} action" in last_rate for i in range(1, 6)) and "not shown" not in last_rate
    first_rate = len(roomy.episodes[0].samples[0].ids)
    per_step = (len(roomy.episodes[0].samples[-2].ids) - first_rate) / 5
    limit = int(first_rate + 2.5 * per_step) + 16 + 8  # room for about two steps
    tight = Rollout(lm, tok, ENV, gc, RolloutConfig(group_size=2, max_steps=6, max_context_tokens=limit)).run([1])
    for ep in tight.episodes:
        assert ep.rate_calls == 6 and 0 < ep.rate_truncations < 6
        rate_samples = ep.samples[0::2]
        assert all(len([i for i, p in enumerate(s.policy) if not p]) <= limit for s in rate_samples)
        last_rate = tok.decode(rate_samples[-1].ids)
        assert ("Step 5 action" in last_rate and "Step 1 action" not in last_rate
                and "earlier steps not shown" in last_rate)
        assert _episode_values(ep)["guidance/rate_history_truncated"] == ep.rate_truncations / 6
    # the actor prompts too: their history was never cut, so they grew past the cap (5 296 tokens at a 300 cap)
    assert all(ep.actor_truncations == 0 and ep.actor_calls == 6 for ep in roomy.episodes)
    longest = max(s.policy.index(True) for s in roomy.episodes[0].samples[1::2])  # the last step's, 5 steps shown
    limit = longest + 16 + 8 - 1  # one token short for it
    tight = Rollout(lm, tok, ENV, gc, RolloutConfig(group_size=2, max_steps=6, max_context_tokens=limit)).run([1])
    for ep in tight.episodes:
        assert max(s.policy.index(True) for s in ep.samples[1::2]) <= limit - 16 - 8
        assert 0 < ep.actor_truncations < 6 and ep.actor_calls == 6
        assert _episode_values(ep)["rollout/actor_history_truncated"] == ep.actor_truncations / 6


class _LongPageEnv(FreeFormEnv):
    """Its second observation is a 400-word page."""

    def step(self, action):
        res = super().step(action)
        res.observation = "word " * 400
        return res


@pytest.mark.parametrize("max_steps", [1, 3])
def test_a_single_stream_episode_never_feeds_past_its_context_cap(tok, max_steps):
    """The cap was checked after a turn: a long observation was fed, and a whole turn generated, past it (a sample of
    485 tokens at a 300 cap). Checked before feeding now; and the last step's observation, which no action follows,
    is not fed at all."""
    gc = GuidanceConfig(max_guidance_tokens=16, max_action_tokens=16)
    lm = ScriptedLM(tok, scripted_reply(action=lambda ctx: "wait"))
    batch = Rollout(lm, tok, _LongPageEnv, gc, RolloutConfig(group_size=2, max_steps=max_steps,
                                                            max_context_tokens=300)).run([0])
    for ep in batch.episodes:
        sample = ep.samples[0]
        assert len(sample.ids) <= 300 and ep.truncated and len(ep.steps) == 1
        last_written = max(i for i, p in enumerate(sample.policy) if p)
        assert len(sample.ids) - last_written < 10  # it ends with the turn: the 400-word page was not fed


class _HeadStartEnv(FreeFormEnv):
    """Starts at score 50 (as some ScienceWorld variations do); 'finish' brings it to 60 and ends the episode."""

    def reset(self, seed, split="train"):
        res = super().reset(seed, split)
        res.score = 50.0
        return res

    def step(self, action):
        res = super().step(action)
        res.score = 60.0 if res.done else 50.0
        return res


def test_score_gained_is_reported_beside_the_raw_score_and_format_errors_are_counted(tok):
    from sglightning.metrics import _episode_values

    def reply(ctx):  # guidance, then an answer that is not the requested JSON but still names an action
        return "Reason: ok\nLabel: positive\nAction: finish"

    gc = GuidanceConfig(decoding="free", actor_format="json", max_guidance_tokens=40, max_action_tokens=40)
    batch = Rollout(ScriptedLM(tok, reply), tok, _HeadStartEnv, gc, RolloutConfig(group_size=2, max_steps=2)).run([0])
    for ep in batch.episodes:
        vals = _episode_values(ep)
        assert ep.won and ep.initial_score == 50.0 and ep.score == 60.0
        assert vals["rollout/score"] == 60.0 and vals["rollout/score_gained"] == 10.0
        assert vals["rollout/format_error_rate"] == 1.0 and not ep.steps[0].invalid


@pytest.mark.parametrize("mode", ["single_stream", "two_call"])
def test_tokens_a_step_and_steps_that_ran_to_a_cap_are_counted(tok, mode):
    """A reason longer than its cap runs to the cap on every step; a short one ends on its newline. The tokens a step
    writes are the policy tokens of its samples, spread over the steps."""
    from sglightning.metrics import _episode_values

    def reply(long):
        return lambda ctx: f"Reason: {'very ' * 30 if long else ''}ok\nLabel: positive\nAction: {first_admissible(ctx)}"

    vals = {}
    for long in (False, True):
        gc = GuidanceConfig(prompt_mode=mode, decoding="constrained", max_guidance_tokens=12, max_action_tokens=24)
        batch = Rollout(ScriptedLM(tok, reply(long)), tok, ENV, gc, RolloutConfig(group_size=2, max_steps=3)).run([4])
        for ep in batch.episodes:
            v = _episode_values(ep)
            assert v["rollout/capped_step_rate"] == float(long), (long, [s.capped for s in ep.steps])
            policy = sum(sum(s.policy) for s in ep.samples)
            assert v["rollout/tokens_per_step"] == pytest.approx(policy / len(ep.steps))
            assert all(s.written > 0 for s in ep.steps)
            vals[long] = v["rollout/tokens_per_step"]
    assert vals[True] > vals[False]  # the capped reason wrote 12 tokens, the short one fewer


@pytest.mark.parametrize("mode,most_sessions", [("single_stream", 1), ("two_call", 4)])
def test_one_engine_session_serves_every_group_of_a_step(tok, mode, most_sessions):
    """All live episodes of all groups decode together: every feed of a session holds all six rows (3 groups of 2),
    and a step opens one session (single_stream) or one a call and turn (two_call: 2 calls x 2 turns), not one a
    group."""
    r = Rollout(ScriptedLM(tok, scripted_reply()), tok, ENV, GuidanceConfig(prompt_mode=mode),
                RolloutConfig(group_size=2, max_steps=2))
    opened, fed = [], []
    real = r.engine.session

    def counting(*args, **kw):
        session = real(*args, **kw)
        feed = session.feed
        session.feed = lambda blocks: (fed.append(len(blocks)), feed(blocks))[1]
        opened.append(session)
        return session

    r.engine.session = counting
    batch = r.run([1, 2, 3])
    assert all(len(ep.steps) == 2 for ep in batch.episodes)  # every episode lived through both turns
    assert 1 <= len(opened) <= most_sessions
    assert fed and set(fed) == {6}


def test_unparsed_guidance_is_neutral_and_counted(tok):
    def reply(ctx):
        return f"I think things are fine.\nAction: {first_admissible(ctx)}"

    r = Rollout(ScriptedLM(tok, reply), tok, ENV, GuidanceConfig(decoding="free"),
                RolloutConfig(group_size=2, max_steps=2))
    batch = r.run([4])
    steps = [s for ep in batch.episodes for s in ep.steps]
    assert steps and all(s.label is None for s in steps)
    assert all(s.internal_reward == 0.0 for s in steps)
    assert not any(s.invalid for s in steps)  # the action was still found


def test_env_crash_fails_only_that_episode(tok):
    CrashingEnv.instances = 0
    factory = functools.partial(CrashingEnv, bad_seeds=(1,), crash_after=1, difficulty=0, info_actions=False)
    r = Rollout(ScriptedLM(tok, scripted_reply()), tok, factory, GuidanceConfig(),
                RolloutConfig(group_size=2, max_steps=4))
    batch = r.run([1, 2])
    bad = [e for e in batch.episodes if e.seed == 1]
    good = [e for e in batch.episodes if e.seed == 2]
    assert all(e.error and "simulated step crash" in e.error and not e.won for e in bad)
    assert all(e.error is None for e in good)
    assert [s.action for s in good[0].steps] == replay_first_admissible(2, 4)[0]
    assert r.env_errors == 2
    assert CrashingEnv.instances == 4 and r.pool.replaced == 2  # the broken workers were retired ...
    r.run([2, 3])
    assert CrashingEnv.instances == 4 + 2  # ... and rebuilt on their next use


@pytest.mark.parametrize("where", ["reset", "garbage"])
def test_env_failing_at_reset_is_isolated(tok, where):
    factory = functools.partial(CrashingEnv, bad_seeds=(1,), where=where, difficulty=0)
    r = Rollout(ScriptedLM(tok, scripted_reply()), tok, factory, GuidanceConfig(),
                RolloutConfig(group_size=2, max_steps=2))
    batch = r.run([1, 2])
    assert all(e.error and e.steps == [] and e.samples == [] for e in batch.episodes if e.seed == 1)
    assert all(e.error is None and e.steps for e in batch.episodes if e.seed == 2)


def test_free_form_env_without_admissible_list(tok):
    reply = scripted_reply(action=lambda ctx: "finish")
    r = Rollout(ScriptedLM(tok, reply), tok, FreeFormEnv, GuidanceConfig(action_decoding="admissible"),
                RolloutConfig(group_size=2, max_steps=3))
    batch = r.run([0])
    assert all(e.won and len(e.steps) == 1 and e.steps[0].action == "finish" for e in batch.episodes)


def test_config_validation_names_the_key():
    for kwargs, key in [
        ({"group_size": 1}, "rollout.group_size"),
        ({"max_steps": 0}, "rollout.max_steps"),
        ({"temperature": 0}, "rollout.temperature"),
    ]:
        with pytest.raises(ValueError, match=key):
            RolloutConfig(**kwargs)
    with pytest.raises(ValueError, match="grpo.invalid_action_penalty"):
        GRPOConfig(invalid_action_penalty=-1)


# ---------------------------------------------------------------------------------------------------------------- real


def _recompute(model, ids: list[int], temperature: float) -> torch.Tensor:
    """[L-1, V]: row i = log π(· | ids[:i+1]) at ``temperature``, from one clean unbatched forward."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()  # [L, V]
    return torch.log_softmax(logits[:-1] / temperature, dim=-1)


def _restricted_reference(rows: torch.Tensor, ids: list[int], restrictions: list) -> torch.Tensor:
    """Log q(ids[i+1]) by hand: log π renormalised over the recorded allowed set (or all but the banned set)."""
    out = []
    for i, r in enumerate(restrictions[1:]):
        lp = rows[i]
        if r is None:
            out.append(lp[ids[i + 1]])
            continue
        listed = torch.zeros(lp.numel(), dtype=torch.bool)
        listed[list(r.ids)] = True
        allowed = ~listed if r.exclude else listed
        assert allowed[ids[i + 1]], "a token was sampled outside its recorded allowed set"
        out.append(lp[ids[i + 1]] - torch.logsumexp(lp[allowed], dim=0))
    return torch.stack(out)


@pytest.mark.parametrize("compile_mode", ["off", "static"])
@pytest.mark.parametrize(
    "mode,decoding,action,fmt,top_k",
    [("single_stream", "constrained", "admissible", "action_line", 0),
     ("single_stream", "free", "free", "action_line", 0), ("two_call", "constrained", "free", "action_line", 0),
     ("two_call", "free", "admissible", "json", 0), ("single_stream", "constrained", "admissible", "think_tags", 0),
     ("two_call", "constrained", "free", "json", 0), ("single_stream", "free", "free", "action_line", 7)],
)
def test_sampled_ids_masks_and_logprobs_match_a_clean_forward(tiny, mode, decoding, action, fmt, top_k, compile_mode):
    """The recorded log-prob of every policy token is that of the distribution it was drawn from (restricted
    sampling renormalised over the recorded set, top-k included), equal to a clean unbatched forward; the
    unrestricted log π is kept beside it.  With the dynamic cache and with the slot cache (the GPU path)."""
    model, tok = tiny
    gc = GuidanceConfig(prompt_mode=mode, decoding=decoding, action_decoding=action, max_guidance_tokens=6,
                        max_action_tokens=6, max_think_tokens=5, actor_format=fmt)
    r = Rollout(model, tok, ENV, gc, RolloutConfig(group_size=2, max_steps=3, temperature=0.7, top_k=top_k),
                engine=BuiltinEngine(EngineConfig(compile=compile_mode)))
    batch = r.run([1, 2, 3], generator=torch.Generator().manual_seed(0))
    assert batch.generated_tokens > 0
    kinds_seen = set()
    restricted_seen = 0
    for s in batch.samples:
        assert len(s.ids) == len(s.policy) == len(s.logprobs) == len(s.kinds) == len(s.restrictions)
        assert not s.policy[0]
        assert all(k == KIND_CONTEXT for k, p in zip(s.kinds, s.policy) if not p)
        assert all(r is None for r, p in zip(s.restrictions, s.policy) if not p)
        kinds_seen |= {k for k, p in zip(s.kinds, s.policy) if p}
        rows = _recompute(model, s.ids, 0.7)
        ref = _restricted_reference(rows, s.ids, s.restrictions)
        full_ref = rows.gather(-1, torch.tensor(s.ids[1:])[:, None])[:, 0]
        got = torch.tensor(s.logprobs[1:])
        pol = torch.tensor(s.policy[1:])
        assert pol.any()
        assert torch.allclose(got[pol], ref[pol], atol=1e-5), float((got[pol] - ref[pol]).abs().max())
        full = torch.tensor(s.full_logprobs[1:])
        assert torch.allclose(full[pol], full_ref[pol], atol=1e-5)
        restricted_seen += sum(r is not None for r in s.restrictions)
    if decoding == "constrained" or action == "admissible" or top_k:
        assert restricted_seen > 0
    if top_k:  # every free token was drawn among the top k
        assert all(r is not None and len(r.ids) <= top_k for s in batch.samples
                   for r, p in zip(s.restrictions, s.policy) if p)
    if action == "admissible":  # the thought (if any) is free, the action is one of the admissible ones
        assert all(not st.invalid and st.format_ok for e in batch.episodes for st in e.steps)
    if decoding == "free" and mode == "single_stream":
        # a random model rarely writes "Action:", so its free turns may be all guidance
        assert KIND_GUIDANCE in kinds_seen and kinds_seen <= {KIND_GUIDANCE, KIND_ACTION}
    else:
        assert kinds_seen == {KIND_GUIDANCE, KIND_ACTION}


def test_constrained_decoding_never_fails_to_parse(tiny):
    model, tok = tiny
    gc = GuidanceConfig(decoding="constrained", action_decoding="admissible", max_guidance_tokens=4)
    r = Rollout(model, tok, ENV, gc, RolloutConfig(group_size=2, max_steps=3))
    batch = r.run([5, 6], generator=torch.Generator().manual_seed(1))
    steps = [s for e in batch.episodes for s in e.steps]
    assert steps and all(s.label in ("positive", "neutral", "negative") for s in steps)
    assert not any(s.invalid for s in steps)


def test_unguided_rollout_has_no_guidance_tokens(tiny):
    model, tok = tiny
    r = Rollout(model, tok, ENV, GuidanceConfig(action_decoding="admissible"), RolloutConfig(group_size=2, max_steps=2))
    batch = r.run([7], guided=False, generator=torch.Generator().manual_seed(0))
    assert all(KIND_GUIDANCE not in s.kinds for s in batch.samples)
    assert all(s.label is None and s.internal_reward == 0 for e in batch.episodes for s in e.steps)
    assert all("Label:" not in tok.decode(s.ids) for s in batch.samples)


def test_batching_does_not_change_greedy_results(tiny):
    """A group played alone and inside a larger, ragged batch produces the same tokens (padding is invisible)."""
    model, tok = tiny
    gc = GuidanceConfig(decoding="constrained", action_decoding="free", max_guidance_tokens=5, max_action_tokens=5)
    alone = Rollout(model, tok, ENV, gc, RolloutConfig(group_size=2, max_steps=3)).run([8], greedy=True)
    mixed = Rollout(model, tok, ENV, gc, RolloutConfig(group_size=2, max_steps=3)).run([2, 8, 13], greedy=True)
    for a, b in zip(alone.episodes, mixed.episodes[2:4]):
        assert a.seed == b.seed
        assert a.samples[0].ids == b.samples[0].ids
        assert a.samples[0].logprobs == pytest.approx(b.samples[0].logprobs, abs=1e-5)


@pytest.mark.parametrize("mode", ["single_stream", "two_call"])
def test_every_token_carries_its_episode_step(tok, mode):
    """Step t's prompt/observation, guidance and action tokens carry t (what step-level advantage estimators use)."""
    lm = ScriptedLM(tok, scripted_reply("positive"))
    r = Rollout(lm, tok, ENV, GuidanceConfig(prompt_mode=mode, decoding="free"),
                RolloutConfig(group_size=2, max_steps=3))
    batch = r.run([1])
    for ep in batch.episodes:
        n = len(ep.steps)
        if mode == "single_stream":
            (s,) = ep.samples
            # an episode cut by max_steps also holds the observation that would have opened step n
            assert s.steps == sorted(s.steps) and set(range(n)) <= set(s.steps) <= set(range(n + 1))
            for t in range(n):  # the policy tokens of step t spell that step's action
                written = tok.decode([i for i, p, st in zip(s.ids, s.policy, s.steps) if p and st == t])
                assert ep.steps[t].action in written
        else:
            assert len(ep.samples) == 2 * n  # a rate and an actor call per step
            for k, s in enumerate(ep.samples):
                assert set(s.steps) == {k // 2}


def test_shared_prefixes_groups_rows_by_their_common_prompt():
    from sglightning.prefixes import shared_prefixes

    a = list(range(20))
    b = a[:12] + [99, 98]
    c = [7] * 30
    cluster_of, cut = shared_prefixes([a, c, a, b, c])
    # rows 0, 2, 3 share a's first 12 tokens; rows 1 and 4 are one prompt twice
    assert cluster_of == [0, 1, 0, 0, 1]
    assert cut == [12, 30, 12, 12, 30]
    assert shared_prefixes([a, c]) is None  # nothing shared
    # two tasks' prompts share a system prompt; each task's rows share far more: two clusters, not one
    system = [5] * 10
    task_a, task_b = system + [1] * 50, system + [2] * 50
    cluster_of, cut = shared_prefixes([task_a, task_b, task_a, task_b, task_a + [9], task_b])
    assert cluster_of == [0, 1, 0, 1, 0, 1] and cut == [60] * 6
    # ... unless the rows of each task are alone: then the system prompt is what is shared
    cluster_of, cut = shared_prefixes([task_a, task_b])
    assert cluster_of == [0, 0] and cut == [10, 10]
    assert shared_prefixes([a, a[:3] + [5]]) is None  # 3 common tokens: below the minimum


def same_rollouts_with_and_without(tiny, mode: str, option: str, seeds: list[int], max_steps: int):
    """Play the same constrained rollouts with ``BuiltinEngine(option=True)`` and ``(option=False)``; assert identical
    tokens and log-probs (beyond float rounding); return both batches (on, off)."""
    model, tok = tiny
    gc = GuidanceConfig(prompt_mode=mode, decoding="constrained", action_decoding="admissible", max_guidance_tokens=5)
    runs = {}
    for on in (True, False):
        r = Rollout(model, tok, ENV, gc, RolloutConfig(group_size=3, max_steps=max_steps, temperature=1.0),
                    engine=BuiltinEngine(**{option: on}))
        runs[on] = r.run(seeds, generator=torch.Generator().manual_seed(0))
    assert len(runs[True].samples) == len(runs[False].samples) > 0
    for a, b in zip(runs[True].samples, runs[False].samples):
        assert a.ids == b.ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    return runs[True], runs[False]


@pytest.mark.parametrize("mode", ["single_stream", "two_call"])
def test_shared_prefix_rollouts_equal_unshared_ones_and_compute_less(tiny, mode):
    """Sharing a group's prompt changes no token and no log-prob (beyond float rounding); it computes fewer
    prefill positions."""
    shared, plain = same_rollouts_with_and_without(tiny, mode, "share_prefix", [1, 2], max_steps=3)
    assert 0 < shared.prefill_positions < plain.prefill_positions


def test_forced_runs_ride_along_with_the_sampled_token_and_log_probs_match_a_clean_forward(tiny):
    """A lock step feeds each row one sampled token plus every token after it that needs no sampling (a Force, a
    Choice's single-continuation tokens): Force(5) · Free(1) · Force(3) · Choice(two options sharing 2 tokens) takes
    3 forwards instead of 12, and every sampled token's log-prob is the model's on the exact context before it."""
    from sglightning.engines.program import Choice, Force, Free

    model, _ = tiny
    model.eval()
    prompt = [[5, 6, 7, 8], [9, 10, 11, 12]]
    program = [Force([20, 21, 22, 23, 24]), Free(1, frozenset()), Force([30, 31, 32]),
               Choice([[40, 41, 42], [40, 41, 43]])]
    s = DecodeSession(model, pad_id=0, generator=torch.Generator().manual_seed(0), share_prefix=False)
    s.feed(prompt)
    pieces = s.run([list(program), list(program)])
    assert s.forward_calls == 1 + 3  # prompt; Force+sample; Free's token+Force+forced Choice run; the choice
    for row, pcs in zip(prompt, pieces):
        ids = row + [t for p in pcs for t in p.ids]
        assert [p.ids for p in pcs][0] == [20, 21, 22, 23, 24] and pcs[3].ids[:2] == [40, 41]
        assert pcs[3].forced == 2 and pcs[3].policy == [False, False, True]
        with torch.no_grad():
            logp = model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [T, V]
        at = len(row) + 5  # the Free token
        torch.testing.assert_close(torch.tensor(pcs[1].full_logprobs[0]), logp[at - 1, pcs[1].ids[0]], atol=1e-5,
                                   rtol=1e-5)
        last = len(ids) - 1  # the Choice's sampled token
        torch.testing.assert_close(torch.tensor(pcs[3].full_logprobs[2]), logp[last - 1, ids[last]], atol=1e-5,
                                   rtol=1e-5)


def test_action_help_first_turn_only_keeps_trajectories_and_cuts_repeats(tok):
    """guidance.action_help_every_turn=false: the env's help is in the first user turn only, the admissible list in
    every turn; a scripted policy plays the same steps, on a shorter context."""
    texts, actions = {}, {}
    for every in (True, False):
        lm = ScriptedLM(tok, scripted_reply("positive"))
        r = Rollout(lm, tok, ENV, GuidanceConfig(action_help_every_turn=every), RolloutConfig(group_size=2,
                                                                                              max_steps=4))
        batch = r.run([3, 11])
        texts[every] = [tok.decode(ep.samples[0].ids) for ep in batch.episodes]
        actions[every] = [[s.action for s in ep.steps] for ep in batch.episodes]
    assert actions[True] == actions[False]
    for text_on, text_off, acts in zip(texts[True], texts[False], actions[True]):
        assert len(acts) >= 2  # several turns, so the help could repeat
        help_text = HouseholdEnv.action_help
        assert text_on.count(help_text) == text_on.count("Admissible actions: ") >= 2  # every user turn
        assert text_off.count(help_text) == 1
        assert text_off.count("Admissible actions: ") == text_on.count("Admissible actions: ")
        assert len(text_off) < len(text_on)


def test_action_help_first_turn_only_needs_the_single_stream():
    with pytest.raises(ValueError, match=r"guidance.action_help_every_turn: .*single_stream"):
        GuidanceConfig(prompt_mode="two_call", action_help_every_turn=False)


def test_plan_stages_cuts_where_lengths_jump_and_keeps_decode_steps_in_one_pass():
    from sglightning.engines.prefill import plan_stages

    assert plan_stages([1] * 13 + [4, 4, 4], cached=400) == [4]  # decode-sized blocks: one pass
    assert plan_stages([50] * 12 + [180] * 4, cached=400) == [50, 180]  # 16x180 padded vs 16x50 + 4x130 (+ copies)
    assert plan_stages([30, 30], cached=0) == [30]
    lens = [47, 50, 59, 59, 76, 83, 137, 166, 0, 3]
    cuts = plan_stages(lens, cached=300)
    assert cuts[-1] == max(lens) and cuts == sorted(set(cuts))
    computed = len(lens) * cuts[0] + sum(sum(x > lo for x in lens) * (hi - lo) for lo, hi in zip(cuts, cuts[1:]))
    assert computed < len(lens) * max(lens)


def test_staged_prefill_gives_the_one_pass_logits_and_computes_fewer_positions(tiny):
    """Blocks of very different lengths fed in stages (rows still longer than a cut, on a copy of their cache) leave
    every row's next-token logits and the rest of the decode as one padded pass does, with fewer positions."""
    model, _ = tiny
    model.eval()
    g = torch.Generator().manual_seed(0)
    prompt = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (12, 7, 9, 12)]
    turn = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (90, 4, 6, 5)]
    sessions = {staged: DecodeSession(model, 0, share_prefix=False, staged_prefill=staged) for staged in (True, False)}
    for s in sessions.values():
        s.feed(prompt)
        s.feed([[3], [4], [5], [6]])
        before = (s.forward_calls, s.fed_positions)
        s.feed(turn)
        s.turn_cost = (s.forward_calls - before[0], s.fed_positions - before[1])
        s.feed([[7], [8], [9], [10]])
    staged, plain = sessions[True], sessions[False]
    assert DecodeSession(model, 0).staged_prefill  # the default on a CPU
    assert staged.turn_cost == (2, 4 * 6 + 1 * 84) and plain.turn_cost == (1, 4 * 90)
    torch.testing.assert_close(staged.last_logits, plain.last_logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(staged.attn.sum(1), plain.attn.sum(1)) and staged.next_pos == plain.next_pos
    for row in range(4):  # the cache: a clean forward of the row's whole sequence gives the same last logits
        ids = prompt[row] + [3 + row] + turn[row] + [7 + row]
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        torch.testing.assert_close(staged.last_logits[row], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["single_stream", "two_call"])
def test_staged_prefill_rollouts_equal_one_pass_rollouts(tiny, mode):
    staged, one_pass = same_rollouts_with_and_without(tiny, mode, "staged_prefill", [1, 2, 3], max_steps=4)
    assert staged.prefill_positions <= one_pass.prefill_positions


def test_a_fed_block_runs_the_lm_head_as_one_matrix_product(tiny):
    """Feeding a block (several tokens per row) computes the LM head on one [rows, H] matrix: no batched product
    over a copy of the [H, V] head weight per row (what a strided last-position slice makes torch's matmul do), and
    the logits are those of a clean forward."""
    from torch.profiler import ProfilerActivity, profile

    model, _ = tiny
    model.eval()
    g = torch.Generator().manual_seed(1)
    blocks = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (9, 9, 9)]
    s = DecodeSession(model, 0, share_prefix=False, staged_prefill=False)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        s.feed(blocks)
    vocab = model.get_output_embeddings().weight.shape[0]
    head_bmm = [e for e in prof.events() if e.name == "aten::bmm" and any(vocab in shape for shape in e.input_shapes)]
    assert not head_bmm, [e.input_shapes for e in head_bmm]
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(blocks)).logits[:, -1].float()
    torch.testing.assert_close(s.last_logits, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["two_call", "single_stream"])
def test_a_json_action_holding_half_a_surrogate_pair_is_an_invalid_action_not_a_crashed_step(tok, mode):
    """JSON decodes an escape of half a surrogate pair to a lone surrogate, which tokenizers and TensorBoard refuse:
    it went into the next prompt and the step ended with a TypeError (the paper's configs: two_call, free, json)."""
    from sglightning.report import trajectory_markdown

    def reply(context):
        if "Answer in exactly two lines" in context.rsplit("<|im_start|>user", 1)[-1]:
            return "Reason: ok\nLabel: positive"
        action = '{"think": "x", "action": "\\ud800 go"}'
        return action if mode == "two_call" else "Reason: ok\nLabel: positive\n" + action

    gc = GuidanceConfig(prompt_mode=mode, decoding="free", actor_format="json", max_action_tokens=64,
                        max_guidance_tokens=64)
    batch = Rollout(ScriptedLM(tok, reply), tok, ENV, gc, RolloutConfig(group_size=2, max_steps=2)).run([3])
    for ep in batch.episodes:
        assert ep.error is None and [s.invalid for s in ep.steps] == [True, True]
        assert all(s.action == "? go" for s in ep.steps)
        trajectory_markdown(ep).encode("utf-8")  # what TensorBoard's text panel takes


def test_the_tokenizer_cache_is_bounded_by_tokens_not_entries(tok, monkeypatch):
    """The text -> ids cache kept up to 65 536 texts: whole two_call prompts of thousands of tokens each, ~7 GB of
    host memory before it cleared.  It now holds at most ``CACHE_TOKENS`` tokens, and returns the same ids."""
    import sglightning.chat as chat

    monkeypatch.setattr(chat, "CACHE_TOKENS", 2_000)
    fmt = chat.ChatFormat(tok)
    texts = [f"observation {i}: " + "you see a mug on the countertop. " * 20 for i in range(40)]
    first = [fmt.encode(t) for t in texts]
    assert 0 < fmt._cached <= 2_000 and sum(len(ids) for ids in fmt._ids.values()) == fmt._cached
    assert [fmt.encode(t) for t in texts] == first == [tok.encode(t, add_special_tokens=False) for t in texts]


def test_a_reason_cut_at_its_cap_is_followed_by_one_newline_before_the_label(tok):
    """A capped reason line is closed with a newline; the label's prefix then added another (a blank line before
    "Label:"), a prompt shape the uncapped line never has."""
    lm = ScriptedLM(tok, scripted_reply("positive"))
    capped = GuidanceConfig(decoding="constrained", max_guidance_tokens=2)
    whole = GuidanceConfig(decoding="constrained", max_guidance_tokens=32)
    for gc, cut in ((capped, True), (whole, False)):
        batch = Rollout(lm, tok, ENV, gc, RolloutConfig(group_size=2, max_steps=2)).run([3])
        text = tok.decode(batch.episodes[0].samples[0].ids).split("<|im_start|>assistant", 1)[1]  # the answers
        assert text.count("\nLabel:") == len(batch.episodes[0].steps) and "\n\nLabel:" not in text, text
        reasons = [line for line in text.splitlines() if line.startswith("Reason:")]
        assert reasons and all(len(tok.encode(r[len("Reason:"):])) <= 2 for r in reasons) == cut  # the control


def test_a_json_thought_cannot_escape_its_closing_quote_and_actions_are_escaped(tok):
    r"""A thought token ending in a lone backslash, then the closer's quote, wrote ``"abc\", "action": …`` (invalid
    JSON in the stream the model reads back); an action holding quotes was written unescaped."""
    from sglightning.chat import closing_tokens, token_texts
    from sglightning.guidance import ACTOR_FORMATS
    from sglightning.rollout import _clean_admissible, _written_as

    texts = token_texts(tok)
    stops, banned = closing_tokens(tok, '", "action": "', json_string=True)
    odd = [i for i, t in enumerate(texts) if '"' not in t and (len(t) - len(t.rstrip("\\"))) % 2]
    even = [i for i, t in enumerate(texts) if '"' not in t and "\n" not in t and t.endswith("\\\\")
            and (len(t) - len(t.rstrip("\\"))) % 2 == 0]
    assert odd and set(odd) <= banned  # the control: the vocabulary has such tokens
    assert not set(even) & banned and not set(odd) & set(stops)
    _, plain = closing_tokens(tok, "</think><action>")
    assert not set(odd) <= plain  # another format's thought may end in a backslash
    assert _written_as('search["red shoe"]', ACTOR_FORMATS["json"]) == 'search[\\"red shoe\\"]'
    assert json.loads('{"action": "' + _written_as('a\\b "c"', ACTOR_FORMATS["json"]) + '"}')["action"] == 'a\\b "c"'
    assert _written_as('say "hi"', ACTOR_FORMATS["action_line"]) == 'say "hi"'
    assert _clean_admissible([]) is None and _clean_admissible([" ", ""]) is None and _clean_admissible(None) is None


def test_a_choice_with_no_options_is_refused():
    """It gave an empty restriction: the engine was asked to sample from no token at all."""
    from sglightning.engines.program import build_trie

    with pytest.raises(ValueError, match="no options"):
        build_trie([])
    assert -1 in build_trie([[5]])[5]  # the control: one option is a trie


def test_an_episode_without_steps_is_left_out_of_the_per_step_shares():
    """A guided episode whose reset failed counted 0 in every label share, in the invalid-action and format-error
    rates, and as a lost 0 in the positive gap: one won episode beside it read as half its labels positive."""
    from sglightning.episodes import Episode, RolloutBatch, StepRecord
    from sglightning.metrics import EpisodeMetrics, batch_stats

    won = Episode(index=0, group=0, seed=1, won=True, guided=True)
    won.steps = [StepRecord(observation="", label="positive", action="go", invalid=False) for _ in range(2)]
    lost = Episode(index=1, group=0, seed=1, won=False, guided=True)
    lost.steps = [StepRecord(observation="", label="negative", action="go", invalid=True)]
    failed = Episode(index=2, group=0, seed=1, guided=True, error="reset: timeout after 1 s")
    metrics = EpisodeMetrics()
    metrics.update(RolloutBatch(episodes=[won, lost, failed]))
    got = metrics.compute()
    assert got["guidance/label_positive"] == pytest.approx(0.5)  # (1 + 0) / 2 episodes with steps, not / 3
    assert got["rollout/invalid_action_rate"] == pytest.approx(0.5) and "guidance/rate_history_truncated" not in got
    assert got["rollout/env_error_rate"] == pytest.approx(1 / 3)  # the control: a whole-episode rate counts it
    assert batch_stats(RolloutBatch(episodes=[won, lost, failed]))["guidance/positive_gap_won_minus_lost"] == 1.0


class AliasEnv(HouseholdEnv):
    """Accepts ``please <admissible command>`` as an alias and runs the command (as ALFWorld runs ``put X in/on Y``
    as ``move X to Y``), saying so in ``info["command"]``."""

    def step(self, action: str):
        command = action.removeprefix("please ")
        res = super().step(command)
        res.info = {**res.info, "command": command}
        return res


def test_an_alias_the_env_ran_is_a_valid_action(tok):
    """A free action off the admissible list that the env accepted (its ``info["command"]`` is admissible) was
    counted invalid and penalised, even on a winning step."""
    lm = ScriptedLM(tok, scripted_reply(action=lambda ctx: "please " + first_admissible(ctx)))
    r = Rollout(lm, tok, functools.partial(AliasEnv, difficulty=0, info_actions=False),
                GuidanceConfig(action_decoding="free"), RolloutConfig(group_size=2, max_steps=3))
    steps = [s for e in r.run([1]).episodes for s in e.steps]
    assert steps and all(s.action.startswith("please ") and s.info["command"] in s.action for s in steps)
    assert not any(s.invalid for s in steps)
    lm = ScriptedLM(tok, scripted_reply(action=lambda ctx: "please dance"))  # the control: an alias of nothing
    r = Rollout(lm, tok, functools.partial(AliasEnv, difficulty=0, info_actions=False),
                GuidanceConfig(action_decoding="free"), RolloutConfig(group_size=2, max_steps=2))
    assert all(s.invalid for e in r.run([1]).episodes for s in e.steps)
