"""The README's first lines are the two fresh-machine commands, and CI runs the second; its
flags tables list the flag groups of kvcompress.settings.flags, row for row as
`vllm serve --help` shows them."""

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


def readme_flag_tables() -> list[tuple[str, list[str]]]:
    """Each table of the README's Flags section: the text before it, and the first cell of
    each of its rows."""
    section = (ROOT / "README.md").read_text().split("\n## Flags\n", 1)[1].split("\n## ", 1)[0]
    tables: list[tuple[str, list[str]]] = []
    lead: list[str] = []
    for block in section.split("\n\n"):
        lines = block.strip().splitlines()
        if lines and lines[0].startswith("|"):
            tables.append(("\n".join(lead), [line.split("|")[1].strip() for line in lines[2:]]))
            lead = []
        else:
            lead.append(block)
    return tables


def row_flag(row: str) -> str:
    return row.strip("`").split()[0]


def test_flags_tables_are_the_flag_groups_in_order_with_their_choices():
    from kvcompress.settings.flags import FLAG_GROUPS

    tables = readme_flag_tables()
    assert len(tables) == len(FLAG_GROUPS)
    for (lead, rows), group in zip(tables, FLAG_GROUPS):
        assert f"`vllm serve --help={group.title}`" in lead, lead
        assert [row_flag(row) for row in rows] == [spec.flag for spec in group.specs]
        for row, spec in zip(rows, group.specs):
            if spec.choices:
                assert row == f"`{spec.flag} {{{','.join(spec.choices)}}}`", row


def test_flags_tables_have_one_row_per_flag_of_vllm_serve_help():
    """Every kvcompress flag `vllm serve --help=<group>` shows has exactly one row, under
    that group's table, and every row names one of them."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from kvcompress.plugin import register
    from kvcompress.settings.flags import CONFIG_KEYS

    register()
    parser = make_arg_parser(FlexibleArgumentParser())
    help_groups = {
        group.title: [action.option_strings[0] for action in group._group_actions]
        for group in parser._action_groups if group.title and "kvcompress" in group.title
    }
    ours = [action.option_strings[0] for action in parser._actions if action.dest in CONFIG_KEYS]
    assert sorted(flag for flags in help_groups.values() for flag in flags) == sorted(ours)
    readme_groups = {}
    for lead, rows in readme_flag_tables():
        title = lead.rsplit("`vllm serve --help=", 1)[1].split("`", 1)[0]
        readme_groups[title] = [row_flag(row) for row in rows]
    assert readme_groups == help_groups
