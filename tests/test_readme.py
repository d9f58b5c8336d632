"""The README's first lines are the two fresh-machine commands, and CI runs the second."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    lines = (ROOT / "README.md").read_text().splitlines()[:6]
    return [line.strip("`") for line in lines if line.startswith("`bash scripts/setup.sh")]


def test_first_lines_hold_the_serve_and_test_commands():
    serve, test = readme_commands()
    assert "vllm serve .models/SmolLM2-135M-Instruct --kv-compression pyramidkv" in serve
    assert "--host 127.0.0.1 --port 8000" in serve
    assert test == "bash scripts/setup.sh && bash scripts/test.sh"


def test_ci_runs_the_readme_test_command():
    _, test = readme_commands()
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test in ci_lines


def test_serve_command_model_path_is_where_setup_puts_it():
    from kvcompress.models import DEFAULT_MODEL_DIR

    serve, _ = readme_commands()
    assert str(DEFAULT_MODEL_DIR) in serve
