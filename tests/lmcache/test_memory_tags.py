"""Where a store's bytes live, as LMCache 0.5.7's L2 memory tags say it: read from the
tier URLs (pure), overridden by the adapter's ``residency``, and handed to LMCache as
its own ``MemoryTags`` where it has them."""

from __future__ import annotations

import pytest

from kvstore_lmcache.memory_tags import StoreTags, store_tags, tier_tags


@pytest.mark.parametrize(
    "url, segment, residency",
    [
        ("mem://hot", "dram", "local"),
        ("file:///var/cache/kv", "storage", "local"),
        ("unix:///run/redis.sock", "storage", "local"),
        # over the network: remote, as LMCache's own adapters say (a loopback port may
        # be a tunnel to another host)
        ("redis://127.0.0.1:6379/0", "storage", "remote"),
        ("rediss://cache.internal:6380", "storage", "remote"),
        ("redis+cluster://127.0.0.1:7000,10.0.0.2:7001", "storage", "remote"),
        ("s3://bucket/kv", "storage", "remote"),
        ("s3://bucket/kv?endpoint_url=http://127.0.0.1:8333", "storage", "remote"),
        ("custom://whatever", "storage", "remote"),  # nothing says where it keeps bytes
    ],
)
def test_each_tier_url_says_where_its_bytes_live(url, segment, residency):
    assert tier_tags(url) == StoreTags(segment, residency)


def test_a_store_is_dram_only_when_every_tier_is_and_remote_when_any_tier_is():
    assert store_tags(["mem://a"]) == StoreTags("dram", "local")
    assert store_tags(["mem://a", "file:///d"]) == StoreTags("storage", "local")
    assert store_tags(["mem://a", "file:///d", "redis://127.0.0.1:6379"]) == StoreTags("storage", "remote")
    # a directory other hosts mount too: LMCache's "shared" flag, or the adapter's setting
    assert store_tags(["file:///shared/kv"], shared=True) == StoreTags("storage", "remote")
    assert store_tags(["file:///shared/kv"], "remote") == StoreTags("storage", "remote")
    assert store_tags(["unix:///run/redis.sock"], "local", shared=True) == StoreTags("storage", "local")
    assert store_tags(["redis://10.0.0.5:6379"], "local") == StoreTags("storage", "local")
