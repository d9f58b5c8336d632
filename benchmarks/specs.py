"""What a benchmark runs: the configurations under test and the engine settings they share.

- ``CompressionSpec``: one configuration ("vanilla", "pyramidkv:128", "snapkv:r=0.875") and the
  ``additional_config`` it becomes; ``benchmark_parser`` and ``parse_*`` read command lines.
- ``EngineSettings``: identical engine settings for every configuration.
- model, dtype and device helpers the settings are derived from.

Importing this module does not import vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcompress.policies import METHODS

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# vLLM's --kv-cache-dtype values a configuration may take (``+cache_dtype=fp8``); "auto" is
# the model's dtype. fp8 pages hold one byte per element.
CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


# ----------------------------------------------------------------------------- configurations
@dataclass(frozen=True)
class CompressionSpec:
    """One configuration: vanilla vLLM (method "none") or a method with a budget or a ratio
    (or, with a ``kv_score_threshold`` option, neither: the threshold alone decides),
    optionally with decode-time eviction (a decode policy and the generated tokens each KV
    head keeps) and settings of its own (``options``: additional_config keys and values,
    e.g. (("kv_pyramid_beta", 4),), over the run's --kv-option ones). ``cache_dtype``: vLLM's
    --kv-cache-dtype for this configuration (vanilla too; "auto" is the model's dtype)."""

    method: str = "none"
    budget: int | None = None
    ratio: float | None = None
    decode_policy: str | None = None
    decode_budget: int | None = None
    options: tuple[tuple[str, Any], ...] = ()
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"cache_dtype {self.cache_dtype!r}; allowed: "
                             f"{', '.join(CACHE_DTYPES)}")
        # JSON round trips (worker jobs) turn the pairs into lists
        object.__setattr__(self, "options", tuple((str(k), v) for k, v in self.options))
        for key, _ in self.options:
            if key not in SPEC_OPTION_KEYS:
                raise ValueError(f"unknown setting {key!r} in a configuration; allowed: "
                                 f"{', '.join(sorted(SPEC_OPTION_KEYS))}")
        if (self.decode_policy is None) != (self.decode_budget is None):
            raise ValueError("give a decode policy and a decode budget together")
        if self.decode_budget is not None and self.decode_budget < 1:
            raise ValueError(f"decode budget must be >= 1, got {self.decode_budget}")
        if self.method == "none":
            if (self.budget, self.ratio, self.decode_policy, self.options) != (None, None,
                                                                                 None, ()):
                raise ValueError("vanilla takes no budget, ratio, decode policy or settings")
            return
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; allowed: none, {', '.join(METHODS)}")
        if self.budget is not None and self.ratio is not None:
            raise ValueError(f"{self.method}: give exactly one of a budget or a ratio")
        if self.budget is None and self.ratio is None and not self.thresholded:
            raise ValueError(f"{self.method}: give exactly one of a budget or a ratio "
                             "(or a +score_threshold=T alone)")
        if self.budget is not None and self.budget < 1:
            raise ValueError(f"{self.method}: budget must be >= 1, got {self.budget}")
        if self.ratio is not None and not 0.0 < self.ratio < 1.0:
            raise ValueError(f"{self.method}: ratio must be in (0, 1), got {self.ratio}")

    @property
    def is_vanilla(self) -> bool:
        return self.method == "none"

    @property
    def thresholded(self) -> bool:
        """A score threshold decides what is kept (a budget or ratio given too caps it)."""
        return any(key == "kv_score_threshold" for key, _ in self.options)

    @property
    def label(self) -> str:
        cache = "" if self.cache_dtype == "auto" else f"+cache_dtype={self.cache_dtype}"
        if self.is_vanilla:
            return "vanilla" + cache
        decode = f"@{self.decode_policy}:{self.decode_budget}" if self.decode_policy else ""
        decode += "".join(f"+{key.removeprefix('kv_')}={value}" for key, value in self.options)
        decode += cache
        if self.budget is not None:
            return f"{self.method}:{self.budget}{decode}"
        if self.ratio is None:  # a score threshold alone
            return f"{self.method}{decode}"
        return f"{self.method}:r={self.ratio:g}{decode}"

    @property
    def compression_factor(self) -> float | None:
        """Prompt compression for ratio specs (0.875 -> 8x); None for budgets (per prompt)."""
        if self.is_vanilla:
            return 1.0
        return None if self.ratio is None else 1.0 / (1.0 - self.ratio)

    def kv_element_bytes(self, dtype: str) -> int:
        """Bytes of one K or V element in this configuration's pages (model ``dtype``)."""
        return DTYPE_BYTES[dtype] if self.cache_dtype == "auto" else 1

    def additional_config(self, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """additional_config keys (``options`` are extra ``kv_*`` settings, e.g. kv_window)."""
        if self.is_vanilla:
            return {}
        config: dict[str, Any] = {"kv_compression": self.method, **(options or {}),
                                  **dict(self.options)}
        if self.budget is not None:
            config["kv_budget"] = self.budget
        elif self.ratio is not None:
            config["kv_compression_ratio"] = self.ratio
        if self.decode_policy:
            config["kv_decode_policy"] = self.decode_policy
            config["kv_decode_budget"] = self.decode_budget
        return config

    @classmethod
    def parse(cls, text: str) -> CompressionSpec:
        """``vanilla`` / ``none``, ``METHOD:BUDGET``, ``METHOD:r=RATIO`` or ``METHOD:budget=N``,
        optionally followed by ``@DECODE_POLICY:DECODE_BUDGET`` (``pyramidkv:256@h2o:256``)
        and by settings of its own, ``+KEY=VALUE`` each (``pyramidkv:64+pyramid_beta=4``;
        the ``kv_`` of the additional_config key may be left out); ``+cache_dtype=fp8``
        (also for vanilla) sets vLLM's --kv-cache-dtype. With ``+score_threshold=T`` the
        amount may be left out (``pyramidkv+score_threshold=-6``): the threshold alone
        decides; an amount given caps it."""
        text = text.strip().lower()
        text, *settings = text.split("+")
        if settings:
            cache_dtype = "auto"
            options = []
            for item in settings:
                key, _, value = item.strip().partition("=")
                if key in ("cache_dtype", "kv_cache_dtype"):
                    cache_dtype = value
                else:
                    options.append(parse_spec_option(item))
            if (text.strip() in METHODS
                    and any(key == "kv_score_threshold" for key, _ in options)):
                return cls(text.strip(), options=tuple(options), cache_dtype=cache_dtype)
            base = cls.parse(text)
            return cls(base.method, base.budget, base.ratio, base.decode_policy,
                       base.decode_budget, tuple(options), cache_dtype)
        if text in ("none", "vanilla", "full"):
            return cls()
        text, at, decode = text.partition("@")
        if at:
            policy, colon, decode_budget = decode.partition(":")
            if not colon or not policy or not decode_budget.isdigit():
                raise ValueError(f"bad decode setting {decode!r}: use @POLICY:BUDGET")
            base = cls.parse(text)
            return cls(base.method, base.budget, base.ratio, policy, int(decode_budget))
        method, sep, amount = text.partition(":")
        if not sep or not amount:
            raise ValueError(f"bad configuration {text!r}: use METHOD:BUDGET or METHOD:r=RATIO")
        key, eq, value = amount.partition("=")
        if not eq:
            key, value = "budget", key
        try:
            if key in ("r", "ratio"):
                return cls(method, ratio=float(value))
            if key in ("b", "budget"):
                return cls(method, budget=int(value))
        except ValueError as error:
            raise ValueError(f"bad configuration {text!r}: {error}") from None
        raise ValueError(f"bad configuration {text!r}: amount must be N, budget=N or r=R")


def _spec_option_keys() -> frozenset[str]:
    from kvcompress.settings.flags import CONFIG_KEYS

    # the method, the amount and the decode policy have their own syntax
    return CONFIG_KEYS - {"kv_compression", "kv_budget", "kv_compression_ratio",
                          "kv_decode_policy", "kv_decode_budget"}


SPEC_OPTION_KEYS = _spec_option_keys()


def parse_spec_option(item: str) -> tuple[str, Any]:
    """``pyramid_beta=4`` / ``kv_pyramid_beta=4`` -> ("kv_pyramid_beta", 4)."""
    key, eq, value = item.strip().partition("=")
    key = key if key.startswith("kv_") else f"kv_{key}"
    if not eq or key not in SPEC_OPTION_KEYS:
        raise ValueError(f"bad setting {item!r}: use KEY=VALUE with KEY one of "
                         f"{', '.join(sorted(k.removeprefix('kv_') for k in SPEC_OPTION_KEYS))}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value  # a bare word such as avg


def add_engine_options(group: Any) -> None:
    """The engine settings the document benchmarks (shared_context, shared_prefix) share."""
    group.add_argument("--max-num-seqs", type=int, default=64)
    group.add_argument("--max-num-batched-tokens", type=int, default=2048)
    group.add_argument("--dtype", default="auto",
                       help="auto = bfloat16, or float32 on CPUs without native bf16")
    group.add_argument("--threads", type=int, default=None)
    group.add_argument("--kv-option", action="append", default=[], metavar="KEY=VALUE")


def add_prefix_caching_option(group: Any) -> None:
    """``--no-prefix-caching``: the one way a benchmark leaves vLLM's default (the result
    JSON's settings record it, and the run's table says so)."""
    group.add_argument("--no-prefix-caching", dest="enable_prefix_caching",
                       action="store_false",
                       help="turn vLLM's prefix caching off for every configuration (on by "
                       "default, as in vLLM); this also turns kvcompress's --kv-reuse off, "
                       "so --kv-scoring auto scores by the window alone")


def add_run_options(parser: argparse.ArgumentParser, output_json: Path) -> None:
    """The run group of the document benchmarks: timeouts, where results and logs go."""
    run = parser.add_argument_group("run")
    run.add_argument("--job-timeout", type=float, default=3600.0)
    run.add_argument("--output-json", type=Path, default=output_json)
    run.add_argument("--log-file", type=Path, default=None)
    run.add_argument("--verbose", action="store_true")
    run.add_argument("--no-progress", action="store_true")


def benchmark_parser(module: str, doc: str | None) -> argparse.ArgumentParser:
    """The command line an engine benchmark starts from: ``python -m MODULE`` in the usage
    line, the first paragraph of its docstring, defaults in --help, and --model."""
    parser = argparse.ArgumentParser(
        prog=f"python -m {module}",
        description=(doc or "").split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", default=None, help="model folder (default: embedded model)")
    return parser


def parse_specs(text: str) -> list[CompressionSpec]:
    specs = [CompressionSpec.parse(part) for part in text.split(",") if part.strip()]
    if len({spec.label for spec in specs}) != len(specs):
        raise ValueError(f"duplicate configurations in {text!r}")
    return specs


def parse_ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def parse_names(text: str, known: Sequence[str], what: str) -> list[str]:
    """Comma-separated names, each one of ``known`` (a ValueError names the unknown ones)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; allowed: {list(known)}")
    return names


_BYTE_UNITS = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_bytes(text: str) -> int:
    """A byte count as vLLM's ``--kv-cache-memory-bytes`` reads it: an integer, or a number
    and a unit (``k``/``m``/``g`` decimal, ``K``/``M``/``G`` binary: ``130M`` is 130 MiB)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG]?)", text.strip())
    if not match:
        raise ValueError(f"{text!r}: bytes, e.g. 130M (MiB), 136m (MB) or 136314880")
    number, unit = match.groups()
    return int(float(number) * _BYTE_UNITS.get(unit, 1))


def parse_kv_options(items: Sequence[str]) -> dict[str, Any]:
    """``["kv_window=16", "kv_pooling=avg"]`` -> additional_config keys, checked by name here
    (values are validated by the engine config, before any engine starts)."""
    from kvcompress.settings.flags import CONFIG_KEYS

    options: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or key not in CONFIG_KEYS or key in ("kv_compression", "kv_budget",
                                                        "kv_compression_ratio"):
            allowed = sorted(CONFIG_KEYS - {"kv_compression", "kv_budget", "kv_compression_ratio"})
            raise SystemExit(f"--kv-option {item!r}: expected KEY=VALUE with KEY in {allowed}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value  # a bare word such as avg
    return options


# ----------------------------------------------------------------------------- engine settings
@dataclass(frozen=True)
class EngineSettings:
    """What every configuration shares; only ``additional_config`` differs between them."""

    model: str
    dtype: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_memory_bytes: int
    enforce_eager: bool = True
    seed: int = 0
    multiprocess: bool = False  # vLLM's engine-core process + worker process; else in-process
    tensor_parallel_size: int = 1  # > 1: vLLM's multiprocessing executor, a process per rank
    compression_options: dict[str, Any] = field(default_factory=dict)  # kv_window, ...
    # vLLM's default, what a server runs: it also carries kvcompress's multi-turn reuse (and
    # with it ``--kv-scoring auto``'s reconstruction pass). Off only where a run says so.
    enable_prefix_caching: bool = True
    # vLLM's --kv-offloading-size (GiB): kvcompress's own offload tier with compression on.
    kv_offloading_gib: float | None = None


def default_model_dir() -> str:
    from kvcompress.models import embedded_model_dir

    return str(embedded_model_dir())


def token_counter(tokenizer: Any) -> Callable[[str], int]:
    """How many tokens a text is, alone (no special tokens): what the workload builders size
    documents and haystacks by."""
    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))
    return count


def detect_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def default_threads() -> int:
    """CPU threads for the model: all cores but one, as vLLM's own multiprocess default (it
    reserves a core for the scheduler). Two threads sharing a core with anything else make
    every OpenMP barrier wait for a time slice: 4x slower on a busy 2-core box."""
    return max(1, (os.cpu_count() or 1) - 1)


def cpu_has_bf16() -> bool:
    """Native bf16 matmul (AVX512-BF16 or AMX); without it bf16 runs ~3x slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str, device: str) -> str:
    """``auto``: the model's bf16, except on CPUs without native bf16 (fp32 is faster there)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device != "cpu" or cpu_has_bf16() else "float32"


def model_shape(model_dir: str) -> dict[str, int]:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    heads = config["num_attention_heads"]
    return {
        "num_layers": config["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": config.get("num_key_value_heads", heads),
        "head_dim": config.get("head_dim", config["hidden_size"] // heads),
        "max_position_embeddings": config.get("max_position_embeddings", 0),
    }


def kv_bytes_per_token(model_dir: str, dtype: str) -> int:
    """K and V of one token in every layer and KV head (vLLM's and kvcompress's unit)."""
    shape = model_shape(model_dir)
    return 2 * shape["num_layers"] * shape["num_kv_heads"] * shape["head_dim"] * DTYPE_BYTES[dtype]
