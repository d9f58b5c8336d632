"""Natural text on every machine, no network: the Python standard library's own source.

Its modules hold prose (module, class and function docstrings, written by people for
people) and code, in one place every Python install has. Files are read and parsed
(``ast``), never imported. The corpus is split by file into a fitting part and a held-out
part (a stable hash of the file's name), so held-out figures come from text the fit never
saw. No vLLM imports.
"""

from __future__ import annotations

import ast
import sysconfig
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

# One file in HELD_OUT_EVERY is held out.
HELD_OUT_EVERY = 4
# Files shorter than this hold too little text to build a prompt from.
MIN_FILE_CHARS = 4000


@dataclass(frozen=True)
class SourceFile:
    """One standard-library module: its source, its docstrings (module first) and its
    documented functions as (name, docstring)."""

    name: str
    source: str
    docstrings: tuple[str, ...]
    functions: tuple[tuple[str, str], ...]


@lru_cache(maxsize=2)
def source_files(held_out: bool) -> tuple[SourceFile, ...]:
    """The standard library's top-level modules with text enough, in name order: the
    held-out part or the fitting part."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.glob("*.py")):
        if (zlib.crc32(path.name.encode()) % HELD_OUT_EVERY == 0) != held_out:
            continue
        parsed = _parse(path)
        if parsed is not None:
            files.append(parsed)
    return tuple(files)


def _parse(path: Path) -> SourceFile | None:
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return None
    if len(source) < MIN_FILE_CHARS:
        return None
    docstrings, functions = [], []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)):
            continue
        text = ast.get_docstring(node)
        if not text or len(text) < 80 or text in docstrings:
            continue
        docstrings.append(text)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not (
                node.name.startswith("_")):
            functions.append((node.name, text))
    if not docstrings:
        return None
    return SourceFile(path.stem, source, tuple(docstrings), tuple(functions))
