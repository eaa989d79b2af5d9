"""Loading the policy: any HF causal LM (hub id or local folder) with LoRA adapters, new or saved.

Everything a run needs of its model passes through :func:`load_policy`: the tokenizer, the base (optionally NF4 via
bitsandbytes: QLoRA) and the adapters (peft). The reference policy is not a second model: it is the same module with
its adapters disabled (``policy.disable_adapter()``). The checks here run in seconds, before anything loads: a
missing folder, an unreachable hub id, a saved adapter trained on another base. Each ends in one line naming the key.
The two offline models (``embedded:SmolLM2-135M-Instruct``, ``embedded:tiny``) are built in
:mod:`sglightning.embedded`. What the loaded model does that the sampler must match is read in
:mod:`sglightning.traits`.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from sglightning.embedded import (
    CHATML_TEMPLATE,
    EMBEDDED_SMOLLM2,
    EMBEDDED_TINY,
    TinyModelConfig,
    build_tiny_model,
    build_tiny_tokenizer,
    cache_root,
    ensure_smollm2_folder,
    no_progress_bars,
    smollm2_folder,
    smollm2_gguf_path,
    tiny_folder,
)
from sglightning.errors import ConfigError, check_number, not_writable
from sglightning.traits import head_is_exact

log = logging.getLogger(__name__)


@dataclass
class PolicyConfig:
    """Which model to train and how to adapt it."""

    name_or_path: str = EMBEDDED_SMOLLM2
    """HF hub id, local folder, ``embedded:SmolLM2-135M-Instruct`` (default, offline) or ``embedded:tiny``"""
    revision: str | None = None
    """hub revision (branch, tag or commit) of a hub id"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """auto = fp32 on CPU (bf16 is slow on CPUs without AVX512-BF16 or AMX), bf16 on CUDA when supported"""
    quantization: Literal["4bit"] | None = None
    """``None`` or ``4bit`` (QLoRA: NF4 base weights via bitsandbytes, computed in ``dtype``; LoRA adapters in fp32)"""
    lora_r: int = 16
    """LoRA rank"""
    lora_alpha: int = 32
    """LoRA scaling numerator (the update is scaled by alpha / r)"""
    lora_dropout: float = 0.0
    """dropout on the LoRA input (0 keeps the sampler's and the trainer's log-probs identical)"""
    lora_target_modules: list[str] | str = "all-linear"
    """module names to adapt, or ``all-linear``"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass (less memory, ~30 % more time)"""
    trust_remote_code: bool = False
    """let transformers run a hub model's own code (only for models you trust)"""
    cache_dir: str | None = None
    """where converted embedded models are kept (default ``$SGLIGHTNING_CACHE`` or ``~/.cache/sglightning``)"""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """extra arguments of the tokenizer's chat template, e.g. {enable_thinking: true}. A template that takes
    enable_thinking (Qwen3) gets false unless set here"""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """shape of ``embedded:tiny`` (tests)"""

    def __post_init__(self) -> None:
        if isinstance(self.tiny, dict):
            self.tiny = TinyModelConfig(**self.tiny)
        if not isinstance(self.chat_template_kwargs, dict):
            raise ValueError(f"model.policy.chat_template_kwargs: must be a mapping, got {self.chat_template_kwargs!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"model.policy.dtype: {self.dtype!r} is not one of auto, float32, bfloat16, float16")
        if self.quantization not in (None, "4bit"):
            raise ValueError(f"model.policy.quantization: {self.quantization!r} is not one of null, 4bit")
        if self.lora_r < 1:
            raise ValueError(f"model.policy.lora_r: must be >= 1, got {self.lora_r}")
        check_number("model.policy.lora_alpha", self.lora_alpha, 0, strict=True)
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"model.policy.lora_dropout: must be in [0, 1), got {self.lora_dropout}")
        name = self.name_or_path
        if name.startswith("embedded:") and name not in (EMBEDDED_SMOLLM2, EMBEDDED_TINY):
            raise ValueError(
                f"model.policy.name_or_path: unknown embedded model {name!r}; "
                f"allowed: {EMBEDDED_SMOLLM2}, {EMBEDDED_TINY}, a HF hub id or a local folder"
            )
        if name.startswith((".", "/", "~")) and not Path(name).expanduser().is_dir():
            raise ValueError(f"model.policy.name_or_path: local folder {name!r} does not exist")


