"""Self-guidance on vs off read as pairs of the same episodes: the validation report's ``paired`` section
(sglightning.report) and benchmarks/paired_onoff.py, which reads it across reports."""

from __future__ import annotations

import json

import pytest
from scripts import benchmark

from sglightning.report import build_report, episode_pairs, paired_outcomes, report_markdown, scalars, sign_test


def _script():
    return benchmark("paired_onoff")


def _ep(seed: int, won: bool, actions=("look",), progress=(0.0,), labels=None) -> dict:
    return {"seed": seed, "task_id": f"t{seed}", "won": won, "actions": list(actions), "progress": list(progress),
            "labels": list(labels) if labels else None}


def test_the_sign_test_by_hand():
    assert sign_test(0, 6) == pytest.approx(2 / 64)  # all six discordant pairs one way
    assert sign_test(1, 2) == 1.0  # 2 * (1 + 3) / 8, capped
    assert sign_test(1, 5) == pytest.approx(2 * (1 + 6) / 64)
    assert sign_test(0, 0) == 1.0


def test_pairs_match_by_task_and_order_within_a_task():
    # two episodes per task: the k-th with guidance pairs with the k-th without, whatever the listing order
    on = [_ep(5, True), _ep(5, False), _ep(6, False)]
    off = [_ep(6, True), _ep(5, False), _ep(5, False), _ep(7, True)]  # task 7 was not played with guidance
    pairs = episode_pairs({"sg": on, "nosg": off})
    assert [(a["seed"], a["won"], b["won"]) for a, b in pairs] == [(5, True, False), (5, False, False),
                                                                    (6, False, True)]
    assert paired_outcomes(pairs) == {"pairs": 3, "only_sg": 1, "only_nosg": 1, "sign_test_p": 1.0}
    assert episode_pairs({"sg": on}) is None


def test_an_episode_whose_reset_failed_still_pairs_by_its_seed():
    """Its summary has no task id (the env never said it): paired on (seed, task id), it fell out of the sign test,
    and a task won only without guidance went uncounted."""
    on = [_ep(100, False), _ep(101, True), _ep(102, True)]
    on[0]["task_id"] = None  # the reset failed with guidance: lost
    off = [_ep(100, True), _ep(101, True), _ep(102, False)]
    assert paired_outcomes(episode_pairs({"sg": on, "nosg": off}))["pairs"] == 3
    assert paired_outcomes(episode_pairs({"sg": on, "nosg": off}))["only_nosg"] == 1


def test_a_report_of_both_modes_holds_the_pairs_in_json_markdown_and_tensorboard():
    from sglightning.episodes import Episode

    def played(seed: int, won: bool, guided: bool) -> Episode:
        return Episode(index=0, group=seed, seed=seed, task="t", task_type="twc", won=won, guided=guided,
                       info={"task_id": f"t{seed}"})

    won_on, won_off = (True, True, False, False), (True, False, False, False)
    modes = {"sg": ({"rollout/success_rate": 0.5}, [played(s, w, True) for s, w in enumerate(won_on)]),
             "nosg": ({"rollout/success_rate": 0.25}, [played(s, w, False) for s, w in enumerate(won_off)])}
    report = build_report(3, 1, "dev", {}, modes)
    assert report["paired"] == {"pairs": 4, "only_sg": 1, "only_nosg": 0, "sign_test_p": 1.0}
    assert scalars(report)["val/paired/only_sg"] == 1.0 and scalars(report)["val/paired/pairs"] == 4.0
    assert "won only with it 1, only without it 0 (exact sign test p = 1.000)" in report_markdown(report)
    one = build_report(3, 1, "dev", {}, {"sg": modes["sg"]})  # one mode: nothing to pair
    assert "paired" not in one and not any(k.startswith("val/paired") for k in scalars(one))
    assert "won only with it" not in report_markdown(one)


def test_pairs_discordant_counts_and_setbacks(tmp_path, capsys):
    ps = _script()
    looping = _ep(9, False, actions=["take x", "put x in a", "take x", "put x in a"], progress=[50, -50, 50, -50],
                  labels=["neutral", "positive", "negative", "positive"])
    report = {"episodes": {
        # on: won 1 (seed 0); off: won seeds 0, 1, 2, listed in another order: pairs match by (seed, task)
        "sg": [_ep(0, True), _ep(1, False), _ep(2, False), looping],
        "nosg": [_ep(2, True), _ep(9, False, actions=["take x", "put x in a"], progress=[50, -50]),
                 _ep(0, True), _ep(1, True)],
    }}
    path = tmp_path / "arm-seed0-final" / "version_0" / "validation_report.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(report))
    ps.main([str(path)])
    out = capsys.readouterr().out
    # 4 pairs; won 1 with, 3 without; 0 only with, 2 only without: p = 2 * 1/4 = 0.5; with guidance the first lost
    # action is put again later (1 of 2), without it never (0 of 1); the setback at step 1 was rated `negative`
    assert "| arm-seed0-final | 4 | 1 | 3 | 0 | 2 | 0.500 | 1 of 2 | 0 of 1 | negative 1 |" in out
    ps.main([str(path), str(path)])
    assert "| pooled | 8 | 2 | 6 | 0 | 4 | 0.125 | 2 of 4 | 0 of 2 | negative 2 |" in capsys.readouterr().out


def test_a_report_without_both_modes_is_one_line_naming_it(tmp_path):
    ps = _script()
    path = tmp_path / "validation_report.json"
    path.write_text(json.dumps({"episodes": {"sg": [_ep(0, True)]}}))
    with pytest.raises(SystemExit, match=r"validation_report.json: no episodes of both modes .*self_guidance=both"):
        ps.main([str(path)])
    path.write_text("{not json")
    with pytest.raises(SystemExit, match="not a readable validation report"):
        ps.main([str(path)])


def test_validation_collects_by_mode_and_merges_in_seed_order():
    """report.Validation without Lightning: batches in, per mode the episodes once each in seed order, the means
    from torchmetrics, peak memory the maximum; reset empties it."""
    import torch

    from sglightning import memory
    from sglightning.episodes import Episode, RolloutBatch
    from sglightning.report import Validation

    def batch(seeds, won, peak):
        eps = [Episode(index=i, group=i, seed=s, won=w) for i, (s, w) in enumerate(zip(seeds, won))]
        return RolloutBatch(episodes=eps, peak_memory={memory.rss_key("validation"): peak})

    v = Validation()
    v.add({"sg": batch([7, 3], [True, False], 1.5), "nosg": batch([7, 3], [False, False], 1.0)})
    v.add({"sg": batch([5], [True], 2.5), "nosg": batch([5], [False], 0.5)})
    merged = v.merged(["sg", "nosg"], world_size=1, device=torch.device("cpu"))
    means, episodes = merged["sg"]
    assert [e.seed for e in episodes] == [3, 5, 7]
    assert means["rollout/success_rate"] == pytest.approx(2 / 3)
    assert means[memory.rss_key("validation")] == 2.5 and merged["nosg"][0][memory.rss_key("validation")] == 1.0
    assert merged["nosg"][0]["rollout/success_rate"] == 0.0
    v.reset()
    assert v.episodes == {"sg": [], "nosg": []} and v.peaks == {"sg": {}, "nosg": {}}
