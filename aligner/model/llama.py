"""Llama-family decoder (Llama 2/3, Qwen2-style QKV bias) built from aligner.nn building blocks.

Owns: RoPE (with Llama 3 frequency scaling), grouped-query attention, SwiGLU MLP (or the sparse
MoE block of :mod:`aligner.model.moe` when ``num_experts`` > 0, Mixtral's layout),
the decoder trunk, the causal LM (policy) and the scalar-head model (critic and
reward model, exported as HF ``LlamaForSequenceClassification``).

No rank, recomputation or pipeline logic lives here (docs/design.md, "Model code reads no rank"): all of it is applied from
outside by :func:`aligner.parallel.parallelize.parallelize`. Tensor/sequence parallelism comes
from the building-block layers once they are sharded; attention reshapes with -1 heads so a
sharded layer needs no branch. A pipeline stage is the same class with layers removed and
``embed_tokens`` / ``norm`` / head set to None; selective recomputation wraps
:meth:`Attention.core`, full recomputation each :class:`DecoderLayer`. Parameter names equal
HF's (``model.layers.0.self_attn.q_proj.weight`` ...), so HF import/export is a rename-free copy.

The rollout engine runs these same modules with a cache implementing :class:`KVCache` (one
forward for training, prefill and decode).
"""

from __future__ import annotations

import math
from typing import Optional, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from aligner.config import ModelConfig
from aligner.model.moe import SparseMoE
from aligner.nn.chunked import LogProbSpec
from aligner.nn.layers import (
    ColumnParallelLinear,
    LMHead,
    RMSNorm,
    RowParallelLinear,
    ScalarHead,
    VocabParallelEmbedding,
    column_parallel_linears,
    swiglu,
)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim/2] (Su et al. 2021), with Llama 3 scaling if configured.

    Llama 3 scaling (Meta's llama3 reference / HF ``_compute_llama3_parameters``): wavelengths
    longer than original_max/low_freq_factor are divided by `factor`, shorter than
    original_max/high_freq_factor are kept, and those between are interpolated smoothly.
    """
    hd = cfg.resolved_head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [B, T, head_dim] for position_ids: [B, T] (fp32 math, cast to `dtype`)."""
    freqs = position_ids.float().unsqueeze(-1) * inv_freq.to(position_ids.device).float()
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, hd]; cos/sin: [B, T, hd]. HF's rotate-half convention."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class KVCache(Protocol):
    """What attention asks of a key/value cache during generation (the interface; the rollout
    engine's caches implement it, :mod:`aligner.rollout.torch_engine.kv_cache`).

    ``update(layer, k, v, positions)``: attention passes its rotated k, v [B, kvh_local, Tq, hd]
    and the forward's ``cache_positions`` (the cache decides what they mean); the cache stores
    them and returns the keys and values to attend to, [B, kvh_local, Tk, hd] each.
    A cache class may also define ``attend(layer, q, k, v, cos, sin) -> Tensor | None``: attention
    calls it first, with the un-rotated projections q [B, Tq, h, hd], k, v [B, Tq, kvh, hd] and the
    RoPE tables cos, sin [B, Tq, hd]. When it returns a [B, Tq, h, hd] tensor it has rotated q and
    k, cached k and v and attended itself, and attention skips RoPE, :meth:`update` and SDPA;
    None means the usual path (the rollout engine's slot cache runs its fused decode attention
    kernel this way).
    """

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class Attention(nn.Module):
    """Grouped-query self-attention; q/k/v column-parallel, o row-parallel."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        hd = cfg.resolved_head_dim
        self.head_dim = hd
        self.layer_idx = layer_idx
        self.q_proj = ColumnParallelLinear(cfg.hidden_size, cfg.num_heads * hd, bias=cfg.attention_bias)
        self.k_proj = ColumnParallelLinear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=cfg.attention_bias)
        self.v_proj = ColumnParallelLinear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(cfg.num_heads * hd, cfg.hidden_size, bias=cfg.o_proj_bias)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """softmax(q k^T / sqrt(hd)) v with GQA: q [B, h, Tq, hd], k/v [B, kvh, Tk, hd], mask [B, 1, Tq, Tk]
        bool (True = attend) or None. None means plain causal attention when Tq == Tk (SDPA's causal
        kernels, flash attention on GPU, with no [B, 1, T, T] mask built or saved), and attention to
        every key for a one-token query (decode with a KV cache whose every slot is a real token)."""
        b, h, tq, hd = q.shape
        kvh = k.shape[1]
        rep = h // kvh
        if tq == 1:
            if rep > 1:
                # one-token decode: each kv head's query group becomes the query axis ([B, kvh, rep, hd]),
                # so the cached k/v are read once instead of copied rep times (q head j uses kv head j // rep)
                out = F.scaled_dot_product_attention(q.reshape(b, kvh, rep, hd), k, v, attn_mask=mask)
                return out.reshape(b, h, 1, hd)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def forward(self, x, cos, sin, mask, kv_cache: Optional[KVCache] = None, cache_positions=None, residual=None):
        """x: [B, T(/tp with SP), H] -> [B, T(/tp), H] (plus `residual`, same shape, when given)."""
        q, k, v = column_parallel_linears(x, (self.q_proj, self.k_proj, self.v_proj))
        b, t = q.shape[0], q.shape[1]
        q, k, v = (y.view(b, t, -1, self.head_dim) for y in (q, k, v))
        attend = getattr(kv_cache, "attend", None)
        out = attend(self.layer_idx, q, k, v, cos, sin) if attend is not None else None
        if out is not None:  # the cache rotated, stored and attended (KVCache.attend)
            return self.o_proj(out.reshape(b, t, -1), residual)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v, cache_positions)
        out = self.core(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1), residual)


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x: [B, T(/tp), H] -> [B, T(/tp), H] (plus `residual` when given)."""
        gate, up = column_parallel_linears(x, (self.gate_proj, self.up_proj))
        return self.down_proj(swiglu(gate, up), residual)


