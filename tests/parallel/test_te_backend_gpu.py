"""TE backend on a GPU: logits equal the torch backend's on the same weights; FP8 trains.

Skipped unless CUDA is available and transformer_engine.pytorch imports.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
try:
    import transformer_engine.pytorch  # noqa: F401
except Exception as e:  # pragma: no cover - depends on the machine
    pytest.skip(f"transformer_engine does not import: {e}", allow_module_level=True)

from aligner.model.llama import build_model  # noqa: E402
from aligner.parallel.te_backend import apply_te_backend, fp8_autocast, fp8_recipe, te_layer_to_hf  # noqa: E402
from tests.toolkit.models import tiny_model_config  # noqa: E402

CFG = tiny_model_config(vocab_size=256, hidden_size=128, intermediate_size=256, max_seq_len=256)


def _pair():
    ref = build_model(CFG, "lm", seed=0).cuda()
    te_model = build_model(CFG, "lm", seed=0).cuda()
    apply_te_backend(te_model)
    return ref, te_model


def test_te_logits_match_torch_backend():
    torch.backends.cuda.matmul.allow_tf32 = False
    ref, te_model = _pair()
    ids = torch.randint(0, CFG.vocab_size, (2, 32), device="cuda")
    with torch.no_grad():
        a, b = ref(ids), te_model(ids)
    assert torch.allclose(a, b, atol=2e-3, rtol=1e-3), float((a - b).abs().max())
    hf = te_layer_to_hf(te_model.model.layers["0"], "model.layers.0.")
    sd = ref.state_dict()
    for k, v in hf.items():
        assert torch.equal(v, sd[k]), k


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fp8_forward_backward_on_hopper(recipe):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("FP8 needs sm_90+")
    ref, te_model = _pair()
    ids = torch.randint(0, CFG.vocab_size, (4, 32), device="cuda")
    with torch.no_grad():
        want = ref(ids).float()
    with fp8_autocast(True, fp8_recipe(recipe)):
        got = te_model(ids).float()
    got.sum().backward()
    assert torch.isfinite(got).all()
    assert float((got - want).abs().mean()) < 0.1 * float(want.abs().mean())
