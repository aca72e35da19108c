"""Interruptible generation: a weight sync that lands between decode steps.

Engine level, no Ray: a sync staged while a call decodes (aligner.rollout.weight_sync.staging) is applied at
the next step boundary; the requests in flight keep their KV cache and go on with the new weights,
and every token records the weight version that sampled it. Checked against a slow reference that
decodes each prompt alone with its own cache: the first N tokens with weights A, then the swap,
then the rest with weights B over the same cache (AReaL's interruptible generation keeps the cache).
"""

from __future__ import annotations

import threading

import pytest
import torch

from aligner.config import SamplingConfig
from aligner.rollout.torch_engine.engine import TorchEngine
from aligner.rollout.torch_engine.kv_cache import StaticKVCache
from aligner.rollout.weight_sync.staging import WeightStaging
from tests.toolkit.engine import ENGINE_CFG, engine_model

PROMPTS = [[3, 9, 4], [7, 1], [5, 5, 5, 2], [11]]
NEW = 10
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=NEW)
KW = dict(max_batch_size=8, compile="off", cpu_layout="out_in", decode_attention="sdpa")


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    """Every parameter of ENGINE_CFG's model drawn with `seed`, by HF name (tied ones under both names)."""
    return [(n, p.detach().clone()) for n, p in engine_model(seed).named_parameters(remove_duplicate=False)]


@torch.no_grad()
def _reference(prompt: list[int], swap_after: int, weights_b) -> list[int]:
    """Greedy decode of one prompt with its own KV cache: tokens 0 .. swap_after-1 with the seed-1 model,
    then its weights replaced by `weights_b` and the rest decoded over the same cache."""
    model = engine_model(1)
    params = dict(model.named_parameters(remove_duplicate=False))
    attn = model.model.layers["0"].self_attn
    cache = StaticKVCache(sorted(int(k) for k in model.model.layers.keys()), 1, attn.k_proj.weight.shape[0] // attn.head_dim,
                          ENGINE_CFG.max_seq_len, ENGINE_CFG.resolved_head_dim, torch.float32, torch.device("cpu"))  # fmt: skip
    p = len(prompt)
    if p > 1:  # the prompt minus its last token, as the continuous scheduler prefills it
        cache.length = p - 1
        model.model(
            torch.tensor([prompt[:-1]]), position_ids=torch.arange(p - 1)[None], kv_cache=cache, cache_positions=torch.arange(p - 1)
        )
    tok, pos, out = prompt[-1], p - 1, []
    for j in range(NEW):
        if j == swap_after:
            for name, t in weights_b:
                params[name].copy_(t)
        cache.length = pos + 1
        mask = torch.ones(1, 1, 1, pos + 1, dtype=torch.bool)
        h = model.model(torch.tensor([[tok]]), position_ids=torch.tensor([[pos]]), attn_mask=mask, kv_cache=cache,
                        cache_positions=torch.tensor([pos]))  # fmt: skip
        tok = int(model.lm_head(h[:, -1]).argmax(-1))
        out.append(tok)
        pos += 1
    return out


def _swap_at(engine: TorchEngine, boundary: int, weights_b) -> None:
    """Stage `weights_b` as a sync from inside the engine's `boundary`-th step boundary (1 = before the first step)."""
    staging, calls = engine.weight_staging, [0]
    original = staging.step_boundary

    def hooked(eng):
        calls[0] += 1
        if calls[0] == boundary:
            assert engine.offer_weights([weights_b]) is False  # a call decodes: staged, not applied
        return original(eng)

    staging.step_boundary = hooked


