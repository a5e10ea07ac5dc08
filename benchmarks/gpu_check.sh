#!/usr/bin/env bash
# The GPU machine's checks in one go, each stage under its own time limit so one cannot starve the next:
# the gpu-marked tests (tests/cluster/test_gpu.py) in one pytest run; the real workload (benchmarks/gpt_gpu.py):
# part 1, one compiled worker against a plain compiled loop with their model FLOPs utilisation, and part 2,
# every strategy on workers sharing the GPU, whose run directories come back for the dashboard's picture;
# optionally the older transformer throughput benchmark (benchmarks/throughput.py --device cuda).
# Run from the repository root on the GPU machine, with the Dask wheels in .whl/ (../shared/gpu/README.md);
# everything it writes lands in $OUT (the device tool brings that folder back). COMMIT names the commit
# measured where the tree there is not a git clone.
#   OUT=/tmp/out TESTS_S=200 GPT1_S=200 GPT2_S=150 BENCH_S=0 COMMIT=<sha> benchmarks/gpu_check.sh [pytest -k expression]
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
{ nvidia-smi -L; python3 -c "import torch, dask, dask_cuda; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'dask', dask.__version__, 'dask-cuda', dask_cuda.__version__, torch.cuda.get_device_name(0))"; } 2>&1 | tee "$OUT/device.txt"
if [ "${TESTS_S:-200}" != 0 ]; then
  timeout -k 10 "${TESTS_S:-200}" python3 -m pytest -m gpu -p no:cacheprovider -q -rA --durations=0 \
    ${1:+-k "$1"} tests/cluster/test_gpu.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -n 60
fi
RUNS=/tmp/gpt-gpu-runs
if [ "${GPT1_S:-200}" != 0 ]; then
  timeout -k 10 "${GPT1_S:-200}" python3 benchmarks/gpt_gpu.py --parts 1 --runs "$RUNS" \
    --out "$OUT/gpt-compiled.json" ${GPT1_ARGS:-} 2>&1 | tee "$OUT/gpt-compiled.log" | tail -n 20
fi
if [ "${GPT2_S:-150}" != 0 ]; then
  timeout -k 10 "${GPT2_S:-150}" python3 benchmarks/gpt_gpu.py --parts 2 --runs "$RUNS" \
    --out "$OUT/gpt-strategies.json" ${GPT2_ARGS:-} 2>&1 | tee "$OUT/gpt-strategies.log" | tail -n 20
  [ -d "$RUNS" ] && tar czf "$OUT/gpt-runs.tgz" --exclude='*.pt' -C "$(dirname $RUNS)" "$(basename $RUNS)"
fi
if [ "${BENCH_S:-0}" != 0 ]; then
  timeout -k 10 "${BENCH_S}" python3 benchmarks/throughput.py --device cuda --repeats "${REPEATS:-1}" \
    --out "$OUT/gpu-benchmark.json" ${ONLY:+--only "$ONLY"} 2>&1 | tee "$OUT/gpu-benchmark.log" | tail -n 40
fi
ls -la "$OUT"
