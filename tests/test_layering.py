"""The package's layering holds, and the checks that enforce it would catch a break.

`lint-imports` (contracts in pyproject.toml) runs in scripts/test.sh; here it also runs over a
copy of the package with a cycle planted, to show the contract fails on one. The AST check keeps
vLLM patching inside kvcompress/vllm_hooks.py.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvcompress"
PATCHING_MODULE = PACKAGE / "vllm_hooks.py"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def run_lint_imports(python_path: Path) -> subprocess.CompletedProcess:
    """lint-imports with ``python_path`` first on sys.path (it also adds its working
    directory, so it runs there)."""
    env = {"PYTHONPATH": str(python_path), "PATH": str(LINT_IMPORTS.parent)}
    return subprocess.run(
        [str(LINT_IMPORTS), str(ROOT / "pyproject.toml"), "--no-cache", "--no-logo"],
        cwd=python_path, env=env, capture_output=True, text=True, timeout=300,
    )


@pytest.fixture(scope="module")
def lint_imports_available() -> None:
    if not LINT_IMPORTS.exists():
        pytest.fail(f"{LINT_IMPORTS} missing: install the test extra (import-linter)")


def test_contracts_hold(lint_imports_available):
    result = run_lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("module", "planted", "broken"),
    [
        # attention/ reaching up into engine/ (the cycle this layout removed)
        ("kvcompress/attention/window_scores.py", "import kvcompress.engine.worker.runtime",
         "Rooms in layers"),
        # two sibling modules importing each other
        ("kvcompress/paging/page_table.py", "import kvcompress.paging.page_manager",
         "No import cycles"),
        # the worker's page tables reaching up into the scheduler's page manager
        ("kvcompress/paging/batch_tables.py", "import kvcompress.paging.page_manager",
         "paging/ in layers"),
        # the worker pipeline picking up vLLM
        ("kvcompress/engine/worker/state.py", "import vllm", "run without vLLM"),
        # a user benchmark leaning on a study, and a shared part on a benchmark
        ("benchmarks/throughput.py", "import benchmarks.studies.kernels", "benchmarks/ in layers"),
        ("benchmarks/specs.py", "import benchmarks.documents", "benchmarks/ in layers"),
    ],
)
def test_contracts_fail_on_a_planted_break(lint_imports_available, tmp_path, module, planted,
                                           broken):
    for package in ("kvcompress", "benchmarks"):  # the contracts' root packages
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "results"))
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{planted}  # noqa\n")
    result = run_lint_imports(tmp_path)
    assert result.returncode != 0
    assert f"{broken}" in result.stdout and "BROKEN" in result.stdout, result.stdout


def vllm_names(tree: ast.Module) -> set[str]:
    """Names bound to vLLM modules or objects by the module's imports (at any depth)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names
                      if a.name.split(".")[0] == "vllm"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            names |= {a.asname or a.name for a in node.names}
    return names


def base_name(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def patches_of_vllm(source: str) -> list[str]:
    """Where a module changes a vLLM object: assignment, deletion or setattr/delattr on
    something imported from vLLM, or use of vLLM's private (underscore) names."""
    tree = ast.parse(source)
    vllm = vllm_names(tree)
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            if isinstance(target, (ast.Attribute, ast.Subscript)) and base_name(target) in vllm:
                found.append(f"line {node.lineno}: changes {ast.unparse(target)}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("setattr", "delattr") and node.args
                and base_name(node.args[0]) in vllm):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__") and base_name(node) in vllm):
            found.append(f"line {node.lineno}: private {ast.unparse(node)}")
        if (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm")
                and any(a.name.startswith("_") and a.name != "_custom_ops" for a in node.names)):
            found.append(f"line {node.lineno}: imports a private vLLM name")
    return found


def test_only_vllm_hooks_patches_vllm():
    offenders = {
        str(path.relative_to(ROOT)): found
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != PATCHING_MODULE and (found := patches_of_vllm(path.read_text()))
    }
    assert not offenders, offenders
    # and the check sees the patches the hooks module does make
    assert patches_of_vllm(PATCHING_MODULE.read_text())


def test_patch_detector_flags_each_kind_of_patch():
    snippets = [
        "from vllm.engine.arg_utils import EngineArgs\nEngineArgs.add_cli_args = f\n",
        "import vllm\nsetattr(vllm.envs, 'X', 1)\n",
        "from vllm.v1.attention.backends import registry\nregistry._ATTN_OVERRIDES.clear()\n",
        "from vllm.v1.attention.selector import _cached_get_attn_backend\n",
    ]
    for snippet in snippets:
        assert patches_of_vllm(snippet), snippet
    harmless = "from vllm.v1.outputs import ModelRunnerOutput\ndef f(o):\n    o.x = 1\n"
    assert not patches_of_vllm(harmless)