@pytest.mark.parametrize("swap_after", [1, 4])
def test_swap_between_decode_steps_equals_reference_with_the_same_cache(swap_after):
    """All four requests decode together (8 slots: no refill), so decode step j samples token j of each;
    the sync staged at boundary swap_after + 1 lands after swap_after tokens. Tokens equal the reference
    token for token, token_versions are [0] * swap_after + [1] * rest, and afterwards the engine holds
    weights B exactly (weight_version 1)."""
    weights_b = _weights(2)
    engine = TorchEngine(engine_model(1), interruptible=True, **KW)
    _swap_at(engine, swap_after + 1, weights_b)
    gens = engine.generate(PROMPTS, GREEDY)
    for prompt, g in zip(PROMPTS, gens):
        assert g.token_ids == _reference(prompt, swap_after, weights_b), prompt
        assert g.token_versions == [0] * swap_after + [1] * (NEW - swap_after)
    assert engine.weight_version == 1 and engine.weight_staging.swaps == 1
    got = dict(engine.model.named_parameters(remove_duplicate=False))
    for name, t in weights_b:
        assert torch.equal(got[name], t), name
    # the swap changed the tokens: a call with weights A throughout differs from the mixed one
    plain = TorchEngine(engine_model(1), **KW).generate(PROMPTS, GREEDY)
    assert [g.token_ids for g in plain] != [g.token_ids for g in gens]
    assert all(g.token_versions is None for g in plain)


def test_sync_while_idle_applies_at_once_and_a_late_one_at_the_call_end():
    """No call decoding: offer_weights applies the sync at once (True). A sync staged after the last step
    boundary is applied when the call ends, so the engine holds the newest weights afterwards; its tokens
    keep the version they were sampled with. Without the switch the engine refuses the static scheduler
    combination and generates exactly as before."""
    engine = TorchEngine(engine_model(1), interruptible=True, **KW)
    assert engine.offer_weights([_weights(2)]) is True and engine.weight_version == 1
    late = _weights(3)
    with engine.weight_staging.decoding(engine):
        assert engine.offer_weights([late]) is False and engine.weight_version == 1
    assert engine.weight_version == 2
    got = dict(engine.model.named_parameters(remove_duplicate=False))
    assert all(torch.equal(got[n], t) for n, t in late)
    gens = engine.generate(PROMPTS, GREEDY)
    assert all(g.token_versions == [2] * NEW for g in gens)
    with pytest.raises(ValueError, match="interruptible=True needs the continuous scheduler"):
        TorchEngine(engine_model(1), interruptible=True, **{**KW, "scheduler": "static"})


def test_sync_from_another_thread_lands_mid_call():
    """The worker's shape: one thread generates, another offers a sync while it runs. The sync lands at a
    step boundary (versions never go down along a response, and the call ends on version 1)."""
    engine = TorchEngine(engine_model(1), interruptible=True, **KW)
    weights_b, started, box = _weights(2), threading.Event(), {}
    original = engine.weight_staging.step_boundary

    def slow_boundary(eng):
        started.set()
        return original(eng)

    engine.weight_staging.step_boundary = slow_boundary
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=40)
    gen = threading.Thread(target=lambda: box.setdefault("gens", engine.generate([[3, 9, 4]] * 2, sampling)))
    gen.start()
    started.wait(30)
    engine.offer_weights([weights_b])
    gen.join(60)
    assert engine.weight_version == 1
    for g in box["gens"]:
        assert len(g.token_versions) == len(g.token_ids)
        assert g.token_versions == sorted(g.token_versions)


def test_weight_staging_applies_staged_syncs_in_order():
    """Two syncs staged in one step apply in order, each with its own finish (the version counts both)."""

    class Sink:
        weight_version = 0

        def __init__(self):
            self.got = []

        def update_weights(self, bucket):
            self.got += [n for n, _ in bucket]

        def finish_weight_update(self):
            self.weight_version += 1

    staging, sink = WeightStaging(), Sink()
    with staging.decoding(sink):
        assert staging.offer(sink, [[("a", torch.zeros(1))]]) is False
        assert staging.offer(sink, [[("b", torch.zeros(1))], [("c", torch.zeros(1))]]) is False
        assert staging.step_boundary(sink) is True and staging.step_boundary(sink) is False
    assert sink.got == ["a", "b", "c"] and sink.weight_version == 2 and staging.swaps == 2
