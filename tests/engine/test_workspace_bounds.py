"""The compression path's temporary memory stays inside the workspace the engine reserves
(``engine.scoring_memory.workspace_bytes``), at a long prompt and a Llama-8B-shaped layout
(32 layers, 8 KV heads of 128 dimensions, 32 query heads), measured on CPU as the peak of
the tensors live at once (``tests.memory_peak``) on top of the inputs (accumulators, pool).

The prompt is 32k tokens here (a few seconds on CPU); every bound is linear in the prompt
at one layer's width, so at 128k it is four times these figures: the workspace is 40 bytes
per score of one layer (42 MB at 128k), against which the whole request's plan used to take
~1.3 GB. Planning also holds its outputs, which grow with the prompt times the layers and are
reserved like the accumulators (``scoring_memory.plan_output_bytes``): the int32 plan, and
with hybrid scoring the rank union of its two sources. Besides them the temporaries stay within
the workspace. Every sharing is measured: by layer, model-wide (hybrid's union selected slice
by slice, a capped score threshold's candidates too), and a group of a long prompt with short
ones (each request's plan as wide as its own rows). Reconstruction and expected scoring are
measured on one layer (they run one layer at a time) at 16k tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kvcompress.attention.reconstruction_scores import (
    SCORING_WORKSPACE_BYTES,
    accumulate_reconstruction_scores,
)
from kvcompress.engine.scoring_memory import plan_output_bytes, workspace_bytes
from kvcompress.engine.worker import compaction as worker_compaction
from kvcompress.engine.worker.compaction import _plan
from kvcompress.engine.worker.expected import ExpectedScorer
from kvcompress.engine.worker.host_transfer import to_host
from kvcompress.engine.worker.reconstruction import Reconstructor
from kvcompress.engine.worker.state import WorkerKVState
from kvcompress.paging import PageLayout, PageTableDelta
from kvcompress.paging.page_format import CPU_PAGE_FORMAT
from kvcompress.profile_model.profiles import QueryProfile
from kvcompress.settings.config import KVCompressionConfig
from kvcompress.step import StepBatch
from tests.memory_peak import LiveBytes

LAYERS, HEADS, GROUP, DIM = 32, 8, 4, 128
PROMPT = 32 * 1024


@dataclass
class ScoredRequest:
    """What planning reads of a request (``worker.request_kv.RequestKV``)."""

    prompt_len: int
    window_scores: torch.Tensor | None
    query_scores: torch.Tensor | None = None
    adopted_rows: np.ndarray | None = None
    query_agnostic: bool = True

    def new_prompt_tokens(self, prompt_len: int) -> int:
        return prompt_len


def planned_peak(options: dict, hybrid: bool,
                 prompts: tuple[int, ...] = (PROMPT,)) -> tuple[int, int]:
    """Peak bytes of planning ``prompts`` (one group: one policy call) and bringing the plan
    to the host, and of those the plan's own outputs (the plan, and with hybrid the union
    of its sources' ranks)."""
    config = KVCompressionConfig.from_mapping({"kv_compression": "snapkv", **options})
    generator = torch.Generator().manual_seed(0)
    requests = [ScoredRequest(
        prompt, torch.rand(LAYERS, HEADS, prompt, generator=generator),
        torch.rand(LAYERS, HEADS, prompt, generator=generator) if hybrid else None)
        for prompt in prompts]
    with LiveBytes() as memory:
        plans = _plan(config, requests, tuple(range(LAYERS)), HEADS)  # type: ignore[arg-type]
        host = to_host([tensor for plan in plans for tensor in (plan.counts, plan.indices)])
    assert int(host[0].sum()) > 0
    union = LAYERS * HEADS * max(prompts) * 4 if hybrid else 0
    return memory.peak, sum(tensor.nbytes for tensor in host) + union


def planning_reserve(hybrid: bool, prompts: tuple[int, ...] = (PROMPT,)) -> int:
    """What the engine reserves for planning ``prompts``: the workspace (of the longest)
    and the outputs of all of them (``scoring_memory.reserved_bytes``)."""
    return workspace_bytes(HEADS, max(prompts)) + plan_output_bytes(
        LAYERS, HEADS, sum(prompts), 2 if hybrid else 1)


def mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def assert_temporaries_in_the_workspace(peak: int, outputs: int) -> None:
    """Besides the plan (and hybrid's union) planning holds at most the workspace of the
    longest prompt, PROMPT."""
    workspace = workspace_bytes(HEADS, PROMPT)
    assert peak - outputs <= workspace, (
        f"temporaries {mib(peak - outputs)}, workspace {mib(workspace)}")


@pytest.mark.parametrize("options, hybrid", [
    ({"kv_budget": 2048, "kv_budget_sharing": "layer"}, False),
    ({"kv_budget": 2048, "kv_budget_sharing": "layer"}, True),
    ({"kv_compression_ratio": 0.5, "kv_budget_sharing": "layer"}, False),
    ({"kv_compression_ratio": 0.5, "kv_budget_sharing": "layer"}, True),
    ({"kv_compression_ratio": 0.5, "kv_budget_sharing": "model"}, False),
], ids=["budget-layer-one-source", "budget-layer-hybrid", "ratio-layer-one-source",
        "ratio-layer-hybrid", "ratio-model-one-source"])
def test_planning_a_long_prompt_stays_in_the_workspace(options, hybrid):
    """Layer by layer, into one output (model-wide: the request's cut-off key found slice
    by slice first): besides the plan (and hybrid's rank union, ranked one layer at a time)
    the temporaries are one layer's, within the workspace."""
    peak, outputs = planned_peak(options, hybrid)
    reserve = planning_reserve(hybrid)
    assert peak <= reserve, f"peak {mib(peak)}, reserve {mib(reserve)}"
    assert_temporaries_in_the_workspace(peak, outputs)


def test_planning_a_long_hybrid_prompt_shared_model_wide_stays_in_the_workspace():
    """Hybrid scoring shared model-wide: the union of the two sources' rankings over the
    request's whole ``[L, H, S]`` is selected at its cut-off slice by slice, never ranked
    whole (``policies.union``)."""
    peak, outputs = planned_peak(
        {"kv_compression_ratio": 0.5, "kv_budget_sharing": "model"}, True)
    reserve = planning_reserve(True)
    assert peak <= reserve, f"peak {mib(peak)}, reserve {mib(reserve)}"
    assert_temporaries_in_the_workspace(peak, outputs)


@pytest.mark.parametrize("options", [
    {"kv_compression_ratio": 0.5},
    {"kv_budget": 700, "kv_pooling": "avg"},
    {"kv_compression_ratio": 0.3, "kv_pooling": "none"},
], ids=["ratio-maxpool", "budget-avgpool", "ratio-no-pooling"])
@pytest.mark.parametrize("workspace", [None, 3000], ids=["own-workspace", "small-workspace"])
def test_hybrid_model_wide_plans_by_slices_are_the_whole_rankings(monkeypatch, options,
                                                                  workspace):
    """The plan of hybrid scores shared model-wide, selected slice by slice, is the plan of
    ranking each source over the whole request (``rank_union``), index for index (a small
    workspace: many slices and narrowing rounds)."""
    config = KVCompressionConfig.from_mapping(
        {"kv_compression": "snapkv", "kv_budget_sharing": "model", **options})
    generator = torch.Generator().manual_seed(3)
    requests = [ScoredRequest(prompt, torch.rand(8, 4, prompt, generator=generator),
                              torch.rand(8, 4, prompt, generator=generator) ** 3)
                for prompt in (3000, 2100)]

    def plan():
        plans = _plan(config, requests, tuple(range(8)), 4)  # type: ignore[arg-type]
        return [tensor for plan in plans for tensor in (plan.counts, plan.indices)]

    monkeypatch.setattr(worker_compaction, "UNION_BYTES_PER_SCORE", 0)  # ranked whole
    whole = plan()
    monkeypatch.setattr(worker_compaction, "UNION_BYTES_PER_SCORE", 2**40)  # by slices
    if workspace is not None:
        monkeypatch.setattr(worker_compaction, "workspace_scores", lambda *_: workspace)
    sliced = plan()
    assert all(torch.equal(one, other) for one, other in zip(whole, sliced, strict=True))


