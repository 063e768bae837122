"""kvstore's CacheGen codec as a serde of LMCache's multiprocess (MP) server.

LMCache 0.5.6 runs an L2 adapter's objects through a *serde* when the adapter's JSON
has a ``"serde"`` object; serdes are looked up by ``type`` in
``lmcache.v1.distributed.serde.factory``.  This module registers ``kvstore_cachegen``
there, so LMCache's own adapters store kvstore CacheGen frames (tested with ``fs``;
any adapter that stores a MemoryObj's bytes and loads them into an equal buffer works)::

    {"type": "fs", "base_path": "/var/cache/lmcache-l2",
     "serde": {"type": "kvstore_cachegen", "codec": "cachegen?profile=smollm2-135m"}}

What is stored: one complete kvstore frame (``kvstore.frame``: magic, header CRC,
codec, dtype, shape, layout, the chunk's kvstore object name as ``key``, CRC32C of the
payload) holding the cachegen payload, byte for byte what a kvstore cold tier writes
for the same tensor under the same name (only ``ctime`` differs), followed by zero
padding up to a fixed *slot* size.  The padding is forced by LMCache: its serde
wrapper sizes the read buffer of a load from ``estimate_serialized_size`` alone, and
its ``fs`` adapter counts a file of any other length as a failed read, so every object
of one layout must have the same length.  The default slot is a proven upper bound of
the codec's output (see `CacheGenFrameSerde.slot_bytes`), so no chunk ever fails to
fit; ``slot_ratio`` trades that guarantee for smaller objects.  `frame_view` cuts the
frame out of a stored object for kvstore's frame and codec readers.

Loads verify the header CRC, the payload CRC32C, the key (the wrapper hands the
serde the chunk's own ``ObjectKey``, so a file renamed or copied under another key is
refused), shape and dtype against the buffer LMCache provides; any defect raises,
which LMCache reports as a miss for the whole load task.  Nothing is ever unpickled.
LMCache leaves a damaged object in place (a serde has no handle on its adapter), so
``python -m kvstore_lmcache.mp_serde verify DIR --quarantine`` (`verify_fs`) finds and renames
them in an ``fs`` directory.

Loading it in the server process (the registry is filled at import time, and the
server builds its L2 adapters before it loads any ``--server-module``):

* ``python -m kvstore_lmcache.mp_serde <the server's usual arguments>`` runs
  ``lmcache.v1.multiprocess.server`` with the serde registered (``python -m
  kvstore_lmcache.mp_serde lmcache server ...`` runs the ``lmcache server`` command); or
* wrap the adapter in LMCache's ``plugin`` type: ``{"type": "plugin", "module_path":
  "kvstore_lmcache.mp_serde", "class_name": "LMCacheL2Adapter", "adapter_params": {<the
  adapter's own JSON>}, "serde": {...}}``; importing this module registers the serde
  before LMCache builds the adapter's serde, and `LMCacheL2Adapter` hands back
  LMCache's own adapter for ``adapter_params``.

Owns: the serde (frame + padding byte layout of an MP L2 object), its options and
registration, the slot bound, the plugin shim, the launcher and ``verify`` of an ``fs``
directory.  Must not touch: the
codec's internals (it only calls `Codec.frame_parts` / `decode_payload` and reads a
profile's bins and codebooks), LMCache's adapters, controllers or threads, frames'
layout (``kvstore.frame`` owns it), ObjectKey → name mapping (``kvstore_lmcache.keymap``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import runpy
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np
import torch
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.distributed.serde import (
    AsyncSerdeProcessor,
    Deserializer,
    SerdeProcessor,
    Serializer,
    get_registered_serde_types,
    register_serde_factory,
)

from kvstore import codec as codecs
from kvstore.codec.base import Codec, dtype_name
from kvstore.codec.cachegen import CacheGenCodec
from kvstore.codec.cachegen_format import HEAD, itemsize
from kvstore.codec.cachegen_kernels import LANES, PROB_BITS, STATE_BYTES
from kvstore.codec.cachegen_tables import alphabet
from kvstore.frame import (
    PAD_MAX,
    PREFIX_LEN,
    FrameError,
    FrameHeader,
    LengthMismatchError,
    MisplacedFrameError,
    decode_frame,
    read_header,
)
from kvstore.keys import DEFAULT_NAMESPACE, MAX_NAME_LEN
from kvstore.tier import codec_for
from kvstore_lmcache.keymap import mp_object_name, payload_of

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.memory_management import MemoryObj

log = logging.getLogger("kvstore.mp_serde")

SERDE_TYPE = "kvstore_cachegen"
SLOT_ALIGN = 4096  # slots are whole pages, so LMCache's fs adapter may use O_DIRECT
FALLBACK_SLOT = SLOT_ALIGN  # the estimate for layouts the codec cannot take: serialize then fails
HEADER_SLACK = 1024  # room for header fields a later codec version may add to ``meta``
# ... and for the padding writers add so the payload is 64-byte aligned: the slot size
# (and so whether objects stored by an earlier kvstore still read) must not change
assert PAD_MAX < HEADER_SLACK // 4
OPTIONS = ("codec", "preset", "profile", "threads", "namespace", "slot_ratio", "max_workers")

# Bits per symbol the rANS coder can spend above the symbol's code length log2(M/f).
# Coding a symbol of frequency f maps a state x to at most (x + f) * M / f, i.e. code
# length + log2(1 + f/x).  A state is renormalised (16 bits out) when
# x >= f * 2**(31 - PROB_BITS), leaving x >= f * 2**(31 - PROB_BITS - 16), so
# f/x <= 2**(PROB_BITS - 15).  States start at 2**15 and never end below it, so the
# words written per lane are bounded by the summed code lengths plus this excess.
RANS_EXCESS_BITS = math.log2(1 + 2.0 ** (PROB_BITS - 15))
_COST_MARGIN = 1e-3  # the encoder compares table costs in float32; its pick may be a hair off


class SlotOverflowError(FrameError):
    """A chunk's frame is larger than the configured slot (``slot_ratio`` too small)."""


