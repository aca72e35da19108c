"""The batch that crosses process boundaries in a PPO step (driver <-> worker groups).

Owns :class:`RolloutBatch` (OpenRLHF's ``Experience``, verl's ``DataProto``): every tensor
with its shape and meaning, plus helpers that move between sequence coordinates
(what a model computes, [B, T-1] next-token log-probs) and response coordinates
([B, R], what the RL math uses).

Layout: row b holds ``prompt_lens[b]`` prompt tokens, then its response tokens, then
padding, in ``input_ids: [B, T]``. Response token j of row b sits at sequence position
``prompt_lens[b] + j``; its log-prob is the next-token log-prob at shifted position
``prompt_lens[b] + j - 1``. ``response_mask: [B, R]`` is 1.0 on real response tokens
(EOS included), 0.0 on padding.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

# Per-token [B, R] float fields and per-sequence [B] fields, in the vocabulary of docs/design.md, "Terms".
TOKEN_FIELDS = (
    "response_mask",
    "rollout_log_probs",
    "old_log_probs",
    "ref_log_probs",
    "teacher_log_probs",
    "values",
    "advantages",
    "returns",
    "kl",
)
SEQ_FIELDS = ("scores", "rewards", "prompt_lens", "response_lens", "group_ids")

ACTOR_UPDATE_FIELDS = ("input_ids", "prompt_lens", "response_mask", "old_log_probs", "advantages", "rollout_log_probs", "ref_log_probs")
"""The RolloutBatch fields the actor's PPO update reads (:meth:`aligner.actor.policy.Policy.ppo_update`;
the trainer sends them per mini-batch with :meth:`RolloutBatch.tensors`). B samples, T = prompt +
response tokens, R = response tokens:

- input_ids: [B, T] int64, prompt + response, right padded.
- prompt_lens: [B] int64, prompt tokens per row (where each row's response starts).
- response_mask: [B, R] float32, 1.0 on real response tokens, 0.0 on padding.
- old_log_probs: [B, R] float32, nats, the actor's log-probs before the update; left out for an
  on-policy update (``algorithm.recompute_old_log_probs=false``: the update's own, detached).
- advantages: [B, R] float32.
- rollout_log_probs: [B, R] float32, nats, the rollout engine's; only with ``algorithm.tis_cap``
  (truncated importance sampling) or ``algorithm.decoupled_loss`` (the behaviour policy of samples
  from stale weights).
- ref_log_probs: [B, R] float32, nats, the reference policy's; only with
  ``algorithm.kl_loss_coef > 0`` (the KL loss term).
"""


@dataclass
class RolloutBatch:
    """One PPO step's samples.

    Fields (B samples, T = longest prompt + response, R = longest response):
        input_ids: [B, T] int64, prompt + response, right padded with pad_id.
        attention_mask: [B, T] int64, 1 on prompt and response tokens.
        prompt_lens: [B] int64 prompt tokens per row. response_lens: [B] int64.
        response_mask: [B, R] float32.
        rollout_log_probs: [B, R] from the rollout engine (for the mismatch metric / TIS).
        old_log_probs, ref_log_probs: [B, R] recomputed by the actor / reference before the update.
        values: [B, R] critic values (GAE only). advantages, returns, kl: [B, R].
        scores: [B] raw reward (RM output or rule). rewards: [B] after standardization.
        group_ids: [B] int64 prompt index (samples of one prompt share it; GRPO/RLOO groups).
        rollout_experts, old_experts: [B, R, L, k] int16, for a Mixture-of-Experts policy only (else
            None): the top-k experts (sorted along k, -1 on padding) each of the L MoE layers chose
            for each response token, in the rollout engine and in the trainer's old_log_probs forward
            (the routing mismatch metric, aligner.algorithms.routing_mismatch).
        weight_version: the actor weight version that generated the responses.
        token_versions: [B, R] int64, the policy version that sampled each response token (right-padded
            with each row's last), for interruptible generation (``rollout.interruptible``: a weight sync
            may land mid-response); None otherwise (every token has weight_version's).
        meta: per-sample python objects (prompt text, reference answers) not sent to workers.
        dropped: samples the rollout could not produce (agent episodes that crashed or hung), left out
            of the batch (aligner.trainers.agent_samples).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_lens: torch.Tensor
    response_lens: torch.Tensor
    response_mask: torch.Tensor
    group_ids: torch.Tensor
    rollout_log_probs: Optional[torch.Tensor] = None
    old_log_probs: Optional[torch.Tensor] = None
    ref_log_probs: Optional[torch.Tensor] = None
    teacher_log_probs: Optional[torch.Tensor] = None  # [B, R], on-policy distillation's teacher (teacher.init)
    values: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    returns: Optional[torch.Tensor] = None
    kl: Optional[torch.Tensor] = None
    scores: Optional[torch.Tensor] = None
    rewards: Optional[torch.Tensor] = None
    rollout_experts: Optional[torch.Tensor] = None
    old_experts: Optional[torch.Tensor] = None
    weight_version: int = 0
    token_versions: Optional[torch.Tensor] = None
    meta: list[dict] = field(default_factory=list)
    dropped: int = 0

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def tensors(self, *names: str) -> dict[str, torch.Tensor]:
        """A plain dict of the named tensor fields (what a dp_split call sends to workers)."""
        out = {}
        for n in names:
            v = getattr(self, n)
            if v is None:
                raise ValueError(f"RolloutBatch.{n} is not set yet; compute it before sending it to workers")
            out[n] = v
        return out

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """input_ids, attention_mask, prompt_lens, response_mask: what every role's forward needs."""
        return self.tensors("input_ids", "attention_mask", "prompt_lens", "response_mask")

    def select(self, index: torch.Tensor) -> RolloutBatch:
        """Rows `index` ([n] int64) of every tensor field (meta too)."""
        kw: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                kw[f.name] = v[index]
            elif f.name == "meta":
                kw[f.name] = [v[i] for i in index.tolist()] if v else []
            else:
                kw[f.name] = v
        return RolloutBatch(**kw)


def build_sequences(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Concatenate prompt and response token lists into right-padded tensors.

    Returns input_ids [B, T], attention_mask [B, T], prompt_lens [B], response_lens [B],
    response_mask [B, R] float32 (R = longest response, at least 1).
    Raises ValueError for mismatched list lengths or an empty prompt.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"build_sequences: {len(prompts)} prompts but {len(responses)} responses")
    b = len(prompts)
    plen = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    rlen = torch.tensor([len(r) for r in responses], dtype=torch.long)
    if (plen == 0).any():
        raise ValueError("build_sequences: a prompt has no tokens")
    t = int((plen + rlen).max())
    r = max(1, int(rlen.max()))
    ids = torch.full((b, t), pad_id, dtype=torch.long)
    attn = torch.zeros(b, t, dtype=torch.long)
    for i, (p, s) in enumerate(zip(prompts, responses)):
        seq = list(p) + list(s)
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attn[i, : len(seq)] = 1
    mask = (torch.arange(r).unsqueeze(0) < rlen.unsqueeze(1)).float()
    return {"input_ids": ids, "attention_mask": attn, "prompt_lens": plen, "response_lens": rlen, "response_mask": mask}


def response_index(prompt_lens: torch.Tensor, r: int, t_shifted: int) -> torch.Tensor:
    """[B, R] int64 positions in the shifted [B, T-1] log-prob tensor of each response token (clamped)."""
    idx = prompt_lens.long().unsqueeze(1) - 1 + torch.arange(r, device=prompt_lens.device).unsqueeze(0)
    return idx.clamp(0, t_shifted - 1)


def to_response(seq: torch.Tensor, prompt_lens: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """seq: [B, T-1] per next-token position -> [B, R] per response token (0 where masked)."""
    idx = response_index(prompt_lens, response_mask.shape[1], seq.shape[1])
    return seq.gather(1, idx) * response_mask.to(seq.dtype)


def values_to_response(values: torch.Tensor, prompt_lens: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """values: [B, T] per position -> [B, R]: the value of the state before response token j
    (read at position prompt_len + j - 1, the same position whose logits produce token j)."""
    return to_response(values[:, :-1], prompt_lens, response_mask)
