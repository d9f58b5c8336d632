"""The compression step after a forward pass (stage 6-7, ``kvcompress.step``): the requests
whose prompt completed compacted (``compaction``), the generated parts over their decode
budget evicted (``decode_eviction``), with one device->host transfer for all of it. No vLLM
imports."""

from __future__ import annotations

import torch

from kvcompress.engine.messages import Compaction, merge_compactions
from kvcompress.engine.worker.compaction import CompactionStats, compact_completed_prompts
from kvcompress.engine.worker.decode_eviction import choose_evictions, evict_generated_tokens
from kvcompress.engine.worker.state import WorkerKVState
from kvcompress.paging.page_format import PageFormat
from kvcompress.step import KVMover, StepBatch


def compress_step(
    state: WorkerKVState,
    step: StepBatch,
    pool: torch.Tensor,
    mover: KVMover,
    stats: CompactionStats | None = None,
    page_format: PageFormat | None = None,
) -> dict[str, Compaction]:
    """The step's compression after its forward: completed prompts compacted
    (``compact_completed_prompts``), then generated parts over their decode budget evicted
    (``evict_generated_tokens``), with one device->host transfer for all of it.

    The decode evictions of the requests whose prompt did not complete in this step are
    chosen first and come over with the prompts' plans. A request whose prompt completed
    and that already holds more generated tokens than its decode budget allows (resumed
    after preemption) is chosen for after its compaction; it has no decode scores, its
    newest tokens are kept, chosen on the host.
    """
    completing = {step.req_ids[index] for index in step.completing_prompt}
    chosen = choose_evictions(state, step, pool, mover, page_format, skip=completing)
    compactions = compact_completed_prompts(state, step, pool, mover, stats, along=chosen)
    # Its lengths are final: the prompt's eviction must reach the scheduler too.
    merge_compactions(compactions, evict_generated_tokens(state, step, pool, mover, stats,
                                                          page_format, chosen=chosen))
    return compactions
