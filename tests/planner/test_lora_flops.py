"""The planner's training FLOPs with LoRA: a frozen base computes no weight
gradients, so its parameters cost 4 FLOPs per token (forward, input gradient) instead of 6, while
the adapters train. Checked against the FLOPs torch counts for aligner's LoRA model on the CPU."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from aligner.config import ClusterConfig, ModelConfig, ParallelConfig
from aligner.model.llama import build_model
from aligner.nn.lora import apply_lora
from aligner.planner import (
    Layout,
    RoleWork,
    estimate_layout,
    lora_num_parameters,
    role_active_parameters,
    role_flop_parameters,
    role_num_parameters,
    train_flops_per_token,
)

MODEL = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=352, num_layers=4, num_heads=4, num_kv_heads=4, max_seq_len=64)
SEQ, ROWS = 64, 2
TARGETS = ("q_proj", "v_proj")


def measured_flops(lora: bool) -> float:
    """FLOPs torch counts for one forward and backward of ROWS x SEQ tokens (full fine-tuning or LoRA r=4)."""
    torch.manual_seed(0)
    model = build_model(MODEL)
    if lora:
        apply_lora(model, 4, 8.0, 0.0, TARGETS)
    ids = torch.randint(0, MODEL.vocab_size, (ROWS, SEQ))
    with FlopCounterMode(display=False) as counter:
        model(ids).float().sum().backward()
    return counter.get_total_flops()


def planned_compute(lora: bool) -> float:
    """The planner's compute seconds of the same work (one optimizer step of ROWS sequences)."""
    work = RoleWork(
        role="actor",
        kind="lm",
        mode="train",
        parallel=ParallelConfig(),
        batch=ROWS,
        batch_field="b",
        seq_len=SEQ,
        lora_rank=4 if lora else 0,
        lora_targets=TARGETS if lora else (),
    )
    cluster = ClusterConfig(gpus_per_node=1)
    return estimate_layout(MODEL, work, Layout(tp=1, pp=1, dp=1, micro_batch_size=ROWS), cluster).time.compute_s


def test_lora_training_flops_skip_the_frozen_weights_gradients():
    """Torch counts about two thirds of full fine-tuning's FLOPs for LoRA (no weight-gradient GEMMs for
    the frozen base); the planner's LoRA compute follows within 10% (it counted full fine-tuning's)."""
    measured = measured_flops(True) / measured_flops(False)
    assert measured < 0.75
    planned = planned_compute(True) / planned_compute(False)
    assert planned == pytest.approx(measured, rel=0.1)


def test_lora_flops_per_token_formula():
    """6N + 12LHT for full fine-tuning; 4 per frozen parameter and 6 per adapter parameter with LoRA,
    the attention core's 12LHT either way; full recomputation adds a forward of everything (2N + 4LHT)."""
    n = role_num_parameters(MODEL, "lm")
    n_ad, _ = lora_num_parameters(MODEL, 4, TARGETS, 1, MODEL.num_layers)
    attn = 4.0 * MODEL.num_layers * MODEL.hidden_size * SEQ
    assert train_flops_per_token(n, MODEL, SEQ, "none") == 6 * n + 3 * attn
    assert train_flops_per_token(n + n_ad, MODEL, SEQ, "none", frozen_params=n) == 4 * n + 6 * n_ad + 3 * attn
    full = train_flops_per_token(n + n_ad, MODEL, SEQ, "full", frozen_params=n)
    assert full == 6 * n + 8 * n_ad + 4 * attn


@pytest.mark.parametrize("tied", [False, True])
def test_six_n_counts_the_parameters_a_token_multiplies_by(tied):
    """Untied, the input embedding is a lookup (torch counts no FLOPs for it) and the head a GEMM: the 6N of
    the planner's training FLOPs is role_flop_parameters, the active count less the embedding (here 11% of it),
    and equals torch's count of the GEMMs within 1%; tied, the one matrix is the head's GEMM and both counts agree."""
    model = ModelConfig(**{**MODEL.__dict__, "vocab_size": 1024, "tie_word_embeddings": tied})
    torch.manual_seed(0)
    net = build_model(model)
    ids = torch.randint(0, model.vocab_size, (ROWS, SEQ))
    with FlopCounterMode(display=False) as counter:
        net(ids).float().sum().backward()
    n = role_flop_parameters(model, "lm")
    # torch's counter has no formula for the CPU's fused attention (its flash kernel for the CPU): compare the
    # GEMMs, 6N a token, leaving out the attention core's 12LHT
    core = 12.0 * model.num_layers * model.hidden_size * SEQ
    planned = (train_flops_per_token(n, model, SEQ, "none") - core) * ROWS * SEQ
    assert planned == pytest.approx(counter.get_total_flops(), rel=0.01)
    lookup = 0 if tied else model.vocab_size * model.hidden_size
    assert n == role_active_parameters(model, "lm") - lookup
    assert role_flop_parameters(model, "score") == role_active_parameters(model, "score") - model.vocab_size * model.hidden_size
