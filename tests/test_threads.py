"""The thread budget (``--threads``): how ``auto`` is resolved, and that the CLI applies it before the run starts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sglightning import threads

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")


@pytest.mark.parametrize(("cpus", "processes", "expected"), [
    (1, 1, 1), (2, 1, 1), (4, 1, 3), (8, 1, 7), (16, 2, 7), (2, 2, 1), (16, 4, 3), (3, 4, 1),
])
def test_auto_leaves_one_core_of_each_process_share(cpus, processes, expected, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads.resolve("auto", processes, cpus=cpus, load=1.5) == expected


@pytest.mark.parametrize(("cpus", "processes", "load", "expected"), [
    (2, 1, 0.1, 2), (2, 1, 0.6, 1), (2, 2, 0.1, 1), (4, 2, 0.1, 1), (4, 1, 0.1, 3), (1, 1, 0.0, 1),
])
def test_auto_takes_both_cores_of_an_idle_two_core_share(cpus, processes, load, expected, monkeypatch):
    """One process on 2 cores of an idle machine uses both (leaving one free cost 1.43x alone); busy, or with
    sibling ranks, or with more cores, one core stays free."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads.resolve("auto", processes, cpus=cpus, load=load) == expected


def test_omp_num_threads_wins_over_auto_and_explicit_counts_win_over_both(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.resolve("auto", 1, cpus=16) is None  # torch already follows OMP_NUM_THREADS
    assert threads.resolve(5, 1, cpus=2) == 5
    assert threads.resolve(None, 1, cpus=2) is None


@pytest.mark.parametrize("bad", [0, -1, True, "two", 1.5])
def test_bad_settings_name_the_key(bad):
    with pytest.raises(ValueError, match="threads: must be auto, null or an integer >= 1"):
        threads.resolve(bad, 1, cpus=4)


@pytest.mark.parametrize(("trainer", "expected"), [
    ({"accelerator": "cpu", "devices": 2}, 2), ({"accelerator": "cpu", "devices": "2"}, 2),
    ({"accelerator": "cpu", "devices": [0, 1, 2]}, 3), ({"accelerator": "cpu", "devices": 1}, 1),
    ({"accelerator": "cpu", "devices": "auto"}, 1), ({}, 1 if not torch.cuda.is_available() else None),
])
def test_local_processes_from_the_trainer_config(trainer, expected):
    if expected is None:
        expected = torch.cuda.device_count()
    assert threads.local_processes(trainer) == expected


def test_available_cpus_respects_the_affinity_mask():
    assert 1 <= threads.available_cpus() <= len(os.sched_getaffinity(0))


def test_apply_sets_torch_threads():
    before = torch.get_num_threads()
    try:
        assert threads.apply(1) == 1 and torch.get_num_threads() == 1
        assert threads.apply(None) == 1  # null leaves whatever is in force
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("trainer", "exported"), [
    ({"devices": 2}, True),  # two ranks here: they inherit the variable
    ({"devices": 1, "num_nodes": 2}, True),  # one rank per node: Lightning's launcher still runs in each
    ({"devices": 1, "num_nodes": "2"}, True),
    ({"devices": 1, "strategy": "ddp"}, True),  # a distributed strategy on one device
    ({"devices": 1, "strategy": {"class_path": "sglightning.strategies.FSDP2Strategy"}}, True),
    ({"devices": 1}, False),  # one process, no launcher: nothing to export
    ({"devices": 1, "strategy": "auto", "num_nodes": 1}, False),
    ({"devices": 1, "strategy": {"class_path": "lightning.pytorch.strategies.SingleDeviceStrategy"}}, False),
])
def test_the_budget_is_not_replaced_by_lightnings_launcher(monkeypatch, trainer, exported):
    """Lightning's launcher sets cores ÷ local processes threads in every rank unless OMP_NUM_THREADS is set: with
    devices: 2 the budget (`auto` leaves a core free; an integer is the user's) was replaced by all the cores, and
    so it still was with one rank per node or a distributed strategy on one device (a 2-node run on one 2-core box
    4-8x slower a step under --threads 1)."""
    from lightning.fabric.utilities.distributed import _set_num_threads_if_needed

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)  # what Lightning divides
    try:
        assert threads.apply(1, trainer) == 1
        assert os.environ.get("OMP_NUM_THREADS") == ("1" if exported else None)
        if exported:
            _set_num_threads_if_needed(threads.local_processes(trainer))  # what fit does in every rank
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_the_cli_applies_the_budget_before_the_run_and_saves_it_in_the_config(tmp_path):
    """In a fresh process: --threads=1 is in force when the model exists (torch.get_num_threads seen from the
    fitted module's process) and recorded in the saved config; a bad value is one line, exit 2."""
    code = (
        "import sys, torch; from sglightning.cli import cli_main; "
        f"cli = cli_main(['fit', '--config', {TINY!r}, '--trainer.max_steps=1', '--trainer.limit_val_batches=0', "
        f"'--trainer.enable_progress_bar=false', '--threads=1', '--trainer.logger.init_args.save_dir={tmp_path}']); "
        "print('THREADS', torch.get_num_threads())"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "THREADS 1" in res.stdout
    saved = list(tmp_path.rglob("config.yaml"))
    assert saved and "threads: 1" in saved[0].read_text()

    res = subprocess.run([sys.executable, "-m", "sglightning.cli", "fit", "--config", TINY, "--threads=0"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "threads" in lines[0], res.stderr


def test_help_documents_the_thread_budget():
    res = subprocess.run([sys.executable, "-m", "sglightning.cli", "fit", "--help"], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0
    assert "--threads" in res.stdout and "one less than this process's share" in " ".join(res.stdout.split())


def test_busy_cpus_sees_a_spinning_process_now(monkeypatch):
    """The idle test measures the CPUs busy now (a job that ended a moment ago does not count, as it would in the
    1-minute load average); a process spinning during the window counts as at least half a CPU."""
    if threads.busy_cpus(0.05) is None:
        pytest.skip("no /proc/stat on this platform")
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 20: pass"])
    try:
        time.sleep(0.3)  # the interpreter is up and spinning
        assert threads.busy_cpus(0.5) >= 0.5
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert threads.resolve("auto", 1, cpus=2) == 1  # busy now: one core stays free
    finally:
        spin.kill()
        spin.wait()


def test_load_falls_back_to_the_load_average_without_proc_stat(monkeypatch):
    monkeypatch.setattr(threads, "_cpu_counters", lambda: None)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (0.25, 0.0, 0.0))
    assert threads.machine_load() == 0.25
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (_ for _ in ()).throw(OSError("none")))
    assert threads.machine_load() == float("inf")
