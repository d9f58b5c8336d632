#!/usr/bin/env bash
# The whole suite, slow engine and server tests included (CI runs everything), then the
# static checks: ruff, the import-layering contracts (lint-imports) and dead code (vulture).
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
.venv/bin/ruff check . || exit 1
.venv/bin/lint-imports --no-logo || exit 1
.venv/bin/vulture && echo "[test] vulture: no dead code"
