"""Rollout: bookkeeping with a scripted policy, token/mask/log-prob contract with a tiny real model."""

from __future__ import annotations

import functools

import pytest
import torch

from sglightning.envs.household import HouseholdEnv
from sglightning.guidance import GuidanceConfig
from sglightning.models import ModelConfig, build_tiny_tokenizer, load_policy
from sglightning.rollout import Rollout, RolloutConfig
from sglightning.sampler import KIND_ACTION, KIND_CONTEXT, KIND_GUIDANCE

from fakes import CrashingEnv, FreeFormEnv, RecordingEnv, ScriptedLM, first_admissible, scripted_reply

ENV = functools.partial(HouseholdEnv, difficulty=0, info_actions=False)


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_policy(ModelConfig(model_name_or_path="embedded:tiny"))
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
    # the group shares its task: members are identical under a deterministic policy (pitfalls §4)
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
    r = Rollout(lm, tok, functools.partial(RecordingEnv, difficulty=0), GuidanceConfig(), RolloutConfig(group_size=3, max_steps=1))
    r.run([5, 9])
    assert sorted(RecordingEnv.log) == [5, 5, 5, 9, 9, 9]  # resets run concurrently: order is free
    # environments are reused across calls, not recreated per episode (pitfalls §7)
    envs = [r.pool.peek(i) for i in range(6)]
    assert all(e is not None for e in envs)
    r.run([6, 7])
    assert [r.pool.peek(i) for i in range(6)] == envs


def test_negative_labels_give_negative_internal_reward_and_penalties(tok):
    lm = ScriptedLM(tok, scripted_reply("negative", action=lambda ctx: "dance wildly"))
    cfg = RolloutConfig(group_size=2, max_steps=3, invalid_action_penalty=0.1)
    r = Rollout(lm, tok, ENV, GuidanceConfig(decoding="free"), cfg)
    batch = r.run([1])
    for ep in batch.episodes:
        assert len(ep.steps) == 3 and all(s.invalid for s in ep.steps)
        assert ep.penalty == pytest.approx(0.3)
        assert ep.internal_rewards == pytest.approx([-0.1] * 3)
        assert all(s.observation for s in ep.steps)


def test_unparsed_guidance_is_neutral_and_counted(tok):
    def reply(ctx):
        return f"I think things are fine.\nAction: {first_admissible(ctx)}"

    r = Rollout(ScriptedLM(tok, reply), tok, ENV, GuidanceConfig(decoding="free"), RolloutConfig(group_size=2, max_steps=2))
    batch = r.run([4])
    steps = [s for ep in batch.episodes for s in ep.steps]
    assert steps and all(s.label is None for s in steps)
    assert all(s.internal_reward == 0.0 for s in steps)
    assert not any(s.invalid for s in steps)  # the action was still found


def test_env_crash_fails_only_that_episode(tok):
    CrashingEnv.instances = 0
    factory = functools.partial(CrashingEnv, bad_seeds=(1,), crash_after=1, difficulty=0, info_actions=False)
    r = Rollout(ScriptedLM(tok, scripted_reply()), tok, factory, GuidanceConfig(), RolloutConfig(group_size=2, max_steps=4))
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
    r = Rollout(ScriptedLM(tok, scripted_reply()), tok, factory, GuidanceConfig(), RolloutConfig(group_size=2, max_steps=2))
    batch = r.run([1, 2])
    assert all(e.error and e.steps == [] and e.samples == [] for e in batch.episodes if e.seed == 1)
    assert all(e.error is None and e.steps for e in batch.episodes if e.seed == 2)


def test_free_form_env_without_admissible_list(tok):
    reply = scripted_reply(action=lambda ctx: "finish")
    r = Rollout(ScriptedLM(tok, reply), tok, FreeFormEnv, GuidanceConfig(action_decoding="admissible"), RolloutConfig(group_size=2, max_steps=3))
    batch = r.run([0])
    assert all(e.won and len(e.steps) == 1 and e.steps[0].action == "finish" for e in batch.episodes)


def test_config_validation_names_the_key():
    for kwargs, key in [
        ({"group_size": 1}, "rollout.group_size"),
        ({"max_steps": 0}, "rollout.max_steps"),
        ({"temperature": 0}, "rollout.temperature"),
        ({"invalid_action_penalty": -1}, "rollout.invalid_action_penalty"),
    ]:
        with pytest.raises(ValueError, match=key):
            RolloutConfig(**kwargs)


# ---------------------------------------------------------------------------------------------------------------- real


def _recompute(model, ids: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()  # [L, V]
    lp = torch.log_softmax(logits[:-1] / temperature, dim=-1)
    return lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]  # [L-1] log p(ids[i+1] | ids[:i+1])


@pytest.mark.parametrize(
    "mode,decoding,action",
    [("single_stream", "constrained", "admissible"), ("single_stream", "free", "free"), ("two_call", "constrained", "free")],
)
def test_sampled_ids_masks_and_logprobs_match_a_clean_forward(tiny, mode, decoding, action):
    model, tok = tiny
    gc = GuidanceConfig(prompt_mode=mode, decoding=decoding, action_decoding=action, max_guidance_tokens=6, max_action_tokens=6)
    r = Rollout(model, tok, ENV, gc, RolloutConfig(group_size=2, max_steps=3, temperature=0.7))
    batch = r.run([1, 2, 3], generator=torch.Generator().manual_seed(0))
    assert batch.generated_tokens > 0
    kinds_seen = set()
    for s in batch.samples:
        assert len(s.ids) == len(s.policy) == len(s.logprobs) == len(s.kinds)
        assert not s.policy[0]
        assert all(k == KIND_CONTEXT for k, p in zip(s.kinds, s.policy) if not p)
        kinds_seen |= {k for k, p in zip(s.kinds, s.policy) if p}
        ref = _recompute(model, s.ids, 0.7)
        got = torch.tensor(s.logprobs[1:])
        pol = torch.tensor(s.policy[1:])
        assert pol.any()
        assert torch.allclose(got[pol], ref[pol], atol=1e-5), float((got[pol] - ref[pol]).abs().max())
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
