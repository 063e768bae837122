"""The `raw` codec: a tensor's bytes as they are, zero-copy both ways.

Owns: nothing but the view arithmetic.  `encode_parts` returns a view of the tensor's
own memory (the tensor must stay alive until the write completes); `decode_payload`
returns a tensor sharing the payload buffer, or copies once into `out`.
"""

from __future__ import annotations

import warnings

import torch

from kvstore.codec.base import Codec, Encoded, dtype_from_name, dtype_name
from kvstore.frame import FrameError, FrameHeader


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A flat byte view of a CPU tensor's memory (copies only if it is not contiguous)."""
    if tensor.device.type != "cpu":
        raise ValueError("raw codec takes CPU tensors; copy device tensors to host first")
    t = tensor.contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().data.cast("B")


# Read-only payloads (the memory tier's zero-copy views) make torch warn once per process;
# the tensors handed out are documented as read-only views.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


class RawCodec(Codec):
    name = "raw"

    def frames_in_place(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.is_contiguous()

    def encode_parts(self, tensor: torch.Tensor, *, layout: str = "raw") -> Encoded:
        return Encoded(
            parts=[tensor_bytes(tensor)],
            dtype=dtype_name(tensor.dtype),
            shape=tuple(tensor.shape),
            layout=layout,
        )

    def decode_payload(
        self, payload: memoryview, header: FrameHeader, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        dtype = dtype_from_name(header.dtype)
        numel = 1
        for d in header.shape:
            numel *= d
        if numel * dtype.itemsize != len(payload):
            raise FrameError(
                f"raw payload of {len(payload)} bytes does not hold {header.shape} {header.dtype}"
            )
        if numel == 0:
            t = torch.empty(header.shape, dtype=dtype)
        else:
            t = torch.frombuffer(payload, dtype=torch.uint8).view(dtype).view(header.shape)
        if out is None:
            return t
        if tuple(out.shape) != tuple(header.shape) or out.dtype != dtype:
            raise ValueError(f"out is {tuple(out.shape)} {out.dtype}; frame holds {header.shape} {dtype}")
        out.copy_(t)
        return out
