"""The test suite's own layering: test modules share code only through tests/toolkit/.

A test module that imports another test module runs that module's import-time code (and, with
pytest's rootdir-relative import, may import it twice under two names); what two modules share
belongs in the toolkit. Checked on the source of every tests/**/*.py: no import of a ``test_*``
module or of ``conftest``, whether written ``tests.x.test_y``, ``test_y`` or relative; and no
test module defines a fixture or override set the toolkit already provides.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# the toolkit's functions and classes, and the constants whose meaning is the toolkit's
TOOLKIT_NAMES = {
    node.name
    for path in (TESTS / "toolkit").glob("*.py")
    for node in ast.parse(path.read_text()).body
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_")
} | {"FAST", "SMALL", "PPO_RULE", "LAYOUT_TOL", "STAGE_METRIC_TOL", "NUM_CPUS", "REPO", "SHARED"}


def _test_module_imports(path: Path) -> list[str]:
    """'line: module' for every import in `path` of a test module or conftest."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = ["." * node.level + (node.module or "")]
            if node.level or node.module in ("tests", None):  # from tests import test_x / from . import test_x
                names += [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.lstrip(".").split(".")
            if any(p.startswith("test_") or p == "conftest" for p in parts) or (node.level if isinstance(node, ast.ImportFrom) else 0):
                bad.append(f"{node.lineno}: {name}")
    return bad


def test_no_test_module_imports_another():
    found = {}
    for path in sorted(TESTS.rglob("*.py")):
        bad = _test_module_imports(path)
        if bad:
            found[str(path.relative_to(TESTS.parent))] = bad
    assert not found, f"import from tests.toolkit instead: {found}"


def test_the_check_sees_each_spelling(tmp_path):
    for line in (
        "from tests.parallel.test_data_parallel import batches",
        "from test_tensor_parallel import run_layout",
        "import tests.test_sft_rm",
        "from tests.conftest import REPO",
        "from . import helpers",
        "from tests import test_ppo",
    ):
        (tmp_path / "m.py").write_text(line + "\n")
        assert _test_module_imports(tmp_path / "m.py"), line
    (tmp_path / "m.py").write_text(
        "from tests.toolkit.spawn import run_distributed\nimport torch\nfrom aligner.config import ModelConfig\n"
    )
    assert _test_module_imports(tmp_path / "m.py") == []


def test_toolkit_fixtures_and_override_sets_are_not_redefined():
    """A module-level def or assignment of a toolkit name outside tests/toolkit/ is a copy."""
    found = []
    for path in sorted(TESTS.rglob("test_*.py")):
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            else:
                continue
            found += [f"{path.relative_to(TESTS.parent)}:{node.lineno}: {n}" for n in names if n in TOOLKIT_NAMES]
    assert not found, f"defined in tests/toolkit/, import it from there: {found}"
