"""LMCache keys map to distinct, reversible kvstore object names."""

from __future__ import annotations

import torch
from lmcache.utils import CacheEngineKey

from kvstore.keys import ChunkKey
from kvstore_lmcache.keymap import chunk_key, object_name, object_names


def _key(h: int, dtype=torch.bfloat16, **kw) -> CacheEngineKey:
    return CacheEngineKey(
        model_name="org/Model-7B", world_size=2, worker_id=1, chunk_hash=h, dtype=dtype, **kw
    )


def test_negative_and_positive_hashes_differ_and_read_back():
    a, b = object_name(_key(-12345), "ns"), object_name(_key(12345), "ns")
    assert a != b
    assert ChunkKey.from_object_name(a).chunk_hash == -12345
    assert ChunkKey.from_object_name(b) == chunk_key(_key(12345), "ns")


def test_dtype_layer_and_tags_are_part_of_the_name():
    base = object_name(_key(7), "ns")
    assert object_name(_key(7, dtype=torch.float16), "ns") != base
    assert object_name(_key(7).split_layers(3)[1], "ns") != base
    tagged = _key(7, request_configs={"lmcache.tag.user": "alice"})
    assert object_name(tagged, "ns") != base
    assert object_name(_key(7), "other") != base


def test_distinct_tags_never_spell_the_same_name():
    """Tags separate tenants (and what changes the KV, such as an adapter): a tag value
    cannot spell another set of tags, and values of different types stay apart."""
    one = _key(7, request_configs={"lmcache.tag.user": "alice.role=admin"})
    two = _key(7, request_configs={"lmcache.tag.user": "alice", "lmcache.tag.role": "admin"})
    assert one != two and object_name(one, "ns") != object_name(two, "ns")
    as_int = _key(7, request_configs={"lmcache.tag.n": 1})
    as_str = _key(7, request_configs={"lmcache.tag.n": "1"})
    assert as_int != as_str and object_name(as_int, "ns") != object_name(as_str, "ns")
    pct = _key(7, request_configs={"lmcache.tag.user": "a%2Eb"})
    dot = _key(7, request_configs={"lmcache.tag.user": "a.b"})
    assert object_name(pct, "ns") != object_name(dot, "ns")


def test_the_lookup_paths_name_is_the_chunk_keys_name():
    """`object_name` (what every lookup and read calls) spells exactly what `ChunkKey` does."""
    keys = [
        _key(7),
        _key(-7, dtype=torch.float16),
        _key(7).split_layers(3)[2],
        _key(2**63 - 1, request_configs={"lmcache.tag.user": "al/ice", "lmcache.tag.k": "v"}),
    ]
    for k in keys:
        assert object_name(k, "ns") == chunk_key(k, "ns").object_name()


def test_a_batch_of_keys_is_named_as_each_key_alone():
    """`object_names` (a lookup names a prompt's keys at once, spelling each run of keys
    that share model, rank, dtype, layer and tags once) gives each key its own name."""
    layers = _key(9).split_layers(2)
    keys = [
        _key(1),
        _key(2),
        _key(3, dtype=torch.float16),  # the run changes with the dtype...
        _key(4),
        CacheEngineKey(model_name="org/Model-7B", world_size=2, worker_id=0, chunk_hash=4, dtype=torch.bfloat16),
        _key(5, request_configs={"lmcache.tag.user": "bob"}),  # ...the rank, the tags...
        _key(5, request_configs={"lmcache.tag.user": "eve"}),
        *layers,  # ...and the layer
        _key(-6),
    ]
    names = object_names(keys, "ns")
    assert names == [object_name(k, "ns") for k in keys]
    assert len(set(names)) == len(keys)
    # equal values spelled apart in a name stay apart (2 / 2.0, 0 / False, 1 / True, 0.0 / -0.0)
    odd = [
        _key(1),
        CacheEngineKey(model_name="org/Model-7B", world_size=2.0, worker_id=1, chunk_hash=2, dtype=torch.bfloat16),  # type: ignore[arg-type]
        CacheEngineKey(model_name="org/Model-7B", world_size=2, worker_id=True, chunk_hash=3, dtype=torch.bfloat16),
        _key(4, request_configs={"lmcache.tag.p": 1}),
        _key(5, request_configs={"lmcache.tag.p": True}),
        _key(6, request_configs={"lmcache.tag.p": 0.0}),
        _key(7, request_configs={"lmcache.tag.p": -0.0}),
    ]
    assert object_names(odd, "ns") == [object_name(k, "ns") for k in odd]
    assert object_names([], "ns") == []


