"""Build an offline bundle of vLLM + LMCache for a GPU machine that has no network.

`bench_vllm_e2e.py` needs vLLM, LMCache 0.5.6 and their Python requirements on a machine
whose image already holds torch (and many common packages) but can reach no package
index, and to which a call carries at most ~60 MiB. This script, run where pip works:

1. downloads the vLLM wheel (default 0.26.0: the last release pinned to torch 2.11), the
   LMCache wheel, and every requirement of theirs that is missing from `--have` (a file
   of the package names the target image holds, one per line or comma-separated), as
   CPython 3.12 manylinux wheels, resolving their requirements the same way;
2. installs them into one folder (`pip install --target`, no dependencies), leaving out
   what an offline Llama-style run on Hopper does not load: vLLM's FlashAttention-2 and
   MoE extensions, its Rust front end and vendored CUDA headers, and xgrammar's static
   library; then strips debug sections from every shared library;
3. packs the folder as xz tars that each unpack on their own: every file over 16 MiB
   (vLLM's kernels) in a tar of its own, the rest one tar per top-level entry; then
   deals the tars into parts of at most `--part-mib` (largest first, first fit), each
   in a folder of its own under `--out` (``part1/``, ``part2/``, ...). One part is
   carried per call; a call unpacks its part at once, so a part's work never waits
   for the next one to arrive:

       mkdir -p /tmp/site
       for f in <part folder>/*.txz; do python3 -c "import lzma,sys,shutil; \\
           shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer, 1<<22)" "$f" \\
           | tar -x -C /tmp/site; done
       ln -sfn $PWD/plugins /tmp/site/kvstore_lmcache
       PYTHONPATH=$PWD:/tmp/site python3 benchmarks/bench_vllm_e2e.py --out e2e.json

   On a lent H200 (2026-11-28) the parts came to 45 MiB (LMCache, the requirements,
   FlashAttention-3 and vLLM's Python) and 53 MiB (vLLM's `_C_stable_libtorch`), carried
   in two calls to one machine kept warm between them: the second call's folder is
   unpacked beside the first's.

    python3 benchmarks/offline_vllm_bundle.py --have have.txt --out .bundle [--vllm 0.26.0]

Pins that resolve against torch 2.11 and vLLM 0.26 (`--pin`, repeatable, overrides):
xgrammar 0.2.5.post1 with apache-tvm-ffi 0.1.10 (later xgrammar needs a later tvm-ffi).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PLATFORM = [
    "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
    *[a for tag in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                    "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_31_x86_64",
                    "manylinux_2_34_x86_64", "manylinux1_x86_64", "any") for a in ("--platform", tag)],
]
# what an offline Llama-style run on Hopper never loads (all are imported under guards)
LEAVE_OUT = (
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    "vllm/_moe_C_stable_libtorch.abi3.so",
    "vllm/vllm-rs",
    "vllm/third_party/deep_gemm/include",
    "vllm/third_party/fmha_sm100",
    "xgrammar/lib/libxgrammar.a",
    # built against torch 2.13: does not load against the image's torch 2.11, and LMCache
    # falls back to torch for its copies either way
    "lmcache/cuda_ops.cpython-312-x86_64-linux-gnu.so",
)
BIG = 16 << 20  # files over this size travel in a tar of their own
# requirements that are optional on that path, or GPU kernels for other models / chips
SKIP = {
    "torch", "torchaudio", "torchvision", "torchcodec", "pynvvideocodec", "flashinfer-python",
    "flashinfer-cubin", "tilelang", "nvidia-cudnn-frontend", "fastsafetensors", "nvidia-cutlass-dsl",
    "quack-kernels", "tokenspeed-mla", "humming-kernels", "mcp", "anthropic", "awscrt",
    "cufile-python", "google-api-core", "google-cloud-bigtable", "grpcio-observability",
    "setuptools-scm", "cuda-python", "cupy-cuda13x", "opentelemetry-semantic-conventions-ai",
}
EXTRA = ["crc32c", "loguru", "interegular"]  # kvstore's checksum; imported by modules vLLM may load
PINS = {"xgrammar": "0.2.5.post1", "apache-tvm-ffi": "0.1.10"}  # xgrammar's metadata asks transformers<5; it runs on 5
NO_DEPS = {"xgrammar", "compressed-tensors"}  # their requirements pull torch: taken without them


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            out.append(line.split(":", 1)[1].strip())
    return out


def resolve(specs: list[str], work: Path) -> list[str]:
    """name==version of what `specs` need, per pip's resolver for the target platform."""
    report = work / "report.json"
    pip("install", "--isolated", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
        "--target", str(work / "dry"), *PLATFORM, *specs)
    got = json.loads(report.read_text())["install"]
    return [f"{g['metadata']['name']}=={g['metadata']['version']}" for g in got]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--have", required=True, help="file naming the packages the target image holds")
    ap.add_argument("--out", required=True)
    ap.add_argument("--vllm", default="0.26.0")
    ap.add_argument("--lmcache", default="0.5.6")
    ap.add_argument("--pin", action="append", default=[], help="NAME==VERSION, overriding a resolved version")
    ap.add_argument("--part-mib", type=int, default=50)
    args = ap.parse_args()
    have = {norm(n) for n in re.split(r"[\s,]+", Path(args.have).read_text()) if n}
    pins = dict(PINS, **dict(p.split("==", 1) for p in args.pin))
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        wheels = work / "wheels"
        pip("download", "--isolated", "--quiet", "--no-deps", *PLATFORM, "-d", str(wheels),
            f"vllm=={args.vllm}", f"lmcache=={args.lmcache}")
        batch: list[str] = []
        for w in sorted(wheels.glob("*.whl")):
            for spec in requirements(w):
                spec = re.sub(r"\[[^\]]*\]", "", spec.split(";")[0]).strip()  # no markers, no extras
                name = norm(re.split(r"[ <>=!~(]", spec)[0])
                if name not in have and name not in SKIP and name not in pins and name not in NO_DEPS:
                    batch.append(spec)
        picked: dict[str, str] = {}
        for item in resolve(batch + EXTRA, work):  # what these need, transitively
            name, version = item.split("==", 1)
            key = norm(name)
            if key not in have and key not in SKIP and not key.startswith("nvidia-"):
                picked[key] = version
        picked.update(pins)
        for w in sorted(wheels.glob("*.whl")):  # requirements that pull torch: without their own
            for spec in requirements(w):
                name = norm(re.split(r"[ <>=!;\[~(]", spec)[0])
                if name in NO_DEPS and name not in pins:
                    picked[name] = resolve(["--no-deps", spec.split(";")[0].strip()], work)[0].split("==", 1)[1]
        pip("download", "--isolated", "--quiet", "--no-deps", *PLATFORM, "-d", str(wheels),
            *[f"{n}=={v}" for n, v in sorted(picked.items())])
        site = work / "site"
        pip("install", "--isolated", "--quiet", "--no-deps", "--no-compile", *PLATFORM, "--target", str(site),
            *map(str, sorted(w for w in wheels.glob("*.whl") if not w.name.startswith("vllm-"))))
        with zipfile.ZipFile(next(wheels.glob("vllm-*.whl"))) as z:
            for member in z.namelist():
                if not any(member == p or member.startswith(p + "/") for p in LEAVE_OUT):
                    z.extract(member, site)
        for path in LEAVE_OUT:
            target = site / path
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
        for lib in site.rglob("*.so"):
            subprocess.run(["strip", "--strip-debug", str(lib)], check=False)
        out.mkdir(parents=True, exist_ok=True)
        tars = pack(site, work / "tars")
        parts = deal(tars, args.part_mib << 20)
        for k, members in enumerate(parts, 1):
            folder = out / f"part{k}"
            folder.mkdir(exist_ok=True)
            for tar in members:
                shutil.move(str(tar), folder / tar.name)
        sizes = ", ".join(f"{sum(t.stat().st_size for t in (out / f'part{k}').glob('*.txz')) / 2**20:.0f}"
                          for k in range(1, len(parts) + 1))
        print(f"{len(picked)} packages beside vllm {args.vllm} and lmcache {args.lmcache}: "
              f"{len(parts)} parts under {out}, MiB: {sizes}")


