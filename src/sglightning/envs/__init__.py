"""Environment registry: YAML names an environment by short name or by ``class_path``.

env:
class_path: household            # or sglightning.envs.household.HouseholdEnv, or my_pkg.envs.MyEnv
init_args: {difficulty: 1}
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from sglightning.envs.base import ResetResult, StepResult, TextEnv

__all__ = ["ResetResult", "StepResult", "TextEnv", "register_env", "resolve_env_class", "make_env", "registered_envs"]

_REGISTRY: dict[str, str] = {
    # short name -> import path (imported lazily so optional benchmark extras are not needed to list names)
    "household": "sglightning.envs.household.HouseholdEnv",
    "scienceworld": "sglightning.envs.scienceworld.ScienceWorldEnv",
    "twx": "sglightning.envs.textworld_express.TextWorldExpressEnv",
    "alfworld": "sglightning.envs.alfworld.ALFWorldEnv",
    "webshop": "sglightning.envs.webshop.WebShopEnv",
}


def register_env(name: str, class_path: str | type) -> None:
    """Register ``name`` for an environment class (or its import path)."""
    if isinstance(class_path, type):
        class_path = f"{class_path.__module__}.{class_path.__qualname__}"
    _REGISTRY[name] = class_path


def registered_envs() -> dict[str, str]:
    return dict(_REGISTRY)


def resolve_env_class(class_path: str, key: str = "env.class_path") -> type[TextEnv]:
    """Return the environment class for a short name or dotted path; raise ``ValueError`` naming ``key`` otherwise."""
    target = _REGISTRY.get(class_path, class_path)
    module_name, _, attr = target.rpartition(".")
    allowed = ", ".join(sorted(_REGISTRY))
    if not module_name:
        raise ValueError(
            f"{key}: unknown environment {class_path!r}; registered names: {allowed} (or a dotted class path)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"{key}: cannot import {module_name!r} for environment {class_path!r} ({err}); "
            f"registered names: {allowed}"
        ) from err
    cls = getattr(module, attr, None)
    if not (inspect.isclass(cls) and issubclass(cls, TextEnv)):
        raise ValueError(f"{key}: {target!r} is not a TextEnv subclass; registered names: {allowed}")
    return cls


def check_env_args(cls: type[TextEnv], init_args: dict[str, Any], key: str = "env.init_args") -> None:
    """Fail early (at config time) when ``init_args`` names a parameter the environment does not take."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = sorted(set(init_args) - set(params) - {"self"})
    if unknown:
        allowed = ", ".join(p for p in params if p != "self")
        raise ValueError(f"{key}: unknown argument(s) {unknown} for {cls.__name__}; allowed: {allowed}")


def make_env(class_path: str, init_args: dict[str, Any] | None = None) -> TextEnv:
    cls = resolve_env_class(class_path)
    init_args = dict(init_args or {})
    check_env_args(cls, init_args)
    return cls(**init_args)


def env_class_of(env: Any) -> Any:
    """The environment class behind a configured ``env`` (jsonargparse hands over a partial of the class)."""
    import functools

    target = env
    if isinstance(target, functools.partial):
        target = next((a for a in target.args if isinstance(a, type)), target.func)
    return target


def build_env(env: Any) -> TextEnv:
    """Call the configured ``env`` and check that it built a :class:`TextEnv` (``TypeError`` naming ``env``)."""
    built = env()
    if not isinstance(built, TextEnv):
        raise TypeError(f"env: {env!r} built a {type(built).__name__}, not a sglightning TextEnv")
    return built


def check_env(factory: Any, splits: dict[str, str]) -> None:
    """Build one environment and check each configured split (``{config key: split}``) against the env's splits.

    Raises :class:`~sglightning.errors.ConfigError` naming the key (``env…`` for a constructor that fails), so that
    it is found before any slow model load."""
    from sglightning.errors import ConfigError

    try:
        probe = factory()
    except (TypeError, ValueError) as err:
        msg = str(err)
        raise ConfigError(msg if msg.startswith("env") else f"env: cannot create the environment: {msg}") from err
    try:
        allowed = tuple(getattr(probe, "splits", ()) or ())
        for key, split in splits.items():
            if allowed and split not in allowed:
                raise ConfigError(
                    f"{key}: {split!r} is not a split of {type(probe).__name__}; allowed: {', '.join(allowed)}")
    finally:
        probe.close()


def stack_versions(env: Any) -> dict[str, str]:
    """sglightning, the training stack and the configured env's benchmark packages (``TextEnv.packages``): recorded in
    every run's config and validation report, since benchmark releases change scores."""
    import sglightning
    from sglightning.envs.base import installed_versions

    out = {"sglightning": sglightning.__version__}
    out.update(installed_versions(("torch", "lightning", "transformers", "peft")))
    target = env_class_of(env)
    if isinstance(target, type) and issubclass(target, TextEnv):
        out.update(target.package_versions())
    return out