def test_a_batch_of_mp_keys_is_named_as_each_key_alone():
    """`mp_object_names` (an MP lookup names a request's keys at once, spelling each run
    of keys that share model, kv_rank, group and salt once) gives each key its own name."""
    from kvstore_lmcache.keymap import mp_object_name, mp_object_names
    from kvstore_lmcache.l2_sync import object_key

    keys = [
        object_key(1),
        object_key(2),
        object_key(3, model="other/model"),  # the run changes with the model...
        object_key(4, kv_rank=(2 << 24) | (1 << 16)),  # ...the rank...
        object_key(5, object_group_id=1),  # ...the group...
        object_key(6, cache_salt="tenant-a"),  # ...and the salt
        object_key(7, cache_salt="tenant-a"),
        object_key(8),
    ]
    names = mp_object_names(keys, "ns")
    assert names == [mp_object_name(k, "ns") for k in keys]
    assert len(set(names)) == len(keys)
    assert mp_object_names([], "ns") == []


def _pool_obj(pool: torch.Tensor, start: int, shape: tuple[int, ...], dtype: torch.dtype, **meta_kw):
    """A MemoryObj as LMCache's tensor allocator makes one: a uint8 slice of its pool,
    ``address`` the offset in the pool, ``shapes`` / ``dtypes`` of one entry."""
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    size = torch.Size(shape).numel() * dtype.itemsize
    meta = MemoryObjMetadata(
        torch.Size(shape), dtype, start, size, 1, 0, MemoryFormat.KV_2LTD,
        **({"shapes": [torch.Size(shape)], "dtypes": [dtype]} | meta_kw),
    )
    return TensorMemoryObj(raw_data=pool[start : start + size], metadata=meta, parent_allocator=None)


def test_a_byte_target_describes_an_allocators_memory_obj_and_writes_into_it():
    from kvstore.tier_stream import ByteTarget
    from kvstore_lmcache.keymap import byte_target, payload_of

    pool = torch.zeros(1 << 16, dtype=torch.uint8)
    obj = _pool_obj(pool, 4096, (2, 4, 8, 16), torch.bfloat16)
    target = byte_target(obj)
    assert isinstance(target, ByteTarget)
    assert (target.shape, target.dtype, target.data.nbytes) == ((2, 4, 8, 16), "bfloat16", 2 * 4 * 8 * 16 * 2)
    src = torch.randn(2, 4, 8, 16).to(torch.bfloat16)
    target.data[:] = src.view(-1).view(torch.uint8).numpy().tobytes()
    assert torch.equal(payload_of(obj)[0], src), "the bytes landed in the MemoryObj's own memory"
    assert pool[:4096].count_nonzero() == 0 and pool[4096 + target.data.nbytes :].count_nonzero() == 0


def test_memory_objs_that_cannot_be_described_are_read_into_their_tensor():
    from kvstore_lmcache.keymap import byte_target

    pool = torch.zeros(1 << 16, dtype=torch.uint8)
    narrowed = _pool_obj(pool, 0, (64,), torch.uint8)
    narrowed.set_used_size(32)  # (the async serde's narrowed buffers)
    two = _pool_obj(pool, 8192, (2, 8), torch.float16, shapes=[torch.Size([2, 8]), torch.Size([4])],
                    dtypes=[torch.float16, torch.float16])
    for obj in (narrowed, two):
        assert byte_target(obj) is None
