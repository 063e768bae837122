#!/usr/bin/env bash
# Every kvstore check that needs a CUDA device, in one pass (for a GPU machine lent for
# a short time): the CUDA tests of kvstore.gpu (paged gather/scatter, staging pool,
# both connectors, LMCache's own engine over GPU caches), then
# benchmarks/bench_gpu_connector.py for each KV layout (pinned memory objects, with and
# without the one-launch row copy; pageable ones through the staging pool), then
# benchmarks/bench_gpu_layerwise.py (what bounds a layerwise pass, and its host costs),
# then benchmarks/bench_gpu_setup.py (one pass step by step: where a request's time goes).
#
#   bash scripts/gpu_check.sh            # results and logs in $OUT (default /tmp/kvstore-gpu-check)
#
# Needs python3 with torch (CUDA build), lmcache and pytest; kvstore is used from this
# checkout. A machine with no network needs lmcache and what it lacks there as wheels
# (docs/benchmarks/gpu.md lists the nine a lent H200 lacked). The layerwise run also
# writes chrome traces of one pass per mode to $OUT/trace. Prints a summary table last; exits non-zero when a test or benchmark failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvstore-gpu-check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,pcie.link.gen.current,pcie.link.width.current \
  --format=csv 2>&1 | tee "$OUT/gpu.txt"
python3 - <<'PY' 2>&1 | tee -a "$OUT/gpu.txt" || status=1
import torch, lmcache, sys
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, lmcache {getattr(lmcache, '__version__', '?')}")
assert torch.cuda.is_available(), "torch sees no CUDA device"
print(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory // 2**30, "GiB")
PY

timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -rs -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/pytest.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

: >"$OUT/bench.log"
# A few seconds of matrix products first, so the first benchmark does not run at idle clocks.
python3 -c "import torch, time; a = torch.randn(4096, 4096, device='cuda'); t = time.time()
while time.time() - t < 3: a @ a
torch.cuda.synchronize()"
for run in "flash_attn --profile" "flash_attn --row-copy off" \
  "flash_attn --row-copy on" "flash_infer" "mla --head-size 576" "mla --head-size 576 --row-copy off" \
  "flash_attn --pageable"; do
  name=$(echo "$run" | tr -d ' -')
  mkdir -p "$OUT/json"
  echo "== bench_gpu_connector.py --layout $run" | tee -a "$OUT/bench.log"
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-150}" python3 benchmarks/bench_gpu_connector.py --layout $run \
    --repeats "${REPEATS:-21}" --json "$OUT/json/$name.json" 2>&1 | grep -v " INFO" | tee -a "$OUT/bench.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
done

echo "== bench_gpu_layerwise.py" | tee -a "$OUT/bench.log"
timeout "${BENCH_TIMEOUT:-150}" python3 benchmarks/bench_gpu_layerwise.py --repeats "${REPEATS:-21}" \
  --json "$OUT/json/layerwise.json" --trace "$OUT/trace" 2>&1 | grep -v " INFO" | tee -a "$OUT/bench.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

echo "== bench_gpu_setup.py" | tee -a "$OUT/bench.log"
timeout "${BENCH_TIMEOUT:-150}" python3 benchmarks/bench_gpu_setup.py 2>&1 | grep -v " INFO" | tee -a "$OUT/bench.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

tar -C "$OUT" -czf "$OUT/bench_json.tgz" json && rm -rf "$OUT/json"
echo "== summary"
tail -n 1 "$OUT/pytest.log"
grep -E "^(==|store|load|layerwise|-- .* breakdown)" "$OUT/bench.log"
exit $status
