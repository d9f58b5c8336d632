"""The ``vllm.general_plugins`` entry point. vLLM calls it in every process it starts.

Wiring only: it installs the CLI flags and the engine-config hook. Nothing changes in
vLLM's behaviour unless a request for compression reaches the engine config.
"""

from __future__ import annotations


def register() -> None:
    """Idempotent: vLLM may call it several times per process."""
    from kvcompress import vllm_hooks
    from kvcompress.engine.engine_args import finish_vllm_config, prepare_engine_args

    vllm_hooks.install(prepare_engine_args, finish_vllm_config)
