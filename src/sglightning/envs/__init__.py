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
        raise ValueError(f"{key}: unknown environment {class_path!r}; registered names: {allowed} (or a dotted class path)")
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
