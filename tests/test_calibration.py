"""Is the guidance informative: label vs measured progress (accuracy, precision), label vs outcome (AUROC)."""

from __future__ import annotations

import functools

import pytest
from fakes import ScriptedLM, scripted_reply
from tiny import tiny_module, tiny_trainer

from sglightning.calibration import auroc, balanced_accuracy, calibration_stats, label_progress_pairs
from sglightning.data import RolloutConfig
from sglightning.embedded import build_tiny_tokenizer
from sglightning.envs.base import ResetResult, StepResult, TextEnv
from sglightning.envs.household import HouseholdEnv
from sglightning.episodes import KIND_ACTION, Episode, StepRecord
from sglightning.guidance import GuidanceConfig, progress_label
from sglightning.report import build_report, report_markdown, scalars
from sglightning.rewards import RewardTerm
from sglightning.rollout import Rollout
from sglightning.update import UpdateConfig

ENV = functools.partial(HouseholdEnv, difficulty=0, info_actions=False)


def _episode(labels, progress, won, guided=True) -> Episode:
    ep = Episode(index=0, group=0, seed=0, won=won, guided=guided)
    ep.steps = [StepRecord(observation="", label=z, progress=p) for z, p in zip(labels, progress)]
    return ep


def test_accuracy_and_precision_pair_each_label_with_the_previous_actions_progress():
    # labels z_1.. rate the progress of the action before them: pairs (pos, +1) (neg, 0) (neu, 0) (pos, -1)
    ep = _episode(["neutral", "positive", "negative", "neutral", "positive", None],
                  [1.0, 0.0, 0.0, -2.0, None, 3.0], won=False)
    assert label_progress_pairs([ep]) == [("positive", 1.0), ("negative", 0.0), ("neutral", 0.0),
                                          ("positive", -2.0)]
    st = calibration_stats([ep])
    assert st["guidance/calibration_pairs"] == 4
    assert st["guidance/label_accuracy"] == pytest.approx(2 / 4)  # (pos,+) and (neu,0) agree
    # progress signs +, 0, 0, -: always "neutral" would be right on 2 of 4 (the best single label)
    assert st["guidance/label_accuracy_constant"] == pytest.approx(2 / 4)
    skewed = calibration_stats([_episode(["positive"] * 5, [0.0, 0.0, 0.0, 1.0, 0.0], won=False)])
    assert skewed["guidance/label_accuracy"] == pytest.approx(1 / 4)  # pairs (pos,0) (pos,0) (pos,+) (pos,0)
    assert skewed["guidance/label_accuracy_constant"] == pytest.approx(3 / 4)
    # balanced: the mean recall over the signs that occur. st: + 1/1, 0 1/2 (neu right, neg wrong), − 0/1 -> 1/2;
    # a constant label scores 1/K whatever the shares: skewed has signs {0, +}, "positive" right on all + -> 1/2
    assert st["guidance/label_balanced_accuracy"] == pytest.approx((1 + 1 / 2 + 0) / 3)
    assert skewed["guidance/label_balanced_accuracy"] == pytest.approx(1 / 2)
    assert balanced_accuracy([]) is None
    assert balanced_accuracy([("neutral", 0.0)] * 9 + [("neutral", 1.0)]) == pytest.approx(1 / 2)  # always neutral
    assert balanced_accuracy([("neutral", 0.0)] * 9 + [("positive", 1.0)]) == 1.0
    assert st["guidance/precision_positive"] == pytest.approx(1 / 2)
    assert st["guidance/precision_neutral"] == 1.0
    assert st["guidance/precision_negative"] == 0.0
    assert "guidance/label_auroc_success" not in st  # only lost episodes: no AUROC


def test_auroc_of_labels_against_success():
    won = _episode(["positive", "positive", "neutral"], [1, 1, 1], won=True)
    lost = _episode(["negative", "neutral", "positive"], [0, 0, 0], won=False)
    st = calibration_stats([won, lost])
    # won values {1, 1, 0} vs lost {-1, 0, 1}: pairs won>lost = 2+2+1 = 5, ties = 1+1+1 = 3 -> (5 + 1.5) / 9
    assert st["guidance/label_auroc_success"] == pytest.approx(6.5 / 9)
    assert auroc([1.0], [0.0]) == 1.0 and auroc([0.0], [1.0]) == 0.0 and auroc([], [1.0]) is None
    # a constant label says nothing about the outcome, whatever the episodes
    flat = [_episode(["positive"] * 3, [1, 0, -1], won=w) for w in (True, False, False)]
    assert calibration_stats(flat)["guidance/label_auroc_success"] == 0.5


