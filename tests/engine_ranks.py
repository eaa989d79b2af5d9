"""Two gloo processes, no server.  ``sync`` (argv[2]): rank 0's vLLM adapter sync fails (the engine refuses the
adapter); ``rollout``: rank 0's rollout raises EngineError while rank 1's plays out; ``oom`` / ``error``: rank 1's
rollout runs out of memory / raises a KeyError.  Each rank writes what it raised,
and after how long, to OUT/rank{r}.json (argv[1]).  Run by tests/test_engines.py."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from processes import end_rank, join_gloo

from sglightning.engines import EngineConfig
from sglightning.engines.vllm import VLLMEngine
from sglightning.errors import EngineError


class _Tokenizer:
    def encode(self, text):
        return [1, 2, 3, 4]


class _Embeddings:
    class weight:  # noqa: N801 - a stand-in for a parameter
        dtype = None


class _Model:
    def get_input_embeddings(self):
        return _Embeddings()


class _Weights:
    version, sharding, model, tokenizer = 1, None, _Model(), _Tokenizer()

    def gathered(self):
        return contextlib.nullcontext()

    def adapter_state(self):
        return {}

    def write_adapter(self, state, folder):
        os.makedirs(folder, exist_ok=True)

    def probe_logprobs(self, ids):
        return [None, -1.0, -1.0, -1.0]


class _RefusingClient:
    url = "http://127.0.0.1:9"

    def load_lora(self, name, path):
        raise EngineError(f"the vLLM engine refused adapter {path}: HTTP 400")


def _rank(rank: int, out: str, scenario: str) -> None:
    join_gloo(rank, out, 60)
    engine = VLLMEngine(EngineConfig(backend="vllm", url=_RefusingClient.url))
    engine.rank, engine.client, engine._adapter_root = rank, _RefusingClient(), Path(out)
    t0 = time.perf_counter()
    try:
        if scenario == "sync":
            with engine.sampling(_Weights()):
                raised = None
        else:
            from sglightning.callbacks import _agreed

            def rollout():
                if rank == 0 and scenario == "rollout":
                    raise EngineError("every request of this turn failed on the engine's side")
                if rank == 1 and scenario == "oom":  # the failing rank is not the first here
                    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
                if rank == 1 and scenario == "error":
                    raise KeyError("answer")
                return "episodes"

            _agreed(rollout)
            raised = None
    except Exception as err:  # noqa: BLE001 - what each rank raised is the result
        raised = f"{type(err).__name__}: {err}"
    Path(out, f"rank{rank}.json").write_text(json.dumps({"raised": raised, "s": time.perf_counter() - t0}))
    dist.barrier()  # neither rank tears gloo down while the other still talks to it (an abort at exit otherwise)
    end_rank()


if __name__ == "__main__":
    mp.spawn(_rank, args=(sys.argv[1], sys.argv[2]), nprocs=2)
