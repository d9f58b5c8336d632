"""The compression figures: gathered by the scheduler per step, exported by the stat logger
plugin, and the Grafana dashboard only asks for metrics that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from prometheus_client import REGISTRY

from kvcompress.engine.messages import Compaction, WorkerReport
from kvcompress.engine.metrics import STATS_FIELD, KVCompressStatLogger, StepFigures

DASHBOARD = Path(__file__).resolve().parents[2] / "docker" / "grafana-kvcompress.json"


def test_figures_count_prompt_and_decode_evictions_and_reset_when_taken():
    figures = StepFigures()
    figures.add_compaction(Compaction(100, np.array([10, 30, 20, 20])), np.full(4, 100))
    figures.add_compaction(Compaction(140, np.array([50] * 4), kind="decode"), np.full(4, 70))
    figures.add_report(WorkerReport(score_seconds=0.25, compaction_seconds=0.5))
    taken = figures.take(pages_free=7, pages_total=64)
    assert taken["evicted_prompt_tokens"] == 400 - 80
    assert taken["evicted_decode_tokens"] == 4 * 20
    assert taken["compressed_requests"] == 1 and taken["kept_fractions"] == [0.2]
    assert (taken["score_seconds"], taken["compaction_seconds"]) == ([0.25], [0.5])
    assert (taken["pages_free"], taken["pages_total"]) == (7, 64)
    assert figures.take(7, 64)["evicted_prompt_tokens"] == 0


def test_stat_logger_exports_the_figures_and_ignores_engines_without_them():
    logger = KVCompressStatLogger(vllm_config=None, engine_index=7)
    figures = StepFigures()
    figures.add_compaction(Compaction(100, np.array([10] * 4)), np.full(4, 100))
    figures.failed_requests = 2
    figures.preempted_tokens = 1234
    figures.window_freed_pages = 17
    logger.record(SimpleNamespace(**{STATS_FIELD: figures.take(5, 9)}), None, engine_idx=7)
    logger.record(SimpleNamespace(), None, engine_idx=7)  # compression off: nothing
    sample = REGISTRY.get_sample_value
    assert sample("kvcompress:evicted_tokens_total", {"engine": "7", "phase": "prompt"}) == 360
    assert sample("kvcompress:compressed_requests_total", {"engine": "7"}) == 1
    assert sample("kvcompress:failed_requests_total", {"engine": "7"}) == 2
    assert sample("kvcompress:preempted_tokens_total", {"engine": "7"}) == 1234
    assert sample("kvcompress:window_freed_pages_total", {"engine": "7"}) == 17
    assert sample("kvcompress:request_kept_fraction_count", {"engine": "7"}) == 1
    assert sample("kvcompress:pages_free", {"engine": "7"}) == 5


def test_the_dashboard_only_queries_exported_metrics():
    figures = StepFigures()  # one of everything, so every metric has samples
    figures.add_compaction(Compaction(100, np.array([10] * 4)), np.full(4, 100))
    figures.add_report(WorkerReport(score_seconds=0.01, compaction_seconds=0.02))
    KVCompressStatLogger(None, 8).record(SimpleNamespace(**{STATS_FIELD: figures.take(1, 2)}),
                                         None, engine_idx=8)
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    names = set(re.findall(r"kvcompress:[a-z_]+", " ".join(exprs)))
    exported = {sample.name for family in REGISTRY.collect() for sample in family.samples
                if sample.name.startswith("kvcompress:")}
    assert names and names <= exported, names - exported


def test_step_stats_recorder_sums_the_seconds_the_workers_report():
    from kvcompress.engine.stats import EngineStats, StepStatsRecorder

    sink = EngineStats()
    recorder = StepStatsRecorder.factory(sink)(None)
    for seconds in ([0.25, 0.5], [], [1.0]):
        figures = {"preempted_tokens": 0, "score_seconds": seconds, "compaction_seconds": [0.1]}
        stats = SimpleNamespace(num_running_reqs=1, num_waiting_reqs=0, kv_cache_usage=0.5,
                                **{STATS_FIELD: figures})
        recorder.record(stats, None)
    assert sink.score_seconds == 1.75
    assert abs(sink.compaction_seconds - 0.3) < 1e-9
    recorder.record(SimpleNamespace(num_running_reqs=0, num_waiting_reqs=0, kv_cache_usage=0.0,
                                    **{STATS_FIELD: None}), None)  # vanilla vLLM: no figures
    assert len(sink.samples) == 4 and sink.score_seconds == 1.75