def test_unguided_episodes_give_no_calibration_numbers():
    st = calibration_stats([_episode([None, None], [1, 1], won=True, guided=False)])
    assert st == {"guidance/calibration_pairs": 0.0, "guidance/auroc_labels": 0.0}


def test_household_progress_is_the_fall_of_the_experts_distance():
    env = ENV()
    res = env.reset(4)
    plan = res.info["expert_plan_length"]
    assert plan > 1
    out = env.step("examine nothing")  # invalid: no change
    assert out.invalid_action and out.progress == 0.0
    steps = 0
    while not out.done:
        out = env.step(env.expert_action())
        steps += 1
        assert out.progress == 1.0  # every expert action brings the goal one step closer
        assert out.info["expert_plan_length"] == plan - steps
    assert out.won and steps == plan


class _ScoredEnv(TextEnv):
    """Reports a score (10, 30, 20, ...) but no progress: the rollout takes the score change."""

    scores = [10.0, 30.0, 20.0, 20.0]

    def reset(self, seed, split="train"):
        self.t = 0
        return ResetResult("start", "do it", ["go"], score=5.0)

    def step(self, action):
        s = self.scores[self.t]
        self.t += 1
        return StepResult("ok", 0.0, self.t == len(self.scores), score=s, admissible_actions=["go"])


def test_rollout_records_the_envs_progress_else_the_score_change():
    tok = build_tiny_tokenizer()
    lm = ScriptedLM(tok, scripted_reply("positive"))
    gc = GuidanceConfig(decoding="constrained")
    batch = Rollout(lm, tok, ENV, gc, RolloutConfig(group_size=2, max_steps=4)).run([3])
    ep = batch.episodes[0]
    env = ENV()
    env.reset(3)
    assert [s.progress for s in ep.steps] == [env.step(s.action).progress for s in ep.steps]
    batch = Rollout(lm, tok, _ScoredEnv, gc, RolloutConfig(group_size=2, max_steps=4)).run([0])
    assert [s.progress for s in batch.episodes[0].steps] == [5.0, 20.0, -10.0, 0.0]
    # a scripted "positive" for every step: accuracy is the share of previous actions that made progress
    st = calibration_stats(batch.episodes)
    assert st["guidance/label_accuracy"] == pytest.approx(2 / 3)  # pairs (pos, 5) (pos, 20) (pos, -10)


def test_validation_report_carries_the_calibration_numbers():
    won = _episode(["positive", "positive"], [1, 1], won=True)
    lost = _episode(["positive", "negative"], [-1, 0], won=False)
    report = build_report(0, 1, "dev", {}, {"sg": ({"rollout/success_rate": 0.5}, [won, lost])})
    flat = scalars(report)
    assert flat["val/sg/label_accuracy"] == 1.0  # pairs (positive, +1) and (negative, -1) both agree
    assert flat["val/sg/label_auroc_success"] == pytest.approx(3 / 4)  # won {1, 1} vs lost {1, -1}
    assert "label AUROC" in report_markdown(report)


