"""Environments: the :class:`TextEnv` protocol and the helpers the trainer builds and checks them with.

A config names its environment by class, like any class in a LightningCLI config::

    env:
      class_path: sglightning.envs.household.HouseholdEnv     # or my_pkg.envs.MyEnv
      init_args: {difficulty: 1}

Built in: ``household.HouseholdEnv``; benchmark adapters (their packages imported only when built):
``scienceworld.ScienceWorldEnv``, ``textworld_express.TextWorldExpressEnv``, ``alfworld.ALFWorldEnv``,
``webshop.WebShopEnv``.
"""

from __future__ import annotations

from typing import Any

from sglightning.envs.base import ResetResult, StepResult, TextEnv

__all__ = ["ResetResult", "StepResult", "TextEnv", "build_env", "check_env", "env_class_of", "stack_versions"]


def env_class_of(env: Any) -> Any:
    """The environment class behind a configured ``env`` (jsonargparse hands over a partial of the class)."""
    import functools

    target = env
    if isinstance(target, functools.partial):
        target = next((a for a in target.args if isinstance(a, type)), target.func)
    return target


def build_env(env: Any, processes: bool | None = None) -> TextEnv:
    """Call the configured ``env`` and check that it built a :class:`TextEnv` (``TypeError`` naming ``env``).

    Args:
        env: the configured env: a ``TextEnv`` class or a partial of one.
        processes: build it in a process of its own (:class:`~sglightning.envs.process.ProcessEnv`); None: the
            class's ``own_process``, where a child process can build it.
    """
    if processes is not False:
        from sglightning.envs.process import ProcessEnv, travels

        # an env class's own choice gives way where a child cannot build it (defined in a script or a notebook)
        if processes or (getattr(env_class_of(env), "own_process", False) and travels(env)):
            return ProcessEnv(env)
    built = env()
    if not isinstance(built, TextEnv):
        raise TypeError(f"env: {env!r} built a {type(built).__name__}, not a sglightning TextEnv")
    return built


def check_env(factory: Any, splits: dict[str, str]) -> None:
    """Build one environment and check each configured split (``{config key: split}``) against the env's splits.

    Raises :class:`~sglightning.errors.ConfigError` naming the key (``env…`` for a constructor that fails), so that
    it is found before any slow model load."""
    from sglightning.errors import ConfigError

    probe = None
    try:  # an env in a process of its own raises its constructor's error when first asked (here: its splits)
        probe = factory()
        # read, not getattr with a default: that would hide the constructor's AttributeError a ProcessEnv raises here
        allowed = tuple(probe.splits or ()) if hasattr(type(probe), "splits") else ()
    except Exception as err:  # noqa: BLE001 - the env's own code: whatever it raises, one line naming the key
        if probe is not None:
            probe.close()
        msg = str(err) if isinstance(err, (TypeError, ValueError)) else f"{type(err).__name__}: {err}"
        raise ConfigError(msg if msg.startswith(("env", "rollout.env")) else
                          f"env: cannot create the environment: {msg}") from err
    try:
        name = getattr(probe, "wrapped", type(probe)).__name__  # a ProcessEnv names the class it plays
        for key, split in splits.items():
            if allowed and split not in allowed:
                raise ConfigError(f"{key}: {split!r} is not a split of {name}; allowed: {', '.join(allowed)}")
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
