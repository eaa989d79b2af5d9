"""``sglightning fit | validate`` — LightningCLI over :class:`~sglightning.module.SelfGuideModule`.

    sglightning fit --config configs/quickstart.yaml
    sglightning validate --config configs/quickstart.yaml [--ckpt_path …] [--model.adapter_path …]
    sglightning fit --config configs/tiny.yaml --print_config

``--config`` can be given several times (later files override earlier ones).  The resolved config is saved as
``config.yaml`` in the run directory.  ``validate`` also writes ``validation_report.json`` and ``.md`` there.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

# third-party import-time noise that says nothing about the run (set before lightning imports bitsandbytes)
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)  # "no `kernels` package" on CPU
warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*")

from lightning.pytorch.cli import LightningCLI, SaveConfigCallback  # noqa: E402

from sglightning.callbacks import run_dir  # noqa: E402
from sglightning.checkpointing import CheckpointError, load_checkpoint_file  # noqa: E402
from sglightning.errors import ConfigError  # noqa: E402
from sglightning.module import SelfGuideModule  # noqa: E402
from sglightning.report import report_markdown  # noqa: E402
from sglightning.strategies import recover_swapped_checkpoints  # noqa: E402

TRAINER_DEFAULTS: dict[str, Any] = {
    "max_steps": 10,
    "max_epochs": -1,  # the run ends at max_steps (the train dataloader yields one item per rollout; a resumed run
    # that raised max_steps goes on into a next pass)
    "num_sanity_val_steps": 0,
    "log_every_n_steps": 1,
    "enable_model_summary": False,
    "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": "runs", "name": "sglightning"},
    },
}


class VersionedSaveConfig(SaveConfigCallback):
    """Saves the resolved config like Lightning does, then appends the package versions of this run as YAML comments
    (benchmark versions change scores between releases), so the file stays a valid ``--config`` and records what ran."""

    def save_config(self, trainer, pl_module, stage: str) -> None:
        if not self.save_to_log_dir:
            return
        path = run_dir(trainer) / self.config_filename  # rank 0 only: no trainer.log_dir (a broadcast)
        versions = pl_module.package_versions() if hasattr(pl_module, "package_versions") else {}
        if path.is_file() and versions:
            with path.open("a") as f:
                f.write("# package versions of this run (written by sglightning):\n")
                for k, v in versions.items():
                    f.write(f"#   {k}: {v}\n")


class SGLightningCLI(LightningCLI):
    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        full = LightningCLI.subcommands()
        return {k: full[k] for k in ("fit", "validate")}

    def instantiate_classes(self) -> None:
        """Config values our dataclasses reject (``ValueError`` naming the key) become a one-line parser error."""
        try:
            super().instantiate_classes()
        except ValueError as err:
            msg = str(err)
            while err.__cause__ is not None and isinstance(err.__cause__, ValueError):
                err = err.__cause__
                msg = str(err)
            self.parser.error(msg.splitlines()[0] if msg else repr(err))

    def before_instantiate_classes(self) -> None:
        """``--ckpt_path last`` on a fresh process: find the newest ``last.ckpt`` of this config's runs
        (``<save_dir>/<name>/version_*/checkpoints/``) and continue in that run's folder; with none, start fresh (so
        one command line serves both the first launch and every requeue after a preemption)."""
        if self.subcommand != "fit":
            return
        cfg = self.config[self.subcommand]
        if cfg.get("ckpt_path") != "last":
            return
        found = find_last_checkpoint(cfg)
        if found is None:
            print("sglightning: --ckpt_path last: no last.ckpt from an earlier run of this config; starting fresh",
                  file=sys.stderr)
            cfg["ckpt_path"] = None
            return
        ckpt, version = found
        cfg["ckpt_path"] = str(ckpt)
        logger = cfg.get("trainer", {}).get("logger")
        if version is not None and logger is not None and not isinstance(logger, bool):
            init = logger.get("init_args") if hasattr(logger, "get") else None
            if init is not None:
                init["version"] = version
        print(f"sglightning: resuming from {ckpt}", file=sys.stderr)

    def _parse_ckpt_path(self) -> None:
        """Check ``--ckpt_path`` up front (safe load, sglightning checkpoint); our checkpoints carry no
        hyper-parameters, so there is nothing to merge into the config (the config file is the source of truth)."""
        sub = self.config.get("subcommand")
        path = self.config[sub].get("ckpt_path") if sub else None
        if not path or path in ("last", "best", "hpc") or not Path(str(path)).is_file():
            return  # Lightning resolves the keywords; distributed checkpoints are folders; a missing file is reported
            # when it is loaded
        try:
            load_checkpoint_file(path)
        except CheckpointError as err:
            print(f"sglightning {sub}: error: {err}", file=sys.stderr)
            sys.exit(2)

    def _run_subcommand(self, subcommand: str) -> None:
        try:
            super()._run_subcommand(subcommand)
        except (CheckpointError, ConfigError) as err:  # one line naming the file / config key, no traceback wall
            print(f"sglightning {subcommand}: error: {err}", file=sys.stderr)
            sys.exit(2)

    def after_fit(self) -> None:
        reason = getattr(self.model, "stop_reason", None)
        if reason:
            print(f"sglightning: {reason}", file=sys.stderr)
            sys.exit(1)

    def after_validate(self) -> None:
        report = getattr(self.model, "val_report", None)
        if report is None or self.trainer.global_rank != 0:
            return
        out = run_dir(self.trainer)
        out.mkdir(parents=True, exist_ok=True)
        report = dict(report, config={
            "env": self.model.env_name(),
            "model": self.model.model_cfg.model_name_or_path,
            "adapter": self.model.adapter_path,
            "checkpoint": self.config_init[self.subcommand].get("ckpt_path") if self.subcommand else None,
            "episodes_per_mode": self.model.eval_cfg.num_tasks * self.model.eval_cfg.episodes_per_task,
            "temperature": self.model.eval_cfg.temperature,
            "max_steps": self.model.rollout_cfg.max_steps,
            "guidance": {k: getattr(self.model.guidance_cfg, k)
                         for k in ("prompt_mode", "decoding", "action_decoding", "actor_format")},
        })
        text = report_markdown(report)
        (out / "validation_report.json").write_text(json.dumps(report, indent=2, default=str))
        (out / "validation_report.md").write_text(text)
        print(text)
        print(f"report: {out / 'validation_report.json'}")


def find_last_checkpoint(cfg) -> tuple[Path, str | None] | None:
    """The newest ``last.ckpt`` of runs made with this config's TensorBoard logger (``save_dir/name/version_*``) or,
    without such a logger, under ``trainer.default_root_dir``; with the version folder name to continue in."""
    trainer = cfg.get("trainer") or {}
    logger = trainer.get("logger")
    roots: list[tuple[Path, bool]] = []
    mapping = logger is not None and not isinstance(logger, (bool, list)) and hasattr(logger, "get")
    init = logger.get("init_args") if mapping else None
    if init is not None and init.get("save_dir") is not None:
        roots.append((Path(str(init.get("save_dir"))) / str(init.get("name") or "lightning_logs"), True))
    roots.append((Path(str(trainer.get("default_root_dir") or ".")), False))
    best: tuple[float, Path, str | None] | None = None
    for root, versioned in roots:
        for folder in root.glob("version_*/checkpoints" if versioned else "**/checkpoints"):
            recover_swapped_checkpoints(folder)  # a distributed save killed between its two renames
        pattern = "version_*/checkpoints/last*.ckpt" if versioned else "**/checkpoints/last*.ckpt"
        for path in root.glob(pattern):
            mtime = path.stat().st_mtime
            if best is None or mtime > best[0]:
                best = (mtime, path.resolve(), path.parent.parent.name if versioned else None)
        if best is not None:
            break
    return None if best is None else (best[1], best[2])


def cli_main(args: list[str] | None = None) -> SGLightningCLI:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return SGLightningCLI(
        SelfGuideModule,
        trainer_defaults=TRAINER_DEFAULTS,
        save_config_callback=VersionedSaveConfig,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
        seed_everything_default=0,
        args=args,
        parser_kwargs={"fit": {"description": "Train with self-guided GRPO"}},
    )


def main() -> int:
    """Console-script entry point (``sglightning``): exit code 0 on success."""
    cli_main()  # LightningCLI reads sys.argv itself (passing it again triggers a warning)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