_TRUTHY = ("1", "true", "yes", "on")
_FALSY = ("", "0", "false", "no", "off")


def check_environment() -> None:
    """The variables model loading reads, when set: ``SGLIGHTNING_CACHE`` a folder path (not empty, not a file),
    ``HF_HUB_OFFLINE`` a boolean word.  ``ConfigError`` naming the variable and what is allowed."""
    cache = os.environ.get("SGLIGHTNING_CACHE")
    if cache is not None:
        if not cache.strip():
            raise ConfigError("SGLIGHTNING_CACHE: empty; unset it (the cache is then ~/.cache/sglightning) or give a "
                              "folder")
        if Path(cache).expanduser().exists() and not Path(cache).expanduser().is_dir():
            raise ConfigError(f"SGLIGHTNING_CACHE: {cache} is a file, not a folder")
    offline = os.environ.get("HF_HUB_OFFLINE")
    if offline is not None and offline.strip().lower() not in _TRUTHY + _FALSY:
        raise ConfigError(f"HF_HUB_OFFLINE: {offline!r} is not one of 1/0, true/false, yes/no, on/off")


def resolve_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype:
    if name == "auto":
        if torch.device(device).type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return getattr(torch, name)


_TINY_QUANT = ("model.policy.quantization: 4bit is not supported for embedded:tiny (a random in-process model: "
               "nothing to quantise); allowed: null, or 4bit with a real model")


def load_tokenizer(cfg: PolicyConfig):
    from transformers import AutoTokenizer

    name = cfg.name_or_path
    if name == EMBEDDED_TINY:
        return build_tiny_tokenizer(cfg.tiny.vocab_size)
    if name == EMBEDDED_SMOLLM2:
        name = str(ensure_smollm2_folder(cfg.cache_dir))
    tok = AutoTokenizer.from_pretrained(name, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None and type(backend.model).__name__ == "BPE":
        # decoding never "cleans up" spaces before punctuation for a BPE vocabulary (the step is WordPiece's and
        # corrupts BPE text; transformers 5.2x skips it with a warning per run, older releases apply it)
        tok.clean_up_tokenization_spaces = False
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if tok.chat_template is None:
        log.warning("tokenizer of %s has no chat template; using ChatML", name)
        tok.chat_template = CHATML_TEMPLATE
    return tok


def load_base_model(cfg: PolicyConfig, vocab_size: int, device: torch.device | str = "cpu"):
    from transformers import AutoModelForCausalLM

    name = cfg.name_or_path
    dtype = resolve_dtype(cfg.dtype, device)
    if name == EMBEDDED_TINY:
        if cfg.quantization:
            raise ConfigError(_TINY_QUANT)
        return build_tiny_model(cfg.tiny, vocab_size, device, dtype)
    if name == EMBEDDED_SMOLLM2:
        name = str(ensure_smollm2_folder(cfg.cache_dir))
    kwargs: dict[str, Any] = dict(revision=cfg.revision, trust_remote_code=cfg.trust_remote_code, dtype=dtype)
    if cfg.quantization == "4bit":
        try:
            import bitsandbytes  # noqa: F401
            from transformers import BitsAndBytesConfig
        except ImportError as err:
            raise ConfigError(
                "model.policy.quantization: 4bit needs bitsandbytes: pip install 'sglightning[quant]' "
                "(or set it to null)"
            ) from err
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=dtype,
            bnb_4bit_use_double_quant=True,
            bnb_4bit_quant_storage=dtype,  # FSDP needs storage dtype == compute dtype
        )
    with no_progress_bars():  # transformers' per-tensor "Loading weights" bar: noise in a training log
        model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
    if cfg.quantization == "4bit":
        from peft import prepare_model_for_kbit_training

        # checkpointing is switched on by add_lora, once, through the current API (peft's call uses the name that
        # transformers 5 deprecates, and the reentrant variant)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        keep_cpu_layout(model)
    return model


