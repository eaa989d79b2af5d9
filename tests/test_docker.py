"""The Dockerfile, read as text (Docker itself does not run in CI): the model cache is a volume (so the GGUF
conversion does not rerun on every ``--rm`` start), Java 17 and the ``benchmarks`` extra are installed (every
benchmark env runs), torch's CPU wheel is pinned before the package is installed, any ``--user`` can write HOME, the
caches and the run folder (files on the host are not root's), and ``.dockerignore`` keeps runs, history, caches and
environments out of the build context."""

from __future__ import annotations

import fnmatch
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    lines = [x for x in (ROOT / "Dockerfile").read_text().splitlines() if not x.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    return [(m[1].upper(), m[2].strip()) for m in re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", joined, re.M)]


def _env() -> dict[str, str]:
    env = {}
    for kind, args in _instructions():
        if kind == "ENV":
            env.update(part.split("=", 1) for part in shlex.split(args))
    return env


def _runs() -> list[str]:
    return [args for kind, args in _instructions() if kind == "RUN"]


def test_the_model_cache_is_a_volume():
    env = _env()
    volumes = [v for kind, args in _instructions() if kind == "VOLUME" for v in re.findall(r'[\w/.-]+', args)]
    cache = Path(env["SGLIGHTNING_CACHE"])
    assert any(cache == Path(v) or Path(v) in cache.parents for v in volumes), (cache, volumes)
    assert Path(env["HF_HOME"]).is_relative_to(volumes[0])  # hub downloads are kept too


def test_java_17_the_benchmark_envs_and_the_torch_pin_first():
    runs = _runs()
    assert any("apt-get install" in r and "openjdk-17-jre-headless" in r for r in runs)
    torch_pin = next(i for i, r in enumerate(runs) if re.search(r'pip install .*"torch==[\d.]+"', r))
    package = next(i for i, r in enumerate(runs) if re.search(r'pip install "\.\[', r))
    assert torch_pin < package and "download.pytorch.org/whl/cpu" in runs[torch_pin]
    extras = re.search(r'pip install "\.\[([^\]]+)\]"', runs[package])[1].split(",")
    optional = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    declared = re.findall(r"^([\w-]+) = \[", optional, re.M)
    assert "benchmarks" in extras and "smollm2" in extras and set(extras) <= set(declared)
    base = next(args for kind, args in _instructions() if kind == "FROM")
    assert base.endswith("-bookworm")  # Debian 12 has openjdk-17 (the plain slim tag moved on to a release without)


def test_any_user_id_can_write_home_the_caches_and_the_run_folder():
    env = _env()
    writable = {p for r in _runs() if "chmod 1777" in r for p in r.split("chmod 1777", 1)[1].split()}
    for path in (env["HOME"], env["XDG_CACHE_HOME"], "/app/runs"):
        assert any(path == w or Path(path).is_relative_to(w) for w in writable), path
    usage = (ROOT / "Dockerfile").read_text()
    assert '--user "$(id -u):$(id -g)"' in usage and "-v sglightning-cache:/cache" in usage


def test_dockerignore_keeps_runs_history_caches_and_environments_out_but_not_the_sources():
    patterns = [x.strip().rstrip("/") for x in (ROOT / ".dockerignore").read_text().splitlines()
                if x.strip() and not x.startswith("#")]

    def ignored(path: str) -> bool:
        return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path.split("/")[0], p)
                   or fnmatch.fnmatch(path, p.removeprefix("**/")) for p in patterns)

    for path in ("runs", ".git", ".cache", ".venv", "venv", ".pytest_cache", "src/sglightning/__pycache__"):
        assert ignored(path), path
    # what the project's own scripts make in a checkout (.ci/run, .ci/versions, gpu_bundle.sh): gigabytes of context
    for line in (ROOT / ".gitignore").read_text().splitlines():
        if line.strip().startswith("/."):
            assert ignored(line.strip().strip("/")), line
    copied = [a for kind, args in _instructions() if kind == "COPY" for a in args.split()[:-1]]
    assert copied and not [p for p in copied if ignored(p)], copied
    assert all((ROOT / p).exists() for p in copied)
