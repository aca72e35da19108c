"""Policy: the Ray-free actor (and reference, and SFT model) on its parallel layout.

Owns the policy-side computations of SFT and PPO, each written once per micro-batch and
run on any tp/pp/dp layout through :class:`aligner.runtime.runner.ModelRunner`:

- ``log_probs``: per-response-token log-probs under softmax(logits / temperature),
  vocab-parallel (no rank holds full-vocabulary logits); with ``parallel.logprob_chunk_size`` > 0
  the model fuses its head with the softmax over chunks of positions (:mod:`aligner.nn.chunked`),
  so no [b, R, V/tp] logits exist either; 0 keeps the logits and :mod:`aligner.nn.vocab`.
- ``sft_step``: next-token NLL on response tokens only (loss_mask), token-mean over the
  global batch.
- ``ppo_update``: clipped surrogate (Schulman et al. 2017) with optional clip-higher and
  dual clip, or GSPO's sequence ratio or CISPO's clipped weight (``algorithm.policy_loss``),
  entropy bonus, KL loss term and truncated importance sampling (aligner.algorithms),
  aggregated over the global mini-batch by ``algorithm.loss_agg``.
- ``dpo_step`` / ``dpo_eval``: the DPO-family preference losses of
  :func:`aligner.algorithms.dpo_loss` on sequence log-probs (sums over response tokens) of
  preference pairs, mean over the global batch of pairs, plus RPO's NLL of the chosen responses;
  ``pair_sequence_log_probs`` gives the same sums (a frozen reference's, for DPO).

Batches are dicts of tensors in the layout of :mod:`aligner.protocol`.
"""

from __future__ import annotations

from typing import Optional

import torch

from aligner import algorithms as alg
from aligner.actor.shared_prompt import pack_shared_prompts, prompt_groups, unpack_micro, unpack_output
from aligner.config import AlgorithmConfig, DPOConfig, PromptLearningConfig
from aligner.model.moe import record_routing, stack_routing
from aligner.model.prompt import attach_prompt, build_prompt, greedy_generate, prompt_state_dict
from aligner.nn.chunked import LogProbSpec, auto_chunk_size
from aligner.nn.vocab import vocab_parallel_log_probs, vocab_parallel_log_probs_entropy
from aligner.protocol import ACTOR_UPDATE_FIELDS, response_index
from aligner.runtime.role import RoleModel
from aligner.runtime.runner import from_last_pp_stage


