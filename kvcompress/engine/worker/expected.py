"""``--kv-scoring expected`` on the worker: when a prompt completes, its keys are read from
its pages and scored by the model's query profile (``kvcompress.attention.expected_scores``)
into the accumulator the plan ranks by. No extra forward; the cost is a few products over
the prompt's keys per layer, paid once per prompt. No vLLM imports.

The keys are read in page-aligned chunks whose ``[Hq, D, keys]`` product holds at most
``workspace_scores(H, prompt)`` elements (4 bytes each); with the layer's ``[Hq, prompt]``
logits (4 bytes per query head and key, normalized in place) a layer's workspace stays
under the planning workspace the engine reserves (``PLAN_BYTES_PER_SCORE`` per score of one
layer) for groups of up to 7 query heads per KV head (measured at Llama-8B's 4:
tests/engine/test_workspace_bounds.py)."""

from __future__ import annotations

import torch

from kvcompress.attention.expected_scores import (
    expected_logits,
    expected_probabilities,
    mean_rotation,
    rotated_profile,
)
from kvcompress.engine.worker.request_kv import RequestKV
from kvcompress.paging import PageLayout
from kvcompress.paging.page_format import PageFormat
from kvcompress.policies.plan import workspace_scores
from kvcompress.policies.settings import DEFAULT_GROUP_REDUCE
from kvcompress.profile_model.profiles import QueryProfile


class ExpectedScorer:
    """Scores prompts of one worker from its share of a query profile (its query heads)."""

    def __init__(self, profile: QueryProfile, layout: PageLayout, device: torch.device,
                 key_scales: tuple[float, ...] = ()) -> None:
        """``key_scales``: each layer's K scale where pages hold fp8 (empty: unquantized
        pages); scores see the keys attention sees."""
        if profile.num_heads % layout.num_kv_heads:
            raise ValueError(f"--kv-profile: {profile.num_heads} query heads do not group "
                             f"into {layout.num_kv_heads} KV heads")
        self.layout = layout
        self.means = profile.means.to(device)
        self.covariances = profile.covariances.to(device)
        self.inv_freq = profile.inv_freq.to(device)
        self.rotary_scaling = profile.rotary_scaling
        self.scale = profile.attention_scale
        self.key_scales = key_scales

    def score(self, request: RequestKV, pool: torch.Tensor, page_format: PageFormat,
              max_elements: int | None = None) -> torch.Tensor:
        """``[L, H, score_width]`` fp32: the expected attention of every prompt slot of every
        compressed row (zeros elsewhere), the future starting at the prompt's end.
        ``max_elements``: of a chunk's product (tests shrink it; default: the workspace)."""
        layout = self.layout
        width = request.score_width()
        scores = torch.zeros(layout.num_layers, layout.num_kv_heads, width,
                             dtype=torch.float32, device=pool.device)
        rotation = mean_rotation(self.inv_freq, request.prompt_len, layout.head_size,
                                 rotary_scaling=self.rotary_scaling)
        prompt_end = torch.as_tensor(request.prompt_end(), device=pool.device)
        reduce = request.config.gqa_reduce if request.config is not None else DEFAULT_GROUP_REDUCE
        heads = layout.num_kv_heads
        pages = torch.as_tensor(request.table.pages, dtype=torch.long, device=pool.device)
        page_size = pool.shape[2]
        elements = max_elements or workspace_scores(heads, width)
        per_key = self.means.shape[1] * layout.head_size  # Hq * D
        chunk = max(1, elements // (per_key * page_size)) * page_size
        for layer in layout.compressed_layers:
            rows = slice(layer * heads, (layer + 1) * heads)
            profile = rotated_profile(self.means[layer], self.covariances[layer], rotation,
                                      heads)
            logits = torch.empty(heads, profile[0].shape[1], width, device=pool.device)
            for first in range(0, width, chunk):
                count = min(chunk, width - first)
                keys = page_format.gather_keys(  # [H, D, count]
                    pool, pages[rows, first // page_size : -(-(first + count) // page_size)],
                    count)
                if self.key_scales:
                    keys = keys * self.key_scales[layer]
                logits[..., first : first + count] = expected_logits(keys, profile,
                                                                     self.scale)
            scores[layer] = expected_probabilities(logits, prompt_end[rows], reduce)
        return scores
