"""Redis killed during retrieve: LMCache gets a shorter hit, no exception, within the deadline.

Same shape as the S3 test: a real ``redis-server`` (append-only file with fsync always,
so a SIGKILL keeps the data) holds the only tier; it is killed between LMCache's lookup
and its retrieve, then restarted on the same port.
"""

from __future__ import annotations

import time

import pytest
import torch

from kvstore.testing.redis_server import RedisServer, redis_available
from tests.lmcache.helpers import CHUNK, cpu_bytes_in_use, empty, random_kv
from tests.support.required import REDIS_INSTALL, needs

BLOCKING_TIMEOUT = 5

pytestmark = needs(redis_available(), "redis-server", REDIS_INSTALL)
PERSIST = ["--appendonly", "yes", "--appendfsync", "always"]  # the data survives SIGKILL


@pytest.mark.parametrize(
    ("path", "asyncm"), [("plugin", False), ("remote", True)], ids=["plugin-sync", "remote-async"]
)
def test_redis_killed_during_retrieve_is_a_shorter_hit(tmp_path, make_engine, path, asyncm):
    with RedisServer(extra=PERSIST, workdir=tmp_path / "redis") as server:
        eng = make_engine(path, asyncm, tiers=[server.url], extra={"kvstore.timeout_s": 3})
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

        server.restart()  # same port, same append-only file
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
