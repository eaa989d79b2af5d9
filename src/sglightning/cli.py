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

from lightning.pytorch.cli import LightningCLI  # noqa: E402

from sglightning.module import SelfGuideModule  # noqa: E402

TRAINER_DEFAULTS: dict[str, Any] = {
    "max_steps": 10,
    "max_epochs": 1,  # one epoch = the whole run (the train dataloader yields one item per rollout)
    "num_sanity_val_steps": 0,
    "log_every_n_steps": 1,
    "enable_model_summary": False,
    "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": "runs", "name": "sglightning"},
    },
}


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

    def after_fit(self) -> None:
        reason = getattr(self.model, "stop_reason", None)
        if reason:
            print(f"sglightning: {reason}", file=sys.stderr)
            sys.exit(1)

    def after_validate(self) -> None:
        report = getattr(self.model, "val_report", None)
        if report is None or self.trainer.global_rank != 0:
            return
        out = Path(self.trainer.log_dir or self.trainer.default_root_dir)
        out.mkdir(parents=True, exist_ok=True)
        report = dict(report, config={"env": self.model.env_name(), "model": self.model.model_cfg.model_name_or_path})
        text = report_markdown(report)
        (out / "validation_report.json").write_text(json.dumps(report, indent=2, default=str))
        (out / "validation_report.md").write_text(text)
        print(text)
        print(f"report: {out / 'validation_report.json'}")


def report_markdown(report: dict[str, Any]) -> str:
    cols = [
        ("success", "rollout/success_rate"),
        ("score", "rollout/score"),
        ("steps", "rollout/episode_length"),
        ("invalid", "rollout/invalid_action_rate"),
        ("unparsed", "guidance/label_unparsed"),
        ("pos", "guidance/label_positive"),
        ("neu", "guidance/label_neutral"),
        ("neg", "guidance/label_negative"),
    ]
    lines = [
        f"### validation — {report.get('config', {}).get('model', '')} on {report.get('config', {}).get('env', '')}",
        "",
        "| self-guidance | episodes | " + " | ".join(c for c, _ in cols) + " |",
        "|---|---|" + "---|" * len(cols),
    ]
    for mode, stats in report["modes"].items():
        vals = " | ".join(f"{stats.get(k, float('nan')):.3f}" for _, k in cols)
        lines.append(f"| {'on' if mode == 'sg' else 'off'} | {stats.get('episodes', 0)} | {vals} |")
    for mode, stats in report["modes"].items():
        per = stats.get("per_task_type_success") or {}
        if len(per) > 1:
            lines.append("")
            lines.append(f"per task type ({'on' if mode == 'sg' else 'off'}): " + ", ".join(f"{k} {v:.2f}" for k, v in per.items()))
    return "\n".join(lines) + "\n"


def cli_main(args: list[str] | None = None) -> SGLightningCLI:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return SGLightningCLI(
        SelfGuideModule,
        trainer_defaults=TRAINER_DEFAULTS,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
        seed_everything_default=0,
        args=args,
        parser_kwargs={"fit": {"description": "Train with self-guided GRPO"}},
    )


def main() -> int:
    """Console-script entry point (``sglightning``): exit code 0 on success."""
    cli_main(sys.argv[1:])
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
