#!/usr/bin/env bash
# The whole suite, slow engine and server tests included (CI runs everything), the GPU check
# in its CPU mode, then the static checks: docs/results.md current with benchmarks/results
# (results_doc --check), ruff, the import-layering contracts (lint-imports), the Dockerfiles
# (hadolint) and dead code (vulture). tests/README.md describes the layout.
# pytest's exit code 5 (no tests collected) counts as a failure.
set -uo pipefail
cd "$(dirname "$0")/.."

.venv/bin/python -m pytest -p no:cacheprovider --timeout 1200 --durations 15 "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "[test] pytest collected no tests: failing" >&2
  exit 1
fi
if [ "$status" -ne 0 ]; then
  exit "$status"
fi
# The GPU path's prepared check, in its CPU mode (Triton interpreter, vLLM unimportable).
bash scripts/gpu_check.sh --cpu "${TMPDIR:-/tmp}/kvcompress-gpu-check" || exit 1
.venv/bin/python -m benchmarks.results_doc --check || exit 1
.venv/bin/ruff check . || exit 1
.venv/bin/lint-imports --no-logo || exit 1
.venv/bin/hadolint docker/Dockerfile.cuda docker/Dockerfile.cpu || exit 1
.venv/bin/vulture && echo "[test] vulture: no dead code"
