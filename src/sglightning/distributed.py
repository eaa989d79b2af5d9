"""Distributed plumbing for the update and the rollouts, as functions of explicit arguments (torch only: no Lightning).

* **Which sharding** — the functions take ``sharding``: ``"fsdp2"``, ``"fsdp1"`` or ``None`` (one device, DDP), as
  :func:`sglightning.strategies.sharding_of` reads it off the Lightning strategy (this file imports no Lightning).
* **Sharding the policy** — :func:`apply_fully_shard` (FSDP2: every decoder layer, then the root) and
  :func:`wrap_fsdp1` (FSDP1 units: decoder layers, LoRA linears, root).
* **Rollouts on whole weights** — :func:`generation_weights`: ranks decode different numbers of tokens, so the
  per-forward all-gathers of FSDP would deadlock; the weights are gathered once per rollout instead.
* **The update across ranks** — :func:`all_reduce`, :func:`no_sync`, :func:`sync_grads` (DDP: one explicit all-reduce
  of the token-weighted gradients, since ranks run different numbers of micro-batches), :func:`dummy_microbatches`
  (FSDP: every rank runs as many forward/backward passes), :func:`reduce_logs` (counts summed, the rest averaged).
* **The adapter as full tensors** — :func:`adapter_state_dict` (gathered under FSDP: a collective).
* **The end of a distributed process** — :func:`release_process_group`, then
  :func:`sglightning.errors.exit_process`: a normal exit's work, but no interpreter teardown (where gloo's threads
  can abort a run that succeeded).

Rule: every collective here runs on every rank in the same order.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch

from sglightning import memory
from sglightning.errors import ConfigError


def clean_name(name: str) -> str:
    """A parameter name without the wrapper prefixes FSDP1 and activation checkpointing insert."""
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def refuse_tensor_parallel(tp: int) -> None:
    if tp > 1:
        raise ConfigError(
            f"trainer.strategy: tensor_parallel_size={tp}, but this trainer only shards with FSDP2 over the data-"
            f"parallel dimension (no tensor-parallel plan); use sglightning.strategies.FSDP2Strategy, or "
            f"ModelParallelStrategy with data_parallel_size=<all processes> and tensor_parallel_size=1"
        )


def process_group_up() -> bool:
    """A process group exists, whatever its size (FSDP2 makes one on a single device)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def is_distributed() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


_GROUP_RELEASED = False  # this process destroyed a process group (see exit_process)


def release_process_group() -> None:
    """Destroy every process group, if one is up, while the interpreter is whole (Lightning leaves them up)."""
    global _GROUP_RELEASED
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        _GROUP_RELEASED = True
        with contextlib.suppress(Exception):  # a peer already gone: nothing left to release cleanly
            dist.destroy_process_group()


def group_was_released() -> bool:
    """This process ran a process group, now destroyed (:func:`release_process_group`)."""
    return _GROUP_RELEASED


def all_reduce(x: torch.Tensor, op=None) -> torch.Tensor:
    """Sum (or ``op``) over ranks, in place; a no-op outside distributed runs."""
    if is_distributed():
        torch.distributed.all_reduce(x, op=op or torch.distributed.ReduceOp.SUM)
    return x


def no_sync(wrapped_model: Any):
    """Backward without DDP's own gradient hooks (``wrapped_model``: the strategy's model): ranks run different
    numbers of micro-batches, so the gradients are summed once, explicitly, after the local passes
    (:func:`sync_grads`)."""
    if hasattr(wrapped_model, "no_sync") and is_distributed():
        return wrapped_model.no_sync()
    return contextlib.nullcontext()


def sync_grads(params: list[torch.nn.Parameter]) -> None:
    """Σ over ranks of every trainable gradient (each rank's loss is already weighted by its share of the global
    token count, so the sum is the gradient of the global token-mean loss).  One flat all-reduce, which also counts
    the ranks that have each gradient: one that no rank has stays None (the optimiser leaves it, as on one device;
    zeros would move it by its momentum and weight decay)."""
    if not is_distributed():
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    has = torch.tensor([p.grad is not None for p in params], dtype=grads[0].dtype, device=grads[0].device)  # [P]
    flat = torch.cat([g.reshape(-1) for g in grads] + [has])
    all_reduce(flat)
    offset, present = 0, (flat[-len(params):] > 0).tolist()
    for p, g, kept in zip(params, grads, present):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(g).clone() if kept else None
        offset += n


