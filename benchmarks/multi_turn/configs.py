"""Configurations of a multi-turn run: vanilla with or without vLLM's prefix cache, or a
kvcompress setting with ``+reuse=on|off`` (``kv_reuse``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.specs import CompressionSpec

DEFAULT_CONFIGS = "vanilla,pyramidkv:r=0.75+reuse=off,pyramidkv:r=0.75+reuse=on"
NO_PREFIX_CACHING = "vanilla-noprefix"
REUSE_KEY = "kv_reuse"


@dataclass(frozen=True)
class RunConfig:
    """One configuration: a CompressionSpec and whether vLLM's prefix cache is on (vanilla;
    kvcompress engines get it on too, and ``kv_reuse`` decides)."""

    spec: CompressionSpec
    prefix_caching: bool = True

    @property
    def label(self) -> str:
        if self.spec.is_vanilla and not self.prefix_caching:
            return NO_PREFIX_CACHING
        return self.spec.label

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
        return RunConfig(spec, self.prefix_caching).label

    def to_json(self) -> dict[str, Any]:
        return {"spec": vars(self.spec), "prefix_caching": self.prefix_caching}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunConfig:
        return cls(CompressionSpec(**data["spec"]), bool(data["prefix_caching"]))


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
        config = RunConfig(CompressionSpec.parse(part))
        if config.reuse not in (None, "on", "off"):
            raise ValueError(f"{part!r}: reuse must be on or off, got {config.reuse!r}")
        configs.append(config)
    labels = [c.label for c in configs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"duplicate configurations in {text!r}")
    if not configs:
        raise ValueError("no configurations")
    return configs



def check_settings(configs: Sequence[RunConfig], options: dict[str, Any]) -> None:
    """Every kvcompress configuration's settings are valid, before any engine starts."""
    from kvcompress.settings.config import KVCompressionConfig, KVCompressionConfigError

    for config in configs:
        try:
            KVCompressionConfig.from_mapping(config.spec.additional_config(options))
        except KVCompressionConfigError as error:
            raise ValueError(f"{config.label}: {error}") from None