def frame_view(blob: bytes | bytearray | memoryview) -> memoryview:
    """The kvstore frame at the start of a stored slot, without its padding.

    Checks the prefix and header (``read_header``); the payload is checked by whoever
    decodes the result (``kvstore.frame.decode_frame`` or ``Codec.decode``).
    """
    mv = memoryview(blob).cast("B")
    header, off = read_header(mv)
    end = off + header.plen
    if end > len(mv):
        raise LengthMismatchError(f"frame needs {end} bytes, the object has {len(mv)} (truncated)")
    return mv[:end]


@dataclass(frozen=True, slots=True)
class SerdeOptions:
    """The ``"serde"`` object of an adapter spec, validated."""

    codec: str = "cachegen"
    namespace: str = DEFAULT_NAMESPACE
    slot_ratio: float | None = None
    max_workers: int = 1
    codec_options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, object]) -> SerdeOptions:
        unknown = sorted(set(kwargs) - set(OPTIONS))
        if unknown:
            raise ValueError(
                f"{SERDE_TYPE}: unknown option(s) {', '.join(unknown)}; known: {', '.join(OPTIONS)}"
            )
        spec = str(kwargs.get("codec", "cachegen"))
        name, parsed = codecs.parse_spec(spec)
        if name != CacheGenCodec.name:
            raise ValueError(
                f"{SERDE_TYPE}: codec must be a cachegen spec (cachegen?profile=...), not {spec!r}"
            )
        options = dict(parsed)
        for key in ("preset", "profile", "threads"):
            if key in kwargs:
                options[key] = kwargs[key]
        raw_ratio = kwargs.get("slot_ratio")
        ratio = None if raw_ratio is None else _number("slot_ratio", raw_ratio)
        if ratio is not None and not 0 < ratio <= 2:
            raise ValueError(f"{SERDE_TYPE}: slot_ratio must be in (0, 2], got {ratio}")
        workers = int(_number("max_workers", kwargs.get("max_workers", 1)))
        if workers < 1:
            raise ValueError(f"{SERDE_TYPE}: max_workers must be >= 1, got {workers}")
        namespace = str(kwargs.get("namespace", DEFAULT_NAMESPACE))
        if not namespace:
            raise ValueError(f"{SERDE_TYPE}: namespace must not be empty")
        return cls(name, namespace, ratio, workers, tuple(sorted(options.items())))


