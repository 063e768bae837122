"""Probability tables of the `cachegen` codec: codebooks of rANS frequency tables.

Owns: integer frequency tables (each sums to ``2**PROB_BITS``, every symbol >= 1), the
derived encode/decode arrays, the builtin parametric codebook and codebook fitting
(k-means under code length).  Must not touch: tensors' layout, payload format, files.

A *codebook* is K <= 256 tables for one alphabet size A (= 2*MAX+1 symbols for a bin
count).  Each coded channel names the table that codes it cheapest (one byte per
channel per chunk), so tables adapt per chunk without shipping them in the payload.
A `CodebookSet` maps alphabet sizes to codebooks and is identified by (id, digest); a
payload records both and decoding resolves them (see `cachegen_profile`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import xxhash

from kvstore.codec.cachegen_kernels import PROB_BITS, PROB_SCALE

MAX_TABLES = 256
BUILTIN_ID = "builtin-v1"


def bins_to_max(bins: int) -> int:
    """LMCache's quantization range: symbols 0..2*MAX with MAX = bins // 2 - 1."""
    return bins // 2 - 1


def alphabet(bins: int) -> int:
    return 2 * bins_to_max(bins) + 1


def check_bins(bins: int) -> int:
    b = int(bins)
    if not 4 <= b <= 256:
        raise ValueError(f"bin count {bins} out of range; use 4..256")
    return b


def normalize_freqs(p: np.ndarray) -> np.ndarray:
    """Probabilities (any non-negative weights) -> uint32 frequencies summing to PROB_SCALE,
    each >= 1.  Deterministic: remainders go to the largest fractional parts, then index."""
    p = np.asarray(p, dtype=np.float64)
    a = p.shape[0]
    if a > PROB_SCALE // 2:
        raise ValueError("alphabet too large for the probability precision")
    tot = p.sum()
    p = np.full(a, 1.0 / a) if not tot > 0 else p / tot
    budget = PROB_SCALE - a
    raw = p * budget
    f = np.floor(raw)
    rem = int(budget - f.sum())
    order = np.lexsort((np.arange(a), -(raw - f)))
    f[order[:rem]] += 1
    out = (f + 1).astype(np.uint32)
    assert int(out.sum()) == PROB_SCALE
    return out


@dataclass(frozen=True)
class Codebook:
    """K frequency tables over one alphabet; derived arrays are built once."""

    alphabet: int
    freqs: np.ndarray  # uint32 [K, A]
    cum: np.ndarray = field(init=False, repr=False)
    lut: np.ndarray = field(init=False, repr=False)
    codelen: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        f = np.ascontiguousarray(self.freqs, dtype=np.uint32)
        if f.ndim != 2 or f.shape[1] != self.alphabet or not 1 <= f.shape[0] <= MAX_TABLES:
            raise ValueError(f"codebook for alphabet {self.alphabet} has shape {f.shape}")
        if (f < 1).any() or (f.sum(axis=1) != PROB_SCALE).any():
            raise ValueError("codebook tables must be >= 1 and sum to 2**PROB_BITS")
        object.__setattr__(self, "freqs", f)
        cum = np.zeros_like(f)
        cum[:, 1:] = np.cumsum(f, axis=1)[:, :-1]
        object.__setattr__(self, "cum", cum)
        lut = np.empty((f.shape[0], PROB_SCALE), np.uint8)
        sym = np.arange(self.alphabet, dtype=np.uint8)
        for k in range(f.shape[0]):
            lut[k] = np.repeat(sym, f[k])
        object.__setattr__(self, "lut", lut)
        object.__setattr__(self, "codelen", (PROB_BITS - np.log2(f)).astype(np.float32))

    @property
    def size(self) -> int:
        return int(self.freqs.shape[0])


