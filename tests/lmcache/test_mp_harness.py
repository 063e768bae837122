"""The MP-server harness against a real ``lmcache.v1.multiprocess.server`` on CPU.

LMCache's own ``fs`` L2 adapter underneath, in a temp directory: round trip of three
chunks, a partial prefix hit, L1 cleared and the chunks read back from L2, a SIGKILL
and restart that finds the chunks through L2,
the shared-memory transfer path, a start failure that reports the server log, and a hung
start that leaves its stacks in the log and is retried once.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.required import require_module

require_module("lmcache")
torch = require_module("torch")

from kvstore.lmcache_mp import (  # noqa: E402
    MPClient,
    MPClientError,
    MPServer,
    MPServerError,
    fs_l2_adapter,
    random_kv,
)

LAYERS, HEADS, HEAD_DIM, CHUNK = 2, 2, 64, 256


def _client(server: MPServer, **kw: object) -> MPClient:
    client = MPClient(server.url, "tiny-mp", LAYERS, HEADS, HEAD_DIM, torch.bfloat16, CHUNK, **kw)
    client.register()
    return client


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (n,), generator=g).tolist()


def _l2_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.suffix == ".data") if path.exists() else []


@pytest.fixture(scope="module")
def fs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[MPServer, Path]]:
    root = tmp_path_factory.mktemp("mp-fs")
    server = MPServer(
        [fs_l2_adapter(root / "l2")], chunk_size=CHUNK, l1_size_gb=0.1, log_path=root / "server.log"
    )
    with server:
        yield server, root / "l2"


def test_round_trip_three_chunks(fs_server: tuple[MPServer, Path]) -> None:
    server, l2 = fs_server
    with _client(server) as client:
        tokens = _tokens(3 * CHUNK + 17, seed=1)  # a trailing partial chunk is not stored
        kv = random_kv(len(tokens), LAYERS, HEADS, HEAD_DIM, torch.bfloat16, seed=1)
        assert client.transfer in ("pickle", "inline")  # LMCache 0.5.6 pickles, 0.5.7 sends tensors inline
        assert client.lookup(tokens) == 0
        assert client.store(tokens, kv) == 3 * CHUNK
        assert client.lookup(tokens) == 3 * CHUNK
        hit, got = client.retrieve(tokens)
        assert hit == 3 * CHUNK
        assert got.dtype == torch.bfloat16 and got.shape == (2, LAYERS, hit, HEADS * HEAD_DIM)
        assert torch.equal(got.view(torch.int16), kv[:, :, :hit].view(torch.int16))  # bytes equal
        # the L2 writes land asynchronously; wait_stored sees them in the adapter
        assert client.wait_stored(tokens, timeout=30)
        assert len(_l2_files(l2)) >= 3
        # per-head input layout is accepted too; the chunks are already stored
        per_head = kv.view(2, LAYERS, len(tokens), HEADS, HEAD_DIM)
        assert client.store(tokens, per_head) == 3 * CHUNK


def test_partial_prefix_hit(fs_server: tuple[MPServer, Path]) -> None:
    server, _ = fs_server
    with _client(server) as client:
        tokens = _tokens(4 * CHUNK, seed=2)
        kv = random_kv(len(tokens), LAYERS, HEADS, HEAD_DIM, torch.bfloat16, seed=2)
        assert client.store(tokens[: 2 * CHUNK], kv[:, :, : 2 * CHUNK]) == 2 * CHUNK
        assert client.lookup(tokens) == 2 * CHUNK
        hit, got = client.retrieve(tokens)
        assert hit == 2 * CHUNK
        assert torch.equal(got, kv[:, :, : 2 * CHUNK])
        # a different first chunk shares no prefix, so nothing hits
        other = [tokens[0] + 1, *tokens[1:]]
        assert client.retrieve(other)[0] == 0
        assert client.wait_stored(timeout=30)  # the store queue drains


def test_clear_l1_then_retrieve_from_l2(fs_server: tuple[MPServer, Path]) -> None:
    server, _ = fs_server
    with _client(server) as client:
        tokens = _tokens(2 * CHUNK, seed=5)
        kv = random_kv(len(tokens), LAYERS, HEADS, HEAD_DIM, torch.bfloat16, seed=5)
        assert client.store(tokens, kv) == 2 * CHUNK
        assert client.l2_status()["l1_used_bytes"] > 0
        assert client.wait_stored(tokens, timeout=30)
        client.clear_l1()
        assert client.l2_status()["l1_used_bytes"] == 0  # nothing left in L1 ...
        hit, got = client.retrieve(tokens)  # ... so this comes back from the fs adapter
        assert hit == 2 * CHUNK and torch.equal(got, kv)


@pytest.mark.slow  # two server starts: ~20 s on a quiet machine, over 30 s under load
def test_restart_after_sigkill_finds_chunks_in_l2(tmp_path: Path) -> None:
    l2 = tmp_path / "l2"
    server = MPServer([fs_l2_adapter(l2)], chunk_size=CHUNK, l1_size_gb=0.1, log_path=tmp_path / "server.log")
    tokens = _tokens(3 * CHUNK, seed=3)
    kv = random_kv(len(tokens), LAYERS, HEADS, HEAD_DIM, torch.bfloat16, seed=3)
    with server:
        client = _client(server, timeout=3.0)
        assert client.store(tokens, kv) == 3 * CHUNK
        assert client.wait_stored(tokens, timeout=30)
        pid = server.pid
        assert server.kill() == -9
        assert not server.running
        assert len(_l2_files(l2)) == 3

        server.start()  # same port, same fs directory, a new process with an empty L1
        assert server.pid != pid
        # the new server knows no layout: a store from the old registration gets no answer
        with pytest.raises(MPClientError, match="register"):
            client.store(tokens, kv)
        client.register()
        assert client.lookup(tokens) == 3 * CHUNK
        hit, got = client.retrieve([*tokens, 1, 2, 3])
        assert hit == 3 * CHUNK
        assert torch.equal(got.view(torch.int16), kv.view(torch.int16))
        client.close()
    assert not server.running


def test_shared_memory_transfer(tmp_path: Path) -> None:
    shm = f"kvstore-test-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    server = MPServer(
        [fs_l2_adapter(tmp_path / "l2")],
        chunk_size=CHUNK,
        l1_size_gb=0.05,
        shm_name=shm,
        log_path=tmp_path / "server.log",
    )
    with server:
        with _client(server) as client:
            assert client.transfer == "shm"
            tokens = _tokens(2 * CHUNK, seed=4)
            kv = random_kv(len(tokens), LAYERS, HEADS, HEAD_DIM, torch.bfloat16, seed=4)
            assert client.store(tokens, kv) == 2 * CHUNK
            assert client.store(tokens, kv) == 2 * CHUNK  # all cached: nothing to write
            hit, got = client.retrieve(tokens)
            assert hit == 2 * CHUNK and torch.equal(got, kv)
        assert server.stop() == 0  # SIGTERM is a clean shutdown
    assert not Path("/dev/shm", f"lmcache_l1_pool_{shm}").exists()


def test_start_failure_reports_the_log(tmp_path: Path) -> None:
    server = MPServer([{"type": "no-such-adapter"}], log_path=tmp_path / "server.log", start_timeout=60)
    with pytest.raises(MPServerError, match="no-such-adapter") as err:
        server.start()
    assert "exited with code" in str(err.value)
    assert not server.running


def test_port_held_by_another_server_is_not_taken_for_ready(
    fs_server: tuple[MPServer, Path], tmp_path: Path
) -> None:
    running, _ = fs_server
    clash = MPServer(
        [], port=running.port, l1_size_gb=0.05, log_path=tmp_path / "server.log", start_timeout=60
    )
    with pytest.raises(MPServerError, match="Address already in use"):
        clash.start()  # the running server answers the probe, but with its own pid
    assert not clash.running and running.running


def _hanging_python(tmp_path: Path) -> str:
    """A `python` for MPServer whose process never gets to serving: it sleeps."""
    import sys

    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import time; time.sleep(600)'\n")
    script.chmod(0o755)
    return str(script)


def test_hung_start_dumps_stacks_retries_once_then_fails(tmp_path: Path) -> None:
    server = MPServer([], python=_hanging_python(tmp_path), log_path=tmp_path / "server.log", start_timeout=3)
    with (
        pytest.warns(RuntimeWarning, match="hung; retrying once") as caught,
        pytest.raises(MPServerError, match="not ready after 3s") as err,
    ):
        server.start()
    assert len([w for w in caught if "hung; retrying" in str(w.message)]) == 1  # one retry, not more
    assert not server.running
    log = (tmp_path / "server.log").read_text()
    assert log.count("=== start") == 2
    # Python's fault handler wrote where each process was stuck before it was killed.
    assert log.count("Fatal Python error: Aborted") == 2
    assert 'File "<string>", line 1' in log and "line 1" in str(err.value)


def test_a_hung_start_is_retried_with_a_new_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.lmcache_mp import server as server_mod

    server = MPServer([], log_path=tmp_path / "server.log")
    calls: list[int] = []

    def spawn() -> None:
        calls.append(server.port)
        if len(calls) == 1:
            raise server_mod._HungStart("MP server not ready after 1s")

    monkeypatch.setattr(server, "_spawn_and_wait", spawn)
    with pytest.warns(RuntimeWarning, match="not ready after 1s"):
        assert server.start() is server
    assert len(calls) == 2


class _Future:
    """A readiness request's answer as the harness sees it (`result` None: never answered)."""

    def __init__(self, result: object | None) -> None:
        self._result = result

    def wait(self, timeout: float | None = None) -> bool:
        if self._result is None:
            time.sleep(timeout or 0)
        return self._result is not None

    def query(self) -> bool:
        return self._result is not None

    def result(self) -> object:
        return self._result


