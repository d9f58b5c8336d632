"""The plugin: entry point, --kv-* flags on vLLM's own parsers, errors before the engine."""

import importlib.metadata
import json

import pytest
from vllm.config import KVTransferConfig
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

from kvcompress.engine.engine_args import OFFLOAD_BYTES_KEY
from kvcompress.engine.handoff import CONNECTOR_NAME, HANDOFF_KEY
from kvcompress.plugin import register
from kvcompress.settings.config import KVCompressionConfigError
from kvcompress.settings.flags import FLAG_SPECS
from kvcompress.vllm_hooks import check_vllm_version


def serve_parser():
    register()
    return make_arg_parser(FlexibleArgumentParser())


def test_entry_point_is_registered_for_vllm():
    plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert {p.name: p.value for p in plugins}.get("kvcompress") == "kvcompress.plugin:register"


def test_register_is_idempotent():
    register()
    wrapped = EngineArgs.create_engine_config
    register()
    assert EngineArgs.create_engine_config is wrapped


def test_serve_parser_has_every_flag_with_help():
    help_text = serve_parser().format_help()
    for spec in FLAG_SPECS:
        assert spec.flag in help_text
    # vLLM's own flags say what they do with compression on (which connectors work; vLLM
    # shows them under `--help=KVTransferConfig` / `--help=CacheConfig`).
    actions = serve_parser()._option_string_actions
    assert "only kvcompress's own connector works" in actions["--kv-transfer-config"].help
    assert "KVCompressConnector" in actions["--kv-transfer-config"].help
    assert "kvcompress's own offload tier" in actions["--kv-offloading-size"].help


def test_flags_reach_additional_config_and_merge_with_it(embedded_model):
    args = serve_parser().parse_args([
        embedded_model, "--kv-compression", "adakv", "--kv-budget", "96", "--kv-window", "16",
        "--kv-pyramid-beta", "5", "--kv-pooling", "avg", "--kv-pooling-kernel", "3",
        "--kv-sink-tokens", "2", "--kv-page-size", "32",
        "--additional-config", json.dumps({"other_plugin_key": 1, "kv_budget": 50}),
    ])
    engine_args = AsyncEngineArgs.from_cli_args(args)
    assert engine_args.additional_config == {
        "other_plugin_key": 1, "kv_compression": "adakv", "kv_budget": 96, "kv_window": 16,
        "kv_pyramid_beta": 5.0, "kv_pooling": "avg", "kv_pooling_kernel": 3,
        "kv_sink_tokens": 2, "kv_page_size": 32,
    }


def test_no_flags_leave_vllm_untouched(embedded_model):
    engine_args = AsyncEngineArgs.from_cli_args(serve_parser().parse_args([embedded_model]))
    assert not engine_args.additional_config
    assert engine_args.scheduler_cls is None or "kvcompress" not in str(engine_args.scheduler_cls)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--kv-budget", "0"], "--kv-budget"),
        (["--kv-compression-ratio", "1.5"], "--kv-compression-ratio"),
        (["--kv-budget", "64", "--kv-compression-ratio", "0.5"], "exclusive"),
        (["--kv-budget", "16", "--kv-window", "32"], "--kv-window"),
        (["--kv-page-size", "12"], "--kv-page-size"),
    ],
)
def test_invalid_values_fail_in_create_engine_config(embedded_model, flags, named):
    args = serve_parser().parse_args([embedded_model, "--kv-compression", "pyramidkv", *flags])
    engine_args = AsyncEngineArgs.from_cli_args(args)
    with pytest.raises(KVCompressionConfigError, match=named):
        engine_args.create_engine_config()


@pytest.mark.parametrize(
    "flags", [["--kv-compression", "h2oo"], ["--kv-pooling", "median"], ["--kv-budget", "x"]]
)
def test_argparse_rejects_bad_choices_and_types(embedded_model, flags, capsys):
    with pytest.raises(SystemExit):
        serve_parser().parse_args([embedded_model, *flags])
    assert flags[0] in capsys.readouterr().err


def test_unsupported_combinations_are_refused_by_name(embedded_model):
    engine_args = EngineArgs(model=embedded_model, pipeline_parallel_size=2,
                             additional_config={"kv_compression": "snapkv"})
    with pytest.raises(NotImplementedError, match=r"--pipeline-parallel-size 2 \(only 1"):
        engine_args.create_engine_config()
    # LMCache's offloading stores whole vLLM blocks: refused by name.
    engine_args = EngineArgs(model=embedded_model, kv_offloading_size=1.0,
                             kv_offloading_backend="lmcache",
                             additional_config={"kv_compression": "snapkv"})
    with pytest.raises(NotImplementedError, match=r"--kv-offloading-backend lmcache"):
        engine_args.create_engine_config()


def test_offloading_size_becomes_kvcompress_s_own_tier(embedded_model):
    """--kv-offloading-size with compression on sizes kvcompress's tier: vLLM makes no
    offloading connector of its own (it would move whole blocks); a bad size is refused by
    name before the engine starts."""
    engine_args = EngineArgs(model=embedded_model, kv_offloading_size=0.5,
                             additional_config={"kv_compression": "snapkv"})
    config = engine_args.create_engine_config()
    assert config.kv_transfer_config is None
    assert config.additional_config[OFFLOAD_BYTES_KEY] == 1 << 29
    for size in (0, -1.0):
        engine_args = EngineArgs(model=embedded_model, kv_offloading_size=size,
                                 additional_config={"kv_compression": "snapkv"})
        with pytest.raises(ValueError, match=r"--kv-offloading-size must be a number of GiB > 0"):
            engine_args.create_engine_config()


def test_transfer_config_naming_our_connector_becomes_the_hand_off(embedded_model, tmp_path):
    """--kv-transfer-config naming KVCompressConnector sets this instance's side of a
    prefill/decode hand-off (vLLM makes no connector); any other connector, no folder, a
    consumer without --kv-reuse, or compression off, is refused by field (vLLM itself
    refuses a bad kv_role)."""
    folder = str(tmp_path / "handoff")
    ours = {"kv_connector": CONNECTOR_NAME, "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"path": folder}}
    engine_args = EngineArgs(model=embedded_model, kv_transfer_config=KVTransferConfig(**ours),
                             additional_config={"kv_compression": "snapkv"})
    config = engine_args.create_engine_config()
    assert config.kv_transfer_config is None
    assert config.additional_config[HANDOFF_KEY] == {"role": "kv_consumer", "path": folder,
                                                     "timeout_s": 480.0, "max_bytes": None}
    cases = [
        ({**ours, "kv_connector": "NixlConnector"}, {}, r"kv_connector 'NixlConnector'"),
        ({**ours, "kv_connector_extra_config": {}}, {}, r"kv_connector_extra_config.path"),
        (ours, {"kv_reuse": "off"}, r"kv_role kv_consumer needs --kv-reuse on"),
        (ours, {"kv_compression": "none"}, r"needs --kv-compression"),
        ({**ours, "kv_role": "kv_producer"}, {"kv_scoring": "reconstruct"},
         r"needs prompts compacted in their last prefill step: --kv-scoring"),
    ]
    for transfer, settings, message in cases:
        engine_args = EngineArgs(model=embedded_model,
                                 kv_transfer_config=KVTransferConfig(**transfer),
                                 additional_config={"kv_compression": "snapkv", **settings})
        with pytest.raises(ValueError, match=message):
            engine_args.create_engine_config()


def test_version_guard_names_the_supported_release():
    check_vllm_version("0.32.0")
    with pytest.raises(RuntimeError, match="0.32"):
        check_vllm_version("0.33.1")