@pytest.mark.parametrize("mode", ["single_stream", "two_call"])
def test_oracle_labels_are_the_envs_progress_and_no_guidance_token_is_trained(mode):
    """guidance.source: oracle: each label shown is the sign of the previous action's measured progress (neutral
    first), each action is paid the sign of its own, the label calibration is perfect, and the guidance is written for
    the model (no policy tokens)."""
    tok = build_tiny_tokenizer()
    replies = []

    def reply(context):  # a scripted actor that records what guidance it was shown
        replies.append(context)
        return scripted_reply("positive")(context)

    lm = ScriptedLM(tok, reply)
    gc = GuidanceConfig(prompt_mode=mode, decoding="constrained", source="oracle")
    batch = Rollout(lm, tok, ENV, gc, RolloutConfig(group_size=2, max_steps=5)).run([3, 4])
    seen_negative_or_neutral = False
    for ep in batch.episodes:
        labels = [s.label for s in ep.steps]
        expected = ["neutral"] + ["positive" if p > 0 else "negative" if p < 0 else "neutral"
                                  for p in (s.progress for s in ep.steps[:-1])]
        assert labels == expected
        # what it pays: each action's own measured progress (the last action too), not the label it showed
        assert ep.internal_rewards == pytest.approx([gc.reward(progress_label(st.progress)) for st in ep.steps])
        seen_negative_or_neutral |= any(z != "positive" for z in labels[1:])
        for s in ep.samples:  # guidance is context: every policy token is an action token
            assert all(k == KIND_ACTION for k, p in zip(s.kinds, s.policy) if p)
    assert seen_negative_or_neutral  # first-admissible actions do not always make progress: not a constant label
    assert calibration_stats(batch.episodes)["guidance/label_accuracy"] == 1.0
    assert any("Label: neutral" in c for c in replies) and "Answer in exactly two lines" not in "".join(replies)


class _PathEnv(TextEnv):
    """A task with a score: ``take`` the object (+50), ``put`` it away (+50, won), ``drop`` it (−50), ``look`` (0).
    Each seed plays one fixed path (the only admissible action at each step); all end in the same outcome."""

    PATHS = {0: ["take", "put"], 1: ["look", "take", "put"], 2: ["take", "drop", "take", "put"],
             3: ["take", "look", "look", "put"]}

    def reset(self, seed, split="train"):
        self.path, self.t, self.held, self.score = self.PATHS[seed], 0, False, 0.0
        return ResetResult("a room", "put the object away", [self.path[0]], score=0.0)

    def step(self, action):
        self.score += {"take": 50.0, "drop": -50.0, "put": 50.0}.get(action, 0.0)
        self.t += 1
        won = action == "put"
        nxt = [self.path[self.t]] if self.t < len(self.path) else ["look"]
        return StepResult("ok", float(won), won, won, score=self.score, admissible_actions=nxt)


def test_the_oracle_never_pays_for_a_delay():
    """Among episodes with the same outcome, the direct path's blended return is at least every detour's: the oracle
    credits each measured action by its own progress (the first and the last included), so an idle step, or an undone
    and redone one, earns nothing extra.  (Paying the label shown before each step instead left the last action
    unrated: 'take, put' earned 0.1, and where the first action went unmeasured 'look, take, put' earned more than
    'take, put'.)"""
    from sglightning.rewards import ScoreGain, episode_returns

    tok = build_tiny_tokenizer()
    gc = GuidanceConfig(decoding="constrained", action_decoding="admissible", source="oracle")
    batch = Rollout(ScriptedLM(tok, scripted_reply()), tok, _PathEnv, gc,
                    RolloutConfig(group_size=2, max_steps=6)).run(sorted(_PathEnv.PATHS))
    eps = {e.seed: e for e in batch.episodes}  # one episode per path (the first of each group)
    assert [s.action for s in eps[2].steps] == _PathEnv.PATHS[2] and all(e.won for e in eps.values())
    assert eps[0].internal_rewards == pytest.approx([0.1, 0.1])  # both scoring actions credited
    returns, _, _ = episode_returns(list(eps.values()), 1.0, terms=[ScoreGain()])
    by_path = dict(zip(eps, returns.tolist()))
    assert all(by_path[0] >= r - 1e-6 for r in by_path.values()), by_path
    assert by_path[0] == pytest.approx(1.0 + 1.0 + 0.2)  # success + score gained + λ·(0.1 + 0.1)


def test_guidance_source_is_checked():
    with pytest.raises(ValueError, match="guidance.source"):
        GuidanceConfig(source="teacher")


def _moments(pairs):
    from sglightning.calibration import LABEL_VALUE

    out = [0.0] * 6
    for z, y in pairs:
        x = LABEL_VALUE[z]
        for k, v in enumerate((1, x, y, x * x, y * y, x * y)):
            out[k] += v
    return out


