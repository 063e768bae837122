"""A real LMCache multiprocess (MP) cache server, run as a subprocess on CPU.

Owns: the command line of ``python -m lmcache.v1.multiprocess.server`` for a CPU
client (engine-driven transfers, LRU eviction, observability off), its process
(start, ready wait, SIGTERM stop, SIGKILL crash, restart on the same port) and its log.
Must not touch: the cache protocol (that is `kvstore.lmcache_mp.client`), storage
logic, or any process it did not start.

The server runs in its own session (process group), so ``stop`` and ``kill`` reach
everything it spawned and nothing else.  ``kvstore.lmcache_mp.status_module`` is loaded
by default as an LMCache ``--server-module``: it answers the client's ``wait_stored``
(have the L2 writes landed?), which the stock server has no request for.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

STATUS_MODULE = {"module_path": "kvstore.lmcache_mp.status_module"}  # 0.5.6: its factory's default name
_REPO_ROOT = Path(__file__).resolve().parents[2]
REPROBE_S = 2.0  # a readiness request unanswered this long is followed by another
FRESH_PROBE_S = 10.0  # with none answered this long, the next requests go over a new connection


class MPServerError(RuntimeError):
    """The server did not start, or died; the message ends with the tail of its log."""


class _HungStart(MPServerError):
    """A start that was not ready in time (retried once by `MPServer.start`)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (another process may still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def fs_l2_adapter(base_path: str | os.PathLike[str], **extra: object) -> dict[str, object]:
    """LMCache's own filesystem L2 adapter spec (``FSL2AdapterConfig``: ``base_path``,
    optional ``relative_tmp_dir``, ``read_ahead_size``, ``use_odirect``)."""
    return {"type": "fs", "base_path": str(base_path), **extra}


def plugin_l2_adapter(
    module_path: str, class_name: str, adapter_params: Mapping[str, object]
) -> dict[str, object]:
    """A third-party L2 adapter spec, loaded by LMCache's ``plugin`` adapter type."""
    return {
        "type": "plugin",
        "module_path": module_path,
        "class_name": class_name,
        "adapter_params": dict(adapter_params),
    }


class MPServer:
    """One ``lmcache.v1.multiprocess.server`` process.

    ``l2_adapters`` are ``--l2-adapter`` JSON objects (see `fs_l2_adapter`,
    `plugin_l2_adapter`); an empty list runs L1 only.  ``port=None`` picks a free port
    at the first start; later starts (after `stop` or `kill`) reuse it, so a client
    that reconnects to `url` reaches the new process.  ``log_path`` defaults to a file
    in a fresh temp directory; every start appends to it.

    ``transfer_mode`` is the server's ``--supported-transfer-mode``; the CPU client
    needs ``engine_driven`` or ``auto``.  ``shm_name`` (with ``--no-l1-use-lazy``,
    added automatically) makes engine-driven transfers go through ``/dev/shm`` instead
    of KV in the requests over ZMQ (pickled with LMCache 0.5.6, tensor envelopes with 0.5.7).  ``extra_args`` are appended last and win over the
    defaults for flags argparse takes once.  ``env`` is added to a copy of the current
    environment; the repository root is put on ``PYTHONPATH`` so this checkout's ``kvstore``,
    ``kvstore_lmcache`` and test modules import in the server.
    """

    def __init__(
        self,
        l2_adapters: Sequence[Mapping[str, object]] = (),
        *,
        chunk_size: int = 256,
        l1_size_gb: float = 0.5,
        host: str = "127.0.0.1",
        port: int | None = None,
        transfer_mode: str = "engine_driven",
        eviction_policy: str = "LRU",
        shm_name: str = "",
        status_module: bool = True,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        python: str = sys.executable,
        start_timeout: float = 120.0,
        stop_timeout: float = 30.0,
    ) -> None:
        if transfer_mode not in ("engine_driven", "auto", "lmcache_driven"):
            raise ValueError(f"unknown transfer_mode {transfer_mode!r}")
        self.l2_adapters = [dict(a) for a in l2_adapters]
        self.chunk_size = chunk_size
        self.l1_size_gb = l1_size_gb
        self.host = host
        self._fixed_port = port is not None
        self.port = port if port is not None else free_port(host)
        self.transfer_mode = transfer_mode
        self.eviction_policy = eviction_policy
        self.shm_name = shm_name
        self.status_module = status_module
        self.extra_args = list(extra_args)
        self.env = dict(env or {})
        if log_path is None:
            log_path = Path(tempfile.mkdtemp(prefix="lmcache-mp-")) / "server.log"
        self.log_path = Path(log_path)
        self.python = python
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0

    # ------------------------------------------------------------------ properties

    @property
    def url(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> list[str]:
        """The server's full command line."""
        cmd = [
            self.python, "-m", "lmcache.v1.multiprocess.server",
            "--host", self.host,
            "--port", str(self.port),
            "--chunk-size", str(self.chunk_size),
            "--l1-size-gb", str(self.l1_size_gb),
            "--eviction-policy", self.eviction_policy,
            "--supported-transfer-mode", self.transfer_mode,
            "--disable-observability",
        ]  # fmt: skip
        if self.shm_name:
            cmd += ["--shm-name", self.shm_name, "--no-l1-use-lazy"]
        for spec in self.l2_adapters:
            cmd += ["--l2-adapter", json.dumps(spec)]
        if self.status_module:
            cmd += ["--server-module", json.dumps(STATUS_MODULE)]
        return cmd + self.extra_args

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("LMCACHE_TRACK_USAGE", "false")
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.setdefault("PYTHONFAULTHANDLER", "1")  # SIGABRT on a hung start dumps every thread's stack
        # The log is a file: let it say what the server did at start (which modules and
        # adapters it loaded), whatever level the calling process runs LMCache at.
        env["LMCACHE_LOG_LEVEL"] = "INFO"
        # prometheus_client's multiprocess mode writes into this directory; a caller's
        # that no longer exists (a finished test's temporary directory) breaks the server.
        if not Path(env.get("PROMETHEUS_MULTIPROC_DIR") or ".").is_dir():
            del env["PROMETHEUS_MULTIPROC_DIR"]
        paths = [str(_REPO_ROOT), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        env.update(self.env)
        return env

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> MPServer:
        """Start the process and wait until it serves requests.

        Ready means this process answered a request sent at spawn and queued by ZMQ
        until the server's transport binds (it logs ``LMCache cache server is
        running...`` then; the request does not depend on its log level); while none is
        answered, another is sent every `REPROBE_S` seconds, and after `FRESH_PROBE_S`
        seconds without an answer they go over a new connection.  With the
        status module the answer names the server's pid, so another server on the same
        port is not taken for this one; without it the request is LMCache's ``noop``.
        Raises `MPServerError`, with the tail of the log, if the process exits or is not
        ready within ``start_timeout`` seconds.  A process that is not ready in time is
        sent SIGABRT first, so Python's fault handler writes every thread's stack to
        the log (where it hung), then killed; one such hung start is retried with a new
        process, with a `RuntimeWarning` that carries the stacks.  With an
        automatically chosen port, a start that loses its port to another process
        retries on a new one.
        """
        if self.running:
            raise MPServerError(f"server already running (pid {self.pid})")
        hung = 0
        for attempt in range(4):
            try:
                self._spawn_and_wait()
                return self
            except _HungStart as exc:
                hung += 1
                if hung > 1:
                    raise MPServerError(str(exc)) from None
                warnings.warn(
                    f"MP server start hung; retrying once with a new process.\n{exc}",
                    RuntimeWarning,
                    stacklevel=2,
                )
            except MPServerError as exc:
                lost_port = "Address already in use" in str(exc)
                if not lost_port or self._fixed_port or attempt == 3:
                    raise
                self.port = free_port(self.host)
            except BaseException:  # Ctrl-C mid-start: no orphaned server, no pool left in /dev/shm
                self.kill()
                raise
        raise MPServerError(f"MP server did not start in {attempt + 1} attempts\n{self.log_tail()}")

    def _spawn_and_wait(self) -> None:
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== start {time.strftime('%H:%M:%S')}: {' '.join(self.command())}\n".encode())
            log.flush()
            self._log_offset = log.tell()
            self._proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self._environment(),
                cwd=str(_REPO_ROOT),
                start_new_session=True,
            )
        deadline = time.monotonic() + self.start_timeout
        # A request sent now waits in ZMQ's queue until the server binds and answers it.
        # A request that reaches the server while it is still setting up can go unanswered,
        # so one with no answer after REPROBE_S is followed by another; any answer counts.
        # With none answered for FRESH_PROBE_S, the requests go over a new client (a new
        # connection): a connection that went wrong stays wrong, whatever is sent on it.
        # Each new client also sends LMCache's ``noop``, so a server that answers it but
        # not the status module's request is told apart from one that answers nothing.
        probe = RequestClientFactory.create(self.url)
        fresh = time.monotonic()
        pending: list[Any] = []
        noops: list[Any] = []
        noop_seen = False
        try:
            pending.append(self._probe(probe))
            sent, seen = time.monotonic(), "none"
            while True:
                pending[-1].wait(0.2)
                for answer in [a for a in pending if a.query()]:
                    pending.remove(answer)
                    result = answer.result()
                    if self._answered_by_us(result):
                        return
                    seen = repr(result)[:200]  # another process holds the port: wait for ours
                noop_seen = noop_seen or any(n.query() for n in noops)
                now = time.monotonic()
                if now - fresh > FRESH_PROBE_S and seen == "none":
                    probe.close()
                    probe = RequestClientFactory.create(self.url)
                    fresh, pending, noops = now, [], [probe.noop()] if self.status_module else []
                if not pending or now - sent > REPROBE_S:
                    pending.append(self._probe(probe))
                    sent = now
                if self._proc.poll() is not None:
                    code = self._reap()
                    raise MPServerError(f"MP server exited with code {code} during start\n{self.log_tail()}")
                if now > deadline:
                    self._dump_stacks()
                    self.kill()
                    noop = "; LMCache's noop was answered: the status module is not serving" if noop_seen else ""
                    raise _HungStart(
                        f"MP server not ready after {self.start_timeout:.0f}s (last answer to a readiness"
                        f" request: {seen}; {len(pending)} unanswered on the last connection{noop})\n"
                        f"{self.log_tail(120)}"
                    )
        finally:
            probe.close()

    def _probe(self, client: Any) -> Any:
        """A readiness request: the status module's (it names the answering process's
        pid), else LMCache's ``noop``."""
        if not self.status_module:
            return client.noop()
        from lmcache.v1.multiprocess.protocols.server_module import ServerModuleCallRequest

        return client.server_module_call(ServerModuleCallRequest(method="kvstore.l2_status", payload=b"{}"))

    def _answered_by_us(self, answer: Any) -> bool:
        if not self.status_module:
            return bool(answer == "OK")
        assert self._proc is not None
        return bool(answer.success) and json.loads(answer.payload).get("pid") == self._proc.pid

    def _dump_stacks(self) -> None:
        """SIGABRT the server (not its group): with ``PYTHONFAULTHANDLER`` set, Python
        writes every thread's stack to the log before it dies."""
        assert self._proc is not None
        try:
            self._proc.send_signal(signal.SIGABRT)
        except ProcessLookupError:
            return
        self._wait(5.0)

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM (a clean shutdown), then SIGKILL after ``timeout`` seconds.

        Returns the exit code (``None`` if it was not running)."""
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            if not self._wait(self.stop_timeout if timeout is None else timeout):
                self._signal_group(signal.SIGKILL)
                self._wait(10.0)
        return self._reap()

    def kill(self) -> int | None:
        """SIGKILL the server's process group, like a crash; returns the exit code."""
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            self._signal_group(signal.SIGKILL)
            self._wait(10.0)
        return self._reap()

    def restart(self) -> MPServer:
        """`stop`, then `start` on the same port."""
        self.stop()
        return self.start()

    def _reap(self) -> int | None:
        assert self._proc is not None
        code = self._proc.poll()
        if code is None:
            return None
        # Whatever the server left in its group (it has no children by default) goes too,
        # and so does its shared-memory pool, which a killed server cannot unlink.
        self._signal_group(signal.SIGKILL)
        self._proc = None
        if self.shm_name:
            bare = self.shm_name.lstrip("/")
            pool = bare if bare.startswith("lmcache_l1_pool_") else f"lmcache_l1_pool_{bare}"
            Path("/dev/shm", pool).unlink(missing_ok=True)
        return code

    def _signal_group(self, sig: signal.Signals) -> None:
        assert self._proc is not None
        try:
            os.killpg(self._proc.pid, sig)  # own session: pgid == pid
        except (ProcessLookupError, PermissionError):
            pass

    def _wait(self, timeout: float) -> bool:
        assert self._proc is not None
        try:
            self._proc.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    # ------------------------------------------------------------------ logs

    def _new_log(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                return f.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        """The last ``lines`` lines of the server log (all starts)."""
        try:
            text = self.log_path.read_bytes().decode("utf-8", "replace")
        except FileNotFoundError:
            return f"(no log at {self.log_path})"
        tail = "\n".join(text.splitlines()[-lines:])
        return f"--- {self.log_path} (last {lines} lines) ---\n{tail}"

    def log_text(self) -> str:
        """The log of the current (or latest) start."""
        return self._new_log()

    # ------------------------------------------------------------------ context manager

    def __enter__(self) -> MPServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running else "stopped"
        return f"MPServer({self.url}, {state}, log={self.log_path})"
