"""The callbacks every run gets: the rollout collector (each step's episodes, and validation's), adapter export, the
end-of-fit summary; :func:`default_callbacks` is the one list of them (preemption lives in
:mod:`sglightning.preemption`).

The rollout callback is given the configs it plays by; from the LightningModule it reads only the policy it samples
(``peft_model``, ``tokenizer``, the ``generation_weights()`` context, ``device``) and the step clock
(``rollouts_done``: steps trained, restored from checkpoints; ``global_step``: the optimiser steps the weights took).
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import json
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException

from sglightning import distributed
from sglightning.checkpointing import readable_as_made, recover_folder, run_dir, swap_in_folder
from sglightning.data import EvalConfig, RolloutConfig, sampling_generator, task_seeds
from sglightning.distributed import clean_name
from sglightning.engines import make_engine
from sglightning.engines.base import Engine, RunContext
from sglightning.envs.base import TextEnv
from sglightning.episodes import Episode, RolloutBatch
from sglightning.errors import ConfigError, EngineError, memory_error_within, out_of_memory, summary
from sglightning.grpo import GRPOConfig
from sglightning.guidance import GuidanceConfig
from sglightning.memory import PhasePeak
from sglightning.metrics import DASHBOARD
from sglightning.models import PolicyConfig, base_signature
from sglightning.optimisation import take_config_settings
from sglightning.preemption import PreemptionCheckpoint, agree_on_sigterm, sigterm_check
from sglightning.profiling import markdown, phase, prepare_for_cuda_graphs, recording, summarise
from sglightning.report import fit_summary, run_settings, trajectory_markdown, write_validation_report
from sglightning.rollout import Rollout, RolloutAborted


class RolloutCallback(Callback):
    """Collects the group samples with self-guidance: owns the generation engine and the rollout on it (one env
    worker per episode slot), chooses each step's task seeds, plays the episodes on the current adapters and puts
    them on the batch — ``batch.rollout`` before ``training_step``, ``batch.rollouts[mode]`` before
    ``validation_step``.  Also logs one trajectory per step as text.

    The engine's lifecycle is the same whichever it is: ``start`` at setup, ``sampling`` around every rollout (given
    the weights about to sample and their version), ``close`` at teardown.

    ``informative(episodes)`` names the groups whose blended returns differ (dynamic sampling keeps those; the
    module judges them with the step's λ)."""

    def __init__(
        self,
        rollout: RolloutConfig,
        evaluation: EvalConfig,
        guidance: GuidanceConfig,
        env_factory: Callable[[], TextEnv],
        *,
        engine: Engine | None = None,
        chat_template_kwargs: dict | None = None,
        informative: Callable[[Sequence[Episode]], set[int]] | None = None,
        text_every_n_steps: int = 1,
        policy: PolicyConfig | None = None,
        grpo: GRPOConfig | None = None,
    ):
        """``engine``: generates the episodes (default: the in-process engine); ``policy`` names the base model an
        external engine serves; with ``grpo`` the engine checks what it cannot serve (:meth:`Engine.check`) at setup,
        before it starts (the CLI checks earlier, a plain ``Trainer.fit`` there)."""
        self.rollout_cfg, self.eval_cfg, self.guidance_cfg = rollout, evaluation, guidance
        self.env_factory, self.chat_template_kwargs = env_factory, chat_template_kwargs
        self.informative = informative
        self.text_every_n_steps = text_every_n_steps
        self.engine = engine if engine is not None else make_engine()
        self.policy_cfg, self.grpo_cfg = policy, grpo
        self.rollout: Rollout | None = None

    def rollout_for(self, pl_module: LightningModule) -> Rollout:
        """The rollout on ``pl_module``'s policy and this callback's engine (built at first use, kept until
        teardown)."""
        if self.rollout is None:
            self.rollout = Rollout(pl_module.peft_model, pl_module.tokenizer, self.env_factory, self.guidance_cfg,
                                   self.rollout_cfg, chat_template_kwargs=self.chat_template_kwargs,
                                   engine=self.engine)
            # the model, tokenizer and libraries are loaded and live as long as the run: keep the garbage collector
            # from scanning their ~500 k objects at every collection a rollout's allocations trigger (0.39 -> 0.06 s
            # of a 128-episode tiny-model rollout; on a GPU that time is the rollout's own order)
            gc.freeze()
        return self.rollout

    # ------------------------------------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.grpo_cfg is not None:
            self.engine.check(self.policy_cfg or PolicyConfig(), self.rollout_cfg, self.grpo_cfg)
        self.engine.start(RunContext(rank=trainer.global_rank, world_size=trainer.world_size, policy=self.policy_cfg,
                                     max_context_tokens=self.rollout_cfg.max_context_tokens, nodes=trainer.num_nodes,
                                     device=str(trainer.strategy.root_device)))

    @contextlib.contextmanager
    def _sampling(self, pl_module: LightningModule):
        """The engine samples with the module's current weights inside (every rank: it may gather or sync).

        Never in inference mode, which a standalone ``validate`` enters (fit's validations do not): FSDP2's gather
        buffers made there fail on a GPU ("Inference tensors do not track version counter"), a pooled slot cache made
        there refuses later writes, and a compiled decode step would be compiled once more for it.

        In eval mode: the policy acts without dropout (training rollouts ran in the update's train mode before), and
        training and validation rollouts run the same traced decode step (torch guards the mode: a second graph)."""
        model = pl_module.peft_model
        training = model.training
        model.eval()
        try:
            with (torch.inference_mode(False), torch.no_grad(),
                  self.engine.sampling(TrainerWeights(pl_module)) as synced):
                yield synced
        finally:
            model.train(training)

    def _play(self, pl_module: LightningModule, seeds, **kw) -> RolloutBatch:
        """One rollout of ``seeds`` on the current weights; the engine's numbers (an adapter sync) in its stats."""
        with self._sampling(pl_module) as synced:
            rb = _agreed(lambda: self.rollout_for(pl_module).run(seeds, policy_version=self.engine.version, **kw))
        rb.engine_counts.update(synced)
        return rb

    def collect(self, pl_module: LightningModule, trainer: Trainer | None = None) -> RolloutBatch:
        """Play this step's groups (step = the module's ``rollouts_done``) on this rank's task seeds."""
        cfg = self.rollout_cfg
        step = pl_module.rollouts_done
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        seeds = task_seeds(cfg.seed, step, cfg.groups_per_step, rank, world, self.eval_cfg.seed_offset)
        gen = sampling_generator(cfg.seed, step, rank, device=pl_module.device)
        stop = sigterm_check(trainer)
        peak = PhasePeak(pl_module.device)
        peak.start()
        rb = self._play(pl_module, seeds, generator=gen, should_stop=stop)
        for extra_round in range(1, cfg.dynamic_sampling_rounds + 1):
            if not self._top_up(pl_module, rb, step, extra_round, rank, world, stop):
                break
        rb.peak_memory = peak.read("rollout")
        return rb

    def _top_up(self, pl_module, rb: RolloutBatch, step: int, extra_round: int, rank: int, world: int, stop) -> bool:
        """One round of dynamic sampling: play new tasks for the informative groups this rank still misses and add
        the informative ones.  Every rank takes part while any rank misses groups (under FSDP gathering the weights
        for generation is a collective).  Returns whether the round ran."""
        cfg = self.rollout_cfg
        if self.informative is None:
            raise RuntimeError("rollout.dynamic_sampling_rounds needs RolloutCallback(informative=...)")
        missing = max(0, cfg.groups_per_step - len(self.informative(rb.episodes)))
        most = distributed.all_reduce(torch.tensor([float(missing)], device=pl_module.device),
                                      op=torch.distributed.ReduceOp.MAX)
        if float(most.item()) == 0:
            return False
        if rb.first_round is None:  # on every rank, topped up or not: each logs dynamic_sampling/… for its batch
            rb.first_round = len(rb.episodes)
        # a seed stream of its own per round (still below the evaluation seeds), sliced by rank like the first
        seeds = task_seeds(cfg.seed + 1_000_033 * extra_round, step, cfg.groups_per_step, rank, world,
                           self.eval_cfg.seed_offset)[:missing]
        gen = sampling_generator(cfg.seed, step, rank, salt=2 + extra_round, device=pl_module.device)
        with self._sampling(pl_module):
            more = _agreed(lambda: self.rollout_for(pl_module).run(
                seeds, generator=gen, policy_version=self.engine.version, should_stop=stop) if seeds else None)
            if more is not None:
                found = self.informative(more.episodes)
                rb.add_groups(more, set(sorted(found)[:missing]))
        return True

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if agree_on_sigterm(trainer, pl_module.device):
            raise SIGTERMException()  # every rank, here, before this step's rollout
        try:
            with phase("rollout"):
                batch.rollout = self.collect(pl_module, trainer)
        except RolloutAborted:
            # SIGTERM during the rollout: abandon this step (nothing was updated yet); PreemptionCheckpoint saves
            raise SIGTERMException() from None
        except EngineError as err:
            # the engine is gone: this step is abandoned (nothing was updated); the CLI says where the last whole
            # step is (a user's ModelCheckpoint may keep last.ckpt elsewhere, and step 1 has none)
            raise EngineError(f"{err}; step {pl_module.rollouts_done + 1} was abandoned") from None
        except torch.cuda.OutOfMemoryError as err:
            raise out_of_memory("rollout", err, pl_module.rollouts_done + 1) from None
        _none_started(batch.rollout, "rollout.split", self.rollout_cfg.split)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        rb, batch.rollout = batch.rollout, None  # free the buffers: nothing of a step outlives it
        if rb is None or not rb.episodes or (pl_module.rollouts_done - 1) % self.text_every_n_steps:
            return
        # show a successful episode when there is one (more informative), else the first
        ep = next((e for e in rb.episodes if e.won), rb.episodes[0])
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text("rollout/trajectory", trajectory_markdown(ep), pl_module.global_step)

    def on_validation_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int, dataloader_idx: int = 0
                                  ) -> None:
        """Play the batch's evaluation tasks in every configured guidance mode, on the same seeds."""
        if agree_on_sigterm(trainer, pl_module.device):
            raise SIGTERMException()  # every rank, here (ranks run equally many batches, padding ones included)
        cfg = self.eval_cfg
        for mode in cfg.modes:
            # entered on every rank, padding batches included: under FSDP gathering the weights is a collective
            with self._sampling(pl_module):
                if not batch.seeds:  # a padding batch (ranks run equally many batches): nothing to play
                    _agreed(lambda: None)  # but the exchange after each rollout, as every rank
                    batch.rollouts[mode] = RolloutBatch(episodes=[])
                    continue
                # seeded by evaluation.seed and the batch's first task, not by the training seed, the batch index
                # or the rank: a batch plays the same draws on any number of processes; on the model's device
                gen = sampling_generator(cfg.seed, 10_000_000 + int(batch.seeds[0]), 0, salt=1,
                                         device=pl_module.device)
                peak = PhasePeak(pl_module.device)
                peak.start()
                try:
                    batch.rollouts[mode] = _agreed(lambda m=mode, g=gen: self.rollout_for(pl_module).run(
                        batch.seeds, group_size=cfg.episodes_per_task, temperature=cfg.temperature,
                        guided=m == "sg", generator=g, split=cfg.split, should_stop=sigterm_check(trainer),
                        policy_version=self.engine.version))
                except torch.cuda.OutOfMemoryError as err:
                    raise out_of_memory("validation", err, pl_module.rollouts_done) from None
                except RolloutAborted:
                    # SIGTERM mid-evaluation: stop within a round rather than play the batch out.  In fit the saved
                    # checkpoint has this validation pending (Lightning runs it again on resume); a standalone
                    # validate stops with nothing reported (PreemptionCheckpoint says so)
                    raise SIGTERMException() from None
                batch.rollouts[mode].peak_memory = peak.read("validation")
            _none_started(batch.rollouts[mode], "evaluation.split", cfg.split)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        try:
            if self.rollout is not None:
                self.rollout.close()  # every env worker (JVMs included)
                self.rollout = None
                gc.unfreeze()  # what rollout_for froze can go: a second fit in this process would find it alive
        finally:
            self.engine.close()  # e.g. a vLLM server's whole process group, when this process launched it

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "exception")


