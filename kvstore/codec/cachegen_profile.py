"""Bin layouts and codebooks for the `cachegen` codec: presets, profiles, resolution.

Owns: `Profile` (per-layer K/V bin counts + the codebook set they are coded with), its
JSON file format, the `lmcache` preset, and the process-wide resolver that turns a
payload's (codebook id, digest) back into tables.  Must not touch: tensors, payloads.

A profile is bound to the model it was fitted on by a `ModelFingerprint` (model name, layer
count, planes, K and V channels per layer, the dtype it was calibrated in): the encoder
refuses a tensor whose layout differs, since bins and tables fitted on one model say
nothing about another's KV.  Decoding never consults the fingerprint: a payload names its
codebook set by (id, digest), and the fingerprint is not part of the digest.

Resolution order for a payload's codebook set: the builtin parametric set; sets of
profiles loaded in this process; profiles shipped in ``kvstore/codec/profiles``; files
in ``$KVSTORE_CODEC_PROFILES`` (a path list).  A miss raises `UnknownCodebookError`
naming the id, so an operator knows which profile file to supply.
"""

from __future__ import annotations

import json
import os
import re
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
MAX_RAW_TOKENS = 64


class UnknownCodebookError(CodecUnavailableError):
    """A payload was coded with tables this process cannot find."""


class ProfileMismatchError(ValueError):
    """A tensor that does not come from the model a profile was fitted on."""


CALIBRATE_HINT = (
    "Make a profile for that model with `kvstore codec calibrate --model DIR --out PROFILE.json` "
    "(or use preset=lmcache, which fits any model)"
)
_QUANT_TAG = re.compile(r"([.-](q\d[\w]*|iq\d[\w]*|f16|f32|bf16|fp16|fp32|gguf))+$", re.IGNORECASE)


def normalize_model_name(name: str) -> str:
    """Last path component, lower case, without a GGUF file's quantization tag:
    ``HuggingFaceTB/SmolLM2-135M-Instruct`` and ``SmolLM2-135M-Instruct.Q4_1`` are one model."""
    base = name.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1].lower()
    return _QUANT_TAG.sub("", base) or base


