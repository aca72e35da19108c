"""Documents and docstrings cite only files that exist in the repository.

What is checked:
- every repository path cited in README.md, docs/*.md and benchmarks/RESULTS.md, and in the
  docstrings and comments of aligner/, benchmarks/ and conf/: a token that starts at one of the
  repository's own top-level entries (``aligner/``, ``tests/``, ``benchmarks/``, ``docs/``,
  ``conf/``, or a top-level file such as ``README.md``) must name an existing file or directory,
  read from the repository root; a glob (``conf/stage/tiny_*.yaml``, ``tests/<package>/...``)
  must match at least one;
- design notes that live only beside the development checkout (``DESIGN.md``, ``STYLE.md``,
  "STYLE 3", ``../shared/DESIGN.md``) are not cited: their content is docs/design.md;
- every relative Markdown link in README.md and docs/*.md resolves from the file that holds it,
  and a link's ``#anchor`` into a Markdown file names one of its headings (GitHub's slugs).

Not checked (exempt, each for a reason): paths under ``outputs/``, ``models/`` and ``data/``
(a run or the user creates them; they are not roots below, so they never match), virtual
environments the benchmark instructions create (``benchmarks/.venv-*``), and ``../shared/data/``
(data recorded beside the development checkout, which the tests that read it skip where absent).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from tests.toolkit.paths import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "RESULTS.md"]
LINKED_DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# Repository roots a cited path starts at. A token must not continue a longer word or path on its
# left (so the ``data/`` in ``aligner/data/x.py`` and ``../aligner/x.py`` in a link are not tokens).
ROOTS = ("aligner", "tests", "benchmarks", "docs", "conf")
PATH = re.compile(r"(?<![\w./<>*-])((?:" + "|".join(ROOTS) + r")/[\w./*<>-]*[\w*>])")
TOP_FILE = re.compile(r"(?<![\w./-])([A-Z][A-Z_]*\.md|Makefile|pyproject\.toml)\b")
# Cited design notes that live only in ../shared (absent from a user's clone).
SHARED_NOTE = re.compile(r"\bDESIGN(?:\.md)?\b|\bSTYLE(?:\.md|\s+\d+)\b|\.\./shared/(?!data/)")
EXEMPT = (
    re.compile(r"^benchmarks/\.venv"),  # virtual environments the benchmark instructions create
    re.compile(r"^tests/unittest/"),  # TensorRT-LLM's own test tree, cited in aligner/rollout/trtllm_engine.py
)
PLACEHOLDER = re.compile(r"<[^>]*>|\bNAME(?=_)")  # tests/<package>/..., conf/stage/NAME_ppo.yaml
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _exists(token: str, base: Path = REPO) -> bool:
    """True when the cited path (or, for a glob, one match) exists under the repository root, or
    beside the citing file (`base`: ``RESULTS.md`` in a benchmark's docstring)."""
    token = token.rstrip(".")
    if any(rx.search(token) for rx in EXEMPT):
        return True
    pattern = PLACEHOLDER.sub("*", token)
    for root in dict.fromkeys((REPO, base)):
        if "*" in pattern and any(root.glob(pattern)) or "*" not in pattern and (root / token).exists():
            return True
    return False


def _py_text(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every docstring and comment of a Python file."""
    src = path.read_text()
    out = []
    for node in ast.walk(ast.parse(src, str(path))):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    out.append((body[0].lineno, body[0].value.value))
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    return out


def _hash_comments(path: Path) -> list[tuple[int, str]]:
    """(line, comment) of a YAML or shell file: the text after a ``#`` that starts a comment."""
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        m = re.search(r"(?:^|\s)#(.*)", line)
        if m:
            out.append((i, m.group(1)))
    return out


def _sources() -> list[tuple[Path, int, str]]:
    """(file, line, text) of every doc and of every docstring / comment of the code."""
    out = [(p, 1, p.read_text()) for p in DOCS]
    for p in sorted((REPO / "aligner").rglob("*.py")) + sorted((REPO / "benchmarks").glob("*.py")):
        out += [(p, line, text) for line, text in _py_text(p)]
    for p in sorted((REPO / "conf").rglob("*.yaml")) + sorted((REPO / "benchmarks").glob("*.sh")):
        out += [(p, line, text) for line, text in _hash_comments(p)]
    return out


def _where(path: Path, line: int, text: str, offset: int) -> str:
    return f"{path.relative_to(REPO)}:{line + text.count(chr(10), 0, offset)}"


def test_the_docs_exist():
    for name in ("README.md", "docs/design.md", "docs/reliability.md", "benchmarks/RESULTS.md"):
        assert (REPO / name).is_file(), name


def test_every_cited_repository_path_exists():
    missing = []
    for path, line, text in _sources():
        for rx in (PATH, TOP_FILE):
            for m in rx.finditer(text):
                if not _exists(m.group(1), path.parent):
                    missing.append(f"{_where(path, line, text, m.start())}: {m.group(1)}")
    assert not missing, "cited paths that do not exist:\n" + "\n".join(missing)


def test_no_citation_of_design_notes_outside_the_repository():
    found = []
    for path, line, text in _sources():
        for m in SHARED_NOTE.finditer(text):
            found.append(f"{_where(path, line, text, m.start())}: {m.group(0)!r} (cite docs/design.md instead)")
    assert not found, "\n".join(found)


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces -> '-'."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    out, seen = set(), {}
    in_code = False
    for line in md.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m and not in_code:
            s = _slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def test_relative_markdown_links_resolve():
    bad = []
    for md in LINKED_DOCS:
        text = md.read_text()
        for m in LINK.finditer(text):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (md.parent / file).resolve() if file else md
            where = _where(md, 1, text, m.start())
            if not dest.exists():
                bad.append(f"{where}: {target} (no such file)")
            elif not str(dest).startswith(str(REPO)):
                bad.append(f"{where}: {target} (outside the repository)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{where}: {target} (no heading #{anchor} in {dest.relative_to(REPO)})")
    assert not bad, "broken links:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "text, bad",
    [
        ("see `aligner/nope.py`", True),
        ("see [x](aligner/model/moe.py)", False),
        ("see aligner/model/moe.py.", False),
        ("conf/stage/tiny_*.yaml", False),
        ("conf/stage/nothing_*.yaml", True),
        ("tests/<package>/test_<module>.py", False),
        ("benchmarks/.venv-trl112", False),
        ("outputs/tiny/ppo/ppo_report.png and models/smollm2-135m", False),
        ("a plain README.md", False),
        ("the old NOTES_GONE.md", True),
        ("conf/stage/NAME_ppo.yaml", False),
    ],
)
def test_the_path_matcher(text, bad):
    """The matcher finds a missing path and passes existing paths, globs and exempt run-time paths."""
    tokens = [m.group(1) for rx in (PATH, TOP_FILE) for m in rx.finditer(text)]
    assert any(not _exists(t) for t in tokens) == bad, tokens


@pytest.mark.parametrize(
    "text, cited", [("DESIGN.md", True), ("(STYLE 3)", True), ("../shared/STYLE.md", True), ("../shared/data/gsm8k", False)]
)
def test_the_design_note_matcher(text, cited):
    assert bool(SHARED_NOTE.search(text)) == cited