def pack(site: Path, into: Path) -> list[Path]:
    """xz tars of `site` that each unpack on their own: one per file over BIG, one per
    top-level entry for the rest."""
    into.mkdir()
    big = sorted(p for p in site.rglob("*") if p.is_file() and p.stat().st_size > BIG)
    alone = set(big)

    def rest(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        return None if site / info.name in alone else info

    made = []
    for path in big:
        made.append(into / (path.relative_to(site).as_posix().replace("/", "+") + ".txz"))
        with tarfile.open(made[-1], "w:xz", preset=6) as tar:
            tar.add(path, arcname=path.relative_to(site).as_posix())
    for entry in sorted(site.iterdir()):
        made.append(into / f"{entry.name}.txz")
        with tarfile.open(made[-1], "w:xz", preset=6) as tar:
            tar.add(entry, arcname=entry.name, filter=rest)
    return made

def deal(tars: list[Path], cap: int) -> list[list[Path]]:
    """Largest first into the first part with room (a tar over `cap` gets a part alone)."""
    parts: list[list[Path]] = []
    room: list[int] = []
    for tar in sorted(tars, key=lambda t: t.stat().st_size, reverse=True):
        size = tar.stat().st_size
        k = next((i for i, r in enumerate(room) if r >= size), None)
        if k is None:
            parts.append([tar])
            room.append(cap - size)
        else:
            parts[k].append(tar)
            room[k] -= size
    return parts

if __name__ == "__main__":
    main()
