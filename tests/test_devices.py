"""Device placement, checked on a CPU-only machine: every generator a rollout draws from is made on the model's
device (training, dynamic sampling, validation before and after fit, a standalone validate) and refused where it is
used when it is not.  On CUDA a CPU generator crashed the main command's first validation (torch refuses it deep in
the first draw); nothing on a CPU could see it, so these tests look at the devices themselves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sglightning import callbacks
from sglightning.cli import cli_main
from sglightning.data import sampling_generator
from sglightning.engines.builtin import DecodeSession, check_generator

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")


@pytest.fixture()
def made(monkeypatch):
    """Every sampling generator the rollout callback makes, with the device it was asked for and the module's."""
    seen: list[tuple[str, torch.device, torch.device]] = []
    real = callbacks.sampling_generator

    def spy(seed, step, rank, salt=0, *, device):
        gen = real(seed, step, rank, salt, device=device)
        seen.append((f"salt {salt}", torch.device(device), gen.device))
        return gen

    monkeypatch.setattr(callbacks, "sampling_generator", spy)
    return seen


def test_every_rollout_generator_is_made_on_the_models_device(tmp_path, made, monkeypatch):
    """A fit that validates before and after training, with a dynamic-sampling round, then validate from the
    checkpoint: every generator made (training salt 0, dynamic sampling salt 3, validation salt 1) is on the
    module's device.  The module says it is on ``cpu:0``, which is not equal to ``cpu``: a callback that made its
    generator on a fixed ``"cpu"`` (the bug a GPU run found) fails here too."""
    from sglightning.module import SelfGuideModule

    monkeypatch.setattr(SelfGuideModule, "device", property(lambda self: torch.device("cpu", 0)))
    args = ["--config", TINY, f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.enable_progress_bar=false",
            "--trainer.max_steps=2", "--model.evaluation.num_tasks=2", "--model.evaluation.tasks_per_batch=2",
            "--model.evaluation.before_fit=true", "--model.rollout.dynamic_sampling_rounds=1"]
    cli = cli_main(["fit", *args])
    device = cli.model.device
    cli_main(["validate", *args, "--ckpt_path=last"])
    salts = {s for s, _, _ in made}
    assert {"salt 0", "salt 1", "salt 3"} <= salts, salts
    assert device == torch.device("cpu", 0) != torch.device("cpu")
    assert all(asked == device and got.type == device.type for _, asked, got in made), made


def test_a_generator_on_another_device_is_refused_where_it_is_used():
    """The session checks the generator against the model's device before the first draw: a CPU generator for a
    model elsewhere (a meta-device model stands in for a GPU one here) is one line naming both devices."""
    with torch.device("meta"):
        model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"the sampling generator is on cpu but the model is on meta"):
        DecodeSession(model, 0, generator=torch.Generator())
    with pytest.raises(ValueError, match=r"the sampling generator is on cpu but the model is on cuda:0"):
        check_generator(torch.Generator(), torch.device("cuda:0"))
    check_generator(torch.Generator(), torch.device("cpu"))
    check_generator(None, torch.device("cuda:0"))  # greedy decoding draws nothing


def test_sampling_generator_needs_the_device():
    with pytest.raises(TypeError):
        sampling_generator(0, 0, 0)  # the device is a required keyword: no caller can forget it
    assert sampling_generator(0, 1, 0, device="cpu").device.type == "cpu"


def test_vllm_seeds_are_drawn_on_the_generators_device(monkeypatch):
    """The vLLM engine draws each row's seed from the rollout's generator; on a GPU trainer that generator is on
    CUDA, and a draw made on the CPU from it raised "Expected a 'cpu' device type for generator".  The draw asks
    for the generator's own device, and gives the seeds of drawing row by row (the same episodes as before)."""
    from sglightning.engines import vllm

    asked: list = []
    real = torch.randint

    def spy(*args, generator=None, device=None, **kw):
        asked.append((generator.device if generator is not None else None, device))
        return real(*args, generator=generator, device=device, **kw)

    gen = torch.Generator().manual_seed(5)
    by_row = [int(real(0, 2**31 - 1, (1,), generator=gen)) for _ in range(7)]
    monkeypatch.setattr(vllm.torch, "randint", spy)
    assert vllm.row_seeds(torch.Generator().manual_seed(5), 7) == by_row
    assert asked and all(torch.device(d) == g for g, d in asked), asked
    assert len(vllm.row_seeds(None, 3)) == 3



