"""``grpo.calibration``: hindsight label targets from the progress the env measured, and the auxiliary loss that
trains the label tokens toward them in the same forward as the policy loss."""

from __future__ import annotations

import math

import pytest
import torch
from tiny import rollout, tiny_module, tiny_trainer

from sglightning import scoring
from sglightning.episodes import KIND_ACTION, KIND_GUIDANCE, Piece, Restriction, Sample
from sglightning.grpo import GRPOConfig, StepCounts, calibration_term
from sglightning.guidance import GuidanceConfig
from sglightning.rollout import label_targets

#: label words as token sequences (LABELS order: positive, neutral, negative); neutral/negative share a first token
OPTIONS = [[5], [6, 7], [6, 8]]


def _label_piece(ids: list[int], policy: list[bool]) -> Piece:
    p = Piece(KIND_GUIDANCE, choice_index=0)
    for t, pol in zip(ids, policy):
        p.add(t, -0.3 if pol else 0.0, pol, Restriction((5, 6)) if pol else None)
    return p


@pytest.mark.parametrize("progress,sampled,policy,expected", [
    (+2.0, [5], [True], [5]),  # positive progress, "positive" sampled: trained toward it
    (+1.0, [6, 8], [True, True], [5, -1]),  # "negative" sampled: the first choice toward "positive", then diverged
    (0.0, [6, 8], [True, True], [6, 7]),  # target "neutral": agrees on the first token, then "utral" over "gative"
    (-1.0, [5], [True], [6]),  # target "negative": its first token
    (-1.0, [6, 8], [True, False], [6, -1]),  # a forced token is no choice: no target
    (None, [5], [True], []),  # the env could not measure the progress: no target at all
])
def test_hindsight_targets_follow_the_measured_progress(progress, sampled, policy, expected):
    piece = _label_piece(sampled, policy)
    reason = Piece(KIND_GUIDANCE)
    reason.add(9, -1.0, True)
    action = Piece(KIND_ACTION, choice_index=1)
    action.add(4, -0.5, True)
    label_targets([reason, piece, action], progress, OPTIONS)
    assert piece.targets == expected
    assert reason.targets == [] and action.targets == []  # only the label choice gets targets


def test_targets_land_on_their_positions_in_the_sample():
    s = Sample(0)
    s.extend_context([1, 2, 3])
    piece = _label_piece([6, 7], [True, True])
    label_targets([piece], -3.0, OPTIONS)
    s.extend_piece(piece)
    assert s.targets == {3: 6, 4: 8} and s.target_labels == {3: 2, 4: 2}  # "negative" (index 2 in LABELS)
    data = scoring.collate([s], pad_id=0, targets=True)
    assert data["target"][0].tolist() == [-1, -1, -1, 6, 8]
    assert data["target_label"][0].tolist() == [-1, -1, -1, 2, 2]
    assert "target" not in scoring.collate([s], pad_id=0)  # off: not collated at all


def test_the_auxiliary_term_is_log_q_of_the_target_and_moves_only_label_logits():
    """Log q(y*) over the token's restriction, by hand; its gradient reaches the logits of the target positions
    only, and within them only the allowed tokens."""
    V = 10
    s = Sample(0)
    s.extend_context([1, 2])
    label = _label_piece([6], [True])  # restriction {5, 6}
    label_targets([label], +1.0, OPTIONS)  # target "positive" = 5, which was not sampled
    s.extend_piece(label)
    act = Piece(KIND_ACTION)
    act.add(3, -1.0, True)
    s.extend_piece(act)
    data = scoring.collate([s], pad_id=0, targets=True)
    sel = data["mask"][:, 1:]  # positions 2 (label) and 3 (action)
    torch.manual_seed(0)
    logits = torch.randn(int(sel.sum()), V, requires_grad=True)  # [M, V]
    _, extra = scoring.logprobs_from_logits(data["ids"], sel, logits, scoring.restrictions_of(data))
    tq = extra["target_logq"]  # [1, L]
    row = torch.log_softmax(logits[0].detach(), -1)
    by_hand = row[5] - torch.logsumexp(row[[5, 6]], 0)
    assert math.isclose(float(tq[0, 2]), float(by_hand), rel_tol=1e-6)
    assert float(tq[0, 3]) == 0.0 and float(tq[0, :2].abs().sum()) == 0.0
    (-tq.sum()).backward()
    g = logits.grad
    assert g[1].abs().sum() == 0  # the action's position: untouched
    assert g[0, [5, 6]].abs().sum() > 0 and g[0, [0, 1, 2, 3, 4, 7, 8, 9]].abs().sum() == 0  # inside the label set
    assert float(g[0, 5]) < 0 < float(g[0, 6])  # descent raises the target's logit, lowers the other label's


