"""Time to first token of vLLM with LMCache's MP server over kvstore, end to end.

One offline vLLM engine per mode, each in its own process, on one GPU:

* ``none``: no connector; every prompt is prefilled (what a server without a KV cache pays);
* ``kvstore``: LMCache's MP connector and server (``python -m lmcache.v1.multiprocess.server``)
  with kvstore's L2 adapter on a local directory;
* ``fs``: the same with LMCache's own ``fs`` L2 adapter on a local directory (the peer).

vLLM's own prefix cache is off, so a repeated prompt is either prefilled again or loaded
through LMCache. Each round sends ``--prompts`` new prompts (``cold``: prefill, and the
connector stores the KV), waits for the stores to settle, then repeats the oldest
``--repeats`` of them (``l2``: the server's L1 holds fewer prompts than were stored, so
these come from the L2 adapter) and then the same ones again (``l1``: now in the server's
memory). TTFT is the wall time of ``generate`` with ``max_tokens=1`` for one prompt;
``cached`` is vLLM's count of prompt tokens it did not compute. Rounds are interleaved
across phases, and the figures are min / median / max over all rounds.

Whether a repeat really came from L2 is up to LMCache's L1 (its eviction runs once a
second, and a store that finds no room is dropped), so the server's log decides: each
request's prefetch line says how many chunks were in L1 and how many were loaded from the
L2 adapter, and in what time. Those are joined to the samples by vLLM's request number
(``from_l2``, ``prefetch_ms``) and the loaded samples are summarised again by where their
chunks came from. ``--settle-each`` waits for each cold prompt's L2 writes to land before
the next prompt (without it, prompts 0.3 s apart filled the L1 with chunks not yet in L2
and later stores were dropped); ``--logs DIR`` keeps each mode's server log and engine
stderr.

The model is random (``load_format="dummy"``) with the shape of a Llama-3-8B by default:
no weights or tokenizer are needed, and compute and KV bytes per token are those of the
real model. Token ids of the cold and loaded runs are compared (``same_token``) as a
check that loaded KV is the KV that was stored.

    python3 benchmarks/bench_vllm_e2e.py --out e2e.json [--modes none,kvstore,fs]
        [--prompt-tokens 8192] [--prompts 6] [--repeats 3] [--rounds 2] [--l1-gb 4]
        [--settle-each] [--logs DIR] [--server-arg=--l2-store-policy --server-arg=skip_l1]

Needs vLLM, LMCache 0.5.6 and a CUDA device; ``kvstore_lmcache`` must be importable in
the server's environment.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import stat
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}

READY = "LMCache cache server is running"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def adapter_spec(mode: str, root: Path) -> dict[str, Any]:
    if mode == "kvstore":
        return {
            "type": "plugin",
            "module_path": "kvstore_lmcache.l2_adapter",
            "class_name": "KVStoreL2Adapter",
            "adapter_params": {"tiers": [f"file://{root}/kvstore?fsync=false"]},
        }
    if mode == "fs":
        return {"type": "fs", "base_path": f"{root}/lmcache-fs"}
    raise ValueError(f"no L2 adapter for mode {mode!r}")


def start_server(mode: str, root: Path, port: int, args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], Path]:
    log = root / f"server-{mode}.log"
    cmd = [
        sys.executable, "-m", "lmcache.v1.multiprocess.server",
        "--host", "127.0.0.1", "--port", str(port), "--chunk-size", str(args.chunk_size),
        "--l1-size-gb", str(args.l1_gb), "--eviction-policy", "LRU", "--disable-observability",
        "--l2-adapter", json.dumps(adapter_spec(mode, root)),
        *args.server_arg,
    ]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + args.server_timeout
    while time.monotonic() < deadline:
        if READY in log.read_text(errors="replace"):
            return proc, log
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"LMCache server ({mode}) did not start; its log:\n{log.read_text(errors='replace')[-4000:]}")


def dir_bytes(path: Path) -> int:
    """Bytes of the files under `path` (files renamed or removed while it looks are skipped)."""
    total = 0
    for p in path.rglob("*") if path.exists() else ():
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            total += st.st_size
    return total


def settle(path: Path, quiet_s: float, most_s: float = 60.0) -> None:
    """Wait until the L2 directory has stopped growing for `quiet_s` (its writes landed)."""
    deadline = time.monotonic() + most_s
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        now = dir_bytes(path)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.2)


def child(mode: str, args: argparse.Namespace) -> None:
    """One engine, one mode; prints one JSON line per sample and a last 'done' line."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    root = Path(args.workdir)
    model_dir = root / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(LLAMA_8B))
    server = None
    kw: dict[str, Any] = {}
    if mode != "none":
        from vllm.config import KVTransferConfig

        port = free_port()
        server, _ = start_server(mode, root, port, args)
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LMCacheMPConnector",
            kv_connector_module_path="lmcache.integration.vllm.lmcache_mp_connector",
            kv_role="kv_both",
            kv_connector_extra_config={"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port},
        )
    n = args.prompt_tokens
    try:
        t0 = time.perf_counter()
        llm = LLM(
            model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
            enable_prefix_caching=False, gpu_memory_utilization=args.gpu_util, max_model_len=n + 64,
            max_num_batched_tokens=n + 64, max_num_seqs=4, dtype="bfloat16", seed=0, **kw,
        )
        print(json.dumps({"mode": mode, "event": "ready", "startup_s": time.perf_counter() - t0}), flush=True)
        sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        rng = random.Random(1234)

        def prompt() -> list[int]:
            return [rng.randrange(1000, 120000) for _ in range(n)]

        def run(ids: list[int]) -> tuple[float, int, int, str]:
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
            dt = time.perf_counter() - t
            return dt, int(out.num_cached_tokens or 0), int(out.outputs[0].token_ids[0]), str(out.request_id)

        l2_dir = root / ("kvstore" if mode == "kvstore" else "lmcache-fs")
        for _ in range(2):  # warm-up, not counted
            run(prompt())
        settle(l2_dir, args.settle_s)
        for rnd in range(args.rounds):
            prompts = [prompt() for _ in range(args.prompts)]
            first: dict[int, int] = {}
            for i, ids in enumerate(prompts):
                dt, cached, tok, req = run(ids)
                first[i] = tok
                print(json.dumps({"mode": mode, "round": rnd, "phase": "cold", "i": i, "ttft_s": dt, "cached": cached,
                                  "req": req}), flush=True)
                if args.settle_each and mode != "none":
                    settle(l2_dir, args.settle_s)  # its L2 writes landed before the next store
                else:
                    time.sleep(0.3)
            if mode == "none":
                continue
            settle(l2_dir, args.settle_s)
            for phase in ("l2", "l1"):
                for i in range(args.repeats):
                    dt, cached, tok, req = run(prompts[i])
                    rec = {"mode": mode, "round": rnd, "phase": phase, "i": i, "ttft_s": dt, "cached": cached,
                           "same_token": tok == first[i], "req": req}
                    print(json.dumps(rec), flush=True)
        l2 = dir_bytes(l2_dir)
        print(json.dumps({"mode": mode, "event": "done", "l2_bytes": l2}), flush=True)
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()


