"""Prompt learning: trained virtual tokens prepended to every sequence of a frozen causal LM.

Owns the virtual-token module (:class:`VirtualPrompt`), its initialization (random or from a
text's token embeddings), attaching it to a :class:`aligner.model.llama.LlamaForCausalLM`
(:func:`attach_prompt`; the trunk prepends its output after the token embedding, see
``LlamaModel.forward``), freezing the base, and the stand-alone export / reload
(``prompt.safetensors`` + ``prompt.json``).

Two methods, as PEFT implements them (peft 0.21 ``tuners/prompt_tuning``, ``tuners/p_tuning``):

- prompt tuning (Lester et al. 2021, "The Power of Scale for Parameter-Efficient Prompt Tuning"):
  the parameters are the [n_virtual, H] embeddings themselves (``embedding.weight``).
- p-tuning (Liu et al. 2021, "GPT Understands, Too"): a prompt encoder reparameterizes them:
  ``embedding`` [n_virtual, H] -> ``mlp_head`` (MLP: Linear(H, h) ReLU Linear(h, h) ReLU Linear(h, H))
  or ``lstm_head`` (2-layer bidirectional LSTM of hidden h, no dropout) -> ``mlp_head``
  (Linear(2h, 2h) ReLU Linear(2h, H)). Parameter names and shapes equal PEFT's ``PromptEncoder``
  (encoder_num_layers=2, encoder_dropout=0, its defaults), so its state dict loads into PEFT's.

Positions follow PEFT's ``PeftModelForCausalLM.forward`` (non-prefix prompt learning): the
virtual tokens take positions 0..n-1 and the real tokens n..n+T-1; every real token attends to
all virtual tokens (causal over the concatenation); the virtual positions are dropped before the
LM head, so logits, labels and loss masks keep the real tokens' [B, T] layout and the virtual
positions are never in a loss (PEFT's -100 labels).

Simplifications: SFT only; one virtual prompt per row (no packing, no KV-cache generation: the
SFT stage's greedy evaluation runs the model's forward, :func:`greedy_generate`); pp_size = 1 and
no sequence parallelism (config validation refuses the rest).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn as nn

from aligner.config import PromptLearningConfig

PROMPT_WEIGHTS = "prompt.safetensors"
PROMPT_JSON = "prompt.json"
PROMPT_PREFIX = "model.prompt."  # parameter-name prefix of the virtual prompt inside a LlamaForCausalLM


class VirtualPrompt(nn.Module):
    """The virtual-token embeddings [n_virtual, H] (prompt tuning) or their prompt encoder (p-tuning).

    Args:
        type: "prompt_tuning" | "p_tuning". num_virtual_tokens: n (>= 1). hidden_size: H, the base
        model's width. encoder: p_tuning's "mlp" | "lstm". encoder_hidden_size: its width h.
    Forward: () -> [n, H] in the parameters' dtype (fp32 by default).
    Raises ValueError for an unknown type or encoder.
    """

    def __init__(self, type: str, num_virtual_tokens: int, hidden_size: int, encoder: str = "mlp", encoder_hidden_size: int = 128):
        super().__init__()
        if type not in ("prompt_tuning", "p_tuning"):
            raise ValueError(f"type={type!r}: valid choices are prompt_tuning, p_tuning")
        if type == "p_tuning" and encoder not in ("mlp", "lstm"):
            raise ValueError(f"encoder={encoder!r}: valid choices are mlp, lstm")
        self.type, self.num_virtual_tokens, self.encoder = type, num_virtual_tokens, encoder
        self.hidden_size, self.encoder_hidden_size = hidden_size, encoder_hidden_size
        h, hs = hidden_size, encoder_hidden_size
        self.embedding = nn.Embedding(num_virtual_tokens, h)
        if type == "p_tuning" and encoder == "mlp":
            self.mlp_head = nn.Sequential(nn.Linear(h, hs), nn.ReLU(), nn.Linear(hs, hs), nn.ReLU(), nn.Linear(hs, h))
        elif type == "p_tuning":
            self.lstm_head = nn.LSTM(h, hs, num_layers=2, bidirectional=True, batch_first=True)
            self.mlp_head = nn.Sequential(nn.Linear(2 * hs, 2 * hs), nn.ReLU(), nn.Linear(2 * hs, h))

    def forward(self) -> torch.Tensor:
        x = self.embedding.weight
        if self.type == "prompt_tuning":
            return x
        if self.encoder == "lstm":
            x = self.lstm_head(x.unsqueeze(0))[0].squeeze(0)
        return self.mlp_head(x)

    def spec(self) -> dict:
        """The constructor arguments (what prompt.json records)."""
        return {
            "type": self.type,
            "num_virtual_tokens": self.num_virtual_tokens,
            "hidden_size": self.hidden_size,
            "encoder": self.encoder,
            "encoder_hidden_size": self.encoder_hidden_size,
        }


def text_init_ids(token_ids: Sequence[int], n: int) -> list[int]:
    """`token_ids` repeated, then truncated, to exactly `n` ids (PEFT PromptTuningInit.TEXT, NeMo's
    new_prompt_init_text). Raises ValueError for an empty list."""
    ids = list(token_ids)
    if not ids:
        raise ValueError("init_text tokenizes to no tokens: give a text with at least one token")
    return (ids * (-(-n // len(ids))))[:n]


def build_prompt(
    cfg: PromptLearningConfig,
    token_embedding: torch.Tensor,
    seed: int,
    init_ids: Optional[Sequence[int]] = None,
) -> VirtualPrompt:
    """A VirtualPrompt for `cfg`, initialized the same on every rank from `seed`.

    token_embedding: the base model's full embedding matrix [V, H] (fp32 read). init=random draws the
    virtual embeddings from normal(0, std of token_embedding), so they start at the real tokens'
    scale; init=text copies token_embedding rows of `init_ids` (:func:`text_init_ids` of init_text's
    tokens). The p-tuning encoder's layers keep torch's default init, drawn from `seed` too.
    Raises ValueError when init=text and `init_ids` is empty or None.
    """
    emb = token_embedding.detach().float()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        prompt = VirtualPrompt(cfg.type, cfg.num_virtual_tokens, emb.shape[1], cfg.encoder, cfg.encoder_hidden_size)
        with torch.no_grad():
            if cfg.init == "text":
                ids = torch.tensor(text_init_ids(init_ids or [], cfg.num_virtual_tokens), dtype=torch.long)
                prompt.embedding.weight.copy_(emb[ids.to(emb.device)])
            else:
                g = torch.Generator().manual_seed(seed)
                prompt.embedding.weight.copy_(torch.empty(prompt.embedding.weight.shape).normal_(0.0, float(emb.std()), generator=g))
    return prompt.to(device=token_embedding.device, dtype=token_embedding.dtype)


def attach_prompt(model: nn.Module, prompt: VirtualPrompt) -> nn.Module:
    """Put `prompt` into `model` (a full LlamaForCausalLM) as ``model.model.prompt`` and freeze every
    other parameter (requires_grad False). Returns `model`."""
    model.model.prompt = prompt
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(PROMPT_PREFIX))
    return model


def prepend_virtual_tokens(prompt: VirtualPrompt, h: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h: [B, T, H] token embeddings, position_ids: [B, T] -> ([B, n+T, H], [B, n+T]).

    The virtual tokens take positions 0..n-1 and the real ones move up by n (PEFT prompt learning)."""
    b, n = h.shape[0], prompt.num_virtual_tokens
    virt = prompt().to(h.dtype).unsqueeze(0).expand(b, -1, -1)
    pre = torch.arange(n, device=position_ids.device, dtype=position_ids.dtype).expand(b, n)
    return torch.cat([virt, h], dim=1), torch.cat([pre, position_ids + n], dim=1)


