"""kvcompress: per-head paged KV-cache compression (PyramidKV, SnapKV, ...) for vLLM."""

__version__ = "0.1.0"
