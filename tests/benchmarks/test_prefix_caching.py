"""Benchmarks run vLLM's default, prefix caching on, unless a run turns it off: the switch is
recorded in the result JSON and said above the run's table. The engine is never started."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from benchmarks import memory_sweep, throughput
from benchmarks.engine import clear_prefix_cache, engine_args
from benchmarks.jobs import JobResult
from benchmarks.quality import cli as quality_cli
from benchmarks.report import (
    PREFIX_CACHING_OFF,
    PREFIX_CACHING_WAS_OFF,
    markdown_tables,
    with_prefix_caching,
)
from benchmarks.results_doc.document import load, result_block, section_files
from benchmarks.results_doc.provenance import CHANGES, stale_reasons
from benchmarks.results_doc.sections import SECTIONS
from benchmarks.specs import CompressionSpec, EngineSettings
from benchmarks.studies import decode_fidelity


def _settings(**changes) -> EngineSettings:
    return EngineSettings(model="m", dtype="float32", max_model_len=64, max_num_seqs=4,
                          max_num_batched_tokens=64, kv_cache_memory_bytes=1 << 20, **changes)


@pytest.mark.parametrize("spec", [CompressionSpec(), CompressionSpec("pyramidkv", ratio=0.875)])
def test_engines_get_vllms_default_prefix_caching_unless_turned_off(spec):
    assert _settings().enable_prefix_caching is True
    assert engine_args(_settings(), spec).enable_prefix_caching is True
    assert engine_args(_settings(enable_prefix_caching=False), spec).enable_prefix_caching is False


@pytest.mark.parametrize("parser", [throughput.build_parser, decode_fidelity.build_parser,
                                    quality_cli.build_parser])
def test_no_prefix_caching_flag(parser):
    assert parser().parse_args([]).enable_prefix_caching is True
    assert parser().parse_args(["--no-prefix-caching"]).enable_prefix_caching is False


@pytest.mark.parametrize("flags, enabled", [([], True), (["--no-prefix-caching"], False)])
def test_throughput_records_prefix_caching_in_its_jobs_and_json(monkeypatch, tmp_path,
                                                                embedded_model, flags, enabled):
    seen = {}

    def fake_run_jobs(module, jobs, **kwargs):
        seen["jobs"] = jobs
        return {job["id"]: JobResult(job["id"], None, "not run here", 0.0) for job in jobs}

    monkeypatch.setattr(throughput, "run_jobs", fake_run_jobs)
    out = tmp_path / "t.json"
    assert throughput.main(["--model", embedded_model, "--configs", "vanilla,pyramidkv:r=0.5",
                            "--num-prompts", "2", "--input-len", "32", "--output-len", "4",
                            "--output-json", str(out), "--no-progress", *flags]) == 1
    # both default workloads, each with --configs
    assert [job["id"] for job in seen["jobs"]] == [
        "vanilla", "pyramidkv:r=0.5", "system-prompt/vanilla", "system-prompt/pyramidkv:r=0.5"]
    assert [job["settings"]["enable_prefix_caching"] for job in seen["jobs"]] == [enabled] * 4
    report = json.loads(out.read_text())
    assert report["settings"]["enable_prefix_caching"] is enabled
    assert all(report["workloads"][name]["settings"]["enable_prefix_caching"] is enabled
               for name in ("random", "system-prompt"))
    rendered = throughput.render_report(report)
    assert (PREFIX_CACHING_OFF in rendered) is not enabled
    assert rendered.count(PREFIX_CACHING_OFF) == (0 if enabled else 2)  # a table a workload


def _section(key: str):
    return next(section for section in SECTIONS if section.key == key)


@pytest.mark.parametrize("key", ["throughput", "memory_sweep", "long_generation"])
def test_the_rendered_table_says_when_prefix_caching_was_off(key):
    row = {"label": "vanilla", "ok": True, "kv_cache_tokens": 100, "output_tok_s": 1.0}
    report = {"command": "python -m benchmarks.throughput", "configs": [row],
              "machine": {"date": "2026-12-05T00:00:00+00:00"},
              "settings": {"dtype": "float32", "enable_prefix_caching": False}}
    block = result_block(_section(key), "x.json", report)
    assert PREFIX_CACHING_OFF in block
    assert block.index(PREFIX_CACHING_OFF) < block.index("| vanilla |")  # above the table
    report["settings"]["enable_prefix_caching"] = True
    assert PREFIX_CACHING_OFF not in result_block(_section(key), "x.json", report)
    # a result from before the setting was recorded ran with it off (the old default)
    del report["settings"]["enable_prefix_caching"]
    assert PREFIX_CACHING_WAS_OFF in result_block(_section(key), "x.json", report)


def test_the_off_line_heads_the_table():
    with markdown_tables():
        text = with_prefix_caching(memory_sweep.render([]), {"enable_prefix_caching": False})
    assert text.startswith(PREFIX_CACHING_OFF) and "| KV tokens |" in text
    assert with_prefix_caching("T", {}, unrecorded=True) == "T"


def test_synthetic_prompts_share_no_prefix_block():
    """With prefix caching on, the default workload's prompts must not hit each other's
    cache: no two share their first 16 tokens (a vLLM block, a kvcompress index block)."""
    prompts = throughput.synthetic_prompts(24, 1024, 128, seed=0, vocab_size=49152,
                                           special_ids=set(range(17)))
    heads = {tuple(p["prompt_token_ids"][:16]) for p in prompts}
    assert len(heads) == len(prompts)


def test_clearing_the_prefix_cache_fails_loudly():
    clear_prefix_cache(SimpleNamespace(reset_prefix_cache=lambda: True))
    with pytest.raises(RuntimeError, match="not reset"):
        clear_prefix_cache(SimpleNamespace(reset_prefix_cache=lambda: False))


def test_the_ledger_marks_what_the_default_altered_and_nothing_else():
    """Results of the engines whose prefix caching the change turned on, run before it, are
    stale; multi-turn and shared-context runs (on already) and transformers-only analyses
    shown beside quality runs are not marked by it."""
    change = next(c for c in CHANGES if "prefix caching on" in c.what)

    def marked(key: str, name: str) -> bool:
        return any(change.commit in reason for reason in stale_reasons(key, name, load(name)))

    for key, name in [("throughput", "throughput.json"),
                      ("memory_sweep", "throughput_memory_sweep.json"),
                      ("long_generation", "throughput_long_generation.json"),
                      ("tensor_parallel", "throughput_tp2.json"),
                      ("quality", "quality.json"), ("decode_recall", "decode_recall.json"),
                      ("hybrid_memory", "hybrid_memory_gemma3.json")]:
        assert marked(key, name), name
    assert not marked("multi_turn", "multi_turn.json")
    assert not marked("shared_context", "shared_context.json")
    tuning = section_files(_section("quality_tuning"))
    assert not marked("quality_tuning", "quality_tuning/retention_grid.json")
    assert marked("quality_tuning", next(n for n in tuning if "budget64" in n))
