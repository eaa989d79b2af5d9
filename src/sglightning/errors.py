"""Errors the CLI turns into one line (no traceback wall)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value that cannot work, found at setup time (env, splits, model loading); the message starts
    with the config key, e.g. ``evaluation.split: 'dev' is not a split of ALFWorldEnv; allowed: ...``."""


class EngineError(RuntimeError):
    """The generation engine (a vLLM server) is gone or refused something essential mid-run: the step in progress is
    abandoned (``last.ckpt`` still holds the last whole step) and the CLI says so in one line."""
