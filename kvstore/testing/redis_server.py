"""Real `redis-server` processes for tests: start, kill -9, restart; a 3-master Cluster.

Owns: launching throwaway Redis servers on loopback (a free TCP port or a unix socket)
with persistence off, waiting until they answer, and tearing them down.  Must not
touch: kvstore code; these are plain helpers any test (backend, migration, LMCache
fault tests) can reuse.

    with RedisServer() as srv:              # free TCP port on 127.0.0.1
        url = srv.url                       # "redis://127.0.0.1:PORT/0"
        srv.kill()                          # SIGKILL, like a crashed server
        srv.restart()                       # same port / socket, empty data
    with RedisServer(unix_socket=True) as srv:
        srv.url                             # "unix:///tmp/.../redis.sock"
    with RedisServer(password="s3cret") as srv:   # requirepass
        ...
    with RedisServer(tls=True) as srv:      # TLS only, self-signed CA made with openssl
        srv.url                             # "rediss://127.0.0.1:PORT/0?ssl_ca_certs=.../ca.crt"
    with RedisClusterProcs(masters=3) as cl:
        cl.url                              # "redis+cluster://127.0.0.1:P1,127.0.0.1:P2,..."
        cl.nodes[0].kill()

Needs `redis-server` and (for clusters) `redis-cli` on PATH; `redis_available()` says
whether they are, so tests can skip with a clear reason.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["RedisClusterProcs", "RedisServer", "free_port", "redis_available"]


def redis_available(cluster: bool = False, tls: bool = False) -> bool:
    """True when `redis-server` (and `redis-cli` for clusters, `openssl` for TLS) can be run."""
    need = ["redis-server"] + (["redis-cli"] if cluster else []) + (["openssl"] if tls else [])
    return all(shutil.which(b) for b in need)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(cluster_bus: bool = False) -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now.

    With `cluster_bus`, also port+10000 is free and below 65536 (Redis Cluster's bus).
    """
    if not cluster_bus:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20000, 55000)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair (port, port+10000) for a Redis Cluster node")


class RedisServer:
    """One `redis-server` process on 127.0.0.1:`port` or on a unix socket.

    `port=None` picks a free port; `unix_socket=True` listens on a socket in the
    server's own temp dir (a str is used as the socket path).  Persistence is off, so a
    restart comes back empty, as after a crash with no AOF.  `extra` adds
    ``redis-server`` arguments, e.g. ``["--maxmemory", "10mb"]``.  The port and socket
    stay the same across `kill`/`restart`, so clients can reconnect to the same URL.
    """

    def __init__(
        self,
        port: int | None = None,
        unix_socket: bool | str = False,
        password: str | None = None,
        extra: list[str] | None = None,
        workdir: str | os.PathLike | None = None,
        tls: bool = False,
    ) -> None:
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="kvstore-redis-")
        self.dir = Path(workdir) if workdir else Path(self._tmp.name if self._tmp else ".")
        self.dir.mkdir(parents=True, exist_ok=True)
        if unix_socket:
            self.socket_path: str | None = (
                unix_socket if isinstance(unix_socket, str) else str(self.dir / "redis.sock")
            )
            self.port = 0
        else:
            self.socket_path = None
            self.port = port or free_port()
        self.password = password
        self.tls = tls
        if tls:
            make_test_certs(self.dir)
        self.extra = list(extra or [])
        self.proc: subprocess.Popen | None = None

    # -- addresses ---------------------------------------------------------------
    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def url(self) -> str:
        """A URL `open_backend` and redis-py accept (password included when set)."""
        auth = f":{self.password}@" if self.password else ""
        if self.socket_path:
            return f"unix://{auth}{self.socket_path}"
        if self.tls:
            return f"rediss://{auth}{self.host}:{self.port}/0?ssl_ca_certs={self.dir / 'ca.crt'}"
        return f"redis://{auth}{self.host}:{self.port}/0"

    def args(self) -> list[str]:
        args = [
            "redis-server",
            "--bind",
            "127.0.0.1",
            "--port",
            "0" if self.tls else str(self.port),
            "--dir",
            str(self.dir),
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
            "--logfile",
            str(self.dir / "redis.log"),
        ]
        if self.socket_path:
            args += ["--unixsocket", self.socket_path, "--unixsocketperm", "700"]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls:
            args += ["--tls-port", str(self.port), "--tls-auth-clients", "no"]
            args += [
                "--tls-cert-file",
                str(self.dir / "server.crt"),
                "--tls-key-file",
                str(self.dir / "server.key"),
            ]
            args += ["--tls-ca-cert-file", str(self.dir / "ca.crt")]
        return args + self.extra

    # -- lifecycle ---------------------------------------------------------------
    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers PING; raise RuntimeError if not."""
        if self.running:
            return self
        if self.socket_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
        self.proc = subprocess.Popen(
            self.args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if self.ping():
                return self
            time.sleep(0.02)
        log = (
            (self.dir / "redis.log").read_text(errors="replace")[-2000:]
            if (self.dir / "redis.log").exists()
            else ""
        )
        self.stop()
        raise RuntimeError(f"redis-server did not start ({' '.join(self.args())}):\n{log}")

    def kill(self) -> None:
        """SIGKILL the server (a crash: open connections drop, no clean shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after 5 s)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the server keeps its socket open but answers nothing (a hang)."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after `pause`."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)

    def restart(self, timeout: float = 10.0) -> RedisServer:
        """Kill -9 if running, then start again on the same port / socket."""
        self.kill()
        return self.start(timeout)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- talking to it without redis-py (so the helper has no dependencies) -------
    def command(self, *args: str | bytes, timeout: float = 2.0) -> bytes:
        """Send one command, return the raw RESP reply (for readiness checks)."""
        addr: str | tuple[str, int]
        if self.socket_path:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            addr = self.socket_path
        else:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            addr = (self.host, self.port)
        if self.tls:
            ctx = ssl.create_default_context(cafile=str(self.dir / "ca.crt"))
            s = ctx.wrap_socket(s, server_hostname=self.host)
        with s:
            s.settimeout(timeout)
            s.connect(addr)
            out = b""
            if self.password:
                out += _resp("AUTH", self.password)
            out += _resp(*args)
            s.sendall(out)
            time.sleep(0.01)
            return s.recv(65536)

    def ping(self) -> bool:
        try:
            return b"PONG" in self.command("PING", timeout=0.5)
        except OSError:
            return False