def prompt_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The virtual prompt's full tensors (PEFT names: ``embedding.weight``, ``mlp_head.0.weight``...)
    plus ``prompt_embeddings`` [n, H], the encoder's output. Collective over dp under FSDP2 (every
    rank calls it); fp32 CPU tensors."""
    prompt = module.model.prompt
    out = {}
    for name, p in prompt.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().float().cpu().clone()
    ref = VirtualPrompt(**prompt.spec())
    ref.load_state_dict({k: v for k, v in out.items()})
    with torch.no_grad():
        out["prompt_embeddings"] = ref().float().contiguous()
    return out


def save_prompt(tensors: dict[str, torch.Tensor], spec: dict, out_dir: str, base_model: str, extra: Optional[dict] = None) -> str:
    """Write out_dir/prompt.safetensors (`tensors`) and out_dir/prompt.json ({"format", **spec,
    "base_model": the HF dir the prompt was trained on, **extra}). Returns out_dir."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out_dir, PROMPT_WEIGHTS))
    meta = {"format": "aligner-prompt-v1", **spec, "base_model": base_model, **(extra or {})}
    Path(out_dir, PROMPT_JSON).write_text(json.dumps(meta, indent=2))
    return out_dir


def load_prompt(prompt_dir: str) -> tuple[VirtualPrompt, dict]:
    """(VirtualPrompt with the saved weights, prompt.json) from a :func:`save_prompt` dir.

    Raises ValueError when the dir lacks prompt.json / prompt.safetensors or they do not match."""
    from safetensors.torch import load_file

    meta_path, w_path = Path(prompt_dir, PROMPT_JSON), Path(prompt_dir, PROMPT_WEIGHTS)
    if not meta_path.is_file() or not w_path.is_file():
        raise ValueError(f"{prompt_dir!r} is not a prompt export: it needs {PROMPT_JSON} and {PROMPT_WEIGHTS}")
    meta = json.loads(meta_path.read_text())
    keys = ("type", "num_virtual_tokens", "hidden_size", "encoder", "encoder_hidden_size")
    prompt = VirtualPrompt(**{k: meta[k] for k in keys})
    tensors = load_file(str(w_path))
    tensors.pop("prompt_embeddings", None)
    prompt.load_state_dict(tensors)
    return prompt, meta


