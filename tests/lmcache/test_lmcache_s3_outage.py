"""S3 killed during retrieve: LMCache gets a shorter hit, no exception, within the deadline.

A real SeaweedFS server on loopback holds the only tier, so every byte of a retrieve
comes from it.  It is SIGKILLed between LMCache's lookup and its retrieve; the retrieve
must come back with fewer tokens (a miss, counted) well within LMCache's
``blocking_timeout_secs``, and after a restart on the same ports the chunks hit again.
"""

from __future__ import annotations

import time

import pytest
import torch

from kvstore.testing.seaweed import SeaweedS3, weed_binary
from tests.lmcache.helpers import CHUNK, cpu_bytes_in_use, empty, random_kv
from tests.support.required import SEAWEED_INSTALL, require

BLOCKING_TIMEOUT = 5  # LMCACHE_BLOCKING_TIMEOUT_SECS the helpers set


@pytest.fixture(scope="module")
def own_seaweed():
    """A server of our own: this test kills it, so it must not be the shared one."""
    require(weed_binary() is not None, "SeaweedFS (weed)", SEAWEED_INSTALL)
    with SeaweedS3() as server:
        server.create_bucket("kvstore-lmcache")
        yield server


@pytest.mark.parametrize(
    ("path", "asyncm"), [("plugin", False), ("remote", True)], ids=["plugin-sync", "remote-async"]
)
def test_s3_killed_during_retrieve_is_a_shorter_hit(own_seaweed, make_engine, monkeypatch, path, asyncm):
    for k, v in own_seaweed.env().items():
        monkeypatch.setenv(k, v)
    url = own_seaweed.url(
        "kvstore-lmcache",
        f"outage-{path}",
        connect_timeout=1,
        read_timeout=2,
        max_attempts=1,
        breaker_reset=0.5,
    )
    eng = make_engine(path, asyncm, tiers=[url], extra={"kvstore.timeout_s": 3})
    assert eng.kvstore_backend() is not None
    tokens = torch.arange(3 * CHUNK)
    kv = random_kv(len(tokens), seed=11)
    eng.engine.store(tokens, kvcaches=kv)
    assert eng.wait_for_writes(30)
    assert eng.engine.lookup(tokens) == 3 * CHUNK

    own_seaweed.kill()  # after the lookup, before the retrieve
    out = empty(len(tokens))
    t = time.monotonic()
    if asyncm:
        _, got_now = eng.lookup_then_load(tokens, out, req_id="during-outage")
        mask = torch.zeros(len(tokens), dtype=torch.bool)
        mask[:got_now] = True
    else:
        mask = eng.engine.retrieve(tokens, kvcaches=out, req_id="during-outage")
    took = time.monotonic() - t
    assert int(mask.sum()) < 3 * CHUNK, "a dead tier cannot serve the whole prompt"
    assert took < BLOCKING_TIMEOUT, f"retrieve took {took:.1f}s; the deadline is {BLOCKING_TIMEOUT}s"
    hit = int(mask.sum())
    assert not out[0][0][:, :, hit:].any(), "nothing past the shorter hit is written"
    assert cpu_bytes_in_use(eng) == 0, "no MemoryObj is leaked by the failed reads"

    own_seaweed.restart()
    deadline = time.monotonic() + 30
    got = 0
    while time.monotonic() < deadline:  # the client's breaker half-opens after breaker_reset
        out = empty(len(tokens))
        _, got = eng.lookup_then_load(tokens, out)
        if got == 3 * CHUNK:
            break
        time.sleep(0.5)
    assert got == 3 * CHUNK, "after the restart the chunks hit again"
    assert torch.equal(out[1][1], kv[1][1])
