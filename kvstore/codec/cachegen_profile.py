"""Bin layouts and codebooks for the `cachegen` codec: presets, profiles, resolution.

Owns: `Profile` (per-layer K/V bin counts + the codebook set they are coded with), its
JSON file format, the `lmcache` preset, and the process-wide resolver that turns a
payload's (codebook id, digest) back into tables.  Must not touch: tensors, payloads.

Resolution order for a payload's codebook set: the builtin parametric set; sets of
profiles loaded in this process; profiles shipped in ``kvstore/codec/profiles``; files
in ``$KVSTORE_CODEC_PROFILES`` (a path list).  A miss raises `UnknownCodebookError`
naming the id, so an operator knows which profile file to supply.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.codec.base import CodecUnavailableError
from kvstore.codec.cachegen_tables import (
    BUILTIN_ID,
    CodebookSet,
    alphabet,
    builtin_set,
    check_bins,
)

PROFILE_FORMAT = "kvstore-cachegen-profile"
PROFILE_VERSION = 1
PROFILE_DIR = Path(__file__).with_name("profiles")


class UnknownCodebookError(CodecUnavailableError):
    """A payload was coded with tables this process cannot find."""


def lmcache_bins(num_layers: int) -> tuple[list[int], list[int]]:
    """LMCache's CacheGen layout: K 32 bins for layers < 10, V for layers < 2, else 16;
    models under 10 layers use 32 everywhere."""
    if num_layers < 10:
        return [32] * num_layers, [32] * num_layers
    k = [32 if i < 10 else 16 for i in range(num_layers)]
    v = [32 if i < 2 else 16 for i in range(num_layers)]
    return k, v


@dataclass(frozen=True)
class Profile:
    name: str
    key_bins: list[int]
    value_bins: list[int]
    codebooks: CodebookSet | None = None  # None: the builtin parametric set
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.key_bins) != len(self.value_bins) or not self.key_bins:
            raise ValueError("a profile needs one K and one V bin count per layer")
        for b in (*self.key_bins, *self.value_bins):
            check_bins(b)

    @property
    def num_layers(self) -> int:
        return len(self.key_bins)

    def codebook_set(self) -> CodebookSet:
        if self.codebooks is not None:
            return self.codebooks
        return builtin_set(sorted({alphabet(b) for b in (*self.key_bins, *self.value_bins)}))

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "name": self.name,
            "num_layers": self.num_layers,
            "key_bins": list(self.key_bins),
            "value_bins": list(self.value_bins),
            "codebook_id": self.codebooks.id if self.codebooks else BUILTIN_ID,
            "codebooks": self.codebooks.to_json() if self.codebooks else None,
            "channel_scales": self.codebooks.scales_json() if self.codebooks else None,
            "info": self.info,
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(json.dumps(self.to_json(), separators=(",", ":")) + "\n")

    @classmethod
    def from_json(cls, m: dict[str, Any]) -> Profile:
        if m.get("format") != PROFILE_FORMAT:
            raise ValueError("not a kvstore cachegen profile (format field)")
        if m.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {m.get('version')}; this kvstore reads {PROFILE_VERSION}")
        books = m.get("codebooks")
        cset = CodebookSet.from_json(str(m["codebook_id"]), books, m.get("channel_scales")) if books else None
        p = cls(
            str(m["name"]),
            [int(b) for b in m["key_bins"]],
            [int(b) for b in m["value_bins"]],
            cset,
            dict(m.get("info") or {}),
        )
        if cset is not None:
            for b in (*p.key_bins, *p.value_bins):
                cset.book(alphabet(b))
            if cset.channel_scales is not None and cset.channel_scales.shape[1] != p.num_layers:
                raise ValueError("profile channel scales do not match its layer count")
        return p

    @classmethod
    def load(cls, path_or_name: str | os.PathLike[str]) -> Profile:
        """A profile from a file path, or a shipped profile by name (``smollm2-135m``)."""
        path = Path(path_or_name)
        if not path.exists():
            shipped = PROFILE_DIR / f"{path_or_name}.json"
            if not shipped.exists():
                names = ", ".join(sorted(p.stem for p in PROFILE_DIR.glob("*.json")))
                raise FileNotFoundError(f"no profile file {path_or_name!r}; shipped profiles: {names}")
            path = shipped
        prof = cls.from_json(json.loads(path.read_text()))
        register(prof)
        return prof


_SETS: dict[tuple[str, int], CodebookSet] = {}
_SCANNED = False


def register(profile: Profile) -> None:
    cs = profile.codebooks
    if cs is not None:
        _SETS[(cs.id, cs.digest)] = cs


def _scan() -> None:
    global _SCANNED
    _SCANNED = True
    dirs = [
        PROFILE_DIR,
        *(Path(p) for p in os.environ.get("KVSTORE_CODEC_PROFILES", "").split(os.pathsep) if p),
    ]
    for d in dirs:
        files = sorted(d.glob("*.json")) if d.is_dir() else [d] if d.is_file() else []
        for f in files:
            try:
                Profile.load(f)
            except (ValueError, KeyError, OSError):
                continue


def resolve(id: str, digest: int, alphabets: list[int]) -> CodebookSet:
    """The codebook set a payload names, or `UnknownCodebookError`."""
    if id == BUILTIN_ID:
        cs = builtin_set(alphabets)
        if cs.digest == digest:
            return cs
        raise UnknownCodebookError(
            f"payload's builtin tables (digest {digest:016x}) differ from this kvstore's builtin-v1; "
            "it was written by an incompatible build"
        )
    cs = _SETS.get((id, digest))
    if cs is None and not _SCANNED:
        _scan()
        cs = _SETS.get((id, digest))
    if cs is None:
        raise UnknownCodebookError(
            f"payload was coded with codebook {id!r} (digest {digest:016x}), which is not loaded; "
            "pass its profile file (get('cachegen', profile=PATH)) or list it in $KVSTORE_CODEC_PROFILES"
        )
    return cs
