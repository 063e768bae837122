"""Redis killed during retrieve: LMCache gets a shorter hit, no exception, within the deadline.

Runs once kvstore's Redis backend (``kvstore/backends/redis.py``, ``redis://`` URLs) is
on the branch; until then it is skipped.  Same shape as the S3 test: a real
``redis-server`` (append-only file, fsync always, so a SIGKILL keeps the data) holds the
only tier; it is killed between LMCache's lookup and its retrieve, then restarted on the
same port.
"""

from __future__ import annotations

import importlib.util
import shutil
import signal
import socket
import subprocess
import time

import pytest
import torch

from tests.lmcache.helpers import CHUNK, cpu_bytes_in_use, empty, random_kv

BLOCKING_TIMEOUT = 5

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("kvstore.backends.redis") is None,
        reason="kvstore's Redis backend is not built in yet",
    ),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed"),
]


class _Redis:
    def __init__(self, data_dir) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = data_dir
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir)]
        args += ["--save", "", "--appendonly", "yes", "--appendfsync", "always"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(250):
            try:
                with socket.create_connection(("127.0.0.1", self.port), 0.1) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.mark.parametrize(
    ("path", "asyncm"), [("plugin", False), ("remote", True)], ids=["plugin-sync", "remote-async"]
)
def test_redis_killed_during_retrieve_is_a_shorter_hit(tmp_path, make_engine, path, asyncm):
    server = _Redis(tmp_path)
    server.start()
    try:
        eng = make_engine(
            path, asyncm, tiers=[f"redis://127.0.0.1:{server.port}/0"], extra={"kvstore.timeout_s": 3}
        )
        assert eng.kvstore_backend() is not None
        tokens = torch.arange(3 * CHUNK)
        kv = random_kv(len(tokens), seed=12)
        eng.engine.store(tokens, kvcaches=kv)
        assert eng.wait_for_writes(30)
        assert eng.engine.lookup(tokens) == 3 * CHUNK

        server.kill()
        out = empty(len(tokens))
        t = time.monotonic()
        if asyncm:
            _, hit = eng.lookup_then_load(tokens, out, req_id="during-outage")
        else:
            hit = int(eng.engine.retrieve(tokens, kvcaches=out, req_id="during-outage").sum())
        took = time.monotonic() - t
        assert hit < 3 * CHUNK
        assert took < BLOCKING_TIMEOUT, f"retrieve took {took:.1f}s; the deadline is {BLOCKING_TIMEOUT}s"
        assert not out[0][0][:, :, hit:].any()
        assert cpu_bytes_in_use(eng) == 0

        server.start()  # same port, same append-only file
        deadline = time.monotonic() + 30
        got = 0
        while time.monotonic() < deadline:
            out = empty(len(tokens))
            _, got = eng.lookup_then_load(tokens, out)
            if got == 3 * CHUNK:
                break
            time.sleep(0.5)
        assert got == 3 * CHUNK, "after the restart the chunks hit again"
        assert torch.equal(out[1][1], kv[1][1])
    finally:
        server.stop()