def keep_cpu_layout(model: torch.nn.Module) -> None:
    """The 4-bit layers keep one layout.  On a CPU with AVX512-BF16, bitsandbytes (0.50) repacks a layer's weights for
    its inference kernel at the first eval-mode, no-grad forward, and its training matmul then fails ("a view of a
    leaf Variable ... in-place").  Rollouts run in eval mode and the update trains, so both must read one layout."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def add_lora(model, cfg: PolicyConfig):
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=cfg.lora_target_modules,
        task_type="CAUSAL_LM",
    )
    try:
        peft_model = get_peft_model(model, lora)
    except ValueError as err:
        raise ConfigError(f"model.policy.lora_target_modules: {err}") from err
    return _with_checkpointing(peft_model, cfg)


def _with_checkpointing(peft_model, cfg: PolicyConfig):
    """``peft_model`` with ``gradient_checkpointing`` applied where the config asks (a new adapter or a loaded one)."""
    if cfg.gradient_checkpointing:
        enable_activation_checkpointing(peft_model.get_base_model())
        peft_model.enable_input_require_grads()
    return peft_model


def enable_activation_checkpointing(model) -> None:
    """Recompute each decoder layer's activations in the backward pass (non-reentrant).  transformers 5 names it
    ``activation_checkpointing_enable`` and warns on the old name, which older versions have alone."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the hub's host accepts a connection (behind a proxy we cannot tell cheaply: assume it does)."""
    import socket
    from urllib.parse import urlparse

    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True

    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def check_cache_writable(cfg: PolicyConfig) -> None:
    """The cache folder can take a converted model (:func:`~sglightning.errors.not_writable`).  Else a ``ConfigError``
    naming where the folder came from (``model.policy.cache_dir``, ``SGLIGHTNING_CACHE``)."""
    root = cache_root(cfg.cache_dir)
    key = ("model.policy.cache_dir" if cfg.cache_dir else "SGLIGHTNING_CACHE" if os.environ.get("SGLIGHTNING_CACHE")
           else "the model cache")
    if reason := not_writable((root / "models").absolute()):
        raise ConfigError(f"{key}: {root} cannot hold the converted model ({reason}); give a folder you can write to")


def check_model_source(cfg: PolicyConfig, key: str = "model.policy.name_or_path") -> None:
    """Where the model comes from, checked in seconds before anything loads: a ``ConfigError`` naming ``key`` for a
    local folder that does not exist or holds no model, a missing embedded package, or a hub id that is neither in the
    local Hugging Face cache nor reachable (instead of a minute of download retries)."""
    name = cfg.name_or_path
    if name == EMBEDDED_TINY:
        if cfg.quantization:
            raise ConfigError(_TINY_QUANT)
        return
    if name == EMBEDDED_SMOLLM2:
        if not (smollm2_folder(cfg.cache_dir) / "config.json").is_file():
            try:
                smollm2_gguf_path()
            except RuntimeError as err:
                raise ConfigError(f"{key}: {err}") from None
            check_cache_writable(cfg)
        return
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ConfigError(f"{key}: {name!r} is not a model folder (no config.json in it)")
        return
    parts = name.split("/")
    if name.startswith((".", "/", "~")) or len(parts) != 2 or not all(parts) or Path(parts[0]).is_dir():
        raise ConfigError(f"{key}: local folder {name!r} does not exist (a hub id looks like 'org/name')")
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = isinstance(try_to_load_from_cache(name, "config.json", revision=cfg.revision), str)
    except Exception:  # noqa: BLE001 - an unusual cache layout: let the real load decide
        return
    if cached:
        return
    if os.environ.get("HF_HUB_OFFLINE", "0").strip().lower() in _TRUTHY or not _hub_reachable():
        raise ConfigError(
            f"{key}: {name!r} is not a local folder, not in the local Hugging Face cache, and the hub cannot be "
            f"reached from here; download it on a networked machine (or give a local folder)"
        )