@pytest.mark.parametrize("hybrid", [False, True], ids=["one-source", "hybrid"])
def test_a_capped_score_threshold_shared_model_wide_stays_in_the_workspace(hybrid):
    """A score threshold capped by a ratio shared model-wide: the passing tokens compete
    for the request's total slice by slice (their cut-off found first), as without one."""
    options = {"kv_compression_ratio": 0.5, "kv_budget_sharing": "model",
               "kv_score_threshold": -1.0}
    peak, outputs = planned_peak(options, hybrid)
    reserve = planning_reserve(hybrid)
    assert peak <= reserve, f"peak {mib(peak)}, reserve {mib(reserve)}"
    assert_temporaries_in_the_workspace(peak, outputs)


GROUP_PROMPTS = (PROMPT, *[2048] * 8)  # one long prompt and short ones completing with it


@pytest.mark.parametrize("sharing", ["layer", "model"])
def test_a_group_of_requests_is_not_padded_to_its_widest_row(sharing):
    """Requests sharing a config are planned in one call, but each request's plan is as
    wide as its own rows: the short prompts of a group are not padded to the long one's
    width (which the reserve, per prompt token, does not cover)."""
    options = {"kv_compression_ratio": 0.5, "kv_budget_sharing": sharing}
    peak, outputs = planned_peak(options, False, GROUP_PROMPTS)
    reserve = planning_reserve(False, GROUP_PROMPTS)
    assert peak <= reserve, f"peak {mib(peak)}, reserve {mib(reserve)}"
    assert_temporaries_in_the_workspace(peak, outputs)


RECONSTRUCTED = 16 * 1024  # prompt tokens of the reconstruction and expected-scoring checks
PAGE = 16


