"""Lightning strategies as this trainer uses them.

``FSDP2Strategy``: Lightning's ``ModelParallelStrategy`` as pure FSDP2 over every process.  Lightning's ``"auto"``
sizes put tensor parallelism inside a node and data parallelism across nodes (on one 8-GPU node: dp 1 × tp 8); this
trainer shards with FSDP2 over the data-parallel mesh only (``SelfGuideModule._apply_fully_shard``) and has no tensor
parallel plan, so here the data-parallel size is always the world size and the tensor-parallel size 1.
"""

from __future__ import annotations

from datetime import timedelta

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy


class FSDP2Strategy(ModelParallelStrategy):
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
