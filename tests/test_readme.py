"""The README's first lines are the two fresh-machine commands, and CI runs the second; its
flags table lists every flag of kvcompress.config.FLAG_SPECS."""

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


def readme_flag_rows() -> list[str]:
    """The first cell of every row of the README's flags table."""
    text = (ROOT / "README.md").read_text()
    table = text.split("## Flags", 1)[1].split("\n\n")[1]
    return [line.split("|")[1].strip() for line in table.splitlines()[2:]]


def test_flags_table_lists_every_flag_in_order_with_its_choices():
    from kvcompress.config import FLAG_SPECS

    rows = readme_flag_rows()
    assert [row.strip("`").split()[0] for row in rows] == [spec.flag for spec in FLAG_SPECS]
    for row, spec in zip(rows, FLAG_SPECS):
        if spec.choices:
            assert row == f"`{spec.flag} {{{','.join(spec.choices)}}}`", row
