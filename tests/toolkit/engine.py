"""The engine tests' small model and the skip marker for the CPU decode attention kernel."""

from __future__ import annotations

import pytest

from aligner.model.llama import build_model
from aligner.rollout.torch_engine import cpu_kernels
from aligner.rollout.torch_engine.cpu_kernels import load_decode_attention
from tests.toolkit.models import tiny_model_config

# a 2-layer model with GQA (4 query, 2 kv heads) small enough to generate in milliseconds
ENGINE_CFG = tiny_model_config(vocab_size=96, hidden_size=64, intermediate_size=128, max_seq_len=48, init_std=0.1)

# marks a case that needs aligner's varlen decode attention kernel (built with the system compiler)
VARLEN = pytest.mark.skipif(
    load_decode_attention() is None, reason=f"aligner's decode attention kernel cannot be built here: {cpu_kernels.LOAD_ERROR}"
)


def engine_model(seed: int = 1):
    """ENGINE_CFG's LlamaForCausalLM in eval mode, weights drawn with `seed`."""
    return build_model(ENGINE_CFG, seed=seed).eval()


# the environment that makes this machine choose, compile and round as an AVX2-only CPU would
# (docs/hardware.md, "Running as another CPU"): torch's kernels, oneDNN's, and aligner's own decisions
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ALIGNER_CPU_ISA": "avx2"}