def _term(logq, labels, counts, balance, rows=slice(None)):
    """calibration_term on rows ``rows`` of a [S, 1] batch whose every row is a target."""
    logq, labels = torch.tensor(logq)[:, None][rows], torch.tensor(labels)[:, None][rows]
    totals = StepCounts(targets=float(sum(counts)), per_label=tuple(counts))
    return calibration_term(logq, torch.ones_like(labels, dtype=torch.bool), labels, totals, balance)


def test_the_balanced_term_gives_each_label_present_the_same_weight():
    """Four targets: three "neutral" (−log q = 0.1 each) and one "positive" (−log q = 2.0).  Uniform: the mean over
    targets, (0.3 + 2.0)/4; balanced: the mean of the labels' means, (0.1 + 2.0)/2.  Split into micro-batches the
    shares add up to the same; with one target per label present the two agree."""
    logq, labels, counts = [-0.1, -0.1, -0.1, -2.0], [1, 1, 1, 0], [1.0, 3.0, 0.0]
    uniform, nll = _term(logq, labels, counts, balance=False)
    balanced, nll_b = _term(logq, labels, counts, balance=True)
    assert math.isclose(float(uniform), 2.3 / 4, rel_tol=1e-6) and math.isclose(float(balanced), 2.1 / 2, rel_tol=1e-6)
    assert math.isclose(float(nll), 2.3, rel_tol=1e-6) and float(nll) == float(nll_b)  # the log keeps the plain sum
    halves = sum(float(_term(logq, labels, counts, True, rows)[0]) for rows in (slice(0, 1), slice(1, 4)))
    assert math.isclose(halves, float(balanced), rel_tol=1e-6)
    even = [-0.1, -2.0], [1, 0], [1.0, 1.0, 0.0]
    assert math.isclose(float(_term(*even, balance=True)[0]), float(_term(*even, balance=False)[0]), rel_tol=1e-6)


def test_balanced_calibration_pulls_harder_on_the_rare_label():
    """The gradient on a rare label's target is larger under the balanced term than under the uniform one, and on a
    common label's smaller: the majority label stops being the cheap answer."""
    labels, counts = [1, 1, 1, 0], [1.0, 3.0, 0.0]
    grads = {}
    for balance in (False, True):
        logq = torch.full((4,), -0.7, requires_grad=True)
        totals = StepCounts(targets=4.0, per_label=tuple(counts))
        term, _ = calibration_term(logq[:, None], torch.ones(4, 1, dtype=torch.bool), torch.tensor(labels)[:, None],
                                   totals, balance)
        term.backward()
        grads[balance] = logq.grad.abs()
    assert grads[True][3] > grads[False][3] and grads[True][0] < grads[False][0]


def test_balance_without_calibration_is_a_config_error():
    with pytest.raises(ValueError, match="grpo.calibration_balance"):
        GRPOConfig(calibration_balance=True)


def _module(calibration: float, lr: float = 1e-2, balance: bool = False):
    return tiny_module(grpo=GRPOConfig(kl_coef=0.0, calibration=calibration, calibration_balance=balance),
                       guidance=GuidanceConfig(decoding="constrained", action_decoding="admissible",
                                               max_guidance_tokens=3, max_action_tokens=4),
                       optimizer=lambda p: torch.optim.AdamW(p, lr=lr))


def _fit(tmp_path, calibration: float, steps: int = 2, lr: float = 1e-2, balance: bool = False):
    module = _module(calibration, lr, balance)
    tiny_trainer(tmp_path, steps).fit(module)
    return module


