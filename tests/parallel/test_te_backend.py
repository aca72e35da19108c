"""te_backend.py against the recorded Transformer Engine 2.20.2 API (../shared/data/apis).

Scans te_backend.py with ``ast``: every ``te.X(...)`` / ``recipe.X(...)`` call must name a
recorded symbol and pass only keywords that symbol accepts; ``**common`` dicts are resolved
from their ``dict(...)`` literal. Skipped (with the reason) where ../shared is absent.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import aligner.parallel.te_backend as te_backend

SRC = Path(te_backend.__file__).read_text()
TREE = ast.parse(SRC)
PREFIX = {"te": "transformer_engine.pytorch", "recipe": "transformer_engine.common.recipe"}


@pytest.fixture
def api(shared):
    return json.loads(shared("data", "apis", "transformer_engine.json").read_text())["symbols"]


def _dict_literals() -> dict[str, set[str]]:
    """Names assigned from dict(k=...) in te_backend.py -> their keys (for **name expansion)."""
    out = {}
    for node in ast.walk(TREE):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "dict":
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = {kw.arg for kw in node.value.keywords if kw.arg}
    return out


def te_calls() -> list[tuple[str, set[str], int]]:
    """(dotted TE name, keywords, line) for every te.X(...) / recipe.X(...) call."""
    dicts, calls = _dict_literals(), []
    for node in ast.walk(TREE):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)):
            continue
        mod = node.func.value.id
        if mod not in PREFIX:
            continue
        kws = set()
        for kw in node.keywords:
            if kw.arg is not None:
                kws.add(kw.arg)
            elif isinstance(kw.value, ast.Name):
                kws |= dicts[kw.value.id]
        calls.append((f"{PREFIX[mod]}.{node.func.attr}", kws, node.lineno))
    return calls


def _accepted(api: dict, name: str) -> set[str]:
    sym = api[name]
    if "init_params" in sym:
        return {p["name"] for p in sym["init_params"]}
    params = api[f"{name}.__init__"]["params"] if f"{name}.__init__" in api else sym["params"]
    return {p["name"] for p in params if p["kind"] not in ("VAR_POSITIONAL", "VAR_KEYWORD")}


def test_scan_finds_the_te_calls():
    names = {c[0] for c in te_calls()}
    assert {
        "transformer_engine.pytorch.Linear",
        "transformer_engine.pytorch.LayerNormLinear",
        "transformer_engine.pytorch.autocast",
    } <= names
    assert {"transformer_engine.common.recipe.DelayedScaling", "transformer_engine.common.recipe.Float8CurrentScaling"} <= names


def test_every_te_call_uses_recorded_names_and_keywords(api):
    for name, kws, line in te_calls():
        assert name in api, f"te_backend.py:{line}: {name} is not in transformer_engine 2.20.2"
        bad = kws - _accepted(api, name)
        assert not bad, f"te_backend.py:{line}: {name} does not accept {sorted(bad)}"


def test_autocast_is_a_context_manager_and_formats_exist(api):
    assert "context manager" in api["transformer_engine.pytorch.autocast"]["kind"]
    assert "HYBRID" in api["transformer_engine.common.recipe.Format"]["members"]
    # normalization value and parallel modes used are strings the layers take
    assert 'normalization="RMSNorm"' in SRC and 'parallel_mode="column"' in SRC and 'parallel_mode="row"' in SRC


def test_layernorm_linear_rmsnorm_and_parallel_params_exist(api):
    for cls in ("transformer_engine.pytorch.Linear.__init__", "transformer_engine.pytorch.LayerNormLinear.__init__"):
        names = {p["name"] for p in api[cls]["params"]}
        assert {"parallel_mode", "tp_group", "tp_size", "sequence_parallel", "params_dtype", "device"} <= names


def test_recipes_refused_on_the_wrong_gpu_without_importing_te():
    with pytest.raises(ValueError, match="needs a Blackwell GPU"):
        te_backend.fp8_recipe("mxfp8", capability=(9, 0))
    with pytest.raises(ValueError, match="needs a Blackwell GPU"):
        te_backend.fp8_recipe("nvfp4", capability=(9, 0))
    with pytest.raises(ValueError, match="sm_90"):
        te_backend.fp8_recipe("delayed", capability=(8, 0))
    with pytest.raises(ValueError, match="valid choices are delayed, current, mxfp8, nvfp4"):
        te_backend.fp8_recipe("fp4", capability=(9, 0))


def test_missing_te_gives_install_hint():
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        with pytest.raises(ImportError, match=r"pip install 'aligner\[te\]'"):
            te_backend.import_te()
    else:
        pytest.skip("transformer_engine imports here")
