"""Generation engines: what the rollout runs its turns on (no Lightning import).

The seam is :mod:`sglightning.engines.base`: a :class:`~sglightning.engines.base.Session` is a batch of rows (one per
live episode), each holding the exact token ids of its context; per turn one *program* per row
(:mod:`sglightning.engines.program`: forced text, free text with a cap and stop tokens, a choice among token
sequences) goes in, and per row the tokens written, which of them the policy chose, the log-prob of the distribution
each was drawn from and that distribution's restriction come out.  An :class:`~sglightning.engines.base.Engine` opens
sessions and has the run's lifecycle (check, start, sampling around every rollout, close).  The rollout, the
guidance programs, the environments and the update never learn which engine ran.

Two engines ship, one module each, chosen by ``model.engine.backend``:

* ``builtin`` (:mod:`sglightning.engines.builtin`, the default and the reference): batched forwards of the trainer's
  own (peft) model with a persistent KV cache, in the trainer's process;
* ``vllm`` (:mod:`sglightning.engines.vllm`): a vLLM server over HTTP; each row's context is sent as token ids (never
  re-tokenised), the server's prefix cache keeps what earlier turns computed, and the LoRA adapter is exported and
  hot-swapped after every optimiser step, verified before it is used.

A class path (``mypackage.MyEngine``, an :class:`~sglightning.engines.base.Engine` subclass taking the config) names
a third.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from sglightning.errors import ConfigError, check_number

if TYPE_CHECKING:
    from sglightning.engines.base import Engine

#: the probe an adapter sync is verified on: the engine's and the trainer's log-probs of its tokens must agree
PROBE_TEXT = "Reason: the last action brought the goal closer.\nLabel: positive\nAction: go to the kitchen"

#: the engines that ship, by their ``model.engine.backend`` name
BACKENDS = ("builtin", "vllm")

#: the in-process engine's decode steps (``model.engine.compile``)
COMPILE_MODES = ("auto", "off", "static", "default", "reduce-overhead", "graphs")

#: LoRA ranks vLLM accepts for ``--max-lora-rank``
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass
class EngineConfig:
    """The generation engine rollouts run on: the in-process engine, a vLLM server (launched here, or running), or
    an engine class of your own.  ``compile``, ``few_rows_alone``, ``prefill_tokens`` and ``cache_memory`` are the
    in-process engine's; the keys after them are the vLLM engine's."""

    backend: str = "builtin"
    """``builtin``: batched forwards of the trainer's own model (the reference); ``vllm``: a vLLM server over HTTP;
    or the class path of an ``sglightning.engines.base.Engine`` subclass"""
    compile: Literal["auto", "off", "static", "default", "reduce-overhead", "graphs"] = "auto"
    """builtin decode step: off, static (slot cache), default (compiled), reduce-overhead (torch's CUDA graphs), graphs
    (the engine's CUDA graphs); auto: reduce-overhead on one GPU, else off"""
    few_rows_alone: bool = True
    """builtin: once at most a quarter of the rows still write, the turn's remaining lock steps run those rows only"""
    prefill_tokens: int | None = 16384
    """builtin: the most positions (rows × block width) one forward of a fed block computes; longer blocks go in chunks;
    null = one pass"""
    cache_memory: float | None = 0.5
    """builtin, CUDA: the share of GPU memory the slot caches may hold; past it, idle caches go, then two_call's kept
    ones; null = no limit"""
    url: str | None = None
    """a running vLLM server (http://host:port), started with the trainer's flags and reading its adapter folders
    (docs/vllm.md); null = launch one on 127.0.0.1"""
    python: str = ".venv-vllm/bin/python"
    """the python executable of the virtual environment vLLM is installed in (launch only; vLLM pins other versions
    of transformers than sglightning, so it lives apart)"""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """the engine's weights: float32 matches the trainer's log-probs (no correction needed); bfloat16/float16 are fast
    on GPUs and AVX512-BF16 CPUs, need grpo.rollout_correction"""
    kv_cache_gb: float = 2.0
    """the engine's KV cache on CPU (``--kv-cache-memory-bytes``); on GPUs vLLM sizes it from
    ``--gpu-memory-utilization`` (pass it in ``extra_args``)"""
    max_model_len: int | None = None
    """the longest context the engine accepts; null = rollout.max_context_tokens + 2048, at most the model's own"""
    max_loras: int = 2
    """adapters the engine holds at once (the new version is loaded before the old one is unloaded: >= 2)"""
    extra_args: list[str] = field(default_factory=list)
    """more arguments for ``vllm.entrypoints.openai.api_server`` (e.g. ``[--tensor-parallel-size, "2"]``)"""
    env: dict[str, str] = field(default_factory=dict)
    """more environment variables for the engine process"""
    cpu_threads: str | None = None
    """CPU engines: the cores its threads bind to (VLLM_CPU_OMP_THREADS_BIND, e.g. ``0-1``); null = every core this
    process may use"""
    startup_timeout_s: float = 900.0
    """how long a launched engine may take to answer /health"""
    request_timeout_s: float = 300.0
    """one generation request; a request that takes longer fails its episode only"""
    max_concurrency: int = 64
    """requests in flight at once (the engine batches them)"""
    sync_tolerance: float | None = None
    """allowed mean log-prob gap, engine vs trainer, on a probe after each adapter sync (one token: 10×); null: 1e-3
    in float32, else 0.15"""
    adapter_dir: str | None = None
    """where adapter versions are written for the engine to load; null = a temporary folder removed at exit"""
    host: str = "127.0.0.1"
    """launch: the address the engine listens on"""
    port: int | None = None
    """launch: the port; null = a free one"""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS and "." not in str(self.backend):
            raise ValueError(f"model.engine.backend: {self.backend!r} is not one of {', '.join(BACKENDS)} or a class "
                             "path (package.module.Class)")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"model.engine.compile: {self.compile!r} is not one of {', '.join(COMPILE_MODES)}")
        if self.prefill_tokens is not None and self.prefill_tokens < 1:
            raise ValueError(f"model.engine.prefill_tokens: {self.prefill_tokens} is not a positive count (or null)")
        if self.cache_memory is not None and not 0 < self.cache_memory <= 1:
            raise ValueError(f"model.engine.cache_memory: {self.cache_memory} is not a share in (0, 1] (or null)")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"model.engine.dtype: {self.dtype!r} is not one of float32, bfloat16, float16")
        if self.url is not None and not str(self.url).startswith(("http://", "https://")):
            raise ValueError(f"model.engine.url: {self.url!r} is not an http(s) URL (e.g. http://127.0.0.1:8000)")
        check_number("model.engine.kv_cache_gb", self.kv_cache_gb, 0, strict=True)
        if self.max_model_len is not None and self.max_model_len < 64:
            raise ValueError(f"model.engine.max_model_len: must be >= 64, got {self.max_model_len}")
        if self.max_loras < 2:
            raise ValueError(f"model.engine.max_loras: must be >= 2 (a new adapter version loads before the old one "
                             f"is unloaded), got {self.max_loras}")
        for key in ("startup_timeout_s", "request_timeout_s"):
            check_number(f"model.engine.{key}", getattr(self, key), 0, strict=True)
        if self.max_concurrency < 1:
            raise ValueError(f"model.engine.max_concurrency: must be >= 1, got {self.max_concurrency}")
        if self.sync_tolerance is not None and not self.sync_tolerance > 0:
            raise ValueError(f"model.engine.sync_tolerance: must be > 0 or null, got {self.sync_tolerance}")
        if self.port is not None and not 0 < self.port < 65536:
            raise ValueError(f"model.engine.port: {self.port} is not a TCP port")
        if not isinstance(self.env, dict) or not all(isinstance(v, str) for v in self.env.values()):
            raise ValueError("model.engine.env: must map variable names to strings")

    def tolerance(self, trainer_half: bool = False) -> float:
        """The sync's bound on the probe's mean gap: ``sync_tolerance``, else 1e-3 when the engine and the trainer
        (``trainer_half`` False) both compute in float32, else 0.15."""
        if self.sync_tolerance is not None:
            return self.sync_tolerance
        return 1e-3 if self.dtype == "float32" and not trainer_half else 0.15


def make_engine(cfg: EngineConfig | None = None) -> Engine:
    """The engine ``cfg.backend`` names, built on ``cfg`` (not started); a class path that does not name an
    :class:`~sglightning.engines.base.Engine` subclass is a :class:`~sglightning.errors.ConfigError`."""
    cfg = cfg if cfg is not None else EngineConfig()
    return engine_class(cfg)(cfg)


def engine_class(cfg: EngineConfig) -> type[Engine]:
    """The :class:`~sglightning.engines.base.Engine` subclass ``cfg.backend`` names (a ConfigError if none)."""
    from sglightning.engines.base import Engine

    if cfg.backend == "builtin":
        from sglightning.engines.builtin import BuiltinEngine

        return BuiltinEngine
    if cfg.backend == "vllm":
        from sglightning.engines.vllm import VLLMEngine  # only runs that use it pay for the import

        return VLLMEngine
    module, _, name = cfg.backend.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"model.engine.backend: cannot import {cfg.backend} ({err})") from None
    if not (isinstance(cls, type) and issubclass(cls, Engine)):
        raise ConfigError(f"model.engine.backend: {cfg.backend} is not an sglightning.engines.base.Engine subclass")
    return cls
