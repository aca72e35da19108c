"""Role-level runs shared by the layout tests of the training runtime (context parallelism, the
interleaved pipeline): a ragged RL batch, the PPO settings, and every parameter's full gradient."""

from __future__ import annotations

import torch

from aligner.config import AlgorithmConfig, OptimConfig
from aligner.protocol import build_sequences

OPTIM = OptimConfig(lr=1e-3, warmup_steps=0, schedule="constant", grad_clip=0.0)
PROMPTS, RESPONSES = (3, 6, 2, 4), (9, 1, 3, 12)  # rows of 12, 7, 5, 16 tokens


def ppo_algo(loss_agg: str = "token-mean") -> AlgorithmConfig:
    """GRPO advantages given, no KL, an entropy bonus and asymmetric clipping: every loss term moves."""
    return AlgorithmConfig(
        advantage="grpo", kl_coef=0.0, kl_loss_coef=0.0, entropy_coef=0.05, clip_eps=0.1, clip_eps_high=0.3, loss_agg=loss_agg
    )


def rl_batch(
    seed: int = 4, shared_prompt: bool = False, prompt_lens: tuple = PROMPTS, response_lens: tuple = RESPONSES
) -> dict[str, torch.Tensor]:
    """Right-padded prompt + response rows of the given lengths (default four; two groups of two
    samples of one prompt when `shared_prompt`): input_ids, prompt_lens, response_mask, advantages,
    returns [B, R], and ``offset`` [B, R] (old log-probs = current - offset, so the PPO ratio is not 1)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 64, (n,), generator=g).tolist() for n in prompt_lens]
    if shared_prompt:
        prompts = [prompts[0], prompts[0], prompts[1], prompts[1]]
    responses = [torch.randint(4, 64, (n,), generator=g).tolist() for n in response_lens]
    seq = build_sequences(prompts, responses, pad_id=0)
    mask = seq["response_mask"]
    return {
        "input_ids": seq["input_ids"],
        "prompt_lens": seq["prompt_lens"],
        "response_mask": mask,
        "advantages": torch.randn(mask.shape, generator=g) * mask,
        "offset": torch.randn(mask.shape, generator=g) * 0.3,
        "returns": torch.randn(mask.shape, generator=g) * mask,
    }


def full_grads(runtime) -> dict[str, torch.Tensor]:
    """Every trainable parameter's full gradient (HF names): FSDP2's gathered, TP shards and PP
    stages through the checkpoint's gather (the gradients swapped into the parameters' place for it)."""
    from aligner.runtime.checkpoint import gather_full_state_dict_any

    params = list(runtime.module.parameters())
    if runtime.dims.tp_size == 1 and runtime.dims.pp_size == 1:
        out = {}
        for n, p in runtime.module.named_parameters():
            if p.grad is not None:  # LoRA: the frozen base has none
                g = p.grad.detach()
                out[n] = g.full_tensor() if hasattr(g, "full_tensor") else g.clone()
        return out
    if getattr(runtime, "fsdp", False) and runtime.dims.dp_size > 1:
        # the swap below reaches FSDP2's sharded parameters only through .data, which the checkpoint's
        # gather does not read: it would return the weights, not the gradients
        raise NotImplementedError("full_grads: FSDP2 with dp > 1 and tp or pp > 1: gather each stage's p.grad.full_tensor() instead")
    for p in params:
        p.data, p.grad = p.grad, p.data
    try:
        return gather_full_state_dict_any(runtime)
    finally:
        for p in params:
            p.data, p.grad = p.grad, p.data
