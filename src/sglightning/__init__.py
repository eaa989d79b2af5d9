"""sglightning: Self-Guide GRPO for LLM agents on PyTorch Lightning."""

__version__ = "0.1.0"
