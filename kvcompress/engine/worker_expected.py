"""``--kv-scoring expected`` on the worker: when a prompt completes, its keys are read from
its pages and scored by the model's query profile (``kvcompress.attention.expected_scores``)
into the accumulator the plan ranks by. No extra forward; the cost is a few products over
the prompt's keys per layer, paid once per prompt. No vLLM imports."""

from __future__ import annotations

import torch

from kvcompress.attention.expected_scores import expected_scores, mean_rotation
from kvcompress.engine.worker_state import RequestKV
from kvcompress.paging import PageLayout
from kvcompress.paging.page_format import PageFormat
from kvcompress.policies.settings import DEFAULT_GROUP_REDUCE
from kvcompress.profiles import QueryProfile


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

    def score(self, request: RequestKV, pool: torch.Tensor,
              page_format: PageFormat) -> torch.Tensor:
        """``[L, H, score_width]`` fp32: the expected attention of every prompt slot of every
        compressed row (zeros elsewhere), the future starting at the prompt's end."""
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
        for layer in layout.compressed_layers:
            rows = slice(layer * heads, (layer + 1) * heads)
            keys = page_format.gather_keys(pool, pages[rows], width)  # [H, D, width]
            if self.key_scales:
                keys = keys * self.key_scales[layer]
            scores[layer] = expected_scores(keys, prompt_end[rows], self.means[layer],
                                            self.covariances[layer], rotation, self.scale,
                                            reduce)
        return scores
