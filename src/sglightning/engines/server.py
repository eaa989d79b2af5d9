"""A vLLM server as a child process, and a small HTTP client for the endpoints the trainer uses (no Lightning).

The server runs in its own virtual environment (vLLM pins other versions of transformers than the trainer), so the
trainer never imports vLLM: it launches ``python -m vllm.entrypoints.openai.api_server`` from that environment in a
process group of its own on 127.0.0.1, waits for ``/health``, and stops the whole group — on close, at interpreter
exit, and when the trainer process dies (the child gets SIGTERM through ``PR_SET_PDEATHSIG``).  The client speaks the
OpenAI-compatible API with vLLM's extensions: token-id prompts, ``return_token_ids``, per-token log-probs,
``allowed_token_ids``, and the runtime LoRA endpoints.  The same client works against the official GPU ``vllm serve``.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from sglightning.errors import ConfigError, EngineError


class RequestFailed(Exception):
    """One request failed (timeout, HTTP error): the episodes it served fail, the run goes on.  ``engine_side``: the
    engine's own failure (a timeout, an HTTP 5xx), not the request's (a 4xx, an answer that does not fit)."""

    def __init__(self, message: str, engine_side: bool = False):
        super().__init__(message)
        self.engine_side = engine_side


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class VLLMClient:
    """HTTP client of one vLLM server."""

    def __init__(self, url: str, timeout_s: float = 300.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def _request(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
        with urllib.request.urlopen(req, timeout=timeout or self.timeout_s) as resp:  # noqa: S310 (our own URL)
            return resp.read()

    def healthy(self, timeout: float = 5.0) -> bool:
        try:
            self._request("GET", "/health", timeout=timeout)
            return True
        except (urllib.error.URLError, OSError, TimeoutError, http.client.HTTPException):  # a port that talks no HTTP
            return False

    def post(self, path: str, body: dict, timeout: float | None = None) -> dict:
        """POST ``body`` as JSON; a refused connection is an :class:`EngineError` (the engine is gone), a timeout or
        an HTTP error a :class:`RequestFailed` (this request only)."""
        try:
            raw = self._request("POST", path, body, timeout)
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:400]
            raise RequestFailed(f"HTTP {err.code} from {path}: {_message(detail)}", err.code >= 500) from None
        except TimeoutError:
            raise RequestFailed(f"{path}: no answer within {timeout or self.timeout_s:g} s", True) from None
        except http.client.HTTPException as err:  # an answer cut short or not HTTP: the engine's side
            raise RequestFailed(f"{path}: a broken answer ({type(err).__name__}: {err})", True) from None
        except (urllib.error.URLError, ConnectionError, OSError) as err:
            reason = getattr(err, "reason", err)
            if isinstance(reason, (TimeoutError, socket.timeout)):
                raise RequestFailed(f"{path}: no answer within {timeout or self.timeout_s:g} s", True) from None
            raise EngineError(f"the vLLM engine at {self.url} is not reachable ({reason})") from None
        try:
            return json.loads(raw) if raw.strip() else {}
        except ValueError:  # the LoRA endpoints answer in plain text ("Success: LoRA adapter ... added")
            return {"text": raw.decode(errors="replace")}

    def completions(self, body: dict) -> dict:
        return self.post("/v1/completions", body)

    def load_lora(self, name: str, path: str) -> None:
        try:
            self.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}, timeout=120)
        except RequestFailed as err:
            raise EngineError(f"the vLLM engine refused adapter {path}: {err}") from None

    def unload_lora(self, name: str) -> None:
        with contextlib.suppress(RequestFailed):
            self.post("/v1/unload_lora_adapter", {"lora_name": name}, timeout=60)

    def models(self) -> list[str]:
        return [m["id"] for m in json.loads(self._request("GET", "/v1/models", timeout=30)).get("data", [])]


def _message(detail: str) -> str:
    try:
        return str(json.loads(detail).get("error", {}).get("message", detail) or detail)[:300]
    except (ValueError, AttributeError):
        return detail[:300]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """In the child: a process group of its own, and SIGTERM when the trainer process dies (even by SIGKILL)."""
    os.setsid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


class VLLMServer:
    """A launched vLLM server: ``start()`` returns once ``/health`` answers; ``stop()`` ends its process group."""

    _live: set[VLLMServer] = set()
    _lock = threading.Lock()

    def __init__(self, command: list[str], env: dict[str, str], host: str, port: int, startup_timeout_s: float,
                 log_dir: str | None = None):
        self.command, self.env, self.host, self.port = command, env, host, port
        self.startup_timeout_s = startup_timeout_s
        self.url = f"http://{host}:{port}"
        self.proc: subprocess.Popen | None = None
        folder = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="sglightning-vllm-log-"))
        folder.mkdir(parents=True, exist_ok=True)
        self.log_path = folder / "vllm-server.log"
        self._own_folder = None if log_dir else folder  # a temporary folder: removed when nobody needs the log
        #: the server answered /health; ``keep_log``: an error named the log (it outlives the run then)
        self.ready = self.keep_log = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        python = Path(self.command[0])
        if not (python.is_file() and os.access(python, os.X_OK)):
            raise ConfigError(f"model.engine.python: {self.command[0]} is not an executable python (the vLLM "
                              "environment: the set-up is in docs/vllm.md, or set model.engine.url to a running "
                              "server)")
        log = open(self.log_path, "ab")  # noqa: SIM115 (closed when the process ends)
        self.proc = subprocess.Popen(self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)  # noqa: PLW1509
        log.close()
        with VLLMServer._lock:
            if not VLLMServer._live:
                atexit.register(VLLMServer.stop_all)
            VLLMServer._live.add(self)
        client = VLLMClient(self.url)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                self.stop()
                raise ConfigError(f"model.engine: the vLLM server exited with code {self.proc.returncode} before "
                                  f"it was ready: {tail} (log: {self.log_path})")
            if client.healthy(timeout=2.0):
                self.ready = True
                return
            time.sleep(0.5)
        self.stop()
        raise ConfigError(f"model.engine.startup_timeout_s: the vLLM server did not answer /health within "
                          f"{self.startup_timeout_s:g} s (log: {self.log_path})")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        """The last error-looking line of the server log (or its last line), for a one-line message."""
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()[-lines:]
        except OSError:
            return "no log"
        for line in reversed(text):
            if "Error" in line or "error" in line:
                return line.strip()[:300]
        return text[-1].strip()[:300] if text else "empty log"

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``timeout_s`` (a vLLM server stopped while it starts
        hangs in its engine core; a ready one is gone in 2-4 s); waits until the group is gone.  Always the group: a
        SIGKILL to the API server alone would leave its engine core and worker running."""
        proc = self.proc
        with VLLMServer._lock:
            VLLMServer._live.discard(self)
        if proc is None:
            return
        # a server that started and is still running has a log nobody needs (one that died, or whose log an error
        # named, keeps it: the temporary folders piled up, one per run)
        needless = self._own_folder is not None and self.ready and not self.keep_log and proc.poll() is None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        _wait_group_gone(proc.pid, timeout_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        _wait_group_gone(proc.pid, 10.0)  # a SIGKILL is delivered asynchronously: the children may still be running
        if needless:
            shutil.rmtree(self._own_folder, ignore_errors=True)

    @classmethod
    def stop_all(cls) -> None:
        for server in list(cls._live):
            server.stop(timeout_s=10.0)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return bool(group_members(pgid))  # zombies of the group count as gone


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    """Until no live process of group ``pgid`` is left, at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid`` (tests: no engine process left behind)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(pid))
    return found
