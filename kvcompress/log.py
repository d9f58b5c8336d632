"""Loggers under vLLM's ``vllm`` logger, so kvcompress lines appear with vLLM's own."""

from __future__ import annotations

import logging


def get_logger(module_name: str) -> logging.Logger:
    # vLLM configures handlers on the "vllm" logger only; children propagate to it.
    return logging.getLogger(f"vllm.{module_name}")