def test_the_engine_samples_outside_inference_mode(tmp_path, monkeypatch):
    """A standalone ``validate`` runs in inference mode (fit's validations do not). Tensors the engine made there
    were inference tensors: FSDP2's gather buffers on a GPU then fail ("Inference tensors do not track version
    counter"), and a pooled slot cache refuses a later rollout's writes. The engine samples outside it."""
    from tiny import tiny_module, tiny_trainer

    from sglightning.data import EvalConfig
    from sglightning.engines import EngineConfig
    from sglightning.engines.static import SlotCache

    made, modes = [], []
    real = SlotCache.allocate.__func__
    monkeypatch.setattr(SlotCache, "allocate", classmethod(lambda cls, *a: made.append(real(cls, *a)) or made[-1]))
    hook = callbacks.RolloutCallback.on_validation_batch_start

    def spy(self, *a, **kw):
        modes.append(torch.is_inference_mode_enabled())
        return hook(self, *a, **kw)

    monkeypatch.setattr(callbacks.RolloutCallback, "on_validation_batch_start", spy)
    module = tiny_module(engine=EngineConfig(compile="static"), evaluation=EvalConfig(num_tasks=2, tasks_per_batch=2))
    tiny_trainer(tmp_path, steps=1, limit_val_batches=1).validate(module, verbose=False)
    assert modes == [True]  # Lightning's standalone loop: the case this guards
    assert made and not any(t.is_inference() for c in made for t in c.keys + c.values)


@pytest.mark.slow
def test_training_and_validation_rollouts_sample_in_eval_mode_on_one_compiled_step(tmp_path, monkeypatch):
    """Every rollout of a fit (validation before, training steps, validation after) samples in eval mode: the policy
    acts without dropout, and the compiled decode step (``compile: default``, inductor on this CPU) is traced once.
    Training rollouts ran in the update's train mode before, and torch guards the mode: the first training rollout
    after a validation traced a second graph, and with two graphs every call's guards are checked.  The module is
    back in train mode for its update."""
    from tiny import tiny_module, tiny_trainer

    from sglightning.data import EvalConfig
    from sglightning.engines import EngineConfig, builtin
    from sglightning.rollout import Rollout

    modes, updates, steps = [], [], []
    make = builtin.compiled
    monkeypatch.setattr(builtin, "compiled", lambda *a: steps.append(make(*a)) or steps[-1])
    real = Rollout.run

    def spy(self, *a, **kw):
        modes.append(self.model.training)
        return real(self, *a, **kw)

    monkeypatch.setattr(Rollout, "run", spy)
    module = tiny_module(engine=EngineConfig(compile="default"),
                         evaluation=EvalConfig(num_tasks=2, tasks_per_batch=2, before_fit=True))
    update = module.update

    def spied_update(*a, **kw):
        updates.append(module.peft_model.training)
        return update(*a, **kw)

    monkeypatch.setattr(module, "update", spied_update)
    tiny_trainer(tmp_path, steps=2, limit_val_batches=1, val_check_interval=2).fit(module)
    [step] = [s for s in steps if s.mode == "default"]
    assert len(modes) >= 4 and not any(modes)  # 2 validations and 2 training rollouts, all in eval mode
    assert updates == [True, True]  # the updates in train mode
    assert step.graphs == 1 and step.skipped > step.checked


def test_the_finite_flag_of_an_update_lives_where_the_process_group_reads(monkeypatch):
    """FSDP1 with CPU offload keeps the parameters on the CPU; NCCL refuses a CPU tensor, so the flag that every
    rank's loss was finite (built on the first parameter's device) crashed every such update on GPUs."""
    from sglightning import distributed

    cpu = torch.device("cpu")
    assert distributed.collective_device(cpu) == cpu  # one process: where the parameters are
    monkeypatch.setattr(distributed, "is_distributed", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "gloo")
    assert distributed.collective_device(cpu) == cpu
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert distributed.collective_device(cpu) == torch.device("cuda", 3)