def make_test_certs(directory: str | os.PathLike) -> None:
    """Write ca.crt, server.crt and server.key (for 127.0.0.1) into `directory` with openssl."""
    d = Path(directory)

    def ssl_cmd(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, cwd=d, capture_output=True, timeout=60)

    ssl_cmd(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=kvstore-test-ca",
    )
    ssl_cmd(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=127.0.0.1",
    )
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    ssl_cmd(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.crt",
        "-days",
        "2",
        "-extfile",
        "san.ext",
    )


def _resp(*args: str | bytes) -> bytes:
    out = [f"*{len(args)}\r\n".encode()]
    for a in args:
        b = a.encode() if isinstance(a, str) else a
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


class RedisClusterProcs:
    """A Redis Cluster of `masters` (≥3) masters, no replicas, on free loopback ports.

    Each node is a `RedisServer` (so tests can kill / restart one); `create` joins them
    with ``redis-cli --cluster create ... --cluster-yes`` and waits for ``cluster_state:ok``.
    A restarted node keeps its nodes.conf, so it rejoins with the same slots.
    """

    def __init__(self, masters: int = 3, node_timeout_ms: int = 2000) -> None:
        if masters < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 masters")
        self._tmp = tempfile.TemporaryDirectory(prefix="kvstore-redis-cluster-")
        self.nodes: list[RedisServer] = []
        for i in range(masters):
            d = Path(self._tmp.name) / f"node{i}"
            port = free_port(cluster_bus=True)
            extra = [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(d / "nodes.conf"),
                "--cluster-node-timeout",
                str(node_timeout_ms),
            ]
            self.nodes.append(RedisServer(port=port, extra=extra, workdir=d))

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"{n.host}:{n.port}" for n in self.nodes)

    def start(self, timeout: float = 30.0) -> RedisClusterProcs:
        for n in self.nodes:
            n.start()
        addrs = [f"{n.host}:{n.port}" for n in self.nodes]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=timeout,
        )
        self.wait_ok(timeout)
        return self

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Block until every running node reports ``cluster_state:ok``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if all(b"cluster_state:ok" in n.command("CLUSTER", "INFO") for n in self.nodes if n.running):
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError("Redis Cluster did not reach cluster_state:ok")

    def close(self) -> None:
        for n in self.nodes:
            n.close()
        self._tmp.cleanup()

    def __enter__(self) -> RedisClusterProcs:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