def use_native_gqa_attention(device: torch.device | str) -> bool:
    """On CPU, let grouped-query attention with a mask run in torch's SDPA (``enable_gqa``) instead of transformers
    copying every key/value head ``num_heads / num_kv_heads`` times per layer and forward first (its default whenever
    an attention mask is given and more than one query position is fed).  Same numbers; measured on SmolLM2-135M
    (9 query / 3 key-value heads, 16 rows, 1 000 cached positions, 2 threads): 8 vs 56 ms per layer for 8 new
    positions, 44 vs 98 ms for 100.  Sets ``TRANSFORMERS_SDPA_FORCE_GQA=1`` (read by transformers at every attention
    call) unless the environment already sets it; not on GPUs, where the mask + GQA kernels differ.  Needs torch ≥
    2.5.  Returns whether it is on."""
    if torch.device(device).type != "cpu" or tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 5):
        return os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA") == "1"
    os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    return os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] == "1"


_ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def check_adapter_folder(path: str | None, key: str = "model.adapter_path") -> None:
    """A peft adapter folder: it exists, holds ``adapter_config.json`` and the weights (``ConfigError`` naming
    ``key``).  Checked before anything starts; whether the adapter fits the model is checked when it is loaded."""
    if path is None:
        return
    folder = Path(path)
    if not folder.exists():
        raise ConfigError(f"{key}: {path} does not exist (give the adapter folder a fit exported: <run dir>/adapter)")
    if not folder.is_dir() or not (folder / "adapter_config.json").is_file():
        raise ConfigError(f"{key}: {path} is not a peft adapter folder (no adapter_config.json in it)")
    if not any((folder / name).is_file() for name in _ADAPTER_WEIGHTS):
        raise ConfigError(f"{key}: {path} holds no adapter weights ({' or '.join(_ADAPTER_WEIGHTS)})")


#: the base model's config fields an adapter records (``sglightning.json`` beside it) and is checked against
BASE_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "vocab_size")


def base_signature(base) -> dict[str, Any]:
    """The shape of ``base`` (a transformers model): what an adapter trained on it depends on."""
    config = getattr(base, "config", None)
    return {k: getattr(config, k) for k in BASE_FIELDS if getattr(config, k, None) is not None}


def _check_base_signature(base, folder: Path, cfg: PolicyConfig, key: str) -> None:
    meta = folder / "sglightning.json"
    if not meta.is_file():
        return  # not exported by sglightning: the tensors are checked after loading

    try:
        recorded = json.loads(meta.read_text()).get("base_model") or {}
    except (OSError, ValueError):
        return
    here = base_signature(base)
    differ = [f"{k}={recorded[k]} (this model: {here[k]})" for k in BASE_FIELDS
              if k in recorded and k in here and recorded[k] != here[k]]
    if differ:
        raise ConfigError(f"{key}: the adapter in {folder} was trained on another base model than "
                          f"{cfg.name_or_path} as configured: {', '.join(differ)}")


def _saved_adapter_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    weights = folder / _ADAPTER_WEIGHTS[0]
    if weights.is_file():
        from safetensors import safe_open

        with safe_open(str(weights), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    state = torch.load(folder / _ADAPTER_WEIGHTS[1], map_location="cpu", weights_only=True)
    return {k: tuple(v.shape) for k, v in state.items()}


def load_adapter(base, cfg: PolicyConfig, path: str, key: str = "model.adapter_path"):
    """``PeftModel.from_pretrained`` (trainable), refusing an adapter that does not fit this base model in one line
    naming ``key``: a base of another shape than the one the adapter recorded (``sglightning.json``: an adapter
    naming its modules loads into a deeper base without complaint), a tensor of another shape (peft raises a
    size-mismatch wall) or a tensor with no place in the model (peft skips those silently)."""
    from peft import PeftModel, get_peft_model_state_dict

    folder = Path(path)
    _check_base_signature(base, folder, cfg, key)
    saved = _saved_adapter_shapes(folder)
    try:
        model = PeftModel.from_pretrained(base, str(folder), is_trainable=True)
    except (RuntimeError, ValueError, KeyError) as err:
        first = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{key}: the adapter in {path} does not fit {cfg.name_or_path}: {first[:300]}") from None
    expected = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(model).items()}
    unplaced = sorted(set(saved) - set(expected))
    missing = sorted(set(expected) - set(saved))
    resized = sorted(k for k in set(saved) & set(expected) if saved[k] != expected[k])
    if unplaced or missing or resized:
        what = [f"{len(unplaced)} of its tensors have no place in the model (e.g. {unplaced[0]})" if unplaced else "",
                f"{len(missing)} adapter tensors of the model are not in it (e.g. {missing[0]})" if missing else "",
                f"{len(resized)} have another shape (e.g. {resized[0]})" if resized else ""]
        raise ConfigError(f"{key}: the adapter in {path} was not trained on {cfg.name_or_path} as configured: "
                          + "; ".join(w for w in what if w))
    differ = _adapter_settings_differ(model, cfg)
    if differ:  # the adapter's own shape trains on: say so once, rather than train another adapter than configured
        log.warning("%s: the adapter in %s has %s; it trains as saved, not as model.policy says", key, path, differ)
    return _with_checkpointing(model, cfg)


