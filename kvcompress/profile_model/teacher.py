"""The score surrogate's teacher: a reconstruction pass's scores of a prompt, in one forward.

The engine scores a prompt by running "repeat the previous context" and then the prompt once
more, in chunks, each chunk at the positions right after the prompt, attending to the whole
prompt and to its own earlier tokens (``engine.worker.reconstruction``); a prompt key's score
is the largest probability any query of any pass, in any query head of its KV head, pays it
(``attention.reconstruction_scores``). Here Hugging Face transformers runs the model once
over the prompt followed by every chunk, and an attention function registered with
transformers (its seam for other kernels, ``AttentionInterface``) lays the mask out as the
engine's passes see it: the prompt causal, each chunk over the prompt and itself, never
another chunk; a sliding-window layer also within its window. The same function takes the
scores as it goes, and the prompt's keys and values as the layer would cache them (after
rotary embedding). One forward, no cache to copy, no attention maps kept: about the cost of
twice the prompt through the model.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

ATTENTION = "kvcompress_teacher"
# Queries per block of the explicit attention: bounds its probabilities' memory
# (heads x block x sequence fp32) while keeping the matrix products large.
QUERY_BLOCK = 1024


@dataclass
class TeacherLayout:
    """One forward's sequence: ``prompt_len`` prompt tokens, then chunks; ``segment [T]`` is 0
    for the prompt and 1, 2, ... for the chunks, ``positions [T]`` each token's position."""

    prompt_len: int
    segment: torch.Tensor
    positions: torch.Tensor

    @classmethod
    def of(cls, prompt_len: int, chunk_lens: Sequence[int]) -> TeacherLayout:
        segment = [torch.zeros(prompt_len, dtype=torch.long)]
        positions = [torch.arange(prompt_len)]
        for number, length in enumerate(chunk_lens, start=1):
            segment.append(torch.full((length,), number, dtype=torch.long))
            positions.append(prompt_len + torch.arange(length))
        return cls(prompt_len, torch.cat(segment), torch.cat(positions))

    def chunks(self) -> Iterator[slice]:
        """Each chunk's tokens in the sequence."""
        bounds = torch.nonzero(self.segment[1:] != self.segment[:-1]).flatten() + 1
        edges = [*bounds.tolist(), len(self.segment)]
        for start, end in zip(edges[:-1], edges[1:]):
            yield slice(start, end)


@dataclass
class TeacherRecord:
    """What one forward left: per layer the prompt's ``keys`` / ``values`` ``[P, H, D]``,
    the largest pass probability of each prompt key ``[H, P]`` and the layer's sliding
    window (None: full attention), by the layers' indices."""

    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    best: dict[int, torch.Tensor] = field(default_factory=dict)
    windows: dict[int, int | None] = field(default_factory=dict)


class TeacherUnsupported(ValueError):
    """A model whose attention does not go through transformers' attention interface."""


_active: list[tuple[TeacherLayout, TeacherRecord]] = []


@contextmanager
def recording(layout: TeacherLayout) -> Iterator[TeacherRecord]:
    """While active, the registered attention lays out ``layout`` and fills the record."""
    record = TeacherRecord()
    _active.append((layout, record))
    try:
        yield record
    finally:
        _active.pop()


def teacher_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask, scaling: float | None = None, dropout: float = 0.0,
                      softcap: float | None = None, sliding_window: int | None = None,
                      s_aux: torch.Tensor | None = None,
                      **_kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``query [1, Hq, T, D]``, ``key`` / ``value``
    ``[1, Hkv, T, D]``; returns ``[1, T, Hq, D]``. The mask transformers built is ignored:
    the layout's is the one the engine's passes see. ``softcap`` (Gemma 2), the layer's
    ``sliding_window`` and attention sinks (``s_aux [Hq]``, gpt-oss) as the models pass
    them."""
    layout, record = _active[-1]
    prompt_len = layout.prompt_len
    num_kv_heads = key.shape[1]
    group = query.shape[1] // num_kv_heads
    layer = module.layer_idx
    record.keys[layer] = key[0, :, :prompt_len].transpose(0, 1).float().cpu()
    record.values[layer] = value[0, :, :prompt_len].transpose(0, 1).float().cpu()
    queries = query[0].float()
    keys = key[0].float().repeat_interleave(group, dim=0)  # [Hq, T, D]
    values = value[0].float().repeat_interleave(group, dim=0)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = sliding_window or getattr(module, "sliding_window", None)
    logit_form = _LogitForm(scale, softcap, None if s_aux is None else s_aux.float())
    places = layout.positions.to(query.device)
    output = torch.empty_like(queries)
    prompt = slice(0, prompt_len)
    output[:, prompt] = _attend(queries[:, prompt], keys[:, prompt], values[:, prompt],
                                places[prompt], window, logit_form)
    best = torch.full((num_kv_heads, prompt_len), float("-inf"), device=query.device)
    for chunk in layout.chunks():
        # A chunk sees the whole prompt and its own earlier tokens.
        seen_keys = torch.cat([keys[:, prompt], keys[:, chunk]], dim=1)
        seen_values = torch.cat([values[:, prompt], values[:, chunk]], dim=1)
        seen_places = torch.cat([places[prompt], places[chunk]])
        mask = _causal(places[chunk], seen_places, window)
        mask[:, :prompt_len] = _within(places[chunk], places[prompt], window)
        probabilities = logit_form.probabilities(queries[:, chunk], seen_keys, mask)
        output[:, chunk] = probabilities @ seen_values
        paid = probabilities[:, :, :prompt_len].reshape(num_kv_heads, group, -1, prompt_len)
        best = torch.maximum(best, paid.amax(dim=(1, 2)))
    record.best[layer] = best.cpu()
    record.windows[layer] = window or None
    return output.to(query.dtype).transpose(0, 1).unsqueeze(0), None


def _within(query_places: torch.Tensor, key_places: torch.Tensor,
            window: int | None) -> torch.Tensor:
    """``[q, k]`` bool: keys inside each query's sliding window (all of them without one)."""
    distance = query_places[:, None] - key_places[None, :]
    return distance < window if window else torch.ones_like(distance, dtype=torch.bool)


