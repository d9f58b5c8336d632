"""Throughput figures from per-step samples, ratios to vanilla, prompts, table."""

from __future__ import annotations

import json

import pytest

from benchmarks.jobs import JobResult
from benchmarks.specs import CompressionSpec
from benchmarks.throughput import (
    AMPLE_LABEL,
    add_ratios,
    config_row,
    file_prompts,
    render,
    summarize,
    synthetic_prompts,
)


def test_summarize_kv_tokens_per_running_request():
    samples = [
        {"running": 2, "waiting": 3, "kv_cache_usage": 0.5},   # 0.5 * 1000 / 2 = 250
        {"running": 0, "waiting": 0, "kv_cache_usage": 0.0},   # idle step: ignored
        {"running": 4, "waiting": 0, "kv_cache_usage": 0.8},   # 0.8 * 1000 / 4 = 200
    ]
    out = summarize(samples, elapsed=10.0, prompt_tokens=300, output_tokens=100,
                    preemptions=2, capacity_tokens=1000)
    assert out["mean_kv_tokens_per_running"] == pytest.approx(225.0)
    assert out["output_tok_s"] == pytest.approx(10.0)
    assert out["total_tok_s"] == pytest.approx(40.0)
    assert out["peak_running"] == 4 and out["mean_running"] == pytest.approx(3.0)
    assert out["peak_kv_usage"] == pytest.approx(0.8) and out["preemptions"] == 2
    assert out["steps"] == 3


def test_summarize_empty():
    out = summarize([], elapsed=0.0, prompt_tokens=0, output_tokens=0, preemptions=0,
                    capacity_tokens=10)
    assert out["output_tok_s"] == 0.0 and out["mean_kv_tokens_per_running"] == 0.0


def test_tokens_held_per_gib_counts_only_steps_where_every_answering_request_runs():
    held = [
        {"tokens": 1000, "requests": 2, "running": 2, "kv_cache_usage": 0.25},  # 4000 / GiB
        {"tokens": 1500, "requests": 2, "running": 3, "kv_cache_usage": 0.5},  # one in prefill
        {"tokens": 900, "requests": 3, "running": 2, "kv_cache_usage": 0.1},  # one preempted
        {"tokens": 600, "requests": 1, "running": 1, "kv_cache_usage": 0.05},  # 12000 / GiB
    ]
    out = summarize([], elapsed=1.0, prompt_tokens=0, output_tokens=0, preemptions=0,
                    capacity_tokens=10, held=held, kv_cache_gib=1.0)
    assert out["tokens_per_gib_used"] == pytest.approx(8000.0)
    assert out["peak_tokens_per_gib_used"] == pytest.approx(12000.0)
    assert (out["peak_tokens_held"], out["held_steps"]) == (1500, 2)
    assert summarize([], elapsed=1.0, prompt_tokens=0, output_tokens=0, preemptions=0,
                     capacity_tokens=10)["tokens_per_gib_used"] is None


def test_ratios_to_vanilla():
    rows = [
        {"label": "vanilla", "ok": True, "output_tok_s": 10.0, "total_tok_s": 50.0,
         "peak_running": 4, "mean_kv_tokens_per_running": 1000.0},
        {"label": "snapkv:r=0.875", "ok": True, "output_tok_s": 25.0, "total_tok_s": 100.0,
         "peak_running": 16, "mean_kv_tokens_per_running": 250.0},
        {"label": "adakv:64", "ok": False},
    ]
    add_ratios(rows)
    assert rows[0]["vs_vanilla"] == {"output_tok_s": 1.0, "total_tok_s": 1.0,
                                     "peak_running": 1.0, "mean_kv_tokens_per_running": 1.0,
                                     "tokens_per_gib_used": None,  # not in these rows
                                     "peak_tokens_per_gib_used": None, "peak_tokens_held": None}
    assert rows[1]["vs_vanilla"]["output_tok_s"] == pytest.approx(2.5)
    assert rows[1]["vs_vanilla"]["mean_kv_tokens_per_running"] == pytest.approx(0.25)
    assert rows[2]["vs_vanilla"]["output_tok_s"] is None


