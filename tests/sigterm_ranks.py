"""Two gloo processes, no model: rank ``NOTED`` (argv[2]) receives a real SIGTERM through the handler that
sglightning installs in place of Lightning's, both ranks then run a collective (as the update's gradient all-reduce)
and meet at a stop point.  Each rank writes what it saw to OUT/rank{r}.json (argv[1]).  Run by
tests/test_distributed.py::test_sigterm_on_one_rank_stops_every_rank_at_the_same_point."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from processes import end_rank, join_gloo

from sglightning.preemption import agree_on_sigterm, install_sigterm_notifier


def _rank(rank: int, out: str, noted: int) -> None:
    join_gloo(rank, out, 30)
    trainer = SimpleNamespace(world_size=2, local_rank=rank,
                              strategy=SimpleNamespace(launcher=None, root_device=torch.device("cpu")),
                              _accelerator_connector=SimpleNamespace(cluster_environment=None))
    trainer._signal_connector = conn = _SignalConnector(trainer)
    install_sigterm_notifier(trainer)  # as PreemptionCheckpoint.setup does
    conn.register_signal_handlers()  # as Lightning does right after setup
    seen = {"before": agree_on_sigterm(trainer)}
    if rank == noted:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # the handler runs at the next bytecode
    seen["own_flag_after_signal"] = bool(conn.received_sigterm)
    x = torch.ones(1)
    dist.all_reduce(x)  # what the ranks were doing anyway; a collective inside the handler would collide with it
    seen["all_reduce"] = float(x.item())
    seen["agreed"] = agree_on_sigterm(trainer)
    seen["flag_after_agreement"] = bool(conn.received_sigterm)
    conn.teardown()
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    end_rank()


if __name__ == "__main__":
    mp.spawn(_rank, args=(sys.argv[1], int(sys.argv[2])), nprocs=2)