class DecoderLayer(nn.Module):
    """Pre-norm decoder block: h + attn(norm(h)), then h + mlp(norm(h))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg) if cfg.num_experts else MLP(cfg)

    def forward(self, h, cos, sin, mask, kv_cache=None, cache_positions=None, token_mask=None):
        """token_mask: [B, T] bool (True = a real token) for an MoE block's auxiliary losses and
        statistics (:class:`SparseMoE`); positional, so activation checkpointing passes it on."""
        h = self.self_attn(self.input_layernorm(h), cos, sin, mask, kv_cache, cache_positions, residual=h)
        if token_mask is not None and isinstance(self.mlp, SparseMoE):
            return self.mlp(self.post_attention_layernorm(h), residual=h, token_mask=token_mask)
        return self.mlp(self.post_attention_layernorm(h), residual=h)


def build_attention_mask(batch: int, t: int, device, segment_ids: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Boolean mask [B, 1, T, T]: causal and block-diagonal over `segment_ids` [B, T]; None without them.

    segment_ids: packed-sequence document ids (0 for padding); tokens attend only to earlier
    tokens of the same segment. Padding attends to padding, so no row is empty.
    None means plain causal attention (``is_causal``): right padding needs no mask, since no
    real token attends to a later position.
    """
    if segment_ids is None:
        return None
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    same = segment_ids.unsqueeze(-1) == segment_ids.unsqueeze(-2)
    return (same & causal).unsqueeze(1)


def shared_prompt_mask(segments: torch.Tensor) -> torch.Tensor:
    """Boolean mask [B, 1, T, T] (True = attend) of shared-prompt packed rows
    (:mod:`aligner.actor.shared_prompt`). segments: [B, T] int64, 0 for the prompt, k >= 1 for
    sample k's response, -1 for padding. Causal, and a query sees keys of the prompt or of its
    own segment; padding sees every earlier position (so no row is empty)."""
    t = segments.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=segments.device).tril()
    qs, ks = segments.unsqueeze(-1), segments.unsqueeze(-2)
    return (causal & ((ks == 0) | (qs == ks) | (qs == -1))).unsqueeze(1)