def _agreed(run: Callable[[], Any]) -> Any:
    """``run()`` (a rollout) on every rank; an error on any rank ends it on every rank, after one exchange
    (:func:`distributed.first_failure`): raised on one rank alone, it left the others at their next collective until
    the process group timed out.  The failing rank raises its own error; the others an :class:`EngineError` saying
    it, or an out-of-memory error for one (so their line names the keys that shrink it too)."""
    failure = own = None
    try:
        result = run()
    except Exception as err:  # noqa: BLE001 - whatever it is, the other ranks must learn of it
        own, result = err, None
        kind = "engine" if isinstance(err, EngineError) else "memory" if memory_error_within(err) else "error"
        failure = (kind, str(err) if kind == "engine" else f"rank {distributed.rank()}'s rollout: {summary(err)}")
    failure = distributed.first_failure(failure)
    if own is not None:
        raise own
    if failure is not None:
        kind, text = failure
        raise torch.cuda.OutOfMemoryError(text) if kind == "memory" else EngineError(text)
    return result


class AdapterExport(Callback):
    """Writes the peft adapter (``PeftModel.from_pretrained`` format) to ``<run dir>/adapter`` atomically, at every
    checkpoint save and at the end of fit."""

    def __init__(self, dirname: str = "adapter"):
        self.dirname = dirname
        self.last_export: Path | None = None  # where the adapter was last written (rank 0)

    def export(self, trainer: Trainer, pl_module: LightningModule) -> Path | None:
        if pl_module.policy is None or trainer.fast_dev_run:  # fast_dev_run writes nothing
            return None
        if trainer.global_rank != 0 and pl_module.sharding is None:
            return None  # only rank 0 writes; under FSDP the others still take part in the gather below
        # the adapter as full tensors (under FSDP a gather of the small adapter shards: a collective on every rank)
        # names as in the module tree: peft finds the adapter's entries by walking that tree (FSDP1 wrappers included)
        state = pl_module.adapter_state_dict(tree_names=True)
        if trainer.global_rank != 0:
            return None
        target = run_dir(trainer) / self.dirname
        target.parent.mkdir(parents=True, exist_ok=True)
        recover_folder(target)  # a killed export's leftovers (its .old made every later export fail)
        tmp = Path(tempfile.mkdtemp(prefix=f".{self.dirname}-", dir=target.parent))
        try:
            write_adapter(pl_module, state, tmp)
            readable_as_made(tmp)  # mkdtemp's folder (and safetensors' file) are the owner's only
            swap_in_folder(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.last_export = target
        return target

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.export(trainer, pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.export(trainer, pl_module)


class FitSummary(Callback):
    """Prints :func:`sglightning.report.fit_summary` when fit ends (rank 0): the module's per-step logs, its
    validations before and after training, where TensorBoard and the adapter are.  The last validation's report goes
    to the run folder (``validation_report.json`` and ``.md``, as ``sglightning validate`` writes it)."""

    @rank_zero_only
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        export = next((c for c in trainer.callbacks if isinstance(c, AdapterExport)), None)
        report = getattr(pl_module, "val_report", None)
        path = None
        if report is not None and not trainer.fast_dev_run:  # the last validation of this fit (fast_dev_run: none)
            path, _ = write_validation_report(dict(report, config=run_settings(pl_module)), run_dir(trainer))
        board = next((lg.log_dir for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), None)
        print(fit_summary(pl_module.history, pl_module.skipped_updates, pl_module.val_report_before,
                          pl_module.val_report, board and Path(board), export.last_export if export else None, path,
                          [t.name for t in pl_module.reward_terms],  # distinct: the module refused twins
                          pl_module.grpo_cfg.ppo_epochs))


class Dashboard(Callback):
    """Gives every TensorBoard logger the Custom Scalars layout :data:`sglightning.metrics.DASHBOARD` (rank 0, once a
    run): success, trust, labels, collapse signs and cost, several keys to a chart, in TensorBoard's Custom Scalars
    tab.  The Scalars tab keeps one chart a key, as before."""

    @rank_zero_only
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        layout = {category: {title: ["Multiline", tags] for title, tags in charts.items()}
                  for category, charts in DASHBOARD.items()}
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_custom_scalars(layout)


class StepProfile(Callback):
    """Profiles one training step, its rollout and its update, and says where the time went: per phase, the calls,
    the wall time and the device time (:mod:`sglightning.profiling`).  Add it to a run with
    ``--trainer.callbacks+=sglightning.callbacks.StepProfile``.  Rank 0 prints the phase table when fit ends; each rank
    writes ``profile-step<N>.md`` and ``.json`` to the run directory (``-rank<r>`` added when there are several).

    Args:
        step: the training step to profile, counted from 1 as the progress line counts (step 1 compiles and warms up).
        trace: also write torch's Chrome trace, ``profile-step<N>.trace.json`` (tens of MB for a long rollout).
        top: how many kernels and host operations the written profile lists.
    """

    def __init__(self, step: int = 2, trace: bool = False, top: int = 10):
        if step < 1:
            raise ConfigError(f"StepProfile.step: {step} is not a training step (they count from 1)")
        self.step, self.trace, self.top = step, trace, top
        self.summary: dict | None = None  # the profiled step's numbers (sglightning.profiling.summarise)
        self.path: Path | None = None  # the written Markdown
        self.error: str | None = None  # why the step could not be profiled
        self._recording = None
        self._prof = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # the profile must start before the rollout does, in the same hook: run before the rollout callback (moving
        # self to an earlier index keeps Lightning's loop over the list from skipping or repeating a callback)
        cbs = trainer.callbacks
        rollout = next((i for i, c in enumerate(cbs) if isinstance(c, RolloutCallback)), None)
        if rollout is not None and rollout < cbs.index(self):
            cbs.remove(self)
            cbs.insert(rollout, self)
        if trainer.strategy.root_device.type == "cuda":
            prepare_for_cuda_graphs()  # before the decode step's graphs are captured

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._recording is None and self.summary is None and self.error is None \
                and _steps_done(trainer, pl_module) + 1 == self.step:
            try:  # a profiler that cannot start (e.g. no access to the GPU's counters) costs the profile, not the run
                self._recording = recording(cuda=pl_module.device.type == "cuda")
                self._prof = self._recording.__enter__()
            except Exception as err:  # noqa: BLE001 - any failure of the profiler is reported, once, at fit end
                self._recording, self.error = None, f"{type(err).__name__}: {err}"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._recording is None:
            return
        try:
            self._stop()
            self._write(trainer, pl_module, summarise(self._prof, self.top))
        except Exception as err:  # noqa: BLE001 - as above: the run goes on without its profile
            self.error = f"{type(err).__name__}: {err}"
        finally:
            self._prof = None

    def _write(self, trainer: Trainer, pl_module: LightningModule, summary: dict) -> None:
        self.summary = summary
        if trainer.fast_dev_run:  # a trial writes nothing (as Lightning): the table is printed at fit end only
            return
        name = f"profile-step{self.step}" + (f"-rank{trainer.global_rank}" if trainer.world_size > 1 else "")
        folder = run_dir(trainer)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{name}.md"
        path.write_text(markdown(summary, self._title(pl_module)))
        (folder / f"{name}.json").write_text(json.dumps(summary, indent=1))
        if self.trace:
            self._prof.export_chrome_trace(str(folder / f"{name}.trace.json"))
        self.path = path

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self._recording is not None:  # the profiler must not outlive the step (nothing is written: it did not end)
            with contextlib.suppress(Exception):  # and must not hide the run's own exception
                self._stop()

    @rank_zero_only
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.error is not None:
            print(f"StepProfile: step {self.step} could not be profiled ({self.error}); the run was not affected")
            return
        if self.summary is None:
            print(f"StepProfile: step {self.step} did not run (this fit ended after step "
                  f"{_steps_done(trainer, pl_module)}); nothing was profiled")
            return
        where = f"(the whole profile: {self.path})" if self.path else "(fast_dev_run: no profile written)"
        print(markdown(self.summary, self._title(pl_module), details=False) + where)

    def _stop(self) -> None:
        recording_, self._recording = self._recording, None
        recording_.__exit__(None, None, None)  # the profiler stops even if this raises: _recording is already None

    def _title(self, pl_module: LightningModule) -> str:
        dev = pl_module.device
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
        return f"Profile of training step {self.step} ({dev.type}: {name})"


def _steps_done(trainer: Trainer, pl_module: LightningModule) -> int:
    """Training steps done (rollouts, not optimiser steps: ``grpo.ppo_epochs`` may take several per rollout)."""
    return int(getattr(pl_module, "rollouts_done", trainer.global_step))


def _none_started(rb: RolloutBatch, key: str, split: str) -> None:
    """Every episode of a batch failed in ``reset``, on several tasks, not by timing out: the split has no playable
    tasks (e.g. ALFWorld's valid_unseen when only train games were downloaded) — a configuration problem.  One task
    (a group shares its seed: ``groups_per_step`` 1, a last validation batch of one) or timeouts can be bad luck: those
    episodes fail, and the run goes on."""
    eps = rb.episodes
    if (eps and len({e.seed for e in eps}) > 1
            and all(e.error is not None and e.error.startswith("reset") and "timeout" not in e.error for e in eps)):
        raise ConfigError(f"{key}: no episode of split {split!r} could start ({len(eps)} tried); the environment said: "
                          f"{eps[0].error}")


def write_adapter(pl_module: LightningModule, state: dict[str, torch.Tensor], folder: Path) -> None:
    """The adapter ``state`` (full tensors, module-tree names) as a peft folder (``PeftModel.from_pretrained``, a vLLM
    server's ``load_lora_adapter``), with ``sglightning.json``: the step and the base model's shape."""
    folder.mkdir(parents=True, exist_ok=True)
    pl_module.peft_model.save_pretrained(folder, state_dict=state)
    _strip_wrapper_names(folder / "adapter_model.safetensors", pl_module.peft_model.active_adapter)
    (folder / "sglightning.json").write_text(json.dumps({
        "global_step": int(pl_module.global_step), "rollouts_done": pl_module.rollouts_done,
        "base_model": {"name_or_path": pl_module.policy_cfg.name_or_path,
                       **base_signature(pl_module.peft_model.get_base_model())},
    }))


class TrainerWeights:
    """The module's policy as an engine sees it (:class:`~sglightning.engines.base.Weights`): its version (the
    optimiser steps taken), the model, the whole weights while gathered, the adapter as a folder, a probe's
    log-probs."""

    def __init__(self, pl_module: LightningModule):
        self.module = pl_module
        self.version = int(pl_module.global_step)
        self.model = pl_module.peft_model
        self.tokenizer = pl_module.tokenizer
        self.sharding = pl_module.sharding

    def gathered(self):
        return self.module.generation_weights()

    def adapter_state(self) -> dict[str, torch.Tensor]:
        return self.module.adapter_state_dict(tree_names=True)

    def write_adapter(self, state: dict[str, torch.Tensor], folder) -> None:
        write_adapter(self.module, state, Path(folder))

    def probe_logprobs(self, ids: list[int]) -> list[float | None]:
        return trainer_probe_logprobs(self.module, ids)


@torch.no_grad()
def trainer_probe_logprobs(pl_module: LightningModule, ids: list[int]) -> list[float | None]:
    """Log π(ids[i] | ids[:i]) under the trainer's current weights (temperature 1, unrestricted); None for the first
    token (the sync's reference)."""
    x = torch.tensor([ids], dtype=torch.long, device=pl_module.device)  # [1, L]
    attn = torch.ones_like(x)
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[:, 0] = False
    logp, _ = pl_module.token_logprobs(x, attn, mask, 1.0)  # [1, L]
    return [None] + [float(v) for v in logp[0, 1:].cpu()]


def _strip_wrapper_names(path: Path, adapter: str) -> None:
    """Rewrite a saved adapter whose keys still carry FSDP1 / activation-checkpointing wrapper names under the plain
    names ``PeftModel.from_pretrained`` expects.  peft finds the adapter's entries by walking the module tree, so it
    must be given the tree's names; it then drops the adapter name only where it ends the module path, which a
    wrapper (``lora_A.default._fsdp_wrapped_module.weight``) hides: both are undone here."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if not path.is_file():
        return
    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
        if all(clean_name(k) == k for k in keys):
            return
        meta = f.metadata()
        tensors = {}
        for k in keys:
            plain = clean_name(k)
            tensors[plain.replace(f".{adapter}.", ".") if plain != k else k] = f.get_tensor(k)
    save_file(tensors, str(path), metadata=meta)


class LastCheckpoint(Checkpoint):
    """``last.ckpt`` in the run's ``checkpoints`` folder after every step, beside a user's own ModelCheckpoint that
    keeps none (monitoring a metric, say).  Not a ModelCheckpoint: one returned by the module would replace the
    user's (Lightning's rule for callbacks of one type)."""

    save_last, dirpath = True, None  # read as a ModelCheckpoint's: this one keeps last.ckpt, in the run's folder

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.path = trainer.strategy.broadcast(str(PreemptionCheckpoint.last_path(trainer)))  # rank 0's

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args) -> None:
        if not trainer.fast_dev_run and not trainer.sanity_checking:
            trainer.save_checkpoint(self.path, weights_only=False)


def _as_made(ckpt: Callback) -> bool:
    """Whether ``ckpt`` is a ModelCheckpoint as ``ModelCheckpoint()`` makes it (Lightning's default), not one a user
    set up (a metric, a folder, a cadence, a file name)."""
    fresh = ModelCheckpoint()
    names = list(inspect.signature(ModelCheckpoint.__init__).parameters)[1:]  # every setting (save_on_exception…)

    def setting(c: Callback, name: str) -> Any:
        return getattr(c, name) if hasattr(c, name) else getattr(c, "_" + name, None)

    return type(ckpt) is ModelCheckpoint and all(setting(ckpt, n) == setting(fresh, n) for n in names)


class ConfiguredOptimiser(Callback):
    """A resume trains with the config's optimiser settings: torch's ``load_state_dict`` puts back the checkpoint's
    learning rate, weight decay, betas…, so a changed ``model.optimizer`` was silently ignored.  The moments and a
    schedule's progress stay the checkpoint's (:func:`sglightning.optimisation.take_config_settings`); one line names
    each setting that changed."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        factory = getattr(pl_module, "optimizer_factory", None)
        if trainer.ckpt_path is None or factory is None:
            return
        wanted = factory([torch.nn.Parameter(torch.zeros(1))]).defaults
        schedules = [c.scheduler for c in trainer.lr_scheduler_configs]
        changed = take_config_settings(trainer.optimizers, schedules, wanted)
        if changed and trainer.global_rank == 0:
            said = ", ".join(f"{k} {new} (the checkpoint's {old})" for k, (old, new) in changed.items())
            print(f"sglightning: resumed with the config's optimiser settings: {said}", file=sys.stderr, flush=True)


def default_callbacks(trainer: Trainer | None, rollout: RolloutCallback) -> list[Callback]:
    """The callbacks every run gets (``SelfGuideModule.configure_callbacks``; the one list, for the CLI and for a
    plain ``Trainer`` alike): ``rollout``, adapter export, preemption checkpoints, the summary,
    :class:`ConfiguredOptimiser` and the TensorBoard :class:`Dashboard` — those the trainer does not have yet (e.g.
    ``validate`` after ``fit``: kept) — and ``last.ckpt`` after every step (adapters, optimiser, counters: a killed or
    preempted run loses at most one step; ``--ckpt_path last`` resumes): a ModelCheckpoint in place of Lightning's
    default, or :class:`LastCheckpoint` beside a user's own that keeps no ``last.ckpt``; none in ``fast_dev_run``.
    (The CLI also gives the Trainer its one progress bar, :class:`sglightning.console.StepProgressBar`, unless the
    user gives one.)"""
    present = {type(c) for c in trainer.callbacks} if trainer is not None else set()
    callbacks: list[Callback] = [rollout] if RolloutCallback not in present else []
    callbacks += [cb() for cb in (AdapterExport, PreemptionCheckpoint, FitSummary, ConfiguredOptimiser, Dashboard)
                  if cb not in present]
    ckpts = [c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)] if trainer is not None else []
    if ckpts and not any(c.save_last for c in ckpts) and not trainer.fast_dev_run:  # fast_dev_run saves nothing
        lightnings = len(ckpts) == 1 and _as_made(ckpts[0])  # a ModelCheckpoint here would replace every one
        callbacks.append(ModelCheckpoint(save_last=True, save_top_k=0, every_n_train_steps=1) if lightnings
                         else LastCheckpoint())  # beside a user's own, which keeps no last.ckpt
    return callbacks
