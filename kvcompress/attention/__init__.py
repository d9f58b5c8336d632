"""Attention over per-(layer, KV head) page tables: vLLM backend and its CPU/GPU ops."""