def collective_device(fallback: torch.device) -> torch.device:
    """Where a small tensor for a collective must live: the current CUDA device under NCCL (FSDP1's CPU offload
    keeps the parameters on the CPU, and NCCL refuses CPU tensors), else ``fallback``."""
    if is_distributed() and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return fallback


def prefix_sharing(setting: bool | None, sharding: str | None, gradient_checkpointing: bool,
                   sliding: bool = False, head_exact: bool = True) -> bool:
    """``update.share_prefix`` resolved for ``sharding`` (``"fsdp2"``, ``"fsdp1"`` or None), gradient checkpointing,
    ``sliding`` (the model has sliding-window layers: :func:`traits.sliding_window`) and ``head_exact``
    (:func:`traits.head_is_exact`): null = on where it holds, true where it cannot hold = ``ConfigError``."""
    why = None
    if sharding is not None:
        why = "FSDP gathers the weights in each root forward; a shared prefix needs two forwards per micro-batch"
    elif gradient_checkpointing:
        why = "gradient checkpointing turns off the KV cache that the continuations attend through"
    elif sliding:
        why = "the model's sliding-window layers count cache slots, and a padded prefix would shift their window"
    elif not head_exact:
        why = "the model changes its logits in a way the decoder-only scoring does not know; it is scored whole"
    if why and setting:
        raise ConfigError(f"update.share_prefix: true is not supported here ({why}); set it to null or false")
    return setting is not False and why is None


def finish_gradients(policy: torch.nn.Module, params: list[torch.nn.Parameter], sharding: str | None, finite: bool,
                     max_norm: float, scaler=None) -> tuple[bool, torch.Tensor | None]:
    """After the step's backward passes: agree across ranks whether every rank's loss was finite (skip together or
    update together), sum the DDP gradients (FSDP reduced them in its backward), then take the total gradient norm and
    clip it to ``max_norm`` in one pass.

    ``scaler``: :func:`loss_scaler`.  Its gradients still carry the loss scale s (Lightning unscales them inside the
    optimiser step, after this): their norm is clipped to ``max_norm`` · s, the same clip as on the true gradients.
    Returns (update?, the true grad norm): the norm is None where a loss was not finite, and not finite where a
    gradient was not (under a loss scale, an overflow)."""
    if is_distributed():
        flag = all_reduce(torch.tensor([1.0 if finite else 0.0], device=collective_device(params[0].device)),
                          op=torch.distributed.ReduceOp.MIN)
        finite = bool(flag.item() == 1.0)
        if finite and sharding is None:
            sync_grads(params)
    if not finite:
        return False, None
    scale = 1.0
    if scaler is not None:  # its step needs a scale and gradients to check, even on a rank that ran no backward
        scaler.scale(torch.zeros((), device=params[0].device))  # sets its scale up; a no-op once it exists
        fill_missing_gradients(params)
        scale = scaler.get_scale()
    if sharding == "fsdp1":  # the norm over every rank's shards (a collective); clips in place
        grad_norm = policy.clip_grad_norm_(max_norm * scale)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm * scale)
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor norm over the shards
        grad_norm = grad_norm.full_tensor()
    grad_norm = grad_norm / scale
    return bool(torch.isfinite(grad_norm)), grad_norm


def loss_scaler(trainer) -> Any | None:
    """The gradient scaler of a ``16-mixed`` run (Lightning's precision plugin holds it; it scales each backward's
    loss and unscales the gradients inside the optimiser step), else None."""
    scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None) if trainer is not None else None
    return scaler if scaler is not None and scaler.is_enabled() else None