def _adapter_settings_differ(model, cfg: PolicyConfig) -> str:
    """The LoRA settings of a loaded adapter that differ from ``cfg``'s, in words ("" when none do)."""
    saved = model.peft_config.get("default")
    if saved is None:
        return ""
    pairs = [("lora_r", saved.r, cfg.lora_r), ("lora_alpha", saved.lora_alpha, cfg.lora_alpha),
             ("lora_dropout", saved.lora_dropout, cfg.lora_dropout)]
    if not isinstance(cfg.lora_target_modules, str):  # all-linear: expanded by peft, nothing to compare
        pairs.append(("lora_target_modules", sorted(saved.target_modules or ()), sorted(cfg.lora_target_modules)))
    return ", ".join(f"{name} {have} (model.policy.{name} {want})" for name, have, want in pairs if have != want)


def load_policy(cfg: PolicyConfig, device: torch.device | str = "cpu", adapter_path: str | None = None):
    """Return ``(peft_model, tokenizer)``.  With ``adapter_path`` the saved adapter is loaded (trainable).  On CPU,
    grouped-query attention runs natively in SDPA (:func:`use_native_gqa_attention`)."""
    use_native_gqa_attention(device)
    tok = load_tokenizer(cfg)
    base = load_base_model(cfg, len(tok), device)
    if adapter_path is not None:
        check_adapter_folder(adapter_path)
        model = load_adapter(base, cfg, adapter_path)
    else:
        model = add_lora(base, cfg)
    head_is_exact(model)  # now, not inside the first update (whose compiled layers would trace this call too)
    return model, tok


def served_model(cfg: PolicyConfig, device: torch.device | str = "cpu") -> str:
    """What an external engine (a vLLM server) loads as the base: a local HF folder holding the same weights and
    tokenizer the trainer loads — the converted SmolLM2 folder, the in-process tiny model saved once under the cache
    (keyed by its shape, seed and, off the CPU, the trainer's ``device`` type and dtype: it is drawn there, as the
    trainer's), a local folder as given — or the hub id (the engine reads the same HF cache)."""
    name = cfg.name_or_path
    if name == EMBEDDED_SMOLLM2:
        return str(ensure_smollm2_folder(cfg.cache_dir))
    if name != EMBEDDED_TINY:
        return str(Path(name).expanduser()) if name.startswith((".", "/", "~")) else name
    return str(tiny_folder(cfg.tiny, cfg.cache_dir, device, resolve_dtype(cfg.dtype, device)))


def max_positions(model_path: str, revision: str | None = None) -> int | None:
    """The model's own context limit (``max_position_embeddings``) from a local folder's config, or a hub id's in
    the local HF cache (nothing is downloaded), or None."""
    config = Path(model_path) / "config.json"
    try:
        if config.is_file():
            return int(json.loads(config.read_text()).get("max_position_embeddings"))
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model_path, revision=revision, local_files_only=True)
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        return int(cfg.max_position_embeddings)
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def head_dim_of(cfg: PolicyConfig) -> int | None:
    """The attention head size of the policy's base model when it is known without loading the model (the tiny
    model's shape, the embedded SmolLM2, a local folder's ``config.json``); None otherwise."""
    if cfg.name_or_path == EMBEDDED_TINY:
        return cfg.tiny.heads_dim
    if cfg.name_or_path == EMBEDDED_SMOLLM2:
        return 64
    path = Path(cfg.name_or_path).expanduser() / "config.json"
    if not path.is_file():
        return None
    try:
        c = json.loads(path.read_text())
        return int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    except (ValueError, KeyError, TypeError, ZeroDivisionError):
        return None
