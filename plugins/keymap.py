"""LMCache keys and memory objects ↔ kvstore names, tensors and frame layouts.

Owns: `CacheEngineKey` (in-process mode) and `ObjectKey` (MP mode) → `ChunkKey` →
object name, the frame ``layout`` string that
records a MemoryObj's format, and reading a frame header back into an allocation.
Must not touch: I/O, event loops.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvstore.codec.base import dtype_from_name, dtype_name
from kvstore.keys import ChunkKey, chunk_object_name, chunk_object_names
from kvstore.tier_stream import ByteTarget

if TYPE_CHECKING:
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.memory_management import MemoryObj

LAYOUT_PREFIX = "lmcache:"


def chunk_key(key: CacheEngineKey, namespace: str) -> ChunkKey:
    """The kvstore key of an LMCache chunk (or per-layer chunk) key.

    The ``fmt`` segment carries what LMCache's key holds beyond model, world size,
    worker and hash: the KV dtype, the layer of a per-layer key and any tags.
    """
    return ChunkKey(
        model=key.model_name,
        world_size=key.world_size,
        worker_id=key.worker_id,
        chunk_hash=key.chunk_hash,
        fmt=_fmt_of(key),
        namespace=namespace,
    )


def _fmt_of(key: CacheEngineKey) -> str:
    fmt = str(key.dtype).removeprefix("torch.")
    layer = getattr(key, "layer_id", None)
    if layer is not None:
        fmt += f".L{layer}"
    for tag, value in key.tags or ():
        fmt += f".{_tag_text(str(tag))}={_tag_text(_typed(value))}"
    return fmt


def _typed(value: Any) -> str:
    """A tag value as text that tells its type: ``1`` and ``"1"`` are different tags."""
    return f"s:{value}" if isinstance(value, str) else f"{type(value).__name__}:{value!r}"


def _tag_text(text: str) -> str:
    """`text` with the characters that separate tags escaped, so no tag name or value
    can spell another set of tags (``user="a.role=admin"`` is not ``user=a, role=admin``)."""
    return text.replace("%", "%25").replace(".", "%2E").replace("=", "%3D")


def object_name(key: CacheEngineKey, namespace: str) -> str:
    """``chunk_key(key, namespace).object_name()``, without building the `ChunkKey`."""
    return chunk_object_name(namespace, key.model_name, _fmt_of(key), key.world_size, key.worker_id, key.chunk_hash)


def object_names(keys: Sequence[CacheEngineKey], namespace: str) -> list[str]:
    """`object_name` of each key.  A lookup names every chunk of a prompt, and they all
    share model, rank, dtype, layer and tags: each run of keys that shares them (as
    spelled in the name) is named by one `chunk_object_names` call, which spells that
    part once."""
    out: list[str] = []
    hashes: list[Any] = []
    group: tuple[Any, ...] | None = None
    first: Any = None
    for key in keys:
        # equal is not enough: the name spells them (2 and 2.0, 1 and True differ there)
        layer = getattr(key, "layer_id", None)
        ws, rank, model = key.world_size, key.worker_id, key.model_name
        g = (model, type(model), ws, type(ws), rank, type(rank), key.dtype, layer, type(layer), key.tags and _fmt_of(key))
        if g != group:
            if hashes:
                out += _named_run(first, hashes, namespace)
                hashes = []
            group, first = g, key
        hashes.append(key.chunk_hash)
    if hashes:
        out += _named_run(first, hashes, namespace)
    return out


def _named_run(key: CacheEngineKey, hashes: list[Any], namespace: str) -> list[str]:
    return chunk_object_names(namespace, key.model_name, _fmt_of(key), key.world_size, key.worker_id, hashes)


def kv_groups(obj: MemoryObj) -> int:
    """How many KV groups (layer groups of one shape) a MemoryObj holds: 1 but for hybrid
    models."""
    return len(obj.get_shapes()) if obj.meta.shapes is not None else 1


def byte_target(obj: MemoryObj) -> ByteTarget | None:
    """`obj`'s payload bytes described for a read off the store's loop (a `ByteTarget`:
    no tensor view made) when it is a plain CPU `TensorMemoryObj` of one shape (as
    LMCache's allocators make them), the frame's shape and dtype then checked against
    its metadata; None otherwise (read into its tensor).  `obj` must stay alive until
    the read is over (LMCache keeps a task's MemoryObjs until it completes)."""
    from lmcache.v1.memory_management import TensorMemoryObj

    if type(obj) is TensorMemoryObj and obj.valid and (obj.meta.shapes is None or len(obj.meta.shapes) == 1):
        raw, meta = obj.raw_data, obj.meta
        if (
            getattr(obj, "_used_size_override", None) is None
            and isinstance(raw, torch.Tensor)
            and raw.device.type == "cpu"
            and raw.is_contiguous()
            and meta.dtype is not None
        ):
            n = meta.shape.numel() * meta.dtype.itemsize
            if 0 < n <= raw.numel() * raw.element_size():
                data = memoryview((ctypes.c_char * n).from_address(raw.data_ptr())).cast("B")
                return ByteTarget(tuple(meta.shape), dtype_name(meta.dtype), data)
    return None


def payload_of(obj: MemoryObj) -> tuple[torch.Tensor, str]:
    """The tensor to store (a view of the MemoryObj's own memory) and its layout tag."""
    fmt = obj.get_memory_format()
    shapes = obj.get_shapes() if obj.meta.shapes is not None else [obj.get_shape()]
    # several KV groups: store the bytes
    tensor = obj.tensor if len(shapes) == 1 else obj.raw_data.view(torch.uint8)[: obj.get_size()]
    assert tensor is not None, "MemoryObj was invalidated before it could be stored"
    return tensor, f"{LAYOUT_PREFIX}{fmt.name}"


def allocation_for(header: Any, metadata: Any = None) -> tuple[torch.Size, torch.dtype, Any]:
    """(shape, dtype, MemoryFormat) to allocate for a stored frame; ValueError if foreign,
    or (with LMCache's engine `metadata`) if its KV is not of this engine's geometry."""
    from lmcache.v1.memory_management import MemoryFormat

    layout = header.layout
    if not layout.startswith(LAYOUT_PREFIX):
        raise ValueError(f"object was not written by the LMCache plugin (layout {layout!r})")
    fmt = MemoryFormat[layout[len(LAYOUT_PREFIX) :]]
    dtype = dtype_from_name(header.dtype)
    if dtype == torch.uint8 and len(header.shape) == 1:
        raise ValueError("multi-group KV objects are not read back by this plugin yet")
    shape = torch.Size(header.shape)
    if metadata is not None:
        check_geometry(shape, fmt, metadata)
    return shape, dtype, fmt


def check_geometry(shape: torch.Size, fmt: Any, metadata: Any) -> None:
    """ValueError when a whole-chunk object (``KV_2LTD``: K/V, layers, tokens, hidden) is
    not of the shape this engine's chunks of as many tokens have: the checksum and key
    hold, but the KV is another model's, stored under the same model name and world
    size (an alias reused, a changed head count).  Other formats are not checked."""
    if getattr(fmt, "name", None) != "KV_2LTD" or len(shape) != 4:
        return
    tokens = int(shape[2])  # (any count: LMCache's own checks store more than a chunk's)
    try:
        want = metadata.get_shapes(tokens)
    except Exception:  # an engine whose metadata cannot say: nothing to compare
        return
    if len(want) == 1 and tuple(want[0]) != tuple(shape):
        raise ValueError(
            f"stored KV has shape {tuple(shape)}, this engine's chunk of {tokens} tokens is "
            f"{tuple(want[0])}: another model's KV under this model name; give each model "
            "its own served model name or kvstore namespace"
        )


# ------------------------------------------------------------------ MP mode keys
MP_FMT_PREFIX = "mp"


def mp_chunk_key(key: ObjectKey, namespace: str) -> ChunkKey:
    """The kvstore key of an LMCache MP-mode ``ObjectKey``.

    Every field of the ObjectKey lands in the name, so different models, parallel
    setups (``kv_rank``), object groups and cache salts (tenants) never share an object:
    ``fmt`` = ``mp.<kv_rank hex>.<group>`` plus ``.<salt>`` when salted.  World size
    and global rank are unpacked from ``kv_rank`` for readability of listings.
    """
    fmt = f"{MP_FMT_PREFIX}.{key.kv_rank:08x}.{key.object_group_id}"
    if key.cache_salt:
        fmt += f".{key.cache_salt}"
    world = (key.kv_rank >> 24) & 0xFF
    rank = (key.kv_rank >> 16) & 0xFF
    if rank >= max(world, 1):  # not packed by ComputeKVRank: the fmt still holds it exactly
        world, rank = 1, 0
    return ChunkKey(
        model=key.model_name,
        world_size=max(world, 1),
        worker_id=rank,
        chunk_hash=bytes(key.chunk_hash),
        fmt=fmt,
        namespace=namespace,
    )


def mp_object_name(key: ObjectKey, namespace: str) -> str:
    return mp_chunk_key(key, namespace).object_name()


def mp_object_names(keys: Sequence[ObjectKey], namespace: str) -> list[str]:
    """`mp_object_name` of each key.  A request's keys share model, ``kv_rank``, group
    and salt: each run of keys sharing them is named by one `chunk_object_names` call
    (the shared part spelled and checked once, as `object_names` does in-process).
    Raises as `mp_object_name` does for the first key that cannot be named."""
    out: list[str] = []
    run: list[bytes] = []
    group: tuple[Any, ...] | None = None
    first: ObjectKey | None = None
    for key in keys:
        model, rank, gid, salt = key.model_name, key.kv_rank, key.object_group_id, key.cache_salt
        # equal is not enough: the name spells them (1 and True differ there)
        g = (model, type(model), rank, type(rank), gid, type(gid), salt)
        if g != group:
            if run:
                out += _mp_named_run(first, run, namespace)  # type: ignore[arg-type]
                run = []
            group, first = g, key
        run.append(bytes(key.chunk_hash))
    if run:
        out += _mp_named_run(first, run, namespace)  # type: ignore[arg-type]
    return out


def _mp_named_run(key: ObjectKey, hashes: list[bytes], namespace: str) -> list[str]:
    ck = mp_chunk_key(key, namespace)
    return chunk_object_names(namespace, ck.model, ck.fmt, ck.world_size, ck.worker_id, hashes)


def mp_object_key(ck: ChunkKey) -> ObjectKey | None:
    """The ``ObjectKey`` a name made by `mp_object_name` came from; None if not one."""
    from lmcache.v1.distributed.api import ObjectKey

    parts = ck.fmt.split(".", 3)
    if len(parts) < 3 or parts[0] != MP_FMT_PREFIX or not isinstance(ck.chunk_hash, bytes):
        return None
    try:
        return ObjectKey(
            chunk_hash=ck.chunk_hash,
            model_name=ck.model,
            kv_rank=int(parts[1], 16),
            object_group_id=int(parts[2]),
            cache_salt=parts[3] if len(parts) == 4 else "",
        )
    except ValueError:
        return None