def test_cap_is_the_output_rate_if_decoding_cost_nothing():
    rows = [
        {"label": "vanilla", "ok": True, "output_tok_s": 10.0, "output_tokens": 1000,
         "prefill_only_s": 40.0},
        {"label": "pyramidkv:r=0.875", "ok": True, "output_tok_s": 20.0, "output_tokens": 1000,
         "prefill_only_s": 50.0},
        {"label": "snapkv:64", "ok": True, "output_tok_s": 12.0, "prefill_only_s": None},
    ]
    add_ratios(rows)
    assert rows[0]["cap"] == {"output_tok_s": 25.0, "x_vanilla": 2.5, "reached": 0.4}
    assert rows[1]["cap"]["x_vanilla"] == pytest.approx(2.0)
    assert rows[1]["cap"]["reached"] == pytest.approx(1.0)
    assert rows[2]["cap"] is None  # measured with --no-cap


def test_share_of_what_ample_memory_gives_vanilla():
    rows = [
        {"label": "vanilla", "ok": True, "output_tok_s": 10.0},
        {"label": "pyramidkv:256@window:256", "ok": True, "output_tok_s": 15.0},
        {"label": "pyramidkv:256@h2o:256", "ok": False},
        {"label": AMPLE_LABEL, "ok": True, "output_tok_s": 20.0},
    ]
    add_ratios(rows)
    assert rows[0]["of_ample_memory"] == pytest.approx(0.5)
    assert rows[1]["of_ample_memory"] == pytest.approx(0.75)
    assert "of_ample_memory" not in rows[2]
    assert rows[3]["vs_vanilla"]["output_tok_s"] == pytest.approx(2.0)
    assert "of ample mem" in render(rows)


def test_ratios_without_vanilla_are_none():
    rows = [{"label": "snapkv:64", "ok": True, "output_tok_s": 3.0}]
    add_ratios(rows)
    assert rows[0]["vs_vanilla"]["output_tok_s"] is None


def test_synthetic_prompts_seeded_and_clean():
    special = {0, 1, 2}
    a = synthetic_prompts(3, 50, 7, seed=1, vocab_size=100, special_ids=special)
    assert a == synthetic_prompts(3, 50, 7, seed=1, vocab_size=100, special_ids=special)
    assert a != synthetic_prompts(3, 50, 7, seed=2, vocab_size=100, special_ids=special)
    assert all(len(p["prompt_token_ids"]) == 50 and p["max_tokens"] == 7 for p in a)
    assert not special & {t for p in a for t in p["prompt_token_ids"]}
    assert a[0]["prompt_token_ids"] != a[1]["prompt_token_ids"]


class FakeTokenizer:
    def encode(self, text):
        return [len(word) for word in text.split()]


def test_file_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a bb ccc", "max_tokens": 5}) + "\n\n"
                    + json.dumps({"prompt": "dddd"}) + "\n")
    prompts = file_prompts(path, FakeTokenizer(), default_max_tokens=9, limit=None)
    assert prompts == [{"prompt_token_ids": [1, 2, 3], "max_tokens": 5},
                       {"prompt_token_ids": [4], "max_tokens": 9}]
    assert len(file_prompts(path, FakeTokenizer(), 9, limit=1)) == 1
    path.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(SystemExit, match="p.jsonl:1"):
        file_prompts(path, FakeTokenizer(), 9, None)


def test_config_row_and_render():
    ok = config_row(CompressionSpec("pyramidkv", ratio=0.875),
                    JobResult("x", result={"output_tok_s": 20.0, "elapsed_s": 3.0}))
    failed = config_row(CompressionSpec(), JobResult("vanilla", error="boom"))
    assert ok["ok"] and ok["prompt_compression"] == pytest.approx(8.0)
    assert not failed["ok"] and failed["error"] == "boom"
    rows = [failed, ok]
    add_ratios(rows)
    table = render(rows)
    assert "pyramidkv:r=0.875" in table and "20.00" in table