def test_an_unanswered_readiness_request_is_followed_by_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request the starting server drops must not leave the harness waiting for it
    until the deadline: after REPROBE_S another is sent, and its answer counts."""
    import json
    import types

    from kvstore.lmcache_mp import server as server_mod

    server = MPServer(
        [], python=_hanging_python(tmp_path), log_path=tmp_path / "server.log", start_timeout=20
    )
    sent: list[float] = []

    def probe(_client: object) -> _Future:
        sent.append(time.monotonic())
        if len(sent) == 1:
            return _Future(None)  # lost: never answered
        assert server.pid is not None
        return _Future(types.SimpleNamespace(success=True, payload=json.dumps({"pid": server.pid}).encode()))

    monkeypatch.setattr(server_mod, "REPROBE_S", 0.3)
    monkeypatch.setattr(server, "_probe", probe)
    try:
        assert server.start() is server
        assert len(sent) == 2 and 0.3 <= sent[1] - sent[0] < 5
    finally:
        server.kill()


def test_a_connection_that_answers_nothing_is_replaced_by_a_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """However many requests go over a connection that went wrong, none is answered:
    after FRESH_PROBE_S without an answer the harness sends them over a new client, whose
    answer counts, and closes every client it made."""
    import json
    import types

    from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

    from kvstore.lmcache_mp import server as server_mod

    class Client:
        def __init__(self, n: int) -> None:
            self.n = n
            self.closed = False

        def noop(self) -> _Future:
            return _Future(None)

        def close(self) -> None:
            self.closed = True

    clients: list[Client] = []

    def create(url: str, **_: object) -> Client:
        clients.append(Client(len(clients)))
        return clients[-1]

    server = MPServer(
        [], python=_hanging_python(tmp_path), log_path=tmp_path / "server.log", start_timeout=20
    )

    def probe(client: Client) -> _Future:
        if client.n == 0:
            return _Future(None)  # the first connection never answers
        assert server.pid is not None
        return _Future(types.SimpleNamespace(success=True, payload=json.dumps({"pid": server.pid}).encode()))

    monkeypatch.setattr(RequestClientFactory, "create", staticmethod(create))
    monkeypatch.setattr(server_mod, "REPROBE_S", 0.2)
    monkeypatch.setattr(server_mod, "FRESH_PROBE_S", 1.0)
    monkeypatch.setattr(server, "_probe", probe)
    try:
        assert server.start() is server
        assert len(clients) == 2 and all(c.closed for c in clients)
        # the same process answered: not a hung start retried with a new one
        assert (tmp_path / "server.log").read_text().count("=== start") == 1
    finally:
        server.kill()


def test_a_timeout_says_when_the_server_answered_noop_but_not_the_status_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

    from kvstore.lmcache_mp import server as server_mod

    class Client:
        def noop(self) -> _Future:
            return _Future("OK")  # the transport answers

        def close(self) -> None:
            pass

    server = MPServer([], python=_hanging_python(tmp_path), log_path=tmp_path / "server.log", start_timeout=1.5)
    monkeypatch.setattr(RequestClientFactory, "create", staticmethod(lambda url, **_: Client()))
    monkeypatch.setattr(server_mod, "REPROBE_S", 0.2)
    monkeypatch.setattr(server_mod, "FRESH_PROBE_S", 0.4)
    monkeypatch.setattr(server, "_probe", lambda client: _Future(None))  # the status module never does
    with pytest.warns(RuntimeWarning), pytest.raises(MPServerError, match="noop was answered"):
        server.start()
    assert not server.running


def test_the_server_logs_at_info_and_drops_a_vanished_prometheus_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another part of the calling process may run LMCache quieter, or leave
    PROMETHEUS_MULTIPROC_DIR naming a directory that is gone: the server's own log still
    says what it loaded, and prometheus_client is not pointed at a missing directory."""
    monkeypatch.setenv("LMCACHE_LOG_LEVEL", "ERROR")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "gone"))
    env = MPServer([], log_path=tmp_path / "server.log")._environment()
    assert env["LMCACHE_LOG_LEVEL"] == "INFO" and "PROMETHEUS_MULTIPROC_DIR" not in env
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    assert MPServer([], log_path=tmp_path / "server.log")._environment()["PROMETHEUS_MULTIPROC_DIR"] == str(tmp_path)
    assert MPServer([], log_path=tmp_path / "l", env={"LMCACHE_LOG_LEVEL": "DEBUG"})._environment()[
        "LMCACHE_LOG_LEVEL"
    ] == "DEBUG"
