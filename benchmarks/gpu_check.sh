#!/usr/bin/env bash
# The GPU machine's checks in one go, each stage under its own time limit so one cannot starve the next:
# the gpu-marked tests (tests/cluster/test_gpu.py) in one pytest run, then the `gpu` suite of
# `python -m benchmarks`, one benchmark per stage: `gpu-gpt-compiled` (one compiled worker against a plain
# compiled loop, with their model FLOPs utilisation), `gpu-gpt-strategies` (every strategy on workers sharing
# the GPU; their run directories come back for the dashboard's picture) and, when BENCH_S is set,
# `gpu-throughput` (the transformer against a plain loop, DDP and the limit).
# Run from the repository root on the GPU machine, with the Dask wheels in .whl/ (../shared/gpu/README.md);
# everything it writes lands in $OUT (the device tool brings that folder back): the result files under
# $OUT/results/<machine class>/, the very files to put under benchmarks/results/ here. COMMIT names the
# commit measured (the tree there is not a git clone) and DIRTY whether that tree had uncommitted changes.
#   OUT=/tmp/out TESTS_S=200 GPT1_S=200 GPT2_S=150 BENCH_S=0 COMMIT=<sha> DIRTY=false \
#     benchmarks/gpu_check.sh [pytest -k expression]
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
RUNS=/tmp/gpt-gpu-runs  # gpt_gpu.py's default --runs
export COMMIT=${COMMIT:-unknown} DIRTY=${DIRTY:-unknown}
stage() {  # stage LIMIT_S BENCHMARK: one benchmark of the gpu suite under its own limit
  [ "$1" != 0 ] || return 0
  timeout -k 10 "$1" python3 -m benchmarks run --only "$2" 2>&1 | tee "$OUT/$2.log" | tail -n 20
}
stage "${GPT1_S:-200}" gpu-gpt-compiled
stage "${GPT2_S:-150}" gpu-gpt-strategies
[ -d "$RUNS" ] && tar czf "$OUT/gpt-runs.tgz" --exclude='*.pt' -C "$(dirname $RUNS)" "$(basename $RUNS)"
stage "${BENCH_S:-0}" gpu-throughput
CLASS=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import resultfile; print(resultfile.machine_class())")
[ -d "benchmarks/results/$CLASS" ] && mkdir -p "$OUT/results" && cp -r "benchmarks/results/$CLASS" "$OUT/results/"
ls -la "$OUT"
