"""The package's import graph points only downward.

Every ``import aligner...`` / ``from aligner... import`` in aligner/, at module level or inside
a function, is an edge from the importing module's layer to the imported one's. A module may
import its own package (the same row below) or a row above it in LAYERS, never a row below,
and the packages may not import each other in a cycle. The README's layout section is the
same table in words.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "aligner"

# lowest first; each row: the packages / top-level modules of one layer
LAYERS = [
    ("errors", "algorithms"),  # exception types; RL math on tensors
    ("config",),  # the config schema
    ("protocol", "tracking", "data"),  # batches between roles; metrics; datasets and tokenizers
    ("nn",),  # building blocks: comm, tensor-parallel layers, vocab-parallel log-probs (no Llama)
    ("model",),  # Llama and HF import/export, built from the building blocks
    ("parallel",),  # parallelize(): TP/SP, pipeline, recomputation, data parallelism; memory model
    ("planner",),  # layouts and memory plans from the config and the memory model
    ("runtime",),  # the training runtime of one role's ranks: model + optimizer + checkpoints
    ("envs",),  # environments for multi-turn rollouts: the interface, trajectories, tools
    ("actor", "critic", "reward", "rollout"),  # role classes, and the rollout engines beside them
    ("workers",),  # all Ray code: worker groups, placement, dispatch, the role workers
    ("run_ops",),  # run operations: the run directory, checkpoint management, preemption, the supervising parent
    ("trainers",),  # the training loop, the SFT / RM / PPO trainers, checkpoints of a run
    ("cli", "plan", "sft", "rm", "ppo", "dpo", "kto", "spin", "rs", "demo", "convert", "eval", "serve_rm", "__main__"),  # entry points
]
LAYER_OF = {name: i for i, row in enumerate(LAYERS) for name in row}
BUILDING_BLOCKS = ("aligner.nn.comm", "aligner.nn.layers", "aligner.nn.vocab")


def _unit(module: str) -> str:
    """aligner.parallel.pipeline -> parallel; aligner.cli -> cli."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported aligner module) for every aligner import in `path`, at any depth."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("aligner")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against this module's package
                base = pkg.split(".")[: -node.level]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod == "aligner":  # from aligner import x: x is the unit
                out += [(node.lineno, f"aligner.{a.name}") for a in node.names]
            elif mod.startswith("aligner."):
                out.append((node.lineno, mod))
    return out


def _edges() -> list[tuple[str, int, str, str]]:
    """(file, line, importing unit, imported unit) for every cross-unit aligner import."""
    edges = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent)
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        src = _unit(module)
        for line, target in _imports(path):
            dst = _unit(target)
            if dst and dst != src:
                edges.append((str(rel), line, src, dst))
    return edges


def test_every_unit_has_a_layer():
    units = {p.stem if p.is_file() else p.name for p in ROOT.iterdir() if (p.suffix == ".py" or (p / "__init__.py").exists())}
    units.discard("__init__")
    missing = sorted(units - set(LAYER_OF))
    assert not missing, f"packages/modules with no row in LAYERS (add them where they belong): {missing}"


def test_imports_point_only_downward():
    upward = [
        f"{f}:{line}: {src} (layer {LAYER_OF[src]}) imports {dst} (layer {LAYER_OF[dst]})"
        for f, line, src, dst in _edges()
        if LAYER_OF[dst] > LAYER_OF[src]
    ]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_imports_within_a_layer_across_packages():
    """Packages of one row are independent (a sideways import would hide a cycle waiting to happen)."""
    sideways = [
        f"{f}:{line}: {src} imports {dst} (both layer {LAYER_OF[src]})"
        for f, line, src, dst in _edges()
        if LAYER_OF[dst] == LAYER_OF[src] and LAYER_OF[src] != len(LAYERS) - 1
    ]
    assert not sideways, "sideways imports:\n" + "\n".join(sideways)


def test_no_cycle_between_packages():
    graph: dict[str, set[str]] = {}
    for _, _, src, dst in _edges():
        graph.setdefault(src, set()).add(dst)
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [node])):
                return cycle
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [])):
            pytest.fail("import cycle between packages: " + " -> ".join(cycle))


def _module_graph(root: Path) -> dict[str, set[str]]:
    """module -> the modules of `root`'s package it imports, by every import statement at any depth
    (inside functions and ``if TYPE_CHECKING:`` too); ``from pkg import sub`` is an edge to pkg.sub."""
    modules = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for t in targets:
            while t not in modules and "." in t:
                t = t.rpartition(".")[0]
            if t in modules and t != module:
                graph.setdefault(module, set()).add(t)
    return graph


