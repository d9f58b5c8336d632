#!/usr/bin/env bash
# The GPU path's one prepared check, for a bare GPU machine (torch + Triton, pytest; no vLLM,
# no network, kvcompress not installed: it runs from this checkout).
#
#   scripts/gpu_check.sh OUTDIR        on CUDA: the kernel tests, the GPU kernel adapter's tests,
#                                      the end-to-end worker-pipeline test, then
#                                      `python -m benchmarks.studies.kernels --quick` (GB/s, % of peak)
#   scripts/gpu_check.sh --cpu OUTDIR  the same tests on CPU (Triton's interpreter and the torch
#                                      references) and the kernel benchmark's --smoke run; CI
#                                      runs this (scripts/test.sh)
#
# vLLM is made unimportable in the test process, so a pass also shows that the worker pipeline
# (page tables, K/V write, attention, window and reconstruction scores, policies, compaction)
# needs none of it. KVCOMPRESS_SYNC_DEBUG=error (tests/sync_debug.py): on CUDA each layer's write,
# attention and scores in the worker-pipeline tests run under
# torch.cuda.set_sync_debug_mode("error"), so a hidden device sync there fails the test; the
# compaction after the forward keeps its one transfer. In --cpu mode the region is a no-op.
# Writes OUTDIR/gpu_check.log, OUTDIR/tests.xml (JUnit) and OUTDIR/kernels.json; exits non-zero
# if any test or the benchmark's reference checks fail.
set -uo pipefail
cd "$(dirname "$0")/.."

mode=cuda
if [ "${1:-}" = "--cpu" ]; then
  mode=cpu
  shift
fi
out=${1:?usage: scripts/gpu_check.sh [--cpu] OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
log="$out/gpu_check.log"
: > "$log"

# This checkout's venv where there is one (CI), else the machine's python3 (the GPU box).
python=${PYTHON:-}
if [ -z "$python" ]; then
  if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
say() { printf '[gpu_check] %s\n' "$*" | tee -a "$log"; }

say "mode $mode, $($python -c 'import sys, torch, triton; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}, cuda available: {torch.cuda.is_available()}")' 2>&1)"
if [ "$mode" = cuda ] && ! $python -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
  say "no CUDA device: use --cpu"
  exit 2
fi
if [ "$mode" = cuda ]; then
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv,noheader 2>&1 | sed 's/^/[gpu_check] gpu: /' | tee -a "$log"
fi

# Tests free of vLLM by design; the CPU attention kernel (vLLM's C++ ops) and the vLLM wiring
# tests are left out on purpose.
tests=(
  tests/kernels
  tests/attention/test_gpu_kernel.py
  tests/attention/test_gpu_kernel_on_cuda.py
  tests/attention/test_decode_scores.py
  tests/engine/test_worker_pipeline.py
  tests/engine/test_worker_moves.py
  tests/engine/test_worker_offload.py
  tests/engine/test_worker_compaction.py
  tests/engine/test_reconstruction.py
  tests/engine/test_expected_scoring.py
  tests/attention/test_expected_scores.py
  tests/engine/test_host_device_boundary.py
  tests/engine/test_device_sync.py
  tests/paging
  tests/policies
)
started=$(date +%s)
say "pytest ${tests[*]}"
KVCOMPRESS_SYNC_DEBUG=error PYTHONPATH=. $python - "$out/tests.xml" "${tests[@]}" >>"$log" 2>&1 <<'EOF'
import sys

sys.modules["vllm"] = None  # any `import vllm...` now fails: the pipeline must not need it
import pytest

junit, *paths = sys.argv[1:]
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-rs", f"--junitxml={junit}", *paths]))
EOF
test_status=$?
say "tests: exit $test_status after $(( $(date +%s) - started )) s ($(grep -E '^[0-9]+ (passed|failed)|passed|failed' "$log" | tail -n 1))"

started=$(date +%s)
bench_args=(--quick)
[ "$mode" = cpu ] && bench_args=(--smoke)
say "python -m benchmarks.studies.kernels ${bench_args[*]} --json $out/kernels.json"
PYTHONPATH=. $python -m benchmarks.studies.kernels "${bench_args[@]}" --json "$out/kernels.json" >>"$log" 2>&1
bench_status=$?
say "kernel benchmark: exit $bench_status after $(( $(date +%s) - started )) s"

if [ "$test_status" -ne 0 ] || [ "$bench_status" -ne 0 ]; then
  say "FAILED (log: $log)"
  exit 1
fi
say "passed"
