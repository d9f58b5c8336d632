#!/usr/bin/env bash
# Optional: the environment of the kvpress reference-equivalence tool
# (benchmarks/kvpress_reference.py). Safe to run again (it skips what is done).
#   - creates .venv-kvpress (Python >= 3.10); kvpress needs transformers < 5.3, which the main
#     .venv (vLLM) cannot have, hence its own environment
#   - installs a CPU build of torch: a local wheel where pip's find-links has one, else the
#     PyTorch CPU index, else PyPI's default wheel (large: it pulls the CUDA libraries)
#   - installs kvpress (KVPRESS_VERSION, default 0.5.5) and transformers < 5.3
#   - makes the repository importable without its dependencies (no vLLM): the tool imports
#     only kvcompress.policies, which needs torch alone
# Then: OMP_NUM_THREADS=1 .venv-kvpress/bin/python -m benchmarks.kvpress_reference
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-kvpress}
KVPRESS_VERSION=${KVPRESS_VERSION:-0.5.5}
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)

log() { printf '[setup-kvpress] %s\n' "$*"; }

if [ ! -x "$PY" ]; then
  log "creating $VENV"
  "$PYTHON" -m venv "$VENV"
  "${PIP[@]}" install -q --upgrade pip
fi

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  log "installing torch (CPU)"
  "${PIP[@]}" install -q --no-index torch 2>/dev/null \
    || "${PIP[@]}" install -q torch --index-url "$TORCH_CPU_INDEX" \
    || "${PIP[@]}" install -q torch
fi

if [ "$("$PY" -c 'import importlib.metadata as m; print(m.version("kvpress"))' 2>/dev/null)" \
     != "$KVPRESS_VERSION" ]; then
  log "installing kvpress==$KVPRESS_VERSION with transformers<5.3 (torch kept as installed)"
  "${PIP[@]}" install -q "kvpress==$KVPRESS_VERSION" "transformers<5.3"
fi

# The repository root on the path: `import kvcompress.policies` and `-m benchmarks.*` work from
# anywhere, without installing kvcompress's dependencies (vLLM) into this environment.
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$PWD" > "$SITE/kvcompress-repo.pth"

"$PY" - <<'EOF'
import importlib.metadata as m
import sys

import kvcompress.policies  # noqa: F401
import kvpress  # noqa: F401

assert "vllm" not in sys.modules, "kvcompress.policies must not import vllm"
print("[setup-kvpress] ok: " + ", ".join(
    f"{name} {m.version(name)}" for name in ("kvpress", "transformers", "torch")
))
EOF
