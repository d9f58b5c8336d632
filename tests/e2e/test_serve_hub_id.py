"""`vllm serve <hub id> --kv-compression pyramidkv` with a model in the local Hugging Face
cache (no network): the surrogate ``python -m kvcompress.profile_model <hub id>`` made is
the one the server scores with, and /metrics says so (issue 52)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import requests

from tests.e2e.serving import client, long_question, metric, running_server

pytestmark = pytest.mark.slow

HUB_ID = "tiny-org/tiny-llama"


def test_served_by_hub_id_with_the_surrogate_its_command_made(local_hub, tmp_path):
    from kvcompress.profile_model.profiles import model_fingerprint

    _, snapshot, cache = local_hub  # the command and the server see it, as a user's shell
    made = subprocess.run(
        [sys.executable, "-m", "kvcompress.profile_model", HUB_ID, "--documents", "1",
         "--surrogate-prompts", "2", "--held-out", "1", "--min-overlap", "0", "--device",
         "cpu"], capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stderr[-3000:]
    surrogate = cache / "surrogates" / f"{model_fingerprint(snapshot)}.pt"
    assert surrogate.is_file() and str(surrogate) in made.stdout

    with running_server(HUB_ID, tmp_path, "--kv-compression", "pyramidkv",
                        "--kv-budget", "64") as (base, log_path):
        reply = client(base).chat.completions.create(
            model=HUB_ID, messages=[{"role": "user", "content": long_question(400)}],
            max_tokens=4, temperature=0)
        assert reply.choices[0].finish_reason
        text = requests.get(f"{base}/metrics", timeout=10).text
        log = log_path.read_text()
    assert f"kvcompress: score surrogate {surrogate}" in log
    assert metric(text, "kvcompress:scoring_info", requested="auto", scoring="surrogate") == 1
    for kind in ("all", "synthetic", "prose", "code", "chat"):
        assert 0 < metric(text, "kvcompress:surrogate_held_out", kind=kind,
                          figure="overlap_4x") <= 1
    assert metric(text, "kvcompress:compressed_requests_total") >= 1
