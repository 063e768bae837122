"""Random paged KV caches and slot mappings for the kvstore.gpu tests and benchmark."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Geometry per layout: small, but with several blocks, heads and a head size that is not
# a power of two so that row arithmetic mistakes show up.
GEOMETRY = {
    "flash_attn": dict(num_layers=3, num_blocks=24, block_size=8, heads=2, head_size=6),
    "flash_infer": dict(num_layers=3, num_blocks=24, block_size=8, heads=2, head_size=6),
    "mla": dict(num_layers=3, num_blocks=24, block_size=8, heads=1, head_size=10),
}
LAYOUTS = tuple(GEOMETRY)


def layer_shape(layout: str, g: dict) -> tuple[int, ...]:
    nb, bs, h, d = g["num_blocks"], g["block_size"], g["heads"], g["head_size"]
    if layout == "flash_attn":
        return (2, nb, bs, h, d)
    if layout == "flash_infer":
        return (nb, 2, bs, h, d)
    return (nb, bs, d)


def make_caches(layout: str, *, dtype=torch.float32, device="cpu", fill="random", seed=0, **over):
    g = {**GEOMETRY[layout], **over}
    gen = torch.Generator().manual_seed(seed)
    shape = layer_shape(layout, g)
    caches = []
    for _ in range(g["num_layers"]):
        if fill == "random":
            t = torch.randn(shape, generator=gen).to(dtype)
        else:
            t = torch.zeros(shape, dtype=dtype)
        caches.append(t.to(device))
    return caches


def reference_token(layout: str, cache: torch.Tensor, slot: int, block_size: int) -> torch.Tensor:
    """[K, W] for one token, read with plain tensor indexing (independent of layout.py)."""
    b, o = divmod(int(slot), block_size)
    if layout == "flash_attn":
        return torch.stack([cache[0, b, o].reshape(-1), cache[1, b, o].reshape(-1)])
    if layout == "flash_infer":
        return torch.stack([cache[b, 0, o].reshape(-1), cache[b, 1, o].reshape(-1)])
    return cache[b, o].reshape(1, -1)


@dataclass
class Requests:
    lengths: list[int]
    slots: list[torch.Tensor]  # per request, int64, non-contiguous blocks


def random_requests(lengths, *, num_blocks: int, block_size: int, seed: int = 0) -> Requests:
    """Disjoint, shuffled blocks per request; the last block of a request may be partial."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    slots = []
    for n in lengths:
        need = math.ceil(n / block_size)
        if need > len(order):
            raise ValueError("not enough blocks for these requests")
        blocks, order = order[:need], order[need:]
        t = torch.arange(n)
        slots.append(torch.tensor(blocks)[t // block_size] * block_size + t % block_size)
    return Requests(list(lengths), slots)