def _kv_view(obj: MemoryObj, what: str) -> torch.Tensor:
    """The single KV tensor of `obj` as cachegen takes it: ``[2, L, T, C]`` or MLA ``[1, L, T, D]``."""
    shapes = obj.get_shapes()
    if len(shapes) != 1:
        raise ValueError(f"{SERDE_TYPE} takes single-group KV objects; the {what} has {len(shapes)} groups")
    tensor = obj.tensor
    if tensor is None:
        raise ValueError(f"the {what} MemoryObj is invalid")
    if tensor.dim() == 3:  # MLA: [layers, tokens, dim]
        tensor = tensor.unsqueeze(0)
    return tensor


def _flat_bytes(obj: MemoryObj, what: str) -> torch.Tensor:
    tensor = obj.tensor
    if tensor is None:
        raise ValueError(f"the {what} MemoryObj is invalid")
    return tensor.reshape(-1).view(torch.uint8)


class CacheGenFrameSerde(Serializer, Deserializer):
    """Serializer and deserializer in one: ObjectKey + KV MemoryObj ↔ kvstore frame in a slot."""

    def __init__(self, options: SerdeOptions | None = None) -> None:
        self.options = options or SerdeOptions()
        codec = codecs.get(self.options.codec, **dict(self.options.codec_options))
        assert isinstance(codec, CacheGenCodec)
        self.codec: CacheGenCodec = codec
        self._decoders: dict[str, Codec] = {codec.name: codec}
        self._slots: dict[tuple[tuple[int, ...], torch.dtype], int] = {}

    # ---- sizes ------------------------------------------------------------------------

    def slot_bytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        """The stored size of every object of this layout (a multiple of `SLOT_ALIGN`).

        Default: an upper bound of the frame.  Per (plane, layer) stream, every channel
        is coded with the table that costs it least, so it costs no more than under the
        table whose longest code is shortest; rANS adds at most `RANS_EXCESS_BITS` per
        symbol, and 16 bytes of final states.  Scales, table choices, bins and lengths
        have fixed sizes; the header is bounded with a key of `MAX_NAME_LEN` bytes.
        With ``slot_ratio``: that fraction of the raw bytes (a chunk that does not fit
        fails to store and is logged; it is never cut).
        """
        key = (tuple(int(d) for d in shape), dtype)
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = self._slot_bytes(key[0], dtype)
        return slot

    def _slot_bytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        if len(shape) == 3:
            shape = (1, *shape)
        if len(shape) != 4 or shape[0] not in (1, 2) or min(shape) < 1:
            raise ValueError(f"{SERDE_TYPE} takes [2, L, T, C] or MLA [L, T, D] KV objects, not {shape}")
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"{SERDE_TYPE} takes float16, bfloat16 or float32 KV, not {dtype}")
        if self.options.slot_ratio is not None:
            raw = math.prod(shape) * dtype.itemsize
            return _align(math.ceil(raw * self.options.slot_ratio))
        return _align(PREFIX_LEN + self._header_bound(shape, dtype) + self._payload_bound(shape, dtype))

    def _header_bound(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        prof = self.codec.profile_for(shape[1])
        worst = FrameHeader(
            codec=self.codec.name,
            dtype=dtype_name(dtype),
            shape=shape,
            layout="lmcache:" + "X" * 32,
            plen=1 << 62,
            csum=0xFFFFFFFF,
            key="x" * MAX_NAME_LEN,
            ctime=time.time(),
            meta={"profile": prof.name},
        )
        return len(msgpack.packb(worst.to_map(), use_bin_type=True)) + HEADER_SLACK

    def _payload_bound(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        P, L, T, C = shape
        prof = self.codec.profile_for(L)
        cset = prof.codebook_set()
        S = P * L
        scale_size = 4 if cset.channel_scales is not None else itemsize(dtype_name(dtype))
        total = HEAD.size + len(cset.id.encode()) + S + S * C + 4 * S + S * T * scale_size
        for bins in [prof.key_bins, prof.value_bins][:P]:
            for b in bins:
                book = cset.book(alphabet(int(b)))
                longest = float(book.codelen.max(axis=1).min())  # bits/symbol of the best worst-case table
                bits = T * C * (longest + RANS_EXCESS_BITS) * (1 + _COST_MARGIN)
                words = min(math.ceil(bits / 16) + LANES, T * C)  # the coder never writes > 1 word/symbol
                total += STATE_BYTES + 2 * words
        return total

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        """`slot_bytes` of the layout; `FALLBACK_SLOT` for one the codec cannot take.

        Never raises: LMCache calls this outside any error handling when it allocates
        temp buffers, so an unsupported layout gets a small buffer and then a failed
        serialize (store) or a short read (load), both of which LMCache handles.
        """
        try:
            if len(layout_desc.shapes) != 1:
                raise ValueError(f"{SERDE_TYPE} takes single-group KV objects")
            return self.slot_bytes(layout_desc.shapes[0], layout_desc.dtypes[0])
        except (ValueError, FrameError) as exc:
            log.error("kvstore: %s cannot store objects of layout %s: %s", SERDE_TYPE, layout_desc, exc)
            return FALLBACK_SLOT

    # ---- serialize --------------------------------------------------------------------

    def frame_parts(self, src: MemoryObj, key: ObjectKey) -> list[memoryview]:
        """The frame a kvstore cold tier would write for this chunk (header, payload)."""
        tensor, layout = payload_of(src)
        if tensor.dim() == 3:
            tensor = tensor.unsqueeze(0)
        return self.codec.frame_parts(tensor, key=mp_object_name(key, self.options.namespace), layout=layout)

    def serialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> int:
        _kv_view(src, "source")  # refuses multi-group objects before encoding
        parts = self.frame_parts(src, key)
        out = _flat_bytes(dst, "destination")
        slot = out.numel()
        n = sum(p.nbytes for p in parts)
        if n > slot:
            log.warning(
                "kvstore: %s frame of %d bytes does not fit its %d-byte slot; chunk not stored "
                "(raise slot_ratio or leave it unset)",
                SERDE_TYPE,
                n,
                slot,
            )
            raise SlotOverflowError(f"frame of {n} bytes does not fit a {slot}-byte slot")
        buf = out.numpy()
        off = 0
        for p in parts:
            buf[off : off + p.nbytes] = np.frombuffer(p, dtype=np.uint8)
            off += p.nbytes
        buf[off:] = 0  # the buffer is reused L1 memory: never store what it held before
        return slot

    # ---- deserialize ------------------------------------------------------------------

    def deserialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> None:
        blob = _flat_bytes(src, "source").numpy().data
        frame = decode_frame(frame_view(blob), key=mp_object_name(key, self.options.namespace))
        header = frame.header
        target = _kv_view(dst, "destination")
        if tuple(header.shape) != tuple(target.shape) or header.dtype != dtype_name(target.dtype):
            raise FrameError(
                f"object holds {tuple(header.shape)} {header.dtype}; LMCache expects "
                f"{tuple(target.shape)} {dtype_name(target.dtype)}"
            )
        self._decoder(header.codec).decode_payload(frame.payload, header, out=target)

    def _decoder(self, name: str) -> Codec:
        dec = self._decoders.get(name)
        if dec is None:
            dec = self._decoders[name] = codec_for(name)  # (a bare name; options refused)
        return dec


def _align(n: int) -> int:
    return max(SLOT_ALIGN, -(-n // SLOT_ALIGN) * SLOT_ALIGN)


def _number(option: str, value: object) -> float:
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            return float(value)
        except ValueError:
            pass
    raise ValueError(f"{SERDE_TYPE}: {option} must be a number, got {value!r}")


def create_serde(kwargs: dict[str, object]) -> SerdeProcessor:
    """LMCache's serde factory for ``{"type": "kvstore_cachegen", ...}``."""
    options = SerdeOptions.from_kwargs(kwargs)
    serde = CacheGenFrameSerde(options)
    return AsyncSerdeProcessor(serde, serde, max_workers=options.max_workers)


def register() -> None:
    """Register `SERDE_TYPE` with LMCache's serde factory (idempotent)."""
    if SERDE_TYPE not in get_registered_serde_types():
        register_serde_factory(SERDE_TYPE, create_serde)


register()


# ---- loading it into the server --------------------------------------------------------


class LMCacheL2Adapter(L2AdapterInterface):
    """LMCache's own L2 adapter for ``adapter_params``, built through LMCache's ``plugin`` type.

    ``{"type": "plugin", "module_path": "kvstore_lmcache.mp_serde", "class_name":
    "LMCacheL2Adapter", "adapter_params": {"type": "fs", "base_path": ...}, "serde":
    {"type": "kvstore_cachegen"}}``: LMCache imports this module (registering the serde),
    then calls the class with ``adapter_params``; the call returns the adapter LMCache
    itself builds for that spec (an ``FSL2Adapter`` here), which the server then wraps
    with the serde named in the outer spec.  Nothing of kvstore sits in the data path
    besides the serde.
    """

    def __new__(cls, params: Mapping[str, Any], l1_memory_desc: Any = None) -> Any:
        from lmcache.v1.distributed.l2_adapters import create_l2_adapter
        from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

        spec = dict(params)
        if spec.get("type") in (None, "plugin") or "serde" in spec:
            raise ValueError(
                "LMCacheL2Adapter: adapter_params must be one LMCache adapter spec with a 'type' "
                "other than 'plugin' and no 'serde' (put the serde on the outer spec)"
            )
        ns = argparse.Namespace(l2_adapter=[json.dumps(spec)])
        (config,) = parse_args_to_l2_adapters_config(ns).adapters
        return create_l2_adapter(config, l1_memory_desc)


def verify_fs(
    base_path: str | os.PathLike[str], *, namespace: str = DEFAULT_NAMESPACE, quarantine: bool = False
) -> dict[str, Any]:
    """Check every object of an ``fs`` L2 directory written through this serde.

    An object is good when its frame and payload checksums hold and its key is the
    kvstore name of the ObjectKey its file name encodes.  LMCache fails a whole load
    task when one of its objects does not deserialize and never removes that object, so
    a damaged file keeps costing misses until it goes: with ``quarantine`` it is renamed
    to ``<name>.corrupt``, which LMCache's lookups no longer see.
    """
    from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import _filename_to_object_key

    report: dict[str, Any] = {"ok": 0, "corrupt": [], "quarantined": 0}
    for path in sorted(Path(base_path).glob("*.data")):
        try:
            key = _filename_to_object_key(path.name)
            if key is None:
                raise MisplacedFrameError("the file name is not an LMCache fs object name")
            decode_frame(frame_view(path.read_bytes()), key=mp_object_name(key, namespace))
        except (FrameError, OSError) as exc:
            report["corrupt"].append({"file": path.name, "error": f"{type(exc).__name__}: {exc}"})
            if quarantine:
                path.rename(path.with_name(path.name + ".corrupt"))
                report["quarantined"] += 1
            continue
        report["ok"] += 1
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvstore_lmcache.mp_serde ARGS``: LMCache's MP server with the serde registered.

    ARGS are the server's own (``--host``, ``--port``, ``--l1-size-gb``,
    ``--eviction-policy``, ``--l2-adapter`` …), passed through unchanged;
    ``python -m kvstore_lmcache.mp_serde lmcache server ARGS`` runs LMCache's ``lmcache`` command
    (its HTTP-fronted server) instead.
    ``python -m kvstore_lmcache.mp_serde verify DIR [--namespace NS] [--quarantine]`` checks an
    ``fs`` L2 directory instead (`verify_fs`; exit status 1 if any object is damaged).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["verify"]:
        parser = argparse.ArgumentParser(prog="python -m kvstore_lmcache.mp_serde verify")
        parser.add_argument("base_path")
        parser.add_argument("--namespace", default=DEFAULT_NAMESPACE)
        parser.add_argument("--quarantine", action="store_true")
        opts = parser.parse_args(args[1:])
        report = verify_fs(opts.base_path, namespace=opts.namespace, quarantine=opts.quarantine)
        print(json.dumps(report, indent=1))
        return 1 if report["corrupt"] else 0
    register()
    if args[:1] == ["lmcache"]:  # LMCache's own command line: ``lmcache server ...``
        from lmcache.cli.main import main as lmcache_main

        lmcache_main(args[1:])
        return 0
    sys.argv = ["lmcache.v1.multiprocess.server", *args]
    runpy.run_module("lmcache.v1.multiprocess.server", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "SERDE_TYPE",
    "CacheGenFrameSerde",
    "LMCacheL2Adapter",
    "SerdeOptions",
    "SlotOverflowError",
    "create_serde",
    "frame_view",
    "main",
    "register",
    "verify_fs",
]