def test_label_reliability_is_zero_for_labels_independent_of_progress():
    from sglightning.grpo import label_reliability

    labels = ("positive", "neutral", "negative")
    independent = [(z, y) for z in labels for y in (-1, 0, 1)]  # every label equally often with every outcome
    assert label_reliability(_moments(independent)) == 0.0
    assert label_reliability(_moments([("positive", y) for y in (-1, 0, 1, 1)])) == 0.0  # constant: no information
    assert label_reliability(_moments([("positive", 1), ("neutral", 0), ("negative", -1)])) == pytest.approx(1.0)
    assert label_reliability(_moments([("positive", -1), ("negative", 1)])) == 0.0  # anti-correlated: clipped
    assert label_reliability(_moments([("positive", 1)])) == 0.0  # too few pairs
    mostly = [("positive", 1)] * 3 + [("negative", -1)] * 3 + [("positive", -1)]
    assert 0.0 < label_reliability(_moments(mostly)) < 1.0


def test_trust_meter_trusts_the_oracle_not_a_constant_guide():
    from sglightning.rewards import TrustMeter

    oracle = [_episode(["neutral", "positive", "neutral", "negative"], [1, 0, -1, 2], won=False)]
    constant = [_episode(["positive"] * 4, [1, 0, -1, 2], won=False)]
    meter = TrustMeter(window=2)
    assert meter.add(oracle) == pytest.approx(1.0)
    assert 0.0 < meter.add(constant) < 1.0  # the window mixes the two steps
    restored = TrustMeter(window=2)
    restored.load_state_dict(meter.state_dict())
    assert restored.steps == meter.steps and restored.reliability == meter.reliability  # read before the next add
    assert meter.add(constant) == 0.0  # the oracle step has left the window


def test_dynamic_sampling_weighs_the_labels_as_the_update_will_under_adaptive_trust():
    """With grpo.trust_adaptive the update pays λ·ρ: a group whose returns differ only through its labels carries no
    signal while ρ = 0, so dynamic sampling must not keep it (it used the scheduled λ alone)."""
    from sglightning.grpo import GRPOConfig

    a, b = _episode(["positive", "positive"], [1, 0], won=False), _episode(["negative", "neutral"], [1, 0], won=False)
    b.index = 1
    for ep in (a, b):
        for st in ep.steps:
            st.internal_reward = {"positive": 0.1, "neutral": 0.0, "negative": -0.1}[st.label]
    module = tiny_module(grpo=GRPOConfig(trust_constant=1.0, trust_adaptive=True, total_steps=4))
    assert module.informative_groups([a, b]) == set()  # no measured reliability yet: λ·ρ = 0
    module.trust.meter.reliability = 0.5
    assert module.informative_groups([a, b]) == {0}
    plain = tiny_module(grpo=GRPOConfig(trust_constant=1.0, total_steps=4))
    assert plain.informative_groups([a, b]) == {0}  # the control: without adaptive trust the labels count


def test_adaptive_trust_scales_lambda_by_the_reliability_in_a_fit(tmp_path):
    from lightning.pytorch import seed_everything

    from sglightning.grpo import GRPOConfig

    seed_everything(0)
    module = tiny_module(
        rollout=RolloutConfig(groups_per_step=2, group_size=2, max_steps=4),
        guidance=GuidanceConfig(max_guidance_tokens=4, action_decoding="admissible", source="oracle"),
        grpo=GRPOConfig(trust_constant=1.0, trust_adaptive=True),
        update=UpdateConfig(micro_batch_size=4),
    )
    tiny_trainer(tmp_path).fit(module)
    for h in module.history:
        assert h["reward/lambda_schedule"] == 1.0
        assert h["reward/lambda"] == pytest.approx(h["guidance/reliability"])
    # the oracle's labels track progress exactly: reliability 1 once they vary (0 while they are constant)
    assert all(h["guidance/reliability"] in (0.0, pytest.approx(1.0)) for h in module.history)
    assert module.history[-1]["guidance/reliability"] == pytest.approx(1.0)


class _InformativeWhenSeedDividesBy3(RewardTerm):
    """Groups of seeds divisible by 3 get a bonus for their first episode (informative); the others' returns are
    all 0 (degenerate)."""

    name = "by3"

    def value(self, episode) -> float:
        if episode.seed % 3 == 0:
            return 0.37 if episode.index % 2 == 0 else 0.0
        return -episode.env_return


