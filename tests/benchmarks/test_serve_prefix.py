"""serve_prefix without servers: the sides' flags, the vllm bench serve command, the parser
of its saved result (a file recorded from a real run against the vanilla server: vLLM 0.32,
4 prompts of a 512-token prefix + 32, 8 out, on 2 CPU cores, with the /metrics counters that
run recorded), /metrics counters, ratios and the table."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks.serve import metrics_delta, parse_metrics
from benchmarks.serve_prefix import (
    COUNTERS,
    add_ratios,
    bench_command,
    bench_figures,
    build_parser,
    load_bench_result,
    parse_sides,
    render,
    render_report,
    serve_options,
)

RECORDED = Path(__file__).parent / "data" / "vllm_bench_serve_prefix_repetition.json"


def test_defaults_are_issue_40s_prefix_repetition_run():
    args = build_parser().parse_args([])
    assert (args.prefix_len, args.suffix_len, args.num_prefixes, args.output_len,
            args.num_prompts) == (1280, 256, 1, 128, 32)
    assert args.kv_cache_memory_bytes == "130M"
    (vanilla, vanilla_flags), (kvc, kvc_flags) = parse_sides(args.sides)
    assert (vanilla, vanilla_flags) == ("vanilla", ["--kv-compression", "none"])
    assert kvc == "kvcompress" and kvc_flags[:2] == ["--kv-compression", "pyramidkv"]


def test_sides_parse_and_reject():
    assert parse_sides("a=--x 1;b=") == [("a", ["--x", "1"]), ("b", [])]
    for bad in ("", "noflags", "a=;a=--y", "=--x"):
        with pytest.raises(ValueError):
            parse_sides(bad)


def test_every_side_gets_the_same_memory_and_the_bench_its_dataset(tmp_path):
    args = build_parser().parse_args(["--model", "m", "--num-prompts", "8"])
    for extra in ([], ["--kv-compression", "none"]):
        options = serve_options(args, extra)
        assert options[options.index("--kv-cache-memory-bytes") + 1] == "130M"
        assert options[len(options) - len(extra):] == extra
    command = bench_command(args, "http://127.0.0.1:9", tmp_path, "b.json")
    flags = dict(zip(command, command[1:]))
    assert command[1:3] == ["bench", "serve"]
    assert flags["--dataset-name"] == "prefix_repetition" and flags["--tokenizer"] == "m"
    assert flags["--prefix-repetition-prefix-len"] == "1280"
    assert flags["--prefix-repetition-suffix-len"] == "256"
    assert flags["--prefix-repetition-num-prefixes"] == "1"
    assert flags["--prefix-repetition-output-len"] == "128"
    assert flags["--num-prompts"] == "8" and flags["--base-url"] == "http://127.0.0.1:9"
    assert "--save-result" in command and flags["--result-dir"] == str(tmp_path)
    assert "--ignore-eos" in command


def test_the_chats_dataset_is_a_custom_file_of_issue_40s_chats(tmp_path, embedded_model):
    from transformers import AutoTokenizer

    from benchmarks.serve_prefix import CHATS_FILE, write_chats

    args = build_parser().parse_args(["--model", embedded_model, "--dataset", "chats",
                                      "--num-prompts", "3", "--system-prompt-tokens", "300",
                                      "--question-tokens", "60"])
    shared = write_chats(args, tmp_path / CHATS_FILE)
    lines = (tmp_path / CHATS_FILE).read_text().splitlines()
    assert len(lines) == 3
    tokenizer = AutoTokenizer.from_pretrained(embedded_model)
    ids = [tokenizer(json.loads(line)["prompt"]).input_ids for line in lines]
    # the text is the templated chat: it tokenizes back to a shared system prompt, then
    # each chat's own question
    assert ids[0][:shared] == ids[1][:shared] == ids[2][:shared]
    assert 300 <= shared < min(map(len, ids)) and len({tuple(i) for i in ids}) == 3
    command = bench_command(args, "http://127.0.0.1:9", tmp_path, "b.json")
    flags = dict(zip(command, command[1:]))
    assert flags["--dataset-name"] == "custom"
    assert flags["--dataset-path"] == str(tmp_path / CHATS_FILE)
    assert flags["--custom-output-len"] == "128" and "--skip-chat-template" in command


def test_the_recorded_result_parses():
    result = load_bench_result(RECORDED)
    # what the server's counters grew by over that bench
    counters = {"vllm:prefix_cache_queries_total": 2176.0,
                "vllm:prefix_cache_hits_total": 1536.0, "vllm:prompt_tokens_total": 2176.0,
                "vllm:prompt_tokens_cached_total": 1536.0,
                "vllm:generation_tokens_total": 32.0}
    figures = bench_figures(result, counters, prefix_len=512, num_prompts=4)
    assert figures["completed"] == 4 and figures["failed"] == 0
    assert figures["total_output_tokens"] == 32 and figures["total_input_tokens"] == 2176
    assert figures["output_throughput"] == pytest.approx(28.388, rel=1e-3)
    assert figures["mean_ttft_ms"] == pytest.approx(831.41, rel=1e-3)
    assert figures["p99_ttft_ms"] == pytest.approx(870.22, rel=1e-3)
    assert figures["median_tpot_ms"] > 0 and figures["p99_e2el_ms"] > 0
    # the first prompt computed its prefix, the three others found it cached
    assert figures["prefill_tokens"] == 2176 - 1536 == 512 + 4 * 32
    assert figures["cached_per_reader"] == 512 == figures["prefix_len"]
    assert figures["prefix_cache_hit_rate"] == pytest.approx(1536 / 2176)


def test_appended_results_read_the_last(tmp_path):
    path = tmp_path / "r.json"
    path.write_text('{"completed": 1}\n{"completed": 2}\n')
    assert load_bench_result(path) == {"completed": 2}
    (tmp_path / "e.json").write_text("")
    with pytest.raises(ValueError, match="empty"):
        load_bench_result(tmp_path / "e.json")


# The form of vLLM's /metrics (counters with a _total sample per label set); the numbers
# are made up.
EXPOSITION = """\
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 49216.0
vllm:prompt_tokens_created{engine="0",model_name="m"} 1.7e+09
vllm:prompt_tokens_cached_total{engine="0",model_name="m"} 39680.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 49216.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 39680.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 320.0
vllm:generation_tokens_total 4096.0
"""


def test_metrics_counters_summed_over_label_sets_and_their_growth():
    counters = parse_metrics(EXPOSITION, COUNTERS)
    assert counters == {"vllm:prompt_tokens_total": 49216.0,
                        "vllm:prompt_tokens_cached_total": 39680.0,
                        "vllm:prefix_cache_queries_total": 49216.0,
                        "vllm:prefix_cache_hits_total": 40000.0,
                        "vllm:generation_tokens_total": 4096.0}
    grown = metrics_delta({"vllm:prompt_tokens_total": 216.0}, counters)
    assert grown["vllm:prompt_tokens_total"] == 49000.0
    assert grown["vllm:prompt_tokens_cached_total"] == 39680.0
    figures = bench_figures({}, grown, prefix_len=1280, num_prompts=32)
    assert figures["cached_per_reader"] == 1280  # every reader after the first: the prefix
    assert figures["prefill_tokens"] == 49000 - 39680
    # kvcompress's segment requests compute prefixes vLLM's prompt counters do not count
    with_segments = parse_metrics(
        EXPOSITION + "kvcompress:prefix_segment_tokens_total 1526.0\n", COUNTERS)
    figures = bench_figures({}, with_segments, prefix_len=1280, num_prompts=32)
    assert figures["segment_tokens"] == 1526
    assert figures["prefill_tokens"] == 49216 - 39680 + 1526


def _run(label, **figures):
    return {"label": label, "serve_command": f".venv/bin/vllm serve m {label}",
            "bench_command": ".venv/bin/vllm bench serve --base-url BASE", "figures": figures}


def test_ratios_over_the_first_side_and_the_rendered_report():
    runs = [_run("vanilla", output_throughput=100.0, mean_ttft_ms=50.0, prefill_tokens=9000),
            _run("kvcompress", output_throughput=120.0, mean_ttft_ms=200.0,
                 prefill_tokens=45000)]
    add_ratios(runs)
    assert runs[1]["vs_vanilla"]["output_throughput"] == 1.2
    assert runs[1]["vs_vanilla"]["mean_ttft_ms"] == 4.0
    assert runs[1]["vs_vanilla"]["prefill_tokens"] == 5.0
    assert runs[1]["vs_vanilla"]["p99_ttft_ms"] is None  # absent on both
    assert "kvcompress" in render(runs) and "1.20" in render(runs)
    report = render_report({"runs": runs})
    assert "`.venv/bin/vllm serve m kvcompress`" in report and "bench serve" in report


def test_help_names_the_dataset(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    assert "prefix_repetition" in capsys.readouterr().out
    assert isinstance(build_parser(), argparse.ArgumentParser)
