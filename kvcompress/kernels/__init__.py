"""KV-cache kernels: Triton (GPU) and torch reference (CPU) implementations side by side.

Every kernel ``name`` comes as ``name_ref`` (torch, any device), ``name_triton``
(same signature, GPU tensors or ``TRITON_INTERPRET=1``) and ``name`` (dispatches: Triton for CUDA
tensors when :func:`has_triton_gpu`, the reference otherwise; ``use_triton=`` overrides).

Importing this package never imports or compiles Triton code; kernels are built on first use.
"""

from ._triton_support import has_triton, has_triton_gpu, triton_interpret_enabled
from .decode_mass import (
    DecodeScoreTarget,
    decode_mass,
    decode_mass_ref,
    decode_mass_triton,
    decode_scores_ref,
)
from .hole_filling import HoleFillingPlan, plan_hole_filling_moves, positions_to_slots
from .logits import attention_lse, attention_probs, soft_cap_logits
from .move_kv import move_kv, move_kv_ref, move_kv_triton
from .paged_attention import paged_attention, paged_attention_ref, paged_attention_triton
from .window_scores import window_scores, window_scores_ref, window_scores_triton
from .write_kv import fp8_codes, write_kv, write_kv_ref, write_kv_triton

__all__ = [
    "DecodeScoreTarget",
    "HoleFillingPlan",
    "attention_lse",
    "attention_probs",
    "fp8_codes",
    "decode_mass",
    "decode_mass_ref",
    "decode_mass_triton",
    "decode_scores_ref",
    "has_triton",
    "has_triton_gpu",
    "move_kv",
    "move_kv_ref",
    "move_kv_triton",
    "paged_attention",
    "paged_attention_ref",
    "paged_attention_triton",
    "plan_hole_filling_moves",
    "positions_to_slots",
    "soft_cap_logits",
    "triton_interpret_enabled",
    "window_scores",
    "window_scores_ref",
    "window_scores_triton",
    "write_kv",
    "write_kv_ref",
    "write_kv_triton",
]
