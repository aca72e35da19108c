"""The agent endpoint's tests' small engine: a Llama that is a bigram model writing a calculator call.

:func:`bigram_model`'s attention and MLP outputs are zero, so its logits depend on the last token
only: after the chat template's generation prompt (a newline) it writes the Hermes call
``<tool_call>{"name": "calculator", "arguments": {"expression": "12+39"}}</tool_call>`` and eos, with
:func:`agent_tokenizer` (the built-in task's tokenizer, its default role-tag template, and the call's
two ends as tokens)."""

from __future__ import annotations

import torch

from aligner.model.llama import build_model
from tests.toolkit.models import tiny_model_config

CALL_HEAD = '<tool_call>{"name": "calculator", "arguments": {"expression": "'
CALL_TAIL = '"}}</tool_call>'
VOCAB = 96
MAX_SEQ_LEN = 1024  # the tool instructions in the system message are ~700 task tokens


def agent_tokenizer(out_dir: str):
    """The built-in task's tokenizer with CALL_HEAD and CALL_TAIL added as (non-special) tokens."""
    from aligner.config import TaskConfig
    from aligner.data.task import build_task_tokenizer
    from aligner.data.tokenizer import load_tokenizer

    tok = load_tokenizer(build_task_tokenizer(TaskConfig(), out_dir))
    tok.add_tokens([CALL_HEAD, CALL_TAIL])
    return tok


def bigram_model(tok, margin: float = 8.0):
    """A 2-layer Llama (vocab = hidden = 96) whose next-token logits are `margin` on succ(last token), 0
    elsewhere: newline -> CALL_HEAD -> 1 2 + 3 9 -> CALL_TAIL -> eos."""
    assert len(tok) <= VOCAB
    model = build_model(
        tiny_model_config(vocab_size=VOCAB, hidden_size=VOCAB, intermediate_size=64, num_heads=4, num_kv_heads=2, max_seq_len=MAX_SEQ_LEN),
        seed=0,
    )
    ids = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    chain = ids("\n") + ids(CALL_HEAD) + ids("12+39") + ids(CALL_TAIL) + [tok.eos_token_id]
    assert len(chain) == len(set(chain)) == 9
    with torch.no_grad():
        for layer in model.model.layers.values():
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(VOCAB))
        head = torch.zeros(VOCAB, VOCAB)
        scale = margin / VOCAB**0.5  # the final RMSNorm turns a one-hot into sqrt(VOCAB) times it
        for a, b in zip(chain, chain[1:]):
            head[b, a] = scale
        model.lm_head.weight.copy_(head)
    return model.eval()


def bigram_engine(tok, margin: float = 8.0):
    """A TorchEngine (continuous scheduler, 8 slots) over :func:`bigram_model` with `margin`."""
    from aligner.rollout.torch_engine.engine import TorchEngine

    return TorchEngine(
        bigram_model(tok, margin), eos_token_id=tok.eos_token_id, max_batch_size=8, cpu_layout="out_in", decode_attention="sdpa"
    )


class SpyEngine:
    """An engine with every generate call's prompts, Generations and seeds kept in ``calls``."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompt_ids, sampling, seeds=None, max_new_tokens=None):
        gens = self.engine.generate(prompt_ids, sampling, seeds=seeds, max_new_tokens=max_new_tokens)
        self.calls.append(([list(p) for p in prompt_ids], gens, list(seeds or [])))
        return gens

    def __getattr__(self, name):
        return getattr(self.engine, name)