@dataclass(frozen=True)
class CodebookSet:
    """Codebooks by alphabet size, with the identity payloads record."""

    id: str
    books: dict[int, Codebook]
    # Optional per-channel scales [2 (K, V), L, C]: channels are divided by them before
    # per-token quantization and multiplied back after (equalizes outlier channels).
    channel_scales: np.ndarray | None = None
    digest: int = field(init=False)

    def __post_init__(self) -> None:
        h = xxhash.xxh3_64()
        h.update(f"{self.id}|{PROB_BITS}".encode())
        if self.channel_scales is not None:
            cs = np.ascontiguousarray(self.channel_scales, dtype=np.float32)
            if cs.ndim != 3 or cs.shape[0] != 2 or not (np.isfinite(cs).all() and (cs > 0).all()):
                raise ValueError("channel scales must be finite, positive, shaped [2, layers, channels]")
            object.__setattr__(self, "channel_scales", cs)
            h.update(np.array(cs.shape, np.uint32).tobytes())
            h.update(cs.tobytes())
        for a in sorted(self.books):
            h.update(np.array([a, self.books[a].size], np.uint32).tobytes())
            h.update(self.books[a].freqs.tobytes())
        object.__setattr__(self, "digest", h.intdigest())

    def book(self, a: int) -> Codebook:
        b = self.books.get(a)
        if b is None:
            raise ValueError(
                f"codebook set {self.id!r} has no tables for {a} symbols (bins {a + 1}); "
                "calibrate a profile for these bins"
            )
        return b

    def to_json(self) -> dict[str, list[list[int]]]:
        return {str(a): b.freqs.tolist() for a, b in sorted(self.books.items())}

    def scales_json(self) -> list[str] | None:
        """Channel scales as hex float32 bytes per (plane, layer): exact round trip."""
        if self.channel_scales is None:
            return None
        cs = self.channel_scales
        return [cs[p, i].astype("<f4").tobytes().hex() for p in range(2) for i in range(cs.shape[1])]

    @classmethod
    def from_json(
        cls, id: str, m: dict[str, list[list[int]]], scales: list[str] | None = None
    ) -> CodebookSet:
        cs = None
        if scales:
            rows = [np.frombuffer(bytes.fromhex(r), dtype="<f4") for r in scales]
            cs = np.stack(rows).reshape(2, len(rows) // 2, -1).astype(np.float32)
        books = {int(a): Codebook(int(a), np.array(t, dtype=np.uint32)) for a, t in m.items()}
        return cls(id, books, cs)


def builtin_codebook(a: int) -> Codebook:
    """A parametric codebook: discretized Gaussians over 16 centres x 16 widths.

    Used when no calibrated profile is given.  Generated deterministically from `a`."""
    centres = np.linspace(0.0, a - 1.0, 16)
    widths = np.geomspace(0.35, max(a / 2.0, 0.5), 16)
    xs = np.arange(a, dtype=np.float64)
    tables = []
    for mu in centres:
        for sd in widths:
            # Light tails (a small uniform floor) keep rare symbols affordable.
            p = np.exp(-0.5 * ((xs - mu) / sd) ** 2) + 1e-4
            tables.append(normalize_freqs(p))
    return Codebook(a, np.stack(tables))


_BUILTIN_CACHE: dict[int, Codebook] = {}


def builtin_set(alphabets: list[int]) -> CodebookSet:
    for a in alphabets:
        if a not in _BUILTIN_CACHE:
            _BUILTIN_CACHE[a] = builtin_codebook(a)
    return CodebookSet(BUILTIN_ID, {a: _BUILTIN_CACHE[a] for a in sorted(set(alphabets))})


def fit_codebook(hists: np.ndarray, k: int = MAX_TABLES, iters: int = 20, seed: int = 0) -> Codebook:
    """Fit K tables to per-channel symbol histograms [N, A] by k-means under code length
    (each histogram is assigned to the table that codes it in the fewest bits)."""
    import torch

    h = torch.as_tensor(np.asarray(hists, dtype=np.float32))
    a = h.shape[1]
    h = h[h.sum(1) > 0]
    k = max(1, min(k, MAX_TABLES, h.shape[0]))
    g = torch.Generator().manual_seed(seed)
    centres = h[torch.randperm(h.shape[0], generator=g)[:k]] + 0.5
    for _ in range(iters):
        p = centres / centres.sum(1, keepdim=True)
        cost = h @ (-torch.log2(p)).T  # [N, K] bits
        best = cost.argmin(1)
        sums = torch.zeros(k, a).index_add_(0, best, h)
        counts = torch.bincount(best, minlength=k)
        empty = (counts == 0).nonzero().flatten()
        if len(empty):
            worst = cost.gather(1, best[:, None]).flatten().argsort(descending=True)[: len(empty)]
            sums[empty] = h[worst]
        centres = sums + 0.02 * sums.sum(1, keepdim=True) / a + 1e-3
    freqs = np.stack([normalize_freqs(c.numpy()) for c in centres])
    return Codebook(a, freqs)


def codebook_bits(book: Codebook, hists: np.ndarray) -> float:
    """Bits to code histograms [N, A] choosing the best table for each (table ids excluded)."""
    cost = np.asarray(hists, np.float32) @ book.codelen.T
    return float(cost.min(1).sum())


def entropy_bits(hists: np.ndarray) -> float:
    h = np.asarray(hists, np.float64)
    tot = h.sum(1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(h > 0, h / np.maximum(tot, 1), 1.0)
    return float(-(h * np.log2(p)).sum())


__all__ = [
    "BUILTIN_ID",
    "Codebook",
    "CodebookSet",
    "alphabet",
    "bins_to_max",
    "builtin_set",
    "check_bins",
    "codebook_bits",
    "entropy_bits",
    "fit_codebook",
    "normalize_freqs",
]
