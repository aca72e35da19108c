"""Safe defaults: safetensors weights, weights_only unpickling, no remote code, no Hydra
instantiation of arbitrary classes, and a local Ray instance with no dashboard.

Source checks walk the AST of every module of the aligner package (and the YAML of conf/), so a
new call site that breaks a rule fails here with its file and line.
"""

from __future__ import annotations

import ast
import pickle
import re
from pathlib import Path

import pytest
import torch

import aligner
from tests.toolkit.models import tiny_model_config

PKG = Path(aligner.__file__).resolve().parent
CONF = PKG.parent / "conf"
SOURCES = sorted(PKG.rglob("*.py"))


def _calls(name: str):
    """(file:line, ast.Call) of every call whose function is `name` or `<anything>.name`."""
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                f = node.func
                fname = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if fname == name:
                    yield f"{path.relative_to(PKG.parent)}:{node.lineno}", node


def _kw(call: ast.Call, name: str):
    for k in call.keywords:
        if k.arg == name:
            return k.value
    return None


def test_package_sources_found():
    assert len(SOURCES) > 40 and (PKG / "model" / "hf.py") in SOURCES


def test_every_torch_load_passes_weights_only_true():
    sites = list(_calls("load"))
    torch_loads = [(w, c) for w, c in sites if isinstance(c.func, ast.Attribute) and getattr(c.func.value, "id", "") == "torch"]
    assert torch_loads, "expected torch.load call sites (hf.py, checkpointing.py)"
    bad = [w for w, c in torch_loads if not (isinstance(_kw(c, "weights_only"), ast.Constant) and _kw(c, "weights_only").value is True)]
    assert not bad, f"torch.load without weights_only=True at {bad}"


def test_no_pickle_or_unsafe_loaders():
    bad = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
                if any(n.split(".")[0] in ("pickle", "dill", "cloudpickle", "marshal", "shelve") for n in names):
                    bad.append(f"{path.name}:{node.lineno}")
    bad += [
        w
        for w, c in _calls("load")
        if isinstance(c.func, ast.Attribute)
        and getattr(c.func.value, "id", "") in ("yaml", "np", "numpy")
        and _kw(c, "allow_pickle") is not False
        and getattr(c.func.value, "id", "") != "yaml"
    ]
    bad += [w for name in ("eval", "exec") for w, c in _calls(name) if isinstance(c.func, ast.Name)]
    assert not bad, f"unsafe deserialization or eval at {bad}"


def test_trust_remote_code_is_never_true():
    sites = [
        (w, _kw(c, "trust_remote_code"))
        for name in ("from_pretrained", "load_tokenizer", "AutoTokenizer", "AutoConfig")
        for w, c in _calls(name)
    ]
    bad = [w for w, v in sites if v is not None and not (isinstance(v, ast.Constant) and v.value is False)]
    assert not bad, f"trust_remote_code not literally False at {bad}"
    for path in SOURCES:  # any other spelling (kwargs dicts, attribute sets)
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"trust_remote_code['\"]?\s*[=:]\s*True", line):
                bad.append(f"{path.name}:{i}")
    for path in sorted(CONF.rglob("*.yaml")):
        if "trust_remote_code" in path.read_text():
            bad.append(str(path))
    assert not bad, f"trust_remote_code=True at {bad}"


def test_no_hydra_instantiate_or_targets():
    bad = [w for w, _ in _calls("instantiate")]  # hydra.utils.call/get_class: caught by the "hydra.utils" check
    for path in SOURCES:
        text = path.read_text()
        if "hydra.utils" in text or "_target_" in text:
            bad.append(str(path.relative_to(PKG.parent)))
    for path in sorted(CONF.rglob("*.yaml")):
        if "_target_" in path.read_text():
            bad.append(str(path.relative_to(PKG.parent)))
    assert not bad, f"Hydra instantiation of config-named classes at {bad}"


def test_a_target_override_is_refused():
    from aligner.cli import load_config
    from aligner.config import ConfigError

    with pytest.raises(ConfigError, match="_target_"):
        load_config("ppo", ["+model._target_=os.system"])


def _tiny_state():
    from aligner.model.llama import build_model

    cfg = tiny_model_config(vocab_size=32, hidden_size=16, intermediate_size=32, num_heads=2, max_seq_len=16)
    return cfg, build_model(cfg, "lm", seed=0).state_dict()


@pytest.mark.parametrize("max_shard_bytes", [5 * 2**30, 4096])
def test_save_hf_writes_only_safetensors(tmp_path, max_shard_bytes):
    from aligner.model.hf import load_hf_model, save_hf

    cfg, sd = _tiny_state()
    out = save_hf(sd, cfg, tmp_path / "hf", max_shard_bytes=max_shard_bytes)
    names = sorted(p.name for p in out.iterdir())
    weights = [n for n in names if n != "config.json" and not n.endswith(".index.json")]
    assert weights and all(n.endswith(".safetensors") for n in weights), names
    assert not any(n.endswith((".bin", ".pt", ".pth", ".pkl", ".ckpt")) for n in names), names
    assert (len(weights) > 1) == (max_shard_bytes == 4096)
    model, _ = load_hf_model(out)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in sd.items())


class _Payload:
    """Unpickling this creates a marker file: what weights_only=True must refuse to do."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_pickled_code_in_pytorch_model_bin_is_not_run(tmp_path):
    from aligner.model.hf import CheckpointError, load_hf_state_dict

    marker = tmp_path / "pwned"
    (tmp_path / "m").mkdir()
    torch.save(
        {"w": torch.zeros(2), "x": _Payload(str(marker))}, tmp_path / "m" / "pytorch_model.bin", pickle_protocol=pickle.HIGHEST_PROTOCOL
    )
    with pytest.raises(CheckpointError, match=r"pytorch_model.bin: cannot load with weights_only=True"):
        load_hf_state_dict(tmp_path / "m")
    assert not marker.exists(), "unpickling ran code from the checkpoint"


def test_pickled_code_in_rng_state_is_not_run(tmp_path):
    from aligner.run_ops.checkpointing import load_trainer_state

    marker = tmp_path / "pwned"
    (tmp_path / "trainer_state.json").write_text('{"step": 1}')
    torch.save({"torch": _Payload(str(marker))}, tmp_path / "rng.pt")
    with pytest.raises(Exception):  # noqa: B017 (whatever the unpickler raises, the payload must not run)
        load_trainer_state(tmp_path)
    assert not marker.exists()


def test_local_ray_has_no_dashboard_and_joins_no_stray_cluster(monkeypatch):
    import ray

    from aligner.config import ClusterConfig
    from aligner.workers import ray_runtime

    seen = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.append(kw))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {})
    monkeypatch.setattr(ray_runtime, "_gcs_address", lambda: "127.0.0.1:0")
    info = ray_runtime.init_ray(ClusterConfig())
    kw = seen[-1]
    assert info.local and kw["address"] == "local"
    dashboard_off = kw.get("include_dashboard") is False
    dashboard_local = kw.get("dashboard_host", "127.0.0.1") == "127.0.0.1"
    assert dashboard_off or (kw.get("include_dashboard") and dashboard_local), kw
    assert "dashboard_host" not in kw or kw["dashboard_host"] in ("127.0.0.1", "localhost"), kw
    # an existing cluster is joined as it is: aligner passes no dashboard or auth settings
    ray_runtime.init_ray(ClusterConfig(address="10.0.0.1:6379"))
    assert seen[-1]["address"] == "10.0.0.1:6379" and not any("dashboard" in k for k in seen[-1]), seen[-1]
