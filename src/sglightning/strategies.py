"""Lightning strategies as this trainer uses them, and the checks that read a configured strategy.

``sharding_of`` names what a strategy does to the policy (``"fsdp2"``, ``"fsdp1"`` or None: one device, DDP); the
Lightning-free code below (:mod:`sglightning.distributed`) takes that name, never the strategy.  ``check_quantization``
and ``check_tensor_parallel`` refuse what this trainer cannot run, before any process starts.

``FSDP2Strategy``: Lightning's ``ModelParallelStrategy`` as pure FSDP2 over every process, with adapter-only
distributed checkpoints.  ``FSDP1Strategy``: Lightning's ``FSDPStrategy`` with the same checkpoints.

* Sizes: Lightning's ``"auto"`` puts tensor parallelism inside a node and data parallelism across nodes (on one 8-GPU
  node: dp 1 × tp 8); this trainer shards with FSDP2 over the data-parallel mesh only
  (``SelfGuideModule._apply_fully_shard``) and has no tensor-parallel plan, so here the data-parallel size is always
  the world size and the tensor-parallel size 1.
* Checkpoints: ``last.ckpt/`` is written after every step.  Lightning's distributed checkpoint holds the whole sharded
  model (a 7B base: ~14 GB of bf16 per save) although the base is frozen and reloaded from ``name_or_path``;
  this strategy keeps only the trainable (adapter) weights plus the optimiser state and the loop metadata, and on
  load asks ``torch.distributed.checkpoint`` for exactly the model entries the checkpoint holds (so folders written
  by ``ModelParallelStrategy`` with the whole model load too).  A save goes to ``.last.ckpt.partial/`` and is
  swapped in by rank 0 once every rank has written its shard (``last.ckpt`` → ``.last.ckpt.old``, partial →
  ``last.ckpt``, old removed): a process killed mid-save leaves the previous checkpoint whole, and
  ``recover_swapped_checkpoints`` (run before ``--ckpt_path last`` is resolved) undoes a swap cut in half.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from sglightning.checkpointing import partial_of, recover_folder, restore_old, swap_in_folder
from sglightning.distributed import clean_name, refuse_tensor_parallel
from sglightning.errors import ConfigError

#: the file Lightning writes next to the shards with everything that is not a model or optimiser tensor
LOOP_STATE_FILE = "meta.pt"


def sharding_of(strategy: Any) -> str | None:
    """``"fsdp2"`` (``ModelParallelStrategy``, so :class:`FSDP2Strategy`), ``"fsdp1"`` (``FSDPStrategy``, so
    :class:`FSDP1Strategy`) or ``None`` (no strategy, one device, DDP)."""
    if isinstance(strategy, ModelParallelStrategy):
        return "fsdp2"
    if isinstance(strategy, FSDPStrategy):
        return "fsdp1"
    return None


def writes_distributed_checkpoint(strategy: Any) -> bool:
    """FSDP2 always, FSDP1 with ``state_dict_type: sharded``: one ``torch.distributed.checkpoint`` folder, which loads
    strictly (so it keeps the whole sharded model)."""
    sharding = sharding_of(strategy)
    return sharding == "fsdp2" or (sharding == "fsdp1" and getattr(strategy, "_state_dict_type", "") == "sharded")


def trainable_entries(state_dict: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """The entries of ``state_dict`` that are ``model``'s trainable (adapter) weights, wrapper names aside."""
    trainable = _trainable_keys(model)
    return {k: v for k, v in state_dict.items() if clean_name(k) in trainable}


def check_quantization(quantization: str | None, strategy: Any) -> None:
    """QLoRA under FSDP is refused (``ConfigError`` naming ``model.policy.quantization``)."""
    if quantization and sharding_of(strategy) is not None:
        raise ConfigError(
            f"model.policy.quantization: {quantization} under {type(strategy).__name__} "
            f"(QLoRA under FSDP) is not supported: on this project's checks bitsandbytes' 4-bit weights fail "
            f"under FSDP2 (in-place bias add on gathered weights during the update) and FSDP1 (integer storage "
            f"cannot be flattened). Use DDP with 4-bit (a 4-bit 7B base fits one 24 GB GPU), or FSDP with "
            f"quantization: null"
        )


def check_tensor_parallel(strategy: Any) -> None:
    """Lightning's ``ModelParallelStrategy`` with a tensor-parallel size above 1 — its ``"auto"`` default is one
    node's process count — is refused before any process starts (``ConfigError`` naming ``trainer.strategy``): this
    trainer has no tensor-parallel plan, and the run would otherwise replicate the model silently."""
    if not isinstance(strategy, ModelParallelStrategy):
        return
    tp = getattr(strategy, "_tensor_parallel_size", 1)
    if tp == "auto":  # Lightning's rule (ModelParallelStrategy.setup_environment): the processes of one node
        tp = len(getattr(strategy, "parallel_devices", None) or [None])
    refuse_tensor_parallel(int(tp))


class _AdapterCheckpoints:
    """Adapter-only distributed checkpoints, swapped in whole (see the module docstring), for a sharded strategy:
    ``_writes_shards`` says whether a save is a distributed folder, ``_load_shards`` reads the model and optimiser
    entries of one in place."""

    def _writes_shards(self) -> bool:
        raise NotImplementedError

    def _load_shards(self, path: Path) -> None:
        raise NotImplementedError

    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = super().lightning_module_state_dict()
        if not self._writes_shards():
            return state
        keep = _trainable_keys(self.model)
        return {k: v for k, v in state.items() if k in keep}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if not self._writes_shards():
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        _save_swapped(self, filepath, lambda partial: super(_AdapterCheckpoints, self).save_checkpoint(
            checkpoint, partial, storage_options))
        return None

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        if not (path.is_dir() and (path / LOOP_STATE_FILE).is_file()):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._load_shards(path)
        return torch.load(path / LOOP_STATE_FILE, weights_only=weights_only)


