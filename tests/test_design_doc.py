"""docs/design.md is the one design document: every `##` section opens with a `Modules:` line
naming the code it describes, every module path it names exists, and its table of contents
lists every section with the same modules. The docs link only to files (and headings) that
exist."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
# A backticked path under one of these is relative to the repository; any other is relative
# to kvcompress/ (the design document's convention).
ROOTED = ("kvcompress", "tests", "benchmarks", "scripts", "docs")
PATH_IN_BACKTICKS = re.compile(r"`([\w./-]+(?:\.py|/))`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
ANCHOR = re.compile(r'<a id="([^"]+)">')


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a `## ` inside a fence is not a heading)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def sections(text: str) -> list[tuple[str, list[str]]]:
    """Each `##` heading with the lines up to the next one."""
    found: list[tuple[str, list[str]]] = []
    for line in prose_lines(text):
        if line.startswith("## "):
            found.append((line, []))
        elif found:
            found[-1][1].append(line)
    return found


def module_path(name: str) -> Path:
    first = name.split("/", 1)[0]
    return ROOT / name if first in ROOTED else ROOT / "kvcompress" / name


def named_modules(line: str) -> list[str]:
    return PATH_IN_BACKTICKS.findall(line)


def modules_line(body: list[str]) -> str:
    first = next((line for line in body if line.strip()), "")
    return first if first.startswith("Modules: ") else ""


def slug(heading: str) -> str:
    """GitHub's anchor for a heading line."""
    text = heading.lstrip("#").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = path.read_text()
    found = set(ANCHOR.findall(text))
    seen: dict[str, int] = {}
    for line in prose_lines(text):
        if line.startswith("#"):
            base = slug(line)
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def test_every_section_opens_with_the_modules_it_describes():
    found = sections(DESIGN.read_text())
    assert len(found) > 10
    missing = [heading for heading, body in found if not named_modules(modules_line(body))]
    assert not missing, f"sections without a `Modules:` line naming a module: {missing}"


def test_every_module_the_design_names_exists():
    names = set(PATH_IN_BACKTICKS.findall(DESIGN.read_text()))
    for heading, body in sections(DESIGN.read_text()):
        assert set(named_modules(modules_line(body))) <= names, heading
    gone = sorted(name for name in names if not module_path(name).exists())
    assert not gone, f"docs/design.md names modules that do not exist: {gone}"


def test_table_of_contents_lists_every_section_with_its_modules():
    text = DESIGN.read_text()
    rows = {}
    for line in text.split("\n## ", 1)[0].splitlines():
        match = re.match(r"\| \[[^\]]+\]\(#([^)]+)\) \| (.+) \|$", line)
        if match:
            rows[match.group(1)] = named_modules(match.group(2))
    expected = {slug(heading): named_modules(modules_line(body))
                for heading, body in sections(text)}
    assert rows == expected


def doc_files() -> list[Path]:
    """Markdown whose relative links resolve from docs/: the docs and the results notes
    (rendered into docs/results.md)."""
    return sorted((ROOT / "docs").glob("*.md")) + sorted(
        (ROOT / "benchmarks" / "results" / "notes").glob("*.md"))


@pytest.mark.parametrize("path", [ROOT / "README.md", *doc_files()],
                         ids=lambda path: str(path.relative_to(ROOT)))
def test_docs_link_only_to_files_and_headings_that_exist(path):
    base = ROOT if path.name == "README.md" else ROOT / "docs"
    broken = []
    for target in LINK.findall("\n".join(prose_lines(path.read_text()))):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        file, _, anchor = target.partition("#")
        linked = base / file if file else (ROOT / "docs" / "results.md"
                                           if path.parent.name == "notes" else path)
        if not linked.exists() or (anchor and linked.suffix == ".md"
                                   and anchor not in anchors(linked)):
            broken.append(target)
    assert not broken, f"{path.relative_to(ROOT)} links to what does not exist: {broken}"