def fill_missing_gradients(params: list[torch.nn.Parameter]) -> None:
    """Zero gradients where the backward left none (the optimiser then steps every parameter, as with all rows)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def skip_optimiser_step(opt, params: list[torch.nn.Parameter], scaler) -> None:
    """The optimiser step of a skipped update (Lightning counts steps by it): no parameter or optimiser state moves.
    Without a loss scaler, gradients of None do it.  ``scaler``'s step checks the gradients first, and NaN ones make
    it skip (and halve its scale, as after an overflow); a scaler that has scaled nothing sets its scale up first."""
    opt.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.scale(torch.zeros((), device=params[0].device))  # sets its scale up; a no-op once it exists
        for p in params:
            p.grad = torch.full_like(p, float("nan"))
    opt.step()
    opt.zero_grad(set_to_none=True)


def extreme(key: str) -> Callable[..., float] | None:
    """How a logged key merges when it is not a mean: ``max`` for maxima (``…_max``, peak memory ``memory/…``),
    ``min`` for minima (``…_min``), None for the rest."""
    if key.startswith(memory.PREFIX) or key.endswith("_max"):
        return max
    return min if key.endswith("_min") else None


def reduce_logs(logs: dict[str, float], sum_keys: Iterable[str], world_size: int) -> dict[str, float]:
    """Merge the ranks' step logs (one ``all_gather_object``): keys in ``sum_keys`` summed, peak memory
    (``memory/…``) and maxima (``…_max``) the maximum over ranks, minima (``…_min``) the minimum, the rest averaged
    over the ranks that have them (episode means come from torchmetrics and are global already).  No key is
    dropped."""
    if not is_distributed():
        return logs
    sums = set(sum_keys)
    gathered: list[dict[str, float] | None] = [None] * world_size
    torch.distributed.all_gather_object(gathered, logs)
    merged: dict[str, float] = {}
    for key in sorted({k for g in gathered if g for k in g}):
        vals = [float(g[key]) for g in gathered if g and key in g]
        pick = extreme(key)
        merged[key] = sum(vals) if key in sums else pick(vals) if pick else sum(vals) / len(vals)
    return merged


def pool_weighted(sums: dict[str, float], weights: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """Weighted means pooled over ranks: each key's weighted sum and weight summed over the ranks that have it (maxima
    and minima, :func:`extreme`: the extreme value, weight 1).  So Σ_r s_r / Σ_r w_r weighs a rank by its tokens; an
    average of the ranks' means weighs a rank of 10 tokens as one of 1 000.  One ``all_gather_object``; the inputs
    themselves outside distributed runs.

    Args:
        sums: a key's weighted sum Σ v·w on this rank (for a maximum or minimum: the value).
        weights: the same key's Σ w on this rank.
    """
    if not is_distributed():
        return sums, weights
    gathered: list[tuple[dict, dict] | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, (sums, weights))
    pooled_sums: dict[str, float] = {}
    pooled_weights: dict[str, float] = {}
    for rank_sums, rank_weights in (g for g in gathered if g is not None):
        for key, value in rank_sums.items():
            pick = extreme(key)
            if key not in pooled_sums:
                pooled_sums[key], pooled_weights[key] = value, rank_weights[key]
            elif pick:
                pooled_sums[key] = pick(pooled_sums[key], value)
            else:
                pooled_sums[key] += value
                pooled_weights[key] += rank_weights[key]
    return pooled_sums, pooled_weights


def rank() -> int:
    """This process's rank (0 outside distributed runs)."""
    return torch.distributed.get_rank() if is_distributed() else 0


def first_failure(failure: Any | None) -> Any | None:
    """The first rank's ``failure`` (rank order; any picklable description), on every rank; None when no rank failed.
    One ``all_gather_object`` under several processes: a rank that raised alone would leave the others waiting at
    their next collective."""
    if not is_distributed():
        return failure
    failures = gather_objects([failure] if failure is not None else [], torch.distributed.get_world_size())
    return failures[0] if failures else None


def gather_objects(items: list, world_size: int) -> list:
    """Every rank's list, concatenated in rank order (one ``all_gather_object``); the list itself outside."""
    if not is_distributed():
        return items
    gathered: list[list | None] = [None] * world_size
    torch.distributed.all_gather_object(gathered, items)
    return [x for part in gathered if part for x in part]


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (one ``broadcast_object_list``); ``obj`` itself outside."""
    if not is_distributed():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    """Every rank waits here for the others (a no-op outside distributed runs)."""
    if is_distributed():
        torch.distributed.barrier()


def most_over_ranks(n: int, device) -> int:
    """The largest ``n`` over ranks (``n`` itself outside distributed runs)."""
    return int(all_reduce(torch.tensor([n], device=device), op=torch.distributed.ReduceOp.MAX).item())


def _dummy_input(device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 2-token row whose second token is scored: (ids, attn, mask), each [1, 2]."""
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    return ids, torch.ones_like(ids), torch.tensor([[False, True]], device=device)


