"""Generation engines: what the rollout runs its turns on (no Lightning import).

The seam is :class:`sglightning.sampler.Decoder`, request-level in what it asks for: a batch of rows (one per live
episode), each holding the exact token ids of its context, and per turn one *program* per row — forced text, free
text with a cap and stop tokens, a choice among token sequences — in; per row the tokens written, which of them the
policy chose, the log-prob of the distribution each was drawn from and that distribution's restriction out.  The
rollout, the guidance programs, the environments and the update never learn which engine ran.

Two engines implement it:

* the built-in decoder (:class:`sglightning.sampler.DecodeSession`, the default and the reference): batched forwards
  of the trainer's own (peft) model with a persistent KV cache, in the trainer's process;
* a vLLM server (:mod:`sglightning.engines.vllm`), over HTTP: each row's context is sent as token ids (never
  re-tokenised), the server's prefix cache keeps what earlier turns computed, and the LoRA adapter is exported and
  hot-swapped after every optimiser step, verified before it is used.

``model.engine`` selects and configures one (:class:`EngineConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

#: the probe an adapter sync is verified on: the engine's and the trainer's log-probs of its tokens must agree
PROBE_TEXT = "Reason: the last action brought the goal closer.\nLabel: positive\nAction: go to the kitchen"

#: LoRA ranks vLLM accepts for ``--max-lora-rank``
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass
class EngineConfig:
    """The generation engine rollouts run on: the built-in decoder, or a vLLM server (launched here, or running)."""

    backend: Literal["builtin", "vllm"] = "builtin"
    """``builtin``: batched forwards of the trainer's own model (the reference); ``vllm``: a vLLM server over HTTP"""
    url: str | None = None
    """a running vLLM server (``http://host:port``), started with the flags ``engine.vllm_command`` would use
    (LoRA, processed log-probs); null = launch one on 127.0.0.1.  It must read adapter folders this process writes
    (same machine or a shared ``engine.adapter_dir``)"""
    python: str = ".venv-vllm/bin/python"
    """the python executable of the virtual environment vLLM is installed in (launch only; vLLM pins other versions
    of transformers than sglightning, so it lives apart)"""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """the engine's weights: float32 makes its log-probs the trainer's within ~1e-5 (they then serve as the old
    policy); bfloat16/float16 are fast on GPUs and AVX512-BF16 CPUs and need ``grpo.rollout_correction``"""
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
    """largest |log-prob difference| between engine and trainer on the probe after an adapter sync; null = 1e-3 for
    float32, 0.15 for half precision"""
    adapter_dir: str | None = None
    """where adapter versions are written for the engine to load; null = a temporary folder removed at exit"""
    host: str = "127.0.0.1"
    """launch: the address the engine listens on"""
    port: int | None = None
    """launch: the port; null = a free one"""

    def __post_init__(self) -> None:
        if self.backend not in ("builtin", "vllm"):
            raise ValueError(f"model.engine.backend: {self.backend!r} is not one of builtin, vllm")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"model.engine.dtype: {self.dtype!r} is not one of float32, bfloat16, float16")
        if self.url is not None and not str(self.url).startswith(("http://", "https://")):
            raise ValueError(f"model.engine.url: {self.url!r} is not an http(s) URL (e.g. http://127.0.0.1:8000)")
        if self.kv_cache_gb <= 0:
            raise ValueError(f"model.engine.kv_cache_gb: must be > 0, got {self.kv_cache_gb}")
        if self.max_model_len is not None and self.max_model_len < 64:
            raise ValueError(f"model.engine.max_model_len: must be >= 64, got {self.max_model_len}")
        if self.max_loras < 2:
            raise ValueError(f"model.engine.max_loras: must be >= 2 (a new adapter version loads before the old one "
                             f"is unloaded), got {self.max_loras}")
        for key in ("startup_timeout_s", "request_timeout_s"):
            if getattr(self, key) <= 0:
                raise ValueError(f"model.engine.{key}: must be > 0, got {getattr(self, key)}")
        if self.max_concurrency < 1:
            raise ValueError(f"model.engine.max_concurrency: must be >= 1, got {self.max_concurrency}")
        if self.sync_tolerance is not None and not self.sync_tolerance > 0:
            raise ValueError(f"model.engine.sync_tolerance: must be > 0 or null, got {self.sync_tolerance}")
        if self.port is not None and not 0 < self.port < 65536:
            raise ValueError(f"model.engine.port: {self.port} is not a TCP port")
        if not isinstance(self.env, dict) or not all(isinstance(v, str) for v in self.env.values()):
            raise ValueError("model.engine.env: must map variable names to strings")

    @property
    def tolerance(self) -> float:
        if self.sync_tolerance is not None:
            return self.sync_tolerance
        return 1e-3 if self.dtype == "float32" else 0.15