class LlamaModel(nn.Module):
    """Decoder trunk: embeddings, decoder layers and final norm (any may be absent on a PP stage).

    Forward: input_ids [B, T] int64 (first pipeline stage) or hidden_states [B, T(/tp), H] (later ones)
    -> hidden_states [B, T(/tp), H] (normed on the last pipeline stage).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens: Optional[VocabParallelEmbedding] = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i) for i in range(cfg.num_layers)})
        self.norm: Optional[RMSNorm] = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.prompt: Optional[nn.Module] = None  # virtual tokens (aligner.model.prompt.attach_prompt), first pipeline stage only

    def forward(
        self,
        x: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        segment_ids: Optional[torch.Tensor] = None,
        attn_mask: Optional[torch.Tensor] = None,
        kv_cache: Optional[KVCache] = None,
        cache_positions: Optional[torch.Tensor] = None,
        prompt_segments: Optional[torch.Tensor] = None,
        token_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """x: input_ids [B, T] or hidden [B, T(/tp), H]; position_ids [B, T] (default 0..T-1, or
        restarting per segment when segment_ids is given); attn_mask [B, 1, T, Tk] bool overrides
        the causal/segment mask (the engine passes its own with a KV cache); prompt_segments
        [B, T] builds the shared-prompt mask of :func:`shared_prompt_mask` (per micro-batch, so
        no [B, 1, T, T] tensor exists for the whole batch); without any of them,
        attention is plain causal with no mask tensor. A later pipeline stage under sequence
        parallelism gets hidden states holding T / tp positions and needs `position_ids`.
        With a virtual prompt (``self.prompt``, n tokens) the output is [B, n+T, H]: the virtual
        tokens first, at positions 0..n-1, the real ones shifted by n (aligner.model.prompt).
        token_mask [B, T] bool (True = real token; None = all): the tokens an MoE model's router
        losses and statistics count (padding excluded, as HF Mixtral's attention_mask does);
        the virtual tokens count as real."""
        if self.embed_tokens is not None:
            b, t = x.shape
            h = self.embed_tokens(x)
            if self.prompt is not None:
                h, position_ids, t = self._prepend_prompt(h, position_ids, segment_ids, attn_mask, kv_cache, prompt_segments)
                if token_mask is not None:
                    n = t - token_mask.shape[1]
                    token_mask = torch.cat([token_mask.new_ones(b, n), token_mask], dim=1)
        else:
            h = x
            b = h.shape[0]
            t = position_ids.shape[1] if position_ids is not None else h.shape[1]
        device = h.device
        if position_ids is None:
            position_ids = default_position_ids(b, t, device, segment_ids)
        if attn_mask is None and prompt_segments is not None:
            attn_mask = shared_prompt_mask(prompt_segments)
        if attn_mask is None:
            attn_mask = build_attention_mask(b, t, device, segment_ids)
        cos, sin = rope_cos_sin(self.inv_freq, position_ids, h.dtype)
        for layer in self.layers.values():
            h = layer(h, cos, sin, attn_mask, kv_cache, cache_positions, token_mask)
        return self.norm(h) if self.norm is not None else h

    def _prepend_prompt(
        self, h, position_ids, segment_ids, attn_mask, kv_cache, prompt_segments=None
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(h [B, n+T, H], position_ids [B, n+T], n+T) with the virtual tokens in front (plain causal rows only)."""
        from aligner.model.prompt import prepend_virtual_tokens

        if (
            segment_ids is not None
            or attn_mask is not None
            or prompt_segments is not None
            or kv_cache is not None
            or getattr(self.embed_tokens, "sequence_parallel", False)
        ):
            raise ValueError("a virtual prompt needs plain causal rows: no segment_ids, attn_mask, KV cache or sequence parallelism")
        b, t = h.shape[0], h.shape[1]
        if position_ids is None:
            position_ids = default_position_ids(b, t, h.device)
        h, position_ids = prepend_virtual_tokens(self.prompt, h, position_ids)
        return h, position_ids, h.shape[1]


def default_position_ids(batch: int, t: int, device, segment_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[B, T] positions 0..T-1, restarting at each new segment of `segment_ids` [B, T]."""
    pos = torch.arange(t, device=device).expand(batch, t)
    if segment_ids is None:
        return pos
    start = torch.ones_like(segment_ids, dtype=torch.bool)
    start[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    start_idx = torch.where(start, pos, torch.zeros_like(pos)).cummax(dim=1).values
    return pos - start_idx


class LlamaForCausalLM(nn.Module):
    """The policy: trunk + vocab-parallel lm_head.

    Forward -> logits [B, T, V/tp] (fp32 math is left to the loss) on the last pipeline stage, else
    hidden states. ``lm_head`` is tied to ``model.embed_tokens`` when tie_word_embeddings.
    ``head_index`` [B, R] int64 (positions in 0..T-1) restricts the head to those positions:
    logits [B, R, V/tp], row i holding the logits at positions head_index[i]. RL losses need
    only the response positions, so the head's matmul and every vocabulary-sized tensor after it
    shrink by R / T (with sequence parallelism the head runs on all positions, then selects).

    With ``logprob`` (a :class:`aligner.nn.chunked.LogProbSpec`) and ``labels`` [B, R] int64 (R = T
    without head_index) the last pipeline stage returns (log_probs [B, R] fp32, entropy [B, R] fp32 nats) of
    the labels under softmax(logits / temperature) instead of logits, computed chunk by chunk from
    the head's input (:class:`aligner.nn.layers.LMHead`): no [B, R, V/tp] logits exist.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        self.lm_head: Optional[LMHead] = LMHead(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        x: torch.Tensor,
        head_index: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        logprob: Optional[LogProbSpec] = None,
        **kw,
    ):
        h = self.model(x, **kw)
        if self.model.prompt is not None:  # drop the virtual positions: outputs cover the real tokens only
            h = h[:, self.model.prompt.num_virtual_tokens :]
        if self.lm_head is None:
            return h
        if logprob is not None:
            return self.lm_head(h, labels=labels, logprob=logprob, head_index=head_index)
        if head_index is None:
            return self.lm_head(h)
        if self.lm_head.sequence_parallel:  # h holds T/tp positions: select after the head's gather
            return select_positions(self.lm_head(h), head_index)
        return self.lm_head(select_positions(h, head_index))


def select_positions(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x: [B, T, D], index: [B, R] int64 in [0, T) -> [B, R, D] with out[b, r] = x[b, index[b, r]]."""
    return x.gather(1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


class LlamaForScore(nn.Module):
    """Critic / reward model: trunk + scalar head ``score`` (HF LlamaForSequenceClassification, 1 label).

    Forward -> per-token scalars [B, T] fp32 on the last pipeline stage (values for the critic; the reward
    model reads the last real token with :func:`last_token_scores`), else hidden states.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        self.score: Optional[ScalarHead] = ScalarHead(cfg.hidden_size)

    def forward(self, x: torch.Tensor, **kw) -> torch.Tensor:
        h = self.model(x, **kw)
        return self.score(h) if self.score is not None else h


def last_token_scores(per_token: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """per_token: [B, T]; attention_mask: [B, T] (1 = real token, right padded) -> [B] at the last real token."""
    last = attention_mask.long().sum(-1) - 1
    if (last < 0).any():
        raise ValueError("last_token_scores: a row has no real tokens (attention_mask all zero)")
    return per_token.gather(1, last.unsqueeze(1)).squeeze(1)


def init_weights(model: nn.Module, std: float, generator: Optional[torch.Generator] = None) -> None:
    """Random init in place: normal(0, std) for matrices, ones for norms, zeros for biases and heads.

    generator: a CPU torch.Generator (or None). Values are drawn on the CPU in fp32 and copied to
    the parameter's device and dtype, so the same seed gives the same weights on CPU and GPU.
    """
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias") or name.startswith("score."):
                p.zero_()
            elif p.device.type == "cpu" and p.dtype == torch.float32:
                p.normal_(0.0, std, generator=generator)
            else:
                p.copy_(torch.empty(p.shape).normal_(0.0, std, generator=generator))


def build_model(cfg: ModelConfig, kind: str = "lm", seed: Optional[int] = None, device="cpu") -> nn.Module:
    """Build a full (unsharded) model. kind: lm (policy) | score (critic/reward). Seeded init if `seed`."""
    cls = {"lm": LlamaForCausalLM, "score": LlamaForScore}.get(kind)
    if cls is None:
        raise ValueError(f"kind={kind!r}: valid choices are lm, score")
    with torch.device(device):
        model = cls(cfg)
    if device != "meta":
        g = torch.Generator().manual_seed(seed if seed is not None else 0)
        init_weights(model, cfg.init_std, g)
    return model