def empty_forwards(n: int, score: Callable, device) -> None:
    """``n`` no-grad forward passes on a 2-token input: under FSDP every forward is a collective, so a rank with fewer
    micro-batches runs these while the others score.  ``score(ids, attn, mask)``."""
    if n <= 0:
        return
    ids, attn, m = _dummy_input(device)
    with torch.no_grad():
        for _ in range(n):
            score(ids, attn, m)


def dummy_microbatches(n: int, score: Callable, backward: Callable, device, with_ref: bool,
                       disable_adapter: Callable) -> None:
    """``n`` zero-weight forward/backward passes on a 2-token input (FSDP: keeps every rank's collectives in step).
    ``score(ids, attn, mask)`` returns (logp, _); ``backward(loss)``; ``disable_adapter()`` is the reference context."""
    if n <= 0:
        return
    ids, attn, m = _dummy_input(device)
    for _ in range(n):
        if with_ref:
            with torch.no_grad(), disable_adapter():
                score(ids, attn, m)
        logp, _ = score(ids, attn, m)
        backward(logp.sum() * 0.0)


# ---------------------------------------------------------------------------------------------------------- sharding
def unwrap(policy: torch.nn.Module) -> torch.nn.Module:
    """The peft model itself (under FSDP1 the policy is its ``FullyShardedDataParallel`` root wrapper)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return policy.module if isinstance(policy, FullyShardedDataParallel) else policy


def decoder_layers(peft_model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(peft_model.get_base_model().get_decoder().layers)


def apply_fully_shard(policy: torch.nn.Module, device_mesh) -> None:
    """FSDP2: shard every decoder layer, then the root (embeddings, final norm and LM head — tied or not — stay in the
    root unit).  Frozen base weights and LoRA weights are both sharded (FSDP2 shards per parameter).  A bf16 base with
    fp32 LoRA weights is gathered in the base's dtype (``MixedPrecisionPolicy``, gradients reduced in fp32), so the
    adapters keep fp32 master weights."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    names = device_mesh.mesh_dim_names or ()
    refuse_tensor_parallel(device_mesh["tensor_parallel"].size() if "tensor_parallel" in names else 1)
    kwargs: dict[str, Any] = {"mesh": device_mesh["data_parallel"]}
    if len({p.dtype for p in policy.parameters()}) > 1:
        frozen = {p.dtype for p in policy.parameters() if not p.requires_grad and p.is_floating_point()}
        compute = min(frozen, key=lambda d: torch.finfo(d).bits) if frozen else torch.float32
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    for layer in decoder_layers(policy):
        fully_shard(layer, **kwargs)
    fully_shard(policy, **kwargs)


def wrap_fsdp1(policy: torch.nn.Module, strategy: Any, world_size: int) -> torch.nn.Module:
    """FSDP1 (``FullyShardedDataParallel``) units: every decoder layer, every leaf module with trainable weights (the
    LoRA A/B linears: FSDP1 flattens a unit's parameters into one tensor, so frozen and trainable weights sharing a
    unit would give the frozen ones a gradient buffer and would need one dtype), and the root (the peft model:
    embeddings, final norm, LM head).  Built here rather than by Lightning's ``auto_wrap_policy`` because the decoder
    layer class comes from the loaded model; the strategy's other settings (sharding strategy, mixed precision from
    ``trainer.precision``, CPU offload, its FSDP kwargs) are used as given.  Each rank keeps its own chunk of every
    flat parameter, so no initial broadcast is needed (the base comes from the same checkpoint; a chunk of any rank's
    adapter initialisation is a valid initialisation).  Returns the root wrapper."""
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import CustomPolicy

    base = policy.get_base_model()
    emb, out = base.get_input_embeddings(), base.get_output_embeddings()
    tied = emb is not None and out is not None and emb.weight is out.weight
    if tied and (world_size == 1 or strategy.sharding_strategy == ShardingStrategy.NO_SHARD):
        raise ConfigError(
            "trainer.strategy: FSDPStrategy without sharding (one process, or NO_SHARD) fails in torch's FSDP1 on "
            "this model's tied input/output embeddings; use 2+ processes with FULL_SHARD, FSDP2 "
            "(sglightning.strategies.FSDP2Strategy), or no strategy on one device"
        )
    layer_types = tuple({type(layer) for layer in decoder_layers(policy)})

    def unit(module: torch.nn.Module) -> bool:
        if isinstance(module, layer_types):
            return True
        own = list(module.parameters(recurse=False))
        return not list(module.children()) and bool(own) and all(p.requires_grad for p in own)

    kwargs = dict(strategy.kwargs)
    user_policy = kwargs.pop("auto_wrap_policy", None)
    strategy.kwargs.pop("auto_wrap_policy", None)  # applied here; Lightning would only warn it was ignored
    kwargs.setdefault("use_orig_params", True)
    mp = strategy.mixed_precision_config
    if mp is not None:  # units cast their inputs: peft hands the LoRA units fp32 inputs (its weights' dtype)
        mp = dataclasses.replace(mp, cast_forward_inputs=True)
    return FullyShardedDataParallel(
        policy,
        auto_wrap_policy=user_policy or CustomPolicy(unit),
        cpu_offload=strategy.cpu_offload,
        mixed_precision=mp,
        sharding_strategy=strategy.sharding_strategy,
        device_id=strategy.root_device,
        **kwargs,
    )