@dataclass(frozen=True)
class ModelFingerprint:
    """The KV layout of the model a profile was fitted on.

    ``planes`` is 2 for K and V (``KV_2LTD``), 1 for MLA; ``key_channels`` /
    ``value_channels`` are per layer (``value_channels`` is empty for MLA).  ``kv_heads``,
    ``head_dim`` and ``dtype`` (what calibration ran in) are recorded for people; the
    codec checks name (when the caller gives one), planes, layers and channels."""

    name: str
    num_layers: int
    planes: int
    key_channels: tuple[int, ...]
    value_channels: tuple[int, ...]
    kv_heads: int | None = None
    head_dim: int | None = None
    dtype: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "key_channels", tuple(int(c) for c in self.key_channels))
        object.__setattr__(self, "value_channels", tuple(int(c) for c in self.value_channels))
        if not self.name or self.planes not in (1, 2) or self.num_layers < 1:
            raise ValueError("a model fingerprint needs a name, planes 1 or 2 and at least one layer")
        if len(self.key_channels) != self.num_layers or len(self.value_channels) != (
            self.num_layers if self.planes == 2 else 0
        ):
            raise ValueError("a model fingerprint needs K (and for 2 planes V) channels for every layer")
        if min((*self.key_channels, *self.value_channels)) < 1:
            raise ValueError("channel counts must be positive")

    @classmethod
    def uniform(
        cls,
        name: str,
        num_layers: int,
        channels: int,
        *,
        planes: int = 2,
        kv_heads: int | None = None,
        head_dim: int | None = None,
        dtype: str | None = None,
    ) -> ModelFingerprint:
        return cls(
            name,
            num_layers,
            planes,
            (channels,) * num_layers,
            (channels,) * num_layers if planes == 2 else (),
            kv_heads,
            head_dim,
            dtype,
        )

    def describe(self) -> str:
        chans = sorted({*self.key_channels, *self.value_channels})
        c = str(chans[0]) if len(chans) == 1 else f"{chans[0]}..{chans[-1]}"
        what = "K and V" if self.planes == 2 else "MLA (one plane)"
        return f"{self.name} ({self.num_layers} layers, {what}, {c} channels)"

    def matches_name(self, model: str) -> bool:
        return normalize_model_name(model) == normalize_model_name(self.name)

    def mismatch(self, shape: tuple[int, ...]) -> str | None:
        """Why a KV tensor of `shape` ([P, L, T, C]) is not this model's, or None."""
        P, L, _, C = (int(d) for d in shape)
        if self.planes != P:
            return f"{P} plane(s) ({'K and V' if P == 2 else 'MLA'}), the model has {self.planes}"
        if self.num_layers != L:
            return f"{L} layers, the model has {self.num_layers}"
        bad = [i for i in range(L) if self.key_channels[i] != C or (P == 2 and self.value_channels[i] != C)]
        if bad:
            i = bad[0]
            want = (
                f"{self.key_channels[i]}"
                if P == 1 or self.key_channels[i] == self.value_channels[i]
                else f"K {self.key_channels[i]} / V {self.value_channels[i]}"
            )
            return f"{C} channels per layer, the model has {want} (layer {i})"
        return None

    def to_json(self) -> dict[str, Any]:
        m: dict[str, Any] = {
            "name": self.name,
            "num_layers": self.num_layers,
            "planes": self.planes,
            "key_channels": list(self.key_channels),
            "value_channels": list(self.value_channels),
        }
        for k in ("kv_heads", "head_dim", "dtype"):
            if getattr(self, k) is not None:
                m[k] = getattr(self, k)
        return m

    @classmethod
    def from_json(cls, m: dict[str, Any]) -> ModelFingerprint:
        return cls(
            str(m["name"]),
            int(m["num_layers"]),
            int(m["planes"]),
            tuple(int(c) for c in m["key_channels"]),
            tuple(int(c) for c in m["value_channels"]),
            None if m.get("kv_heads") is None else int(m["kv_heads"]),
            None if m.get("head_dim") is None else int(m["head_dim"]),
            None if m.get("dtype") is None else str(m["dtype"]),
        )


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
    model: ModelFingerprint | None = None  # None: a profile written before fingerprints
    # Leading tokens of every chunk stored verbatim instead of quantized (0: none).  An
    # encoder policy: payloads record their own count, so decoding does not depend on it
    # and it is not part of the codebook digest.
    raw_tokens: int = 0

    def __post_init__(self) -> None:
        if len(self.key_bins) != len(self.value_bins) or not self.key_bins:
            raise ValueError("a profile needs one K and one V bin count per layer")
        if isinstance(self.raw_tokens, bool) or not isinstance(self.raw_tokens, int):
            raise ValueError(f"profile {self.name!r}: raw_tokens must be an integer")
        if not 0 <= self.raw_tokens <= MAX_RAW_TOKENS:
            raise ValueError(
                f"profile {self.name!r}: raw_tokens {self.raw_tokens} out of range 0..{MAX_RAW_TOKENS}"
            )
        for b in (*self.key_bins, *self.value_bins):
            check_bins(b)
        fp = self.model
        if fp is not None:
            if fp.num_layers != self.num_layers:
                raise ValueError(
                    f"profile {self.name!r} has bins for {self.num_layers} layers; its model has {fp.num_layers}"
                )
            cs = self.codebooks.channel_scales if self.codebooks is not None else None
            if cs is not None and (
                cs.shape[1] != fp.num_layers or fp.mismatch((fp.planes, fp.num_layers, 1, cs.shape[2]))
            ):
                raise ValueError(
                    f"profile {self.name!r}: channel scales are shaped {tuple(cs.shape)} (planes, layers, "
                    f"channels); its model {fp.describe()} needs (2, {fp.num_layers}, {fp.key_channels[0]})"
                )

    def bound_to(self, model: ModelFingerprint) -> Profile:
        """This profile with `model` as its fingerprint (same bins, tables and digest)."""
        return Profile(
            self.name, self.key_bins, self.value_bins, self.codebooks, dict(self.info), model, self.raw_tokens
        )

    def check_tensor(self, shape: tuple[int, ...]) -> None:
        """Raise `ProfileMismatchError` unless a KV tensor of `shape` is this profile's model's."""
        fp = self.model
        if fp is None:
            raise ProfileMismatchError(
                f"profile {self.name!r} names no model (it was written before profiles were bound "
                "to their model), so kvstore cannot check that this KV fits it; re-run "
                "`kvstore codec calibrate` for your model, or stamp this profile with "
                "`kvstore codec bind PROFILE --model DIR` if you know it was fitted on that model"
            )
        why = fp.mismatch(shape)
        if why is not None:
            raise ProfileMismatchError(
                f"profile {self.name!r} was calibrated on {fp.describe()}; this tensor "
                f"{tuple(int(d) for d in shape)} has {why}: it is another model's KV. {CALIBRATE_HINT}"
            )

    def check_model_name(self, model: str) -> None:
        fp = self.model
        if fp is not None and not fp.matches_name(model):
            raise ProfileMismatchError(
                f"profile {self.name!r} was calibrated on {fp.name!r}, not {model!r}. {CALIBRATE_HINT}"
            )

    @property
    def num_layers(self) -> int:
        return len(self.key_bins)

    def codebook_set(self) -> CodebookSet:
        if self.codebooks is not None:
            return self.codebooks
        return builtin_set(sorted({alphabet(b) for b in (*self.key_bins, *self.value_bins)}))

    def to_json(self) -> dict[str, Any]:
        m: dict[str, Any] = {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "name": self.name,
            "num_layers": self.num_layers,
            "key_bins": list(self.key_bins),
            "value_bins": list(self.value_bins),
            "codebook_id": self.codebooks.id if self.codebooks else BUILTIN_ID,
            "codebooks": self.codebooks.to_json() if self.codebooks else None,
            "channel_scales": self.codebooks.scales_json() if self.codebooks else None,
            "model": self.model.to_json() if self.model is not None else None,
            "info": self.info,
        }
        if self.raw_tokens:  # absent when 0, so older profiles save as they were
            m["raw_tokens"] = self.raw_tokens
        return m

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
            ModelFingerprint.from_json(m["model"]) if m.get("model") else None,
            m.get("raw_tokens", 0),
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
    found = _SETS.get((id, digest))
    if found is None and not _SCANNED:
        _scan()
        found = _SETS.get((id, digest))
    if found is None:
        raise UnknownCodebookError(
            f"payload was coded with codebook {id!r} (digest {digest:016x}), which is not loaded; "
            "pass its profile file (get('cachegen', profile=PATH)) or list it in $KVSTORE_CODEC_PROFILES"
        )
    return found