def _target_logq(module, samples) -> float:
    """Mean log q(y*) of the hindsight targets of ``samples`` under ``module``'s current weights."""
    data = scoring.collate(samples, pad_id=0, targets=True)
    restrict = scoring.restrictions_of(data)
    with torch.no_grad():
        _, extra = module.token_logprobs(data["ids"], data["attn"], data["mask"], 1.0, restrict=restrict)
    has = data["target"] >= 0
    return float(extra["target_logq"][has].mean())


@pytest.mark.slow
def test_calibration_trains_the_labels_toward_their_targets(tmp_path):
    """Two fits from the same start, α = 0 and α = 5: on a fixed set of labelled turns played before training,
    the calibrated policy puts more probability on the hindsight targets than the uncalibrated one, and more than it
    did before training; the step logs the targets and the auxiliary loss."""
    fixed = _module(calibration=0.0)
    fixed.configure_model()
    batch = rollout(fixed).run(list(range(40, 46)), generator=torch.Generator().manual_seed(3))
    samples = [s for s in batch.samples if s.targets]
    assert samples, "no labelled turn with a measured progress"
    before = _target_logq(fixed, samples)
    plain = _fit(tmp_path / "plain", calibration=0.0, steps=6, lr=3e-2)
    calibrated = _fit(tmp_path / "cal", calibration=5.0, steps=6, lr=3e-2)
    after_plain, after_cal = _target_logq(plain, samples), _target_logq(calibrated, samples)
    assert after_cal > after_plain + 0.1 and after_cal > before + 0.1, (before, after_plain, after_cal)
    hist = calibrated.history
    assert all(r["guidance/calibration_targets"] > 0 and r["loss/calibration"] > 0 for r in hist)


def test_calibration_off_logs_nothing_of_it_and_on_adds_one_term(tmp_path):
    off = _fit(tmp_path / "off", calibration=0.0)
    assert not any("loss/calibration" in r or "guidance/calibration_targets" in r for r in off.history)
    on = _fit(tmp_path / "on", calibration=1.0)
    assert any(r.get("guidance/calibration_targets", 0) > 0 for r in on.history)
    assert all(r["loss/calibration"] > 0 for r in on.history if r.get("guidance/calibration_targets", 0) > 0)


def test_the_trainer_applies_the_balanced_term_when_asked(tmp_path, monkeypatch):
    """With ``calibration_balance`` the update's term is the balanced one, computed from the step's per-label counts;
    on these steps (labels unequally common) it differs from the uniform term on the same tensors."""
    import sglightning.grpo as grpo_mod

    real, seen = grpo_mod.calibration_term, []

    def spy(logq, targets, labels, totals, balance=False):
        both = [float(real(logq, targets, labels, totals, b)[0]) for b in (True, False)]
        seen.append((balance, *both, list(totals.per_label)))
        return real(logq, targets, labels, totals, balance)

    monkeypatch.setattr(grpo_mod, "calibration_term", spy)  # the update's objective calls it through the module
    bal = _fit(tmp_path / "bal", calibration=1.0, balance=True)
    assert seen and all(b for b, *_ in seen)  # the flag reaches the loss
    assert all(sum(counts) > 0 and len(counts) == 3 for *_, counts in seen)  # the step's targets by label
    assert any(abs(x - y) > 1e-6 for _, x, y, _ in seen), seen  # the weighting changed the term
    assert all(r["loss/calibration"] > 0 for r in bal.history if r.get("guidance/calibration_targets", 0) > 0)


@pytest.mark.parametrize("args", [["--model.guidance.decoding=free", "--model.guidance.action_decoding=free"],
                                  ["--model.guidance.source=oracle"],
                                  ["--model.grpo.calibration=-1"],
                                  ["--model.grpo.calibration=0", "--model.grpo.calibration_balance=true"]])
def test_calibration_that_cannot_work_is_one_line(args, tmp_path, capsys, monkeypatch):
    from pathlib import Path

    from sglightning.cli import cli_main

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    monkeypatch.setattr("sys.argv", ["sglightning"])
    with pytest.raises(SystemExit) as exc:
        cli_main(["fit", "--config", str(root / "configs" / "tiny.yaml"), f"--trainer.default_root_dir={tmp_path}",
                  f"--trainer.logger.init_args.save_dir={tmp_path}", "--model.grpo.calibration=1", *args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(lines) == 1 and "grpo.calibration" in lines[0], lines
