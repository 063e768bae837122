"""S3: `retention_risks` reads the bucket's lifecycle rules (GetBucketLifecycleConfiguration,
which SeaweedFS implements) and names those that expire or move objects under the
backend's prefix; `migrate --delete-source` into such a bucket is refused."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import aiobotocore.session
import pytest
import torch

from kvstore.backends import open_backend
from kvstore.keys import ChunkKey
from kvstore.ops.migrate import MigrateOptions, migrate
from kvstore.tier import Tier

_buckets = itertools.count()


async def bucket_with_rules(seaweed: Any, rules: list[dict[str, Any]]) -> str:
    bucket = f"kvstore-lc-{os.getpid()}-{next(_buckets)}"
    seaweed.create_bucket(bucket)
    if rules:
        session = aiobotocore.session.get_session()
        async with session.create_client("s3", **seaweed.client_kwargs()) as client:
            await client.put_bucket_lifecycle_configuration(
                Bucket=bucket, LifecycleConfiguration={"Rules": rules}
            )
    return bucket


def expire(prefix: str, **extra: Any) -> dict[str, Any]:
    return {
        "ID": f"expire-{prefix or 'all'}",
        "Status": "Enabled",
        "Filter": {"Prefix": prefix},
        "Expiration": {"Days": 1},
        **extra,
    }


async def risks_of(url: str) -> list[str]:
    b = open_backend(url)
    try:
        return await b.retention_risks()
    finally:
        await b.close()


async def test_a_bucket_without_lifecycle_rules_keeps_everything(s3_env) -> None:  # type: ignore[no-untyped-def]
    bucket = await bucket_with_rules(s3_env, [])
    assert await risks_of(s3_env.url(bucket, "kv")) == []


@pytest.mark.parametrize("rule_prefix", ["", "kv/", "kv/tenant/"])
async def test_an_expiry_over_the_prefix_is_a_risk(s3_env, rule_prefix: str) -> None:  # type: ignore[no-untyped-def]
    bucket = await bucket_with_rules(s3_env, [expire(rule_prefix)])
    (risk,) = await risks_of(s3_env.url(bucket, "kv"))
    assert f"expire-{rule_prefix or 'all'}" in risk and "expires objects after 1 days" in risk


async def test_rules_that_cannot_touch_our_objects_are_no_risk(s3_env) -> None:  # type: ignore[no-untyped-def]
    tagged = expire("kv/", Filter={"And": {"Prefix": "kv/", "Tags": [{"Key": "tmp", "Value": "1"}]}})
    rules = [
        expire("logs/"),
        {**expire("kv/"), "ID": "off", "Status": "Disabled"},
        {**tagged, "ID": "tagged"},
    ]
    bucket = await bucket_with_rules(s3_env, rules)
    assert await risks_of(s3_env.url(bucket, "kv")) == []


async def test_delete_source_into_an_expiring_bucket_is_refused(s3_env, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    bucket = await bucket_with_rules(s3_env, [expire("")])
    src_url = (tmp_path / "src").as_uri()
    name = ChunkKey("m", 1, 0, 7, namespace="tenant").object_name()
    assert await Tier.open(src_url).put_many([(name, torch.ones(2, 2, 4, 8))], layout="KV_2LTD") == [True]
    dst = open_backend(s3_env.url(bucket, "kv"))
    try:
        with pytest.raises(ValueError, match="lifecycle rule 'expire-all'"):
            await migrate(
                open_backend(src_url), dst, MigrateOptions(delete_source=True, journal=tmp_path / "j")
            )
        assert await dst.contains_many([name]) == [False]
    finally:
        await dst.close()
    assert await open_backend(src_url).contains_many([name]) == [True]