@torch.no_grad()
def greedy_generate(
    forward, prompts: list[list[int]], max_new_tokens: int, stop_ids: Sequence[int]
) -> list[tuple[list[int], list[float], str]]:
    """Greedy decoding by full forwards (no KV cache), prompts of equal length batched together.

    forward: input_ids [b, t] int64 -> logits [b, t, V] (the model with its virtual prompt).
    prompts: token-id lists. stop_ids: tokens that end a response (kept as its last token).
    Returns, per prompt in order, (response ids, their log-probs under softmax(logits) in nats,
    "stop" | "length").
    """
    out: list[Optional[tuple[list[int], list[float], str]]] = [None] * len(prompts)
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    stop = set(int(s) for s in stop_ids)
    for idx in by_len.values():
        ids = torch.tensor([prompts[i] for i in idx], dtype=torch.long)
        done = torch.zeros(len(idx), dtype=torch.bool)
        resp: list[list[int]] = [[] for _ in idx]
        lps: list[list[float]] = [[] for _ in idx]
        for _ in range(max_new_tokens):
            lp, nxt = torch.log_softmax(forward(ids)[:, -1].float(), dim=-1).max(-1)
            nxt = nxt.cpu()
            for r, (tok, val) in enumerate(zip(nxt.tolist(), lp.tolist())):
                if not done[r]:
                    resp[r].append(tok)
                    lps[r].append(val)
                    done[r] = tok in stop
            if bool(done.all()):
                break
            ids = torch.cat([ids, nxt.unsqueeze(1).to(ids.device)], dim=1)
        for r, i in enumerate(idx):
            out[i] = (resp[r], lps[r], "stop" if done[r] else "length")
    return out