def test_dynamic_sampling_tops_the_step_up_with_informative_groups():
    from sglightning.grpo import GRPOConfig
    from sglightning.rewards import informative_groups

    def module(rounds):
        m = tiny_module(
            rollout=RolloutConfig(groups_per_step=3, group_size=2, max_steps=2, dynamic_sampling_rounds=rounds),
            guidance=GuidanceConfig(max_guidance_tokens=4, action_decoding="admissible"),
            grpo=GRPOConfig(total_steps=10, trust_constant=0.0),
            reward_terms=[_InformativeWhenSeedDividesBy3()],
        )
        m.configure_model()
        return m

    def collect(m):
        return m.rollout_callback().collect(m)

    plain, topped = collect(module(0)), collect(module(6))
    n_plain = len(informative_groups(plain.episodes, 0.0, terms=[_InformativeWhenSeedDividesBy3()]))
    found = informative_groups(topped.episodes, 0.0, terms=[_InformativeWhenSeedDividesBy3()])
    assert n_plain < 3 and plain.extra_groups == 0
    assert len(found) == 3 == n_plain + topped.extra_groups  # the missing groups were found in extra rounds
    assert [e.seed for e in topped.episodes[:6]] == [e.seed for e in plain.episodes]  # the first round kept whole
    added = topped.episodes[6:]
    assert len(added) == 2 * topped.extra_groups and all(e.seed % 3 == 0 for e in added)
    assert len({e.index for e in topped.episodes}) == len(topped.episodes)  # renumbered: no clash
    assert all(s.episode == e.index for e in topped.episodes for s in e.samples)
    assert topped.generated_tokens > plain.generated_tokens
    assert topped.policy_round().episodes == topped.episodes[:6] and plain.policy_round() is plain


def test_dynamic_sampling_counts_the_caches_its_rounds_gave_back():
    """``engine/caches_given_back`` counts every round of the step, the dynamic-sampling rounds included (their
    engine numbers were dropped before): two_call on the slot cache with room for one cache only."""
    from sglightning.engines import EngineConfig
    from sglightning.engines.builtin import SlotPool
    from sglightning.grpo import GRPOConfig

    m = tiny_module(
        rollout=RolloutConfig(groups_per_step=3, group_size=2, max_steps=2, dynamic_sampling_rounds=6),
        guidance=GuidanceConfig(prompt_mode="two_call", max_guidance_tokens=4, action_decoding="admissible"),
        grpo=GRPOConfig(total_steps=10, trust_constant=0.0),
        reward_terms=[_InformativeWhenSeedDividesBy3()],
        engine=EngineConfig(compile="static"),
    )
    m.configure_model()
    cb = m.rollout_callback()
    cb.engine.slots = SlotPool(limit_bytes=1)  # every call takes the other call's cache
    rb = cb.collect(m)
    assert rb.extra_groups > 0 and cb.engine.slots.given_back > 0
    assert rb.engine_counts["caches_given_back"] == cb.engine.slots.given_back


def test_dynamic_sampling_logs_the_policys_round_under_the_usual_names(tmp_path):
    """rollout/* and guidance/* describe the first round (the policy's own draw); the groups selected for having
    unequal returns are described under dynamic_sampling/*, and the update trains on all of them."""
    from sglightning.grpo import GRPOConfig

    module = tiny_module(
        rollout=RolloutConfig(groups_per_step=3, group_size=2, max_steps=2, dynamic_sampling_rounds=6),
        guidance=GuidanceConfig(max_guidance_tokens=4, action_decoding="admissible"),
        grpo=GRPOConfig(total_steps=10, trust_constant=0.0, kl_coef=0.0),
        reward_terms=[_InformativeWhenSeedDividesBy3()],
    )
    tiny_trainer(tmp_path, steps=1).fit(module)
    (h,) = module.history
    added = h["rollout/dynamic_sampling_groups"]
    assert added > 0
    assert h["rollout/episodes"] == 6.0 and h["rollout/groups"] == 3.0  # the first round only
    assert h["dynamic_sampling/groups"] == 3.0 + added
    assert h["dynamic_sampling/degenerate_groups"] == h["rollout/degenerate_groups"]  # the added ones are informative
    assert h["rollout/degenerate_groups"] == added  # each degenerate group of the first round was made up for