def test_both_workloads_by_default_and_one_where_a_preset_or_a_file_says():
    from benchmarks.throughput import build_parser, selected_workloads

    parser = build_parser()
    assert selected_workloads(parser.parse_args([])) == ["random", "system-prompt"]
    assert selected_workloads(parser.parse_args(["--workload", "system-prompt"])) == [
        "system-prompt"]
    assert selected_workloads(parser.parse_args(["--prompts-file", "x.jsonl"])) == ["random"]
    with pytest.raises(ValueError):
        selected_workloads(parser.parse_args(["--workload", "random,system-prompt",
                                              "--sweep-kv-memory"]))
    with pytest.raises(ValueError):
        selected_workloads(parser.parse_args(["--workload", "poems"]))


def test_system_prompt_chats_share_their_prefix(smollm_tokenizer):
    from benchmarks.throughput import chat_prompts, shared_prefix_length

    prompts = chat_prompts(5, 400, 90, 128, 0, smollm_tokenizer)
    assert len(prompts) == 5 and {p["max_tokens"] for p in prompts} == {128}
    shared = shared_prefix_length(prompts)
    assert 380 <= shared <= 460  # the template's head and the ~400-token system prompt
    own = [len(p["prompt_token_ids"]) - shared for p in prompts]
    assert all(80 <= n <= 130 for n in own)
    assert chat_prompts(5, 400, 90, 128, 0, smollm_tokenizer) == prompts  # seeded


def _workload_row(workload, label, tok_s):
    return {"label": label, "ok": True, "output_tok_s": tok_s, "workload": workload}


def test_each_workload_is_compared_with_its_own_vanilla_and_rendered_apart():
    from benchmarks.throughput import ratio_groups, render_report

    rows = [_workload_row("random", "vanilla", 10.0),
            _workload_row("random", "pyramidkv:r=0.875", 20.0),
            _workload_row("system-prompt", "vanilla", 40.0),
            _workload_row("system-prompt", "pyramidkv:r=0.875", 46.0)]
    for group in ratio_groups(rows, False, 2):
        add_ratios(group)
    assert rows[1]["vs_vanilla"]["output_tok_s"] == 2.0
    assert rows[3]["vs_vanilla"]["output_tok_s"] == pytest.approx(1.15)
    workloads = {
        "random": {"workload": {"num_prompts": 24, "input_len": 1024, "output_len": 128},
                   "settings": {"kv_cache_memory_bytes": 80_000_000,
                                "enable_prefix_caching": True}},
        "system-prompt": {"workload": {"num_prompts": 32, "system_prompt_tokens": 1500,
                                       "shared_prefix_tokens": 1521, "question_tokens": 270,
                                       "output_len": 128},
                          "settings": {"kv_cache_memory_bytes": 136_314_880,
                                       "enable_prefix_caching": True}}}
    text = render_report({"configs": rows, "settings": {"enable_prefix_caching": True},
                          "workloads": workloads})
    random_part, chats_part = text.split("Workload system-prompt")
    assert random_part.startswith("Workload random (24 prompts, 1024 in / 128 out, 80 MB")
    assert chats_part.startswith(" (32 chats, a 1521-token shared prefix + ~270 tokens each, "
                                 "128 out, 136 MB of KV)")
    assert "1.15" in chats_part and "1.15" not in random_part
    # a run of one workload (every result before workloads): one table, as before
    single = render_report({"configs": rows[:2], "settings": {"enable_prefix_caching": True}})
    assert "Workload" not in single


def test_the_headline_reads_the_random_workload():
    from benchmarks.results_doc.sections import _config

    rows = [_workload_row("random", "vanilla", 10.0),
            _workload_row("system-prompt", "vanilla", 40.0)]
    assert _config({"configs": rows[::-1]}, "vanilla")["output_tok_s"] == 10.0
    assert _config({"configs": [{"label": "vanilla", "x": 1}]}, "vanilla")["x"] == 1
