"""Request traces in the Mooncake format: one JSON object per line.

Owns: reading a trace into `Request` values.  Must not touch: policies or stores.

Fields used: ``timestamp`` (ms), ``input_length`` and ``output_length`` (tokens) and
``hash_ids`` — the prompt as block ids, one per ``block_tokens`` (512) tokens,
prefix-chained: equal ids at equal positions mean equal prefixes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class Request:
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: str | Path, limit: int | None = None) -> list[Request]:
    """The requests of a Mooncake-format JSONL file, in file order."""
    out: list[Request] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                out.append(
                    Request(
                        float(rec.get("timestamp", 0)),
                        int(rec.get("input_length", 0)),
                        int(rec.get("output_length", 0)),
                        tuple(rec["hash_ids"]),
                    )
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(
                    f"{path}:{lineno}: not a Mooncake trace record ({exc}); each line needs a "
                    "'hash_ids' list of block ids"
                ) from exc
            if limit is not None and len(out) >= limit:
                break
    return out


def distinct_blocks(requests: list[Request]) -> int:
    seen: set[int] = set()
    for r in requests:
        seen.update(r.hash_ids)
    return len(seen)