def _module_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of `graph`: its strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_cycle_between_modules():
    """No two modules of aligner import each other, directly or around a circle, not even for type hints only."""
    cycles = _module_cycles(_module_graph(ROOT))
    assert not cycles, "import circles between modules:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_module_checker_sees_a_type_checking_circle(tmp_path):
    """A mutation check of the module walker: a circle closed only by an ``if TYPE_CHECKING:`` import is found."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import X\n")
    (pkg / "c.py").write_text("import pkg.sub.a\n")
    assert _module_cycles(_module_graph(pkg)) == [["pkg.sub.a", "pkg.sub.b"]]
    (pkg / "sub" / "b.py").write_text("X = 1\n")
    assert _module_cycles(_module_graph(pkg)) == []


def test_the_checker_sees_upward_and_function_level_imports(tmp_path):
    """A mutation check of the walker: an import inside a function is found, and resolved to its unit."""
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from aligner.workers.group import WorkerGroup\n    import aligner.model.llama\n")
    found = [(line, _unit(m)) for line, m in _imports_of(f)]
    assert found == [(2, "workers"), (3, "model")]


def _imports_of(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("aligner")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("aligner"):
            out.append((node.lineno, node.module))
    return sorted(out)


@pytest.mark.parametrize("module", BUILDING_BLOCKS)
def test_building_blocks_import_no_model(module):
    """`python -c "import aligner.nn.layers"` loads no aligner.model (nor anything above nn)."""
    code = (
        f"import sys, {module}; bad = sorted(m for m in sys.modules if m.startswith(('aligner.model', 'aligner.parallel', "
        "'aligner.runtime', 'aligner.workers', 'aligner.trainers'))); print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{module} imports {r.stdout.strip()} {r.stderr[-500:]}"


# what every Ray worker and stage process imports at start; the libraries that each cost about a second
# of CPU per process start (transformers ~0.5 s, torch._dynamo with sympy and FSDP ~1 s) load only
# where they are used (a tokenizer loaded, a lower-right causal mask, FSDP2 applied)
PROCESS_ENTRY_MODULES = ("aligner.workers.actor", "aligner.workers.rollout", "aligner.workers.critic", "aligner.ppo")


def test_process_entry_modules_import_no_heavy_library():
    """`python -c "import aligner.workers.actor"` (and the other entry modules) loads neither transformers nor
    torch._dynamo: one process imports them in turn and names the first module that pulls either in."""
    code = (
        "import importlib, sys\n"
        f"for name in {PROCESS_ENTRY_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "    bad = sorted(m for m in ('transformers', 'torch._dynamo') if m in sys.modules)\n"
        "    if bad:\n"
        "        print(name, 'imports', bad); sys.exit(1)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{r.stdout.strip()} {r.stderr[-500:]}"


def test_tests_mirror_the_packages():
    """tests/<package>/test_<module>*.py: every test folder is an aligner package (or, for aligner's top-level modules,
    tests/<module>/: tests/cli/ for aligner/cli.py), so a module's test is found by its name; tests/project/ holds the
    whole-project checks (import graph, docs, safe defaults, the suite's own rules). No test module at the top of tests/.
    (tests/toolkit/ holds no tests: the helpers the test modules share, tests/project/test_toolkit.py.)"""
    tests = Path(__file__).resolve().parents[1]
    folders = sorted(
        p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "_")) and p.name not in ("toolkit", "project")
    )
    stray = [f for f in folders if not ((ROOT / f / "__init__.py").exists() or (ROOT / f"{f}.py").exists())]
    assert not stray, f"test folders that are neither an aligner package nor a top-level module: {stray}"
    top = sorted(p.name for p in tests.glob("test_*.py"))
    assert not top, f"test modules at the top of tests/ (move each into tests/<package>/ or tests/project/): {top}"


def test_ruff_lint_and_format_are_clean():
    """`ruff check` and `ruff format --check` pass with the configuration in pyproject.toml."""
    pytest.importorskip("ruff", reason="ruff is in the test extra: pip install -e .[test]")
    from ruff.__main__ import find_ruff_bin

    repo = ROOT.parent
    for args in (["check", "aligner", "tests", "benchmarks"], ["format", "--check", "aligner", "tests", "benchmarks"]):
        r = subprocess.run([find_ruff_bin(), *args], cwd=repo, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"ruff {' '.join(args)}:\n{r.stdout[-3000:]}{r.stderr[-1000:]}"