class FSDP2Strategy(_AdapterCheckpoints, ModelParallelStrategy):
    """FSDP2 (``fully_shard``) over all ``num_nodes × devices`` processes; see the module docstring."""

    def __init__(
        self,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # every process is one FSDP2 shard
        super().setup_environment()

    def _writes_shards(self) -> bool:
        return self._save_distributed_checkpoint

    def _load_shards(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        stored = _stored_keys(path, "state_dict.")
        model_state = {k: v for k, v in get_model_state_dict(self.model).items() if k in stored}
        _check_trainables(path, _trainable_keys(self.model), model_state.keys())
        state: dict[str, Any] = {"state_dict": model_state}
        dcp.load(state, checkpoint_id=path)  # into the (sharded) tensors of model_state, in place
        self.model.load_state_dict(state["state_dict"], strict=False)
        for idx, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{idx}"
            optim_state = {key: get_optimizer_state_dict(self.model, optimizer)}
            dcp.load(optim_state, checkpoint_id=path)
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=optim_state[key],
                                     options=StateDictOptions(cpu_offload=True))


def _save_swapped(strategy, filepath, write) -> None:
    """``write(partial)`` on every rank (each writes its shard, rank 0 the metadata), then rank 0 swaps the finished
    folder in (:func:`~sglightning.checkpointing.swap_in_folder`: ``X`` → ``.X.old``, ``.X.partial`` → ``X``, the old
    one removed).  Barriers around each phase."""
    path = Path(strategy.broadcast(str(filepath)))
    partial = partial_of(path)
    if strategy.global_rank == 0:
        recover_folder(path)  # a save that was cut off, in writing or in its swap
    strategy.barrier()
    write(partial)
    strategy.barrier()
    if strategy.global_rank == 0:
        swap_in_folder(partial, path)
    strategy.barrier()


def _trainable_keys(model: torch.nn.Module) -> set[str]:
    """State-dict names of the trainable (adapter) weights (FSDP1 wrapper names removed, as its state dicts do)."""
    return {clean_name(name) for name, p in model.named_parameters() if p.requires_grad}


def _stored_keys(path: Path, prefix: str) -> set[str]:
    """The entries under ``prefix`` (``"state_dict."``, ``"model."``) of a distributed checkpoint folder."""
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {k[len(prefix):] for k in keys if k.startswith(prefix)}


def _check_trainables(path: Path, trainable: set[str], found: set[str]) -> None:
    missing = trainable - found
    if missing:
        raise RuntimeError(f"{path}: the checkpoint has no entry for {len(missing)} trainable weights, e.g. "
                           f"{sorted(missing)[0]}")


def recover_swapped_checkpoints(checkpoint_dir: Path) -> list[Path]:
    """Undo a checkpoint-folder swap that a kill cut in half (``.X.old`` left, ``X`` gone): put ``X`` back
    (:func:`~sglightning.checkpointing.restore_old`, safe when every rank tries).  Returns the restored paths."""
    folder = Path(checkpoint_dir)
    return [target for old in folder.glob(".*.old") if restore_old(target := old.with_name(old.name[1:-len(".old")]))]


class FSDP1Strategy(_AdapterCheckpoints, FSDPStrategy):
    """Lightning's ``FSDPStrategy`` (FSDP1) with this trainer's checkpoints: with ``state_dict_type: sharded`` the
    ``last.ckpt/`` folder holds the adapter shards, their optimiser state and the loop metadata (the frozen base is
    reloaded from ``name_or_path``), is swapped in whole (as ``FSDP2Strategy``'s), and loading asks for
    exactly the model entries a folder holds (whole-model folders written by ``FSDPStrategy`` load too).  The FSDP
    units are built by ``SelfGuideModule._wrap_fsdp1``.  Being a subclass, it also passes Lightning's GPU-only check
    for ``FSDPStrategy``: torch's FSDP1 runs on CPU processes (gloo) as well, which is how CI runs it."""

    def _writes_shards(self) -> bool:
        return self._state_dict_type == "sharded"

    def _load_shards(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from lightning.pytorch.trainer.states import TrainerFn
        from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
        from torch.distributed.fsdp import (
            FullyShardedDataParallel,
            ShardedOptimStateDictConfig,
            ShardedStateDictConfig,
            StateDictType,
        )

        stored = _stored_keys(path, "model.")
        sharded = FullyShardedDataParallel.state_dict_type(
            self.model, StateDictType.SHARDED_STATE_DICT,
            ShardedStateDictConfig(offload_to_cpu=True), ShardedOptimStateDictConfig(offload_to_cpu=True),
        )
        with sharded:
            model_state = {k: v for k, v in self.model.state_dict().items() if k in stored}
            _check_trainables(path, _trainable_keys(self.model), model_state.keys())
            state = {"model": model_state}
            dcp.load(state, checkpoint_id=path)
            self.model.load_state_dict(state["model"], strict=False)
            if self.lightning_module.trainer.state.fn == TrainerFn.FITTING and self.optimizers:
                reader = dcp.FileSystemReader(str(path))
                for idx, optimizer in enumerate(self.optimizers):
                    key = f"optimizer_{idx}"
                    optim_state = load_sharded_optimizer_state_dict(
                        model_state_dict=state["model"], optimizer_key=key, storage_reader=reader)
                    optimizer.load_state_dict(FullyShardedDataParallel.optim_state_dict_to_load(
                        model=self.model, optim=optimizer, optim_state_dict=optim_state[key]))