def fsdp1_shards(policy: torch.nn.Module) -> bool:
    """Whether FSDP1 actually shards: with one process (or ``NO_SHARD``) every rank holds whole weights, there is
    nothing to gather, and ``summon_full_params`` trips over tied weights."""
    from torch.distributed.fsdp import ShardingStrategy

    return policy.sharding_strategy != ShardingStrategy.NO_SHARD


def generation_weights(policy: torch.nn.Module, sharding: str | None):
    """Context for rollouts.  FSDP2: all-gather every unit once and keep it unsharded for the whole rollout (ranks
    decode different numbers of tokens, so per-forward all-gathers would deadlock); reshard after.  FSDP1: the same
    through ``summon_full_params`` (:func:`_fsdp1_full_weights`).  Cost: one full copy of the model per rank while
    generating.  A no-op elsewhere."""
    if sharding == "fsdp1":
        return _fsdp1_full_weights(policy)
    if sharding != "fsdp2":
        return contextlib.nullcontext()
    return _fsdp2_unsharded(policy)


@contextlib.contextmanager
def _fsdp2_unsharded(policy: torch.nn.Module):
    from torch.distributed.fsdp import FSDPModule

    mods = [m for m in policy.modules() if isinstance(m, FSDPModule)]
    for m in mods:  # collectives, in the same order on every rank
        m.unshard()
    policy.set_reshard_after_forward(False)
    try:
        yield
    finally:
        policy.set_reshard_after_forward(True)
        policy.set_reshard_after_forward(False, recurse=False)  # the root as fully_shard left it: unsharded after
        for m in mods:                                          # forward (else 1-2 more all-gathers per micro-batch)
            m.reshard()


@contextlib.contextmanager
def _fsdp1_full_weights(policy: torch.nn.Module):
    """FSDP1 rollouts: ``summon_full_params`` all-gathers every unit once (full precision, no write-back) and points
    the original parameters at the full tensors.  A unit's own ``forward`` would still all-gather inside that context
    (a collective per layer per decoded token, which deadlocks when ranks decode different lengths), so for the
    duration every unit's ``forward`` is the wrapped module's own (an instance attribute, removed after).  The rollout
    engine calls the peft model inside the root wrapper directly.  Without sharding (one process, ``NO_SHARD``) the
    weights are whole already: only the forwards are bypassed."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    units = [m for m in policy.modules() if isinstance(m, FullyShardedDataParallel) and m is not policy]
    gather = (FullyShardedDataParallel.summon_full_params(policy, writeback=False, recurse=True)
              if fsdp1_shards(policy) else contextlib.nullcontext())
    with gather:
        for u in units:
            u.__dict__["forward"] = u.module.forward
        try:
            yield
        finally:
            for u in units:
                u.__dict__.pop("forward", None)


def adapter_state_dict(policy: torch.nn.Module, sharding: str | None, tree_names: bool = False
                       ) -> dict[str, torch.Tensor]:
    """The trainable (adapter) weights as full CPU tensors, on every rank, under the peft model's parameter names
    (``tree_names``: as in the module tree, FSDP1 wrapper names included).  Under FSDP1/FSDP2 this gathers the
    shards: a collective, call it on every rank."""
    name = (lambda n: n) if tree_names else clean_name
    peft_model = unwrap(policy)
    if sharding == "fsdp1" and fsdp1_shards(policy):
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(policy, writeback=False, recurse=True):
            return {name(n): p.detach().cpu().clone() for n, p in peft_model.named_parameters() if p.requires_grad}
    return {name(n): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
            for n, p in peft_model.named_parameters() if p.requires_grad}