def _causal(query_places: torch.Tensor, key_places: torch.Tensor,
            window: int | None) -> torch.Tensor:
    distance = query_places[:, None] - key_places[None, :]
    return (distance >= 0) & (distance < window if window else True)


@dataclass
class _LogitForm:
    """How a layer turns logits into probabilities: the scale, a soft cap, sinks."""

    scale: float
    softcap: float | None
    sinks: torch.Tensor | None  # [Hq]: a logit per head that takes probability, no value

    def probabilities(self, queries: torch.Tensor, keys: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
        """``[Hq, q, k]`` for ``queries [Hq, q, D]``, ``keys [Hq, k, D]``, ``mask [q, k]``."""
        logits = queries @ keys.transpose(1, 2) * self.scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        logits = logits.masked_fill(~mask, float("-inf"))
        if self.sinks is None:
            return logits.softmax(-1)
        sinks = self.sinks.to(logits.device)[:, None, None].expand(-1, logits.shape[1], 1)
        return torch.cat([logits, sinks], dim=-1).softmax(-1)[..., :-1]

    @property
    def plain(self) -> bool:
        """Whether PyTorch's fused attention computes it (no cap, no sinks)."""
        return not self.softcap and self.sinks is None


def _attend(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            places: torch.Tensor, window: int | None, form: _LogitForm) -> torch.Tensor:
    """The prompt's own causal attention (no scores needed): PyTorch's fused kernel (given a
    batch dimension, which its CPU fast path wants), else explicit in blocks of queries."""
    if form.plain:
        mask = _causal(places, places, window) if window else None
        return torch.nn.functional.scaled_dot_product_attention(
            queries[None], keys[None], values[None], attn_mask=mask, is_causal=mask is None,
            scale=form.scale)[0]
    mask = _causal(places, places, window)
    output = torch.empty_like(queries)
    for start in range(0, queries.shape[1], QUERY_BLOCK):
        block = slice(start, start + QUERY_BLOCK)
        output[:, block] = form.probabilities(queries[:, block], keys, mask[block]) @ values
    return output


def register() -> str:
    """Register the attention with transformers; returns the ``attn_implementation`` name to
    load a model with. No mask function goes with it: transformers then builds no mask (the
    layout makes its own)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, teacher_attention)
    return ATTENTION


def teacher_forward(model, prompt_ids: Sequence[int], repeat_ids: Sequence[int],
                    chunk: int) -> TeacherRecord:
    """Run ``model`` (loaded with ``attn_implementation=register()``) over the prompt and its
    reconstruction chunks; the record holds every layer's keys, values and pass scores."""
    prompt = list(prompt_ids)
    tokens, chunk_lens = list(prompt), []
    for start in range(0, len(prompt), chunk):
        piece = list(repeat_ids) + prompt[start : start + chunk]
        tokens += piece
        chunk_lens.append(len(piece))
    layout = TeacherLayout.of(len(prompt), chunk_lens)
    device = model.device
    with recording(layout) as record, torch.inference_mode():
        # The base model only: the teacher needs no logits (a vocabulary-wide product).
        model.get_decoder()(input_ids=torch.tensor([tokens], device=device),
                            position_ids=layout.positions[None].to(device), use_cache=False)
    if len(record.best) != model.config.num_hidden_layers:
        raise TeacherUnsupported(
            f"{type(model).__name__} ran {len(record.best)} of its "
            f"{model.config.num_hidden_layers} attention layers through transformers' "
            "attention interface; the teacher needs all of them")
    return record
