"""The examples of docs/extending.md (examples/extending/): a new environment, reward term, advantage estimator and
generation engine, each one file, together in one config — trained through the real CLI."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from sglightning import grpo
from sglightning.cli import cli_main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "extending"


@pytest.fixture(autouse=True)
def _examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    yield
    for name in ("countdown_env", "brevity_reward", "return_to_go", "counting_engine"):
        sys.modules.pop(name, None)


def test_the_four_extensions_train_together_from_one_config(tmp_path, capsys):
    from counting_engine import CountingEngine

    CountingEngine.fed_tokens = CountingEngine.generated_tokens = 0
    cli = cli_main([
        "fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--config", str(EXAMPLES / "config.yaml"),
        "--trainer.max_steps=2", f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.limit_val_batches=0",
    ])
    module = cli.model
    assert CountingEngine.fed_tokens > 0 and CountingEngine.generated_tokens > 0  # the rollouts ran on it
    assert [t.name for t in module.reward_terms] == ["brevity"]
    assert len(module.history) == 2
    for h in module.history:
        assert "reward/brevity" in h and 0.0 <= h["reward/brevity"] <= 0.5
        assert h["rollout/env_error_rate"] == 0.0 and math.isfinite(h.get("loss/total", 0.0))
    assert module.grpo_cfg.advantage == "return_to_go:return_to_go"


def test_an_engine_of_ones_own_gets_its_lifecycle_hooks_in_order(tmp_path, monkeypatch):
    """``check`` before anything starts, ``start`` once, ``sampling`` around every rollout with the version of the
    weights about to sample (validation before training at 0 in both guidance modes, the steps' rollouts at 0 and 1,
    validation after at 2), ``close`` once at the end; each step sampled with its own weights (no lag)."""
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    from fakes import LifecycleEngine

    LifecycleEngine.events = []
    cli = cli_main(["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--trainer.max_steps=2",
                    "--model.engine.backend=fakes.LifecycleEngine", "--model.evaluation.before_fit=true",
                    f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}"])
    events = LifecycleEngine.events
    assert events[0] == "check" and events[-1] == "close" and events.count("close") == 1
    assert [e for e in events if e.startswith("start")] == ["start rank 0 of 1"]
    assert events.index("start rank 0 of 1") < events.index("sampling v0")
    assert [e for e in events if e.startswith("sampling")] == [
        "sampling v0", "sampling v0",  # validation before training: self-guidance on, then off
        "sampling v0", "sampling v1",  # the two steps' rollouts
        "sampling v2", "sampling v2"]  # validation after
    assert [h["rollout/policy_lag"] for h in cli.model.history] == [0.0, 0.0]


def test_return_to_go_estimator_by_hand():
    from return_to_go import return_to_go

    # one group of two episodes: step shares [0, 1] (won at step 2) and [0, 0, 0]
    x = grpo.AdvantageInputs(
        returns=torch.tensor([1.0, 0.0]), group_ids=torch.tensor([0, 0]),
        step_returns=[torch.tensor([0.0, 1.0]), torch.tensor([0.0, 0.0, 0.0])],
        sample_episode=torch.tensor([0, 1]),
        token_step=torch.tensor([[0, 0, 1, 1], [0, 1, 2, 2]]),
        mask=torch.tensor([[False, True, False, True], [False, True, True, True]]), eps=0.0)
    adv = return_to_go(x)
    # returns-to-go: ep0 [1, 1], ep1 [0, 0, 0]; step 0 and 1: mean 0.5, std sqrt(0.5) -> ±0.7071;
    # step 2: one episode -> 0
    a = 0.5 / math.sqrt(0.5)
    expected = torch.tensor([[0.0, a, 0.0, a], [0.0, -a, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected)


def test_an_unknown_advantage_estimator_is_named_in_one_line():
    with pytest.raises(ValueError, match="grpo.advantage"):
        grpo.GRPOConfig(advantage="no_such_estimator")
    with pytest.raises(ValueError, match="grpo.advantage: cannot import"):
        grpo.GRPOConfig(advantage="no_such_module:fn")


def test_an_estimator_of_the_wrong_shape_is_one_line_naming_the_key(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    with pytest.raises(SystemExit) as exc:
        cli_main(["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--trainer.max_steps=1",
                  "--model.grpo.advantage=fakes:per_episode_advantages", f"--trainer.default_root_dir={tmp_path}",
                  f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.limit_val_batches=0"])
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("sglightning fit: error: model.grpo.advantage: 'fakes:per_episode_advantages' returned (")
    assert "expected token advantages of shape [S, L]" in line


def test_countdown_env_expert_wins():
    from countdown_env import CountdownEnv

    env = CountdownEnv(max_start=3)
    for seed in range(3):
        env.reset(seed)
        while (a := env.expert_action()) is not None:
            res = env.step(a)
        assert res.won and res.score == 100.0
