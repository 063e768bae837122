"""One side of the two-process test: `write` stores a prompt's KV, `read` looks it up.

Run as ``python -m tests.lmcache.two_process_worker write|read``; LMCache is configured by
the LMCACHE_* environment the test passes.  Prints one JSON line.
"""

from __future__ import annotations

import json
import sys

import torch

from kvstore.demo.cpu_engine import build_cpu_engine
from tests.lmcache.helpers import CHUNK, HEAD_DIM, HEADS, LAYERS, empty, random_kv


def main(role: str) -> None:
    eng = build_cpu_engine(
        model_name="tiny-test", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype=torch.bfloat16
    )
    tokens = torch.arange(4 * CHUNK)
    kv = random_kv(len(tokens), seed=7)
    try:
        if role == "write":
            eng.engine.store(tokens, kvcaches=kv)
            ok = eng.wait_for_writes(30)
            print(json.dumps({"stored": ok}))
        else:
            out = empty(len(tokens))
            hit, got = eng.lookup_then_load(tokens, out)
            equal = all(torch.equal(a[0][:, :, :got], b[0][:, :, :got]) for a, b in zip(kv, out))
            print(json.dumps({"hit": hit, "got": got, "equal": equal}))
    finally:
        eng.close()


if __name__ == "__main__":
    main(sys.argv[1])
