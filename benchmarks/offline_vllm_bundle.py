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
3. packs the folder as one xz tar and cuts it into parts of at most `--part-mib`, each in
   a folder of its own under `--out` (``part1/``, ``part2/``, ...), to be carried one per
   call and gathered on the target:

       mkdir -p /tmp/b /tmp/site && cp <part folder>/* /tmp/b/        # once per call
       cat /tmp/b/bundle.txz.* | python3 -c "import lzma,sys,shutil; \\
           shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer, 1<<22)" \\
           | tar -x -C /tmp/site
       ln -sfn $PWD/plugins /tmp/site/kvstore_lmcache
       PYTHONPATH=$PWD:/tmp/site python3 benchmarks/bench_vllm_e2e.py --out e2e.json

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
)
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
        bundle = work / "bundle.txz"
        with tarfile.open(bundle, "w:xz", preset=7) as tar:
            for entry in sorted(site.iterdir()):
                tar.add(entry, arcname=entry.name)
        out.mkdir(parents=True, exist_ok=True)
        size, step = bundle.stat().st_size, args.part_mib << 20
        with bundle.open("rb") as f:
            for k in range(-(-size // step)):
                part = out / f"part{k + 1}"
                part.mkdir(exist_ok=True)
                (part / f"bundle.txz.{k:02d}").write_bytes(f.read(step))
        print(f"{len(picked)} packages beside vllm {args.vllm} and lmcache {args.lmcache}: "
              f"{size / 2**20:.0f} MiB in {-(-size // step)} parts under {out}")


if __name__ == "__main__":
    main()
