"""The codec contract: tensor ↔ payload, and payload ↔ a standalone frame.

Owns: `Codec` (the ABC), `Encoded` (what crosses from a codec to the store) and the
dtype name table.  Must not touch: backends, I/O, placement.

A codec implements two primitives the store uses on its hot path:

* ``encode_parts(tensor, layout=...) -> Encoded``  payload parts (no copies where the
  codec allows; `raw` returns a view of the tensor's memory) plus dtype/shape/meta;
* ``decode_payload(payload, header, out=None) -> Tensor``  from a frame's payload view;
  with `out`, the result is written into the caller's tensor.

and the stable, self-contained pair outside tools use: ``encode(tensor) -> bytes`` (a
complete kvstore frame) and ``decode(buffer) -> Tensor`` (raises `FrameError` on any
corruption, never returns garbage).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from kvstore.frame import FrameError, FrameHeader, decode_frame, encode_frame

if TYPE_CHECKING:
    import torch


class CodecUnavailableError(FrameError):
    """The frame is intact, but this process cannot decode it (a codec, profile or table
    it names is not installed).  Tiers serve it as a miss and leave it in place."""


DTYPE_NAMES = (
    "float16", "bfloat16", "float32", "float64", "uint8", "int8", "int16", "int32", "int64",
    # fp8 KV caches (vLLM's ``kv_cache_dtype=fp8``): raw frames only, their bytes as stored
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    import torch

    if name not in DTYPE_NAMES:
        raise FrameError(f"unsupported dtype {name!r} in frame")
    return getattr(torch, name)


@dataclass(frozen=True, slots=True)
class Encoded:
    """A codec's output: payload parts plus what the frame header must record."""

    parts: list[memoryview]
    dtype: str
    shape: tuple[int, ...]
    layout: str
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


class Codec(abc.ABC):
    name: ClassVar[str]

    @abc.abstractmethod
    def encode_parts(self, tensor: torch.Tensor, *, layout: str = "raw") -> Encoded: ...

    @abc.abstractmethod
    def decode_payload(
        self, payload: memoryview, header: FrameHeader, out: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def frames_in_place(self, tensor: torch.Tensor) -> bool:
        """Whether encoding `tensor` reads none of its bytes (the payload is a view of its
        memory): an unsealed frame of it then costs no pass over the data."""
        return False

    def frame_parts(
        self, tensor: torch.Tensor, *, key: str = "", layout: str = "raw", sealed: bool = True
    ) -> list[memoryview]:
        """Encode and frame: the parts a backend writes (payload not copied); with
        ``sealed=False`` an `kvstore.frame.UnsealedFrame` (checksum computed later)."""
        enc = self.encode_parts(tensor, layout=layout)
        return encode_frame(
            enc.parts,
            codec=self.name,
            dtype=enc.dtype,
            shape=enc.shape,
            layout=enc.layout,
            key=key,
            meta=enc.meta,
            sealed=sealed,
        )

    def encode(self, tensor: torch.Tensor) -> bytes:
        """A complete, self-checking kvstore frame holding `tensor`."""
        return b"".join(self.frame_parts(tensor))

    def decode(self, buffer: bytes | bytearray | memoryview) -> torch.Tensor:
        """Inverse of `encode`; raises `FrameError` for anything corrupt or foreign."""
        frame = decode_frame(buffer)
        if frame.header.codec != self.name:
            raise FrameError(f"frame holds codec {frame.header.codec!r}, not {self.name!r}")
        return self.decode_payload(frame.payload, frame.header)