PREFETCH = re.compile(
    r"Prefetch request completed \(L1\+L2\): (\d+)/(\d+) retained keys \((\d+) L1, (\d+) L2\) "
    r"in ([\d.]+) ms \(external_request_id=([^,)\s]+)"
)


def server_facts(text: str) -> dict[str, Any]:
    """What the LMCache server's log says: each request's prefetch (chunks found in L1 and
    loaded from L2, and its time), keyed by vLLM's request number, and how many stores
    found no room in L1 (LMCache drops those chunks)."""
    prefetch: dict[str, dict[str, float]] = {}
    for m in PREFETCH.finditer(text):
        req = m.group(6).split("-", 1)[0]
        prefetch[req] = {"l1": int(m.group(3)), "l2": int(m.group(4)), "ms": float(m.group(5))}
    return {"prefetch": prefetch, "alloc_failures": text.count("Failed to batched allocate")}


def attach_prefetches(rows: list[dict[str, Any]], facts: dict[str, Any]) -> None:
    """Mark each loaded sample with where its chunks came from (`from_l2`: chunks the
    server loaded from its L2 adapter for this request; 0 = all were in its L1)."""
    for r in rows:
        hit = facts["prefetch"].get(str(r.get("req", "")).split("-", 1)[0])
        if hit is not None and r.get("cached", 0) > 0:
            r["from_l2"], r["prefetch_ms"] = int(hit["l2"]), hit["ms"]