def pair_rows(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Preference pairs (:func:`aligner.data.collate.collate_pairs`) -> response-layout rows, chosen and
    rejected interleaved (row 2i = chosen i, 2i+1 = rejected i, so a pair never straddles a micro-batch).

    batch: chosen_input_ids, rejected_input_ids, chosen_attention_mask, rejected_attention_mask
    [B, T] (right padded), prompt_lens [B] (tokens the two sides share); optionally
    ref_chosen_logps, ref_rejected_logps [B].
    Returns input_ids [2B, T], prompt_lens [2B], response_mask [2B, R] float32 (R = longest
    response, at least 1) and, when given, ref_logps [2B]. An empty prompt (an implicit-prompt pair
    without a common prefix, no bos) counts as 1 token: the first token has no log-prob to score.
    Raises KeyError without prompt_lens.
    """
    ids = torch.stack([batch["chosen_input_ids"], batch["rejected_input_ids"]], dim=1).flatten(0, 1)
    lens = torch.stack([batch["chosen_attention_mask"], batch["rejected_attention_mask"]], dim=1).flatten(0, 1).sum(1)
    plens = batch["prompt_lens"].long().clamp(min=1).repeat_interleave(2)  # a first token has no log-prob: prompt >= 1
    rlens = (lens - plens).clamp(min=0)
    r = max(1, int(rlens.max()))
    out = {"input_ids": ids, "prompt_lens": plens, "response_mask": (torch.arange(r).unsqueeze(0) < rlens.unsqueeze(1)).float()}
    if "ref_chosen_logps" in batch:
        out["ref_logps"] = torch.stack([batch["ref_chosen_logps"], batch["ref_rejected_logps"]], dim=1).flatten()
    return out


class Policy(RoleModel):
    """A causal LM role. See RoleModel for the constructor arguments (kind is "lm").

    prompt_learning: an enabled :class:`aligner.config.PromptLearningConfig` trains virtual tokens
    on a frozen base (:mod:`aligner.model.prompt`): only they are in the optimizer and in
    checkpoints. prompt_init_ids: init_text's token ids (prompt_learning.init=text).
    """

    kind = "lm"

    def __init__(self, *args, prompt_learning: Optional[PromptLearningConfig] = None, prompt_init_ids: Optional[list] = None, **kw):
        self.prompt_cfg = prompt_learning if prompt_learning is not None and prompt_learning.enabled else None
        self.prompt_init_ids = prompt_init_ids
        super().__init__(*args, **kw)
        if self.prompt_cfg is not None:
            self.runtime.checkpoint_trainable_only = True  # the frozen base is the init: not saved again

    def prepare_model(self, full: torch.nn.Module, seed: int) -> torch.nn.Module:
        """With prompt learning: attach the virtual prompt (seeded, the same on every rank) and freeze the base."""
        if self.prompt_cfg is None:
            return full
        prompt = build_prompt(self.prompt_cfg, full.model.embed_tokens.weight, seed, self.prompt_init_ids)
        return attach_prompt(full, prompt)

    # ---- prompt learning ----------------------------------------------------------------
    def prompt_tensors(self) -> dict[str, torch.Tensor]:
        """The virtual prompt's full fp32 tensors (:func:`aligner.model.prompt.prompt_state_dict`; collective)."""
        return prompt_state_dict(self.runtime.module)

    @torch.no_grad()
    def full_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [b, t] int64 -> logits [b, t, V] over the full vocabulary (tp shards gathered).
        Collective over the role (FSDP2 gathers; every rank must call it with the same shapes)."""
        out = self.runtime.forward(input_ids.to(self.runtime.device), position_ids=None)
        if self.dims.tp_size == 1:
            return out
        parts = [torch.empty_like(out) for _ in range(self.dims.tp_size)]
        torch.distributed.all_gather(parts, out.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)

    def greedy(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int]) -> list[tuple[list[int], list[float], str]]:
        """Greedy responses by the training model's forward (virtual prompt included): see
        :func:`aligner.model.prompt.greedy_generate`. Every rank runs every prompt (collective)."""
        was = self.runtime.module.training
        self.runtime.eval()
        try:
            return greedy_generate(self.full_logits, prompts, max_new_tokens, stop_ids)
        finally:
            self.runtime.train(was)

    @property
    def chunked(self) -> bool:
        """True when the model returns log-probs and entropy itself (parallel.logprob_chunk_size != 0)."""
        return self.parallel.logprob_chunk_size != 0

    @property
    def chunk_size(self) -> int:
        """Positions per log-prob chunk: parallel.logprob_chunk_size, or for -1 :func:`auto_chunk_size` of V/tp."""
        size = self.parallel.logprob_chunk_size
        return size if size > 0 else auto_chunk_size(self.model_cfg.vocab_size // self.dims.tp_size)

    def _with_labels(self, inputs: dict, labels: torch.Tensor, temperature: float) -> dict:
        """`inputs` plus labels [B, R] and, on the chunked path, the model input ``logprob``."""
        out = {**inputs, "labels": labels}
        if self.chunked:
            out["logprob"] = LogProbSpec(temperature=temperature, chunk_size=self.chunk_size)
        return out

    def _log_probs_entropy(self, out, mb: dict, temperature: float, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The model output -> (log_probs [b, R] fp32, entropy [b, R] fp32) of mb["labels"].

        out: (log_probs, entropy) on the chunked path, else logits [b, R, V/tp]. The entropy
        carries gradient only with `entropy_grad` (an entropy bonus)."""
        if not self.chunked:
            return vocab_parallel_log_probs_entropy(out, mb["labels"], self.tp_group, self.vocab_start, temperature, entropy_grad)
        lp, ent = out
        return lp, ent if entropy_grad else ent.detach()

    def _label_log_probs(self, out, mb: dict, temperature: float) -> torch.Tensor:
        """The model output (as for :meth:`_log_probs_entropy`) -> log_probs [b, R] fp32 of mb["labels"]."""
        if self.chunked:
            return out[0]
        return vocab_parallel_log_probs(out, mb["labels"], self.tp_group, self.vocab_start, temperature)

    def _token_inputs(self, batch: dict[str, torch.Tensor], keys: tuple[str, ...]) -> dict:
        """`keys` of batch plus labels [B, T]: the next token at each position (input_ids shifted left;
        the last position scores a dummy label, the first token, and is dropped by the caller).

        The labels are shifted, not the logits: the log-probs run over all T positions, so the
        [b, T, V] logits (unchunked path) are read in place instead of copied into a
        [b, T-1, V] slice first (as HF's causal-LM loss does)."""
        ids = batch["input_ids"]
        return self._with_labels({k: batch[k] for k in keys if k in batch}, torch.cat([ids[:, 1:], ids[:, :1]], dim=1), 1.0)

    @staticmethod
    def _response_inputs(batch: dict[str, torch.Tensor], keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """`keys` of batch plus head_index [B, R] (the positions whose logits predict the response
        tokens: prompt_len - 1 + j, clamped) and labels [B, R] (the tokens they predict), so the
        model applies its head to the response positions only (LlamaForCausalLM ``head_index``)."""
        ids = batch["input_ids"]
        head_index = response_index(batch["prompt_lens"], batch["response_mask"].shape[1], ids.shape[1] - 1)
        return {**{k: batch[k] for k in keys}, "head_index": head_index, "labels": ids.gather(1, head_index + 1)}

    def _response_model_inputs(self, batch: dict[str, torch.Tensor], keys: tuple[str, ...], temperature: float) -> dict:
        """:meth:`_response_inputs` plus the ``logprob`` model input on the chunked path."""
        inputs = self._response_inputs(batch, keys)
        return self._with_labels(inputs, inputs["labels"], temperature)

    # ---- inference ------------------------------------------------------------------
    def _shared_prompt_inputs(
        self, batch: dict[str, torch.Tensor], sample_keys: tuple[str, ...], temperature: float, micro_batch_size: int, pack_len: int
    ) -> Optional[tuple[dict, int]]:
        """(packed model inputs, packed rows per micro-batch) when `batch` packs by shared prompt
        (:mod:`aligner.actor.shared_prompt`), else None: pack_len 0, a virtual prompt or MoE layers
        (their routing and capacity count padded rows), rows not in equal groups of G > 1, a
        micro-batch smaller than G samples (a packed row holds G), or a row over pack_len tokens."""
        if pack_len <= 0 or self.prompt_cfg is not None or self.model_cfg.num_experts > 0:
            return None
        g = prompt_groups(batch["input_ids"], batch["prompt_lens"])
        if g < 2 or micro_batch_size < g:
            return None
        budget = self.runner.micro_batch_tokens  # a packed row must fit a token-budget micro-batch too
        packed = pack_shared_prompts(batch, g, sample_keys, self.runner.seq_multiple, min(pack_len, budget) if budget > 0 else pack_len)
        if packed is None:
            return None
        return self._with_labels(packed, packed["labels"], temperature), micro_batch_size // g

    def log_probs(self, batch: dict[str, torch.Tensor], micro_batch_size: int, temperature: float = 1.0, pack_len: int = 0) -> torch.Tensor:
        """batch: input_ids [B, T], prompt_lens [B], response_mask [B, R] -> log_probs [B, R] fp32 (0 where masked).

        pack_len > 0: the samples of one prompt run as one packed row of at most that many tokens,
        the prompt once (``trainer.shared_prompt_pack_len``; :mod:`aligner.actor.shared_prompt`)."""
        r = batch["response_mask"].shape[1]
        packed = self._shared_prompt_inputs(batch, ("response_mask",), temperature, micro_batch_size, pack_len)
        if packed is not None:

            def packed_out(output, mb):
                mb = unpack_micro(mb, ("response_mask",), r)
                return self._label_log_probs(unpack_output(output, r), mb, temperature) * mb["response_mask"]

            return self.runner.forward(packed[0], packed_out, packed[1])

        def out(output, mb):  # logits [b, R, V/tp] at the response positions, or (log_probs, entropy)
            return self._label_log_probs(output, mb, temperature) * mb["response_mask"]

        inputs = self._response_model_inputs(batch, ("input_ids", "response_mask"), temperature)
        return self.runner.forward(inputs, out, micro_batch_size)

    def log_probs_with_routing(self, batch: dict[str, torch.Tensor], micro_batch_size: int, temperature: float = 1.0) -> dict:
        """:meth:`log_probs` plus the MoE routing of the same forward, for the engine / trainer
        routing comparison (:func:`aligner.algorithms.routing_mismatch`).

        batch: as :meth:`log_probs`. Returns {"log_probs": [B, R] fp32, "routed_experts": [B, R, L, k]
        int16}: for response token j of row b, the top-k experts (sorted along k) each of the
        model's L MoE layers chose at position prompt_lens[b] + j - 1 (the position whose logits
        give token j), -1 where response_mask is 0; L = 0 for a dense model. Eval-mode routing
        (dropless), as the engine's. Collective like :meth:`log_probs`; with pp > 1 each pipeline stage
        records its own layers and the pipeline stages' parts are gathered over the pp group (layer order);
        tp ranks route identically (the router is replicated, sequence parallelism gathers the
        tokens first); expert parallelism does not change the expert ids. Runs row-count
        micro-batches even with ``trainer.micro_batch_tokens`` > 0 (the log is read as [B, T] rows).
        """
        budget, self.runner.micro_batch_tokens = self.runner.micro_batch_tokens, 0  # the log's [B, T] rows: row-count micro-batches
        try:
            with record_routing(self.runtime.module) as logs:
                lp = self.log_probs(batch, micro_batch_size, temperature)
        finally:
            self.runner.micro_batch_tokens = budget
        ids, mask = batch["input_ids"], batch["response_mask"]
        b, r = mask.shape
        head_index = response_index(batch["prompt_lens"], r, ids.shape[1] - 1)  # [B, R]
        per_layer = []
        for log in logs:  # one [b_i * T_pad, k] per micro-batch, in micro-batch order
            if not log:  # an empty local batch runs no forward
                continue
            e = torch.cat([x.cpu() for x in log]).view(b, -1, log[0].shape[-1])  # [B, T(padded), k]
            per_layer.append(e.gather(1, head_index.unsqueeze(-1).expand(-1, -1, e.shape[-1])))
        k = self.model_cfg.num_experts_per_tok
        local = stack_routing(per_layer) if per_layer else torch.zeros(b, r, 0, k, dtype=torch.int16)
        if self.dims.pp_size > 1:
            parts: list = [None] * self.dims.pp_size
            torch.distributed.all_gather_object(parts, local, group=self.dims.pp_group)
            local = torch.cat(parts, dim=2)
        local = local.masked_fill(~(mask > 0)[:, :, None, None], -1)
        return {"log_probs": lp, "routed_experts": local}

    def sequence_log_probs(self, batch: dict[str, torch.Tensor], micro_batch_size: int) -> torch.Tensor:
        """batch: input_ids [B, T] -> next-token log_probs [B, T-1] fp32 (all positions)."""
        inputs = self._token_inputs(batch, ("input_ids",))
        return self.runner.forward(inputs, lambda output, mb: self._label_log_probs(output, mb, 1.0)[:, :-1], micro_batch_size)

    # ---- SFT ----------------------------------------------------------------------
    def sft_step(self, batch: dict[str, torch.Tensor], micro_batch_size: int) -> dict[str, float]:
        """One optimizer step of response-only NLL.

        batch: input_ids [B, T] int64, loss_mask [B, T] (1 on tokens that are predicted, i.e.
        response tokens), optional segment_ids / position_ids [B, T] for packed rows.
        Returns loss (global token-mean NLL, nats), tokens (global), grad_norm, lr, pad_tokens and
        pad_fraction (:meth:`aligner.runtime.runner.ModelRunner.padding_metrics`).
        """
        target = batch["loss_mask"][:, 1:].float()
        norm = self.normalizer(target.sum())

        def loss_fn(output, mb):
            lp = self._label_log_probs(output, mb, 1.0)[:, :-1]
            return -(lp * mb["loss_mask"][:, 1:].float()).sum() / norm

        stats = self.runner.optimizer_step(self._token_inputs(batch, tuple(batch)), loss_fn, micro_batch_size)
        tokens = norm * self.dims.dp_size
        return {
            "loss": self.dp_mean(stats["loss"] * norm, float(target.sum())),
            "tokens": tokens,
            **self.runner.padding_metrics(),
            "grad_norm": stats["grad_norm"],
            "lr": stats["lr"],
            "skipped": stats.get("skipped", 0.0),
            **{k: v for k, v in stats.items() if k.startswith("moe_")},
        }

    @torch.no_grad()
    def sft_eval(self, batch: dict[str, torch.Tensor], micro_batch_size: int) -> dict[str, float]:
        """Validation NLL: {"loss": token-mean over this call's global batch, "tokens"}."""
        lp = self.sequence_log_probs(batch, micro_batch_size)
        mask = batch["loss_mask"][:, 1:].float()
        local, count = float(-(lp * mask).sum()), float(mask.sum())
        return {"loss": self.dp_mean(local, count), "tokens": self.normalizer(count) * self.dims.dp_size}

    # ---- PPO ----------------------------------------------------------------------
    @staticmethod
    def _policy_loss(algo: AlgorithmConfig, lp, old, advantages, mask, weights) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``algo.policy_loss`` on one micro-batch's whole rows [b, R]: ppo (:func:`aligner.algorithms.policy_loss`),
        gspo (:func:`aligner.algorithms.gspo_loss`; its sequence ratio needs every token of a row, which each
        micro-batch has: the runner never splits a row, and context parallelism gathers the per-token outputs of
        the whole rows before the loss) or cispo (:func:`aligner.algorithms.cispo_loss`, bound 1 + clip_eps_high)."""
        high = algo.clip_eps if algo.clip_eps_high is None else algo.clip_eps_high
        if algo.policy_loss == "gspo":
            return alg.gspo_loss(lp, old, advantages, mask, algo.clip_eps, algo.clip_eps_high, algo.loss_agg, weights)
        if algo.policy_loss == "cispo":
            return alg.cispo_loss(lp, old, advantages, mask, high, algo.loss_agg, weights)
        return alg.policy_loss(
            lp,
            old,
            advantages,
            mask,
            algo.clip_eps,
            clip_eps_high=algo.clip_eps_high,
            dual_clip=algo.dual_clip,
            loss_agg=algo.loss_agg,
            is_weights=weights,
        )

    def ppo_update(
        self, batch: dict[str, torch.Tensor], algo: AlgorithmConfig, micro_batch_size: int, temperature: float = 1.0, pack_len: int = 0
    ) -> dict[str, float]:
        """One optimizer step of the clipped policy loss over this rank's share of a mini-batch (the
        actor's PPO update; one PPO step of the trainer runs ppo_epochs x mini-batches of them).

        batch: the fields of :data:`aligner.protocol.ACTOR_UPDATE_FIELDS` (shapes and dtypes there):
        input_ids, prompt_lens, response_mask, old_log_probs, advantages; rollout_log_probs when
        algo.tis_cap or algo.decoupled_loss is set; ref_log_probs when algo.kl_loss_coef > 0. Without old_log_probs (an on-policy update,
        ``algorithm.recompute_old_log_probs=false``) the forward's own log-probs, detached, are
        the old ones: ratio 1, gradient that of the policy gradient (TRL's GRPOTrainer does the
        same with num_iterations=1). pack_len: as :meth:`log_probs` (the samples of one prompt in
        one packed row; the same loss and gradient up to GEMM rounding).

        With ``algo.decoupled_loss`` the policy loss is AReaL's decoupled objective
        (:func:`aligner.algorithms.decoupled_policy_loss`: behaviour = rollout_log_probs, proximal =
        old_log_probs), for samples from stale weights; the token means of its behaviour weights are
        returned too (behavior_weight_mean, behavior_weight_capped_frac, behavior_approx_kl).

        The loss is ``policy_loss - entropy_coef * entropy + kl_loss_coef * kl_loss``, each
        term aggregated over the global mini-batch by ``algo.loss_agg`` (exact across
        micro-batches and dp ranks: every part adds its sum and the total is divided by the
        global token or sequence count, :func:`aligner.algorithms.loss_agg_count`).

        Returns policy_loss, kl_loss (with kl_loss_coef > 0) and entropy (aggregated by
        ``loss_agg``), clipfrac and approx_kl (token means), grad_norm, lr, skipped, pad_tokens and
        pad_fraction (token positions run without a real token, :meth:`ModelRunner.padding_metrics`).

        With ``trainer.micro_batch_tokens`` > 0 the runner groups rows by that token budget: the
        same loss and gradient, since every micro-batch adds its sums over the global count.
        """
        mode = algo.loss_agg
        norm = self.normalizer(alg.loss_agg_count(batch["response_mask"], mode))
        sums: dict[str, float] = {}

        def add(name: str, value: torch.Tensor) -> None:
            sums[name] = sums.get(name, 0.0) + float(value.detach())

        def loss_fn(output, mb):  # logits [b, R, V/tp] at the response positions, or (log_probs, entropy)
            mask = mb["response_mask"]
            lp, ent_tok = self._log_probs_entropy(output, mb, temperature, entropy_grad=algo.entropy_coef > 0)
            lp = lp * mask
            weights = None
            old = mb["old_log_probs"] if "old_log_probs" in mb else lp.detach()
            clip = dict(clip_eps_high=algo.clip_eps_high, dual_clip=algo.dual_clip, loss_agg=mode)
            if algo.decoupled_loss:  # AReaL: behaviour = the engine's log-probs, proximal = the recomputed old ones
                loss, m = alg.decoupled_policy_loss(
                    lp,
                    old,
                    mb["rollout_log_probs"],
                    mb["advantages"],
                    mask,
                    algo.clip_eps,
                    behavior_weight_cap=algo.behavior_weight_cap,
                    **clip,
                )
                for k in ("behavior_weight_mean", "behavior_weight_capped_frac", "behavior_approx_kl"):
                    add(k, m[k] * mask.sum())
            else:
                if algo.tis_cap is not None:
                    weights = alg.truncated_is_weights(mb["old_log_probs"], mb["rollout_log_probs"], mask, algo.tis_cap)
                loss, m = self._policy_loss(algo, lp, old, mb["advantages"], mask, weights)
            count, tokens = alg.loss_agg_count(mask, mode), mask.sum()
            entropy = alg.aggregate_loss(ent_tok, mask, mode)
            total = loss * count
            if algo.entropy_coef > 0:
                total = total - algo.entropy_coef * entropy * count
            if algo.kl_loss_coef > 0:
                kl = alg.kl_loss(lp, mb["ref_log_probs"], mask, algo.kl_loss_estimator, mode)
                total = total + algo.kl_loss_coef * kl * count
                add("kl_loss", kl * count)
            add("policy_loss", loss * count)
            add("entropy", entropy * count)
            add("clipfrac", m["clipfrac"] * tokens)
            add("approx_kl", m["approx_kl"] * tokens)
            return total / norm

        keys = tuple(k for k in ACTOR_UPDATE_FIELDS if k in batch and k != "prompt_lens")  # prompt_lens -> head_index
        sample_keys = tuple(k for k in keys if k != "input_ids")  # the [B, R] fields
        r = batch["response_mask"].shape[1]
        packed = self._shared_prompt_inputs(batch, sample_keys, temperature, micro_batch_size, pack_len)
        if packed is not None:
            stats = self.runner.optimizer_step(
                packed[0], lambda output, mb: loss_fn(unpack_output(output, r), unpack_micro(mb, sample_keys, r)), packed[1]
            )
        else:
            inputs = self._response_model_inputs(batch, keys, temperature)
            stats = self.runner.optimizer_step(inputs, loss_fn, micro_batch_size)
        sums = from_last_pp_stage(sums, self.dims)
        tokens = float(batch["response_mask"].sum())
        counts = {k: tokens for k in ("clipfrac", "approx_kl", "behavior_weight_mean", "behavior_weight_capped_frac", "behavior_approx_kl")}
        agg_count = float(alg.loss_agg_count(batch["response_mask"], mode))
        out = {k: self.dp_mean(v, counts.get(k, agg_count)) for k, v in sorted(sums.items())}
        moe = {k: v for k, v in stats.items() if k.startswith("moe_")}
        pad = self.runner.padding_metrics()
        return {**out, "grad_norm": stats["grad_norm"], "lr": stats["lr"], "skipped": stats.get("skipped", 0.0), **pad, **moe}

    # ---- DPO ----------------------------------------------------------------------
    def pair_sequence_log_probs(self, batch: dict[str, torch.Tensor], micro_batch_size: int) -> dict[str, torch.Tensor]:
        """Sequence log-probs of preference pairs (no gradient): {"ref_chosen_logps", "ref_rejected_logps": [B] fp32,
        nats, the sums over each response's tokens}. batch as :func:`pair_rows`; micro_batch_size counts pairs."""
        rows = pair_rows(batch)
        seq = self.log_probs(rows, 2 * micro_batch_size).sum(-1).view(-1, 2)
        return {"ref_chosen_logps": seq[:, 0].contiguous(), "ref_rejected_logps": seq[:, 1].contiguous()}

    def _dpo_terms(self, lp: torch.Tensor, mb: dict, dpo: DPOConfig) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token log-probs lp [2b, R] (0 where masked) of interleaved rows -> (sum of the pairs' DPO
        losses, sum of the chosen tokens' NLL, per-quantity sums for the metrics)."""
        mask = mb["response_mask"]
        seq = lp.sum(-1).view(-1, 2)
        ref = mb["ref_logps"].to(seq.dtype).view(-1, 2)
        lens = mask.sum(-1).view(-1, 2)
        losses, chosen_r, rejected_r = alg.dpo_loss(
            seq[:, 0], seq[:, 1], ref[:, 0], ref[:, 1], dpo.beta, dpo.loss_type, dpo.label_smoothing, lens[:, 0], lens[:, 1]
        )
        nll = -lp.view(-1, 2, lp.shape[-1])[:, 0].sum()
        sums = {
            "dpo_loss": losses.sum(),
            "rewards_chosen": chosen_r.sum(),
            "rewards_rejected": rejected_r.sum(),
            "reward_accuracy": (chosen_r > rejected_r).float().sum(),
            "reward_margin": (chosen_r - rejected_r).sum(),
            "logps_chosen": seq[:, 0].sum(),
            "logps_rejected": seq[:, 1].sum(),
        }
        return losses.sum(), nll, {k: v.detach() for k, v in sums.items()} | {"nll": nll.detach()}

    def _dpo_metrics(self, sums: dict[str, float], pairs: float, chosen_tokens: float, dpo: DPOConfig) -> dict[str, float]:
        """Global means: per pair, and the chosen NLL per chosen token; loss = dpo_loss + rpo_alpha * nll."""
        out = {k: self.dp_mean(v, chosen_tokens if k == "nll" else pairs) for k, v in sorted(sums.items())}
        out["loss"] = out["dpo_loss"] + dpo.rpo_alpha * out["nll"]
        return out

    def dpo_step(self, batch: dict[str, torch.Tensor], dpo: DPOConfig, micro_batch_size: int) -> dict[str, float]:
        """One optimizer step of the DPO-family loss over this rank's share of the global batch of pairs.

        batch: as :func:`pair_rows`, with ref_chosen_logps / ref_rejected_logps [B] (the frozen
        reference's sequence log-probs). micro_batch_size counts pairs (2 rows each).

        The loss is ``mean over pairs of dpo_loss + rpo_alpha * NLL``, NLL the token mean of
        -log pi over the chosen responses' tokens of the global batch (TRL's ``sft`` loss term, as
        its RPO; Pang et al. 2024 normalize per sequence instead). Exact across micro-batches and
        dp ranks: each part's sum is divided by the global pair or chosen-token count.

        Returns loss, dpo_loss, nll (per chosen token), rewards_chosen, rewards_rejected,
        reward_accuracy (chosen reward > rejected, TRL's convention: a tie counts as wrong),
        reward_margin, logps_chosen, logps_rejected (means over pairs), grad_norm, lr, skipped.
        """
        rows = pair_rows(batch)
        pairs = float(rows["input_ids"].shape[0] // 2)
        chosen_tokens = float(rows["response_mask"][0::2].sum())
        norm, nll_norm = self.normalizer(pairs), self.normalizer(chosen_tokens)
        sums: dict[str, float] = {}

        def loss_fn(output, mb):  # logits [2b, R, V/tp] at the response positions, or (log_probs, entropy)
            lp = self._label_log_probs(output, mb, 1.0) * mb["response_mask"]
            loss_sum, nll, parts = self._dpo_terms(lp, mb, dpo)
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            total = loss_sum / norm
            if dpo.rpo_alpha > 0:
                total = total + dpo.rpo_alpha * nll / nll_norm
            return total

        inputs = self._response_model_inputs(rows, ("input_ids", "response_mask", "ref_logps"), 1.0)
        stats = self.runner.optimizer_step(inputs, loss_fn, 2 * micro_batch_size, unit=2)
        sums = from_last_pp_stage(sums, self.dims)
        out = self._dpo_metrics(sums, pairs, chosen_tokens, dpo)
        moe = {k: v for k, v in stats.items() if k.startswith("moe_")}
        return {
            **out,
            **self.runner.padding_metrics(),
            "grad_norm": stats["grad_norm"],
            "lr": stats["lr"],
            "skipped": stats.get("skipped", 0.0),
            **moe,
        }

    @torch.no_grad()
    def dpo_eval(self, batch: dict[str, torch.Tensor], dpo: DPOConfig, micro_batch_size: int) -> dict[str, float]:
        """Held-out :meth:`dpo_step` metrics (no update) over this call's global batch of pairs."""
        rows = pair_rows(batch)
        lp = self.log_probs(rows, 2 * micro_batch_size)
        _, _, parts = self._dpo_terms(lp, rows, dpo)
        chosen_tokens = float(rows["response_mask"][0::2].sum())
        return self._dpo_metrics({k: float(v) for k, v in parts.items()}, float(lp.shape[0] // 2), chosen_tokens, dpo)