def one_layer_state(prompt: int, scratch_tokens: int = 0):
    """One request filling one layer of Llama-8B-shaped rows with ``prompt`` random keys."""
    pages = prompt // PAGE
    scratch = HEADS * -(-scratch_tokens // PAGE)
    layout = PageLayout(1, HEADS, DIM, PAGE, 2, HEADS * pages, scratch_pages=scratch)
    state = WorkerKVState(layout, torch.device("cpu"))
    ids = np.random.default_rng(0).permutation(HEADS * pages).astype(np.int32)
    state.apply_deltas({"r": PageTableDelta(fresh=True, appends=[(
        np.full(HEADS, pages, np.int32), ids)])})
    request = state.requests["r"]
    request.lengths = np.full(HEADS, prompt, dtype=np.int64)
    request.prompt_len = prompt
    pool = torch.randn(HEADS * pages + scratch, 2, PAGE, DIM, dtype=torch.bfloat16,
                       generator=torch.Generator().manual_seed(0))
    return layout, state, pool


def test_reconstruction_scoring_of_a_long_prompt_stays_in_its_workspace():
    """One layer of a pass of 512 prompt tokens (plus its instruction) over a 16k prompt:
    the keys are read in chunks, never the prompt's whole logit matrix."""
    chunk, repeat = 512, [1] * 16
    layout, state, pool = one_layer_state(RECONSTRUCTED, chunk + len(repeat))
    after = np.full((1, HEADS), RECONSTRUCTED, dtype=np.int64)
    step = StepBatch(layout=layout, req_ids=["r"], query_start_loc=[0, 1],
                     num_new_tokens=torch.tensor([1]), lengths_before=torch.as_tensor(after - 1),
                     tables=None, slot_mapping=torch.zeros(1, HEADS, dtype=torch.long),
                     logical_after=np.array([RECONSTRUCTED]), host_lengths_before=after - 1,
                     host_lengths_after=after, completing_prompt=[0])
    reconstructor = Reconstructor(state, repeat, chunk=chunk)
    reconstructor.register(step, ["r"], lambda _: list(range(RECONSTRUCTED)))
    one = next(iter(reconstructor.passes({"r": 1})))
    (window,) = one.step.window_queries
    query = torch.randn(len(one.input_ids), HEADS * GROUP, DIM, dtype=torch.bfloat16)
    with LiveBytes() as memory:
        accumulate_reconstruction_scores(query, pool, CPU_PAGE_FORMAT, one.step, window, 0,
                                         DIM**-0.5, soft_cap=50.0)
    assert float(state.requests["r"].window_scores.max()) > 0
    assert memory.peak <= SCORING_WORKSPACE_BYTES, f"peak {memory.peak / 2**20:.1f} MiB"


def test_expected_scoring_of_a_long_prompt_stays_in_the_workspace():
    """One layer of a 16k prompt scored by a query profile: the keys are read in chunks
    whose ``[Hq, D, keys]`` product is bounded, never all at once."""
    layout, state, pool = one_layer_state(RECONSTRUCTED)
    generator = torch.Generator().manual_seed(1)
    factor = torch.randn(1, HEADS * GROUP, DIM, DIM, generator=generator) * 0.05
    profile = QueryProfile(torch.randn(1, HEADS * GROUP, DIM, generator=generator),
                           factor @ factor.transpose(-1, -2),
                           1.0 / 500.0 ** (torch.arange(0, DIM, 2).float() / DIM), DIM, 1.0,
                           DIM**-0.5, "test", 10)
    scorer = ExpectedScorer(profile, layout, torch.device("cpu"))
    with LiveBytes() as memory:
        scores = scorer.score(state.requests["r"], pool, CPU_PAGE_FORMAT)
        del scores
    assert memory.peak <= workspace_bytes(HEADS, RECONSTRUCTED), (
        f"peak {memory.peak / 2**20:.1f} MiB")


@dataclass
class AdoptingRequest(ScoredRequest):
    """An adopter: row ``(l, h)``'s new prompt tokens start at slot ``adopted_rows[l, h]``."""

    new_tokens: int = 0

    def new_prompt_tokens(self, prompt_len: int) -> int:
        return self.new_tokens


def test_an_adopters_long_new_part_is_planned_within_the_workspace():
    """An adopter of a compressed context (rows of unequal length) with a 32k-token new
    part: its scores are shifted to the rows' starts in place, a layer at a time (a whole
    ``[L, H, N]`` copy and its int64 index were ~100 MiB at these shapes), and the plan is
    the one of the explicitly gathered segment scores."""
    config = KVCompressionConfig.from_mapping({"kv_compression": "snapkv",
                                               "kv_compression_ratio": 0.5})
    generator = torch.Generator().manual_seed(1)
    adopted = torch.randint(0, 512, (LAYERS, HEADS), generator=generator).numpy()
    scores = torch.rand(LAYERS, HEADS, 512 + PROMPT, generator=generator)
    slots = torch.as_tensor(adopted)[:, :, None] + torch.arange(PROMPT)
    reference = _plan(config, [ScoredRequest(PROMPT, scores.gather(-1, slots))],  # type: ignore[list-item]
                      tuple(range(LAYERS)), HEADS)[0]
    request = AdoptingRequest(PROMPT + 512, scores, adopted_rows=adopted, new_tokens=PROMPT)
    with LiveBytes() as memory:
        plan = _plan(config, [request], tuple(range(LAYERS)), HEADS,  # type: ignore[list-item]
                     adopters=True)[0]
        host = to_host([plan.counts, plan.indices])
    reserve = planning_reserve(False)
    assert memory.peak <= reserve, f"peak {mib(memory.peak)}, reserve {mib(reserve)}"
    assert_temporaries_in_the_workspace(memory.peak, sum(tensor.nbytes for tensor in host))
    assert torch.equal(host[0], reference.counts) and torch.equal(host[1], reference.indices)
    # planned again (a group's planning retried request by request): the same plan
    again = _plan(config, [request], tuple(range(LAYERS)), HEADS,  # type: ignore[list-item]
                  adopters=True)[0]
    assert torch.equal(again.indices, reference.indices)
