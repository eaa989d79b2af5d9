"""The shipped benchmark configs end to end through the CLI with the tiny model: ``fit`` on real TextWorldExpress,
``validate`` on real ALFWorld fixture games (per-task-type success, failure patterns, versions in config and report)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sglightning.cli import cli_main

ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL = ["--model.policy.name_or_path=embedded:tiny", "--model.policy.lora_r=4", "--model.policy.lora_alpha=8",
              "--trainer.accelerator=cpu", "--trainer.precision=32-true"]

pytestmark = [pytest.mark.jvm, pytest.mark.slow]


def _tags(run_dir: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return set(acc.Tags().get("scalars", []))


def test_fit_on_twx_twc_with_validation(tmp_path, capsys):
    cli = cli_main([
        "fit", "--config", str(ROOT / "configs" / "twx_twc.yaml"), *TINY_MODEL,
        f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--trainer.max_steps=2", "--model.rollout.groups_per_step=1", "--model.rollout.group_size=2",
        "--model.rollout.max_steps=3", "--model.evaluation.num_tasks=2", "--model.evaluation.tasks_per_batch=2",
        "--model.guidance.max_guidance_tokens=4",
    ])
    run_dir = Path(cli.trainer.log_dir)
    config = (run_dir / "config.yaml").read_text()
    assert "# package versions of this run" in config and "#   textworld-express: 1.1.0" in config
    assert "#   sglightning: " in config and "#   torch: " in config
    tags = _tags(run_dir)
    assert "rollout/success_rate" in tags and "rollout/env_error_rate" in tags
    assert "val/sg/success_rate" in tags and "val/nosg/success_rate" in tags
    assert any(t.startswith("val/sg/failure_") for t in tags), sorted(t for t in tags if t.startswith("val/"))
    # the history of the run: every training episode ran on the real simulator without env errors
    assert all(h["rollout/env_error_rate"] == 0.0 for h in cli.model.history)


def test_validate_on_alfworld_fixture_games(alfworld_data, tmp_path, capsys):
    cli = cli_main([
        "validate", "--config", str(ROOT / "configs" / "paper" / "alfworld_grpo_sg_gr.yaml"), *TINY_MODEL,
        f"--model.env.init_args.data_path={alfworld_data}", "--model.evaluation.split=valid_seen",
        "--model.evaluation.num_tasks=2", "--model.evaluation.tasks_per_batch=2", "--model.rollout.max_steps=3",
        "--model.guidance.prompt_mode=single_stream", "--model.guidance.decoding=constrained",
        "--model.guidance.action_decoding=admissible", "--model.guidance.max_guidance_tokens=4",
        "--model.guidance.max_think_tokens=4", "--model.evaluation.self_guidance=both",
        f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}",
    ])
    out = Path(cli.trainer.log_dir)
    report = json.loads((out / "validation_report.json").read_text())
    assert report["split"] == "valid_seen" and report["versions"]["alfworld"] == "0.4.2"
    for mode in ("sg", "nosg"):
        stats = report["modes"][mode]
        assert stats["episodes"] == 2 and stats["rollout/env_error_rate"] == 0.0
        assert set(stats["per_task_type_success"]) == {"Cool", "Pick2"}  # the two valid_seen fixture games
        fp = stats["failure_patterns"]
        assert fp["failed_episodes"] == 2 - round(2 * stats["rollout/success_rate"])
        if fp["failed_episodes"]:
            assert {"looping", "redundant_exploration", "wrong_object_focus"} <= set(fp)
    for mode in ("sg", "nosg"):  # every episode, as data: same tasks in both modes
        eps = report["episodes"][mode]
        assert len(eps) == 2 and all(len(e["actions"]) == e["steps"] for e in eps)
        assert sorted(e["task_type"] for e in eps) == ["Cool", "Pick2"]
    assert [e["task_id"] for e in report["episodes"]["sg"]] == [e["task_id"] for e in report["episodes"]["nosg"]]
    assert report["episodes"]["nosg"][0]["labels"] is None and len(report["episodes"]["sg"][0]["labels"]) >= 1
    text = capsys.readouterr().out
    assert "(valid_seen split)" in text and "| self-guidance | Cool | Pick2 |" in text
    assert "Versions: " in text and "alfworld 0.4.2" in text
