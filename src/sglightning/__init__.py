"""sglightning: Self-Guide GRPO for LLM agents on PyTorch Lightning."""

import logging

# import-time noise that says nothing about a run, for every entry point (CLI, benchmarks, notebooks): bitsandbytes
# logs "Failed to load CPU gemm_4bit_forward … no module named 'kernels'" on CPU when it is imported
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

__version__ = "0.1.0"
