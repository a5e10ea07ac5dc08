#!/usr/bin/env bash
# The GPU machine's checks in one go: the gpu-marked tests (tests/test_gpu.py) and the CUDA benchmark
# (benchmarks/throughput.py --device cuda), each under its own time limit so one cannot starve the other.
# Run from the repository root on the GPU machine, with the Dask wheels in .whl/ (../shared/gpu/README.md);
# everything it writes lands in $OUT (the device tool brings that folder back).
#   OUT=/tmp/out TESTS_S=200 BENCH_S=170 REPEATS=1 benchmarks/gpu_check.sh [pytest -k expression]
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
    ${1:+-k "$1"} tests/test_gpu.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -n 60
  [ -d test-artifacts/gpu-runs ] && tar czf "$OUT/gpu-runs.tgz" --exclude='*.pt' -C test-artifacts gpu-runs
fi
if [ "${BENCH_S:-170}" != 0 ]; then
  timeout -k 10 "${BENCH_S:-170}" python3 benchmarks/throughput.py --device cuda --repeats "${REPEATS:-1}" \
    --out "$OUT/gpu-benchmark.json" ${ONLY:+--only "$ONLY"} 2>&1 | tee "$OUT/gpu-benchmark.log" | tail -n 40
fi
ls -la "$OUT"