def summarise(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        if "phase" not in r:
            continue
        keys = [f"{r['mode']}/{r['phase']}"]
        if "from_l2" in r:  # loaded samples again, by where the server found their chunks
            keys.append(f"{r['mode']}/loaded, {'L2 adapter' if r['from_l2'] else 'server L1 only'}")
        for key in keys:
            out.setdefault(key, {"ttft_ms": [], "cached": [], "same_token": [], "prefetch_ms": []})
            out[key]["ttft_ms"].append(r["ttft_s"] * 1e3)
            out[key]["cached"].append(r["cached"])
            if "same_token" in r:
                out[key]["same_token"].append(r["same_token"])
            if "prefetch_ms" in r:
                out[key]["prefetch_ms"].append(r["prefetch_ms"])
    table = {}
    for key, v in out.items():
        t = v["ttft_ms"]
        table[key] = {
            "n": len(t), "min_ms": round(min(t), 1), "median_ms": round(statistics.median(t), 1),
            "max_ms": round(max(t), 1), "median_cached": statistics.median(v["cached"]),
            "same_token": f"{sum(v['same_token'])}/{len(v['same_token'])}" if v["same_token"] else "",
        }
        if v["prefetch_ms"]:
            table[key]["median_prefetch_ms"] = round(statistics.median(v["prefetch_ms"]), 1)
    base = table.get("none/cold", {}).get("median_ms")
    if base:
        for v in table.values():
            v["vs_no_cache"] = round(v["median_ms"] / base, 3)
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="none,kvstore,fs")
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--l1-gb", type=float, default=4.0)
    ap.add_argument("--gpu-util", type=float, default=0.5)
    ap.add_argument("--settle-s", type=float, default=2.0)
    ap.add_argument("--settle-each", action="store_true",
                    help="after each cold prompt, wait for the L2 directory to stop growing")
    ap.add_argument("--logs", default="", help="folder to copy each mode's server log and engine stderr to")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="one more argument for the LMCache server, repeatable: --server-arg=--l2-store-policy "
                         "--server-arg=skip_l1 drops chunks from its L1 once they are in L2, so every repeat loads from L2")
    ap.add_argument("--server-timeout", type=float, default=120.0)
    ap.add_argument("--mode-timeout", type=float, default=300.0)
    ap.add_argument("--workdir", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--child", default="")
    args = ap.parse_args()
    if args.child:
        child(args.child, args)
        return
    rows: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    for mode in args.modes.split(","):
        work = Path(tempfile.mkdtemp(prefix=f"e2e-{mode}-"))
        cmd = [sys.executable, __file__, "--child", mode, "--workdir", str(work)]
        for k in ("prompt_tokens", "prompts", "repeats", "rounds", "chunk_size", "l1_gb", "gpu_util", "settle_s",
                  "server_timeout"):
            cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
        if args.settle_each:
            cmd.append("--settle-each")
        cmd += [f"--server-arg={a}" for a in args.server_arg]
        # its own process group, so a mode that runs out of time takes its LMCache server
        # with it (a SIGKILLed child never reaches its `finally`)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=args.mode_timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            err += "\n(timed out)"
            rc = -1
        for line in out.splitlines():
            if line.startswith("{"):
                rows.append(json.loads(line))
                print(line, flush=True)
        if rc != 0:
            errors[mode] = err[-6000:]
            print(f"--- mode {mode} failed (rc {rc}):\n{err[-6000:]}", flush=True)
        if args.logs:
            logs = Path(args.logs)
            logs.mkdir(parents=True, exist_ok=True)
            (logs / f"engine-{mode}.log").write_text(err)
            for log in work.glob("server-*.log"):
                shutil.copy(log, logs / log.name)
        for log in work.glob("server-*.log"):
            text = log.read_text(errors="replace")
            facts = server_facts(text)
            attach_prefetches([r for r in rows if r.get("mode") == mode], facts)
            print(json.dumps({"mode": mode, "event": "server", "prefetches": len(facts["prefetch"]),
                              "from_l2": sum(1 for f in facts["prefetch"].values() if f["l2"]),
                              "alloc_failures": facts["alloc_failures"]}), flush=True)
            warnings = [line for line in text.splitlines() if "WARNING" in line or "ERROR" in line]
            print(f"--- {log.name}: {len(warnings)} warning/error lines", flush=True)
            for line in warnings[:5]:
                print(f"    {line[:300]}", flush=True)
            print(f"--- {log.name} (last 1500 chars):\n{text[-1500:]}", flush=True)
        shutil.rmtree(work, ignore_errors=True)
    table = summarise(rows)
    for key, v in table.items():
        print(key, v)
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "table": table, "errors": errors}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # vLLM's sampler imports FlashInfer unless told not to; it is not needed for greedy
    # sampling and is not in the offline bundle (offline_vllm_bundle.py)
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    main()
