"""Prompt learning (aligner.model.prompt) against PEFT and on the Policy: frozen base, prompt-only
optimizer and checkpoints, export / reload, greedy decoding with the virtual tokens.

PEFT (peft 0.21) is the peer: with the same base weights (an HF LlamaForCausalLM) and the same
virtual-token / prompt-encoder weights, our logits on the real tokens must equal
``get_peft_model(PromptTuningConfig | PromptEncoderConfig)``'s (which prepends the virtual tokens
with positions 0..n-1, ones in the attention mask and -100 labels) within 1e-5 fp32, and our
response NLL its loss.
"""

from __future__ import annotations

import json

import pytest
import torch

from aligner.config import OptimConfig, ParallelConfig, PromptLearningConfig
from aligner.model.prompt import (
    PROMPT_JSON,
    VirtualPrompt,
    attach_prompt,
    build_prompt,
    greedy_generate,
    load_prompt,
    prompt_state_dict,
    save_prompt,
    text_init_ids,
)
from tests.toolkit.models import tiny_model_config

N_VIRT = 5
HF_BASE = dict(
    vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2, max_position_embeddings=128, num_attention_heads=4
)
PEER_CASES = {"prompt_tuning": ("prompt_tuning", "mlp"), "p_tuning_mlp": ("p_tuning", "mlp"), "p_tuning_lstm": ("p_tuning", "lstm")}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers", reason="the peer model is HF LlamaForCausalLM")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_BASE, num_key_value_heads=2)).eval()
    d = tmp_path_factory.mktemp("base") / "hf"
    hf.save_pretrained(d)
    return d


def _ours(hf_dir, typ: str, enc: str, seed: int = 3):
    from aligner.model.hf import load_hf_model

    model, _ = load_hf_model(hf_dir)
    pl = PromptLearningConfig(type=typ, num_virtual_tokens=N_VIRT, encoder=enc, encoder_hidden_size=24)
    return attach_prompt(model, build_prompt(pl, model.model.embed_tokens.weight, seed)).eval()


@pytest.mark.parametrize("case", sorted(PEER_CASES))
def test_logits_and_loss_equal_peft(hf_dir, case):
    peft = pytest.importorskip("peft", reason="PEFT prompt tuning / p-tuning is the peer")
    from transformers import LlamaForCausalLM

    typ, enc = PEER_CASES[case]
    ours = _ours(hf_dir, typ, enc)
    if typ == "prompt_tuning":
        pc = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=N_VIRT)
    else:
        pc = peft.PromptEncoderConfig(
            task_type="CAUSAL_LM", num_virtual_tokens=N_VIRT, encoder_hidden_size=24, encoder_reparameterization_type=enc.upper()
        )
    peer = peft.get_peft_model(LlamaForCausalLM.from_pretrained(hf_dir), pc).eval()
    # the same encoder weights: our parameter names and shapes are PEFT's (load_state_dict is strict)
    peer.prompt_encoder["default"].load_state_dict(ours.model.prompt.state_dict())
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 96, (3, 12), generator=g)
    lens = torch.tensor([12, 9, 7])
    real = torch.arange(12) < lens[:, None]  # right padding
    labels = torch.where(real, x, -100)
    # the first token is a prompt token in SFT (never in loss_mask); unmasked, PEFT would also score it
    # from the last virtual position, a prediction our response-only loss never makes
    labels[:, 0] = -100
    with torch.no_grad():
        got = ours(x)
        out = peer(input_ids=x, attention_mask=real.long(), labels=labels)
    want = out.logits[:, N_VIRT:]
    assert got.shape == want.shape == (3, 12, 96)
    for b in range(3):  # real tokens only (HF masks padding keys, plain causal rows do not: pads are never read)
        torch.testing.assert_close(got[b, : lens[b]], want[b, : lens[b]], atol=1e-5, rtol=0)
    # the loss: PEFT's mean NLL over the real next tokens (its -100 virtual labels excluded) equals ours
    lp = torch.log_softmax(got[:, :-1].float(), -1).gather(-1, x[:, 1:, None]).squeeze(-1)
    mask = real[:, 1:].float()
    assert float(-(lp * mask).sum() / mask.sum()) == pytest.approx(float(out.loss), abs=1e-5)
    # the virtual tokens matter: without them the logits differ
    ours.model.prompt = None
    with torch.no_grad():
        assert float((ours(x)[0] - got[0]).abs().max()) > 1e-3


def test_p_tuning_encoder_equals_peft_prompt_encoder():
    peft = pytest.importorskip("peft", reason="PEFT's PromptEncoder is the peer of the p-tuning encoder")
    for enc in ("mlp", "lstm"):
        ours = VirtualPrompt("p_tuning", 6, 32, enc, 20)
        cfg = peft.PromptEncoderConfig(
            task_type="CAUSAL_LM",
            num_virtual_tokens=6,
            token_dim=32,
            num_transformer_submodules=1,
            encoder_hidden_size=20,
            encoder_reparameterization_type=enc.upper(),
        )
        peer = peft.tuners.p_tuning.PromptEncoder(cfg)
        peer.load_state_dict(ours.state_dict())  # strict: same names and shapes
        with torch.no_grad():
            torch.testing.assert_close(ours(), peer(torch.arange(6)[None])[0], atol=1e-6, rtol=0)


def test_init_random_and_text():
    emb = torch.randn(50, 16) * 0.3
    assert text_init_ids([4, 5, 6], 7) == [4, 5, 6, 4, 5, 6, 4]  # repeated, then truncated (PEFT TEXT init)
    assert text_init_ids([1, 2, 3, 4, 5], 3) == [1, 2, 3]
    with pytest.raises(ValueError, match="no tokens"):
        text_init_ids([], 3)
    text = build_prompt(PromptLearningConfig(type="prompt_tuning", num_virtual_tokens=4, init="text", init_text="x"), emb, 0, [7, 9])
    torch.testing.assert_close(text.embedding.weight.data, emb[[7, 9, 7, 9]], atol=0, rtol=0)
    pl = PromptLearningConfig(type="p_tuning", num_virtual_tokens=64, encoder="lstm")
    a, b, c = build_prompt(pl, emb, 0), build_prompt(pl, emb, 0), build_prompt(pl, emb, 1)
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(va, vb), f"{k}: the same seed must give every rank the same prompt"
    assert not torch.equal(a.embedding.weight, c.embedding.weight)
    assert float(a.embedding.weight.detach().std()) == pytest.approx(float(emb.std()), rel=0.15)  # the token embeddings' scale


def test_config_validation():
    from aligner.config import AlignerConfig, ConfigError

    def cfg(**pl):
        from aligner.config import ActorRoleConfig

        return AlignerConfig(stage="sft", actor=ActorRoleConfig(prompt_learning=PromptLearningConfig(**pl)))

    cfg(type="prompt_tuning")  # valid
    for pl, field in [
        (dict(type="prefix"), "actor.prompt_learning.type='prefix'"),
        (dict(type="prompt_tuning", init="text"), "actor.prompt_learning.init_text=''"),
        (dict(type="p_tuning", encoder="gru"), "actor.prompt_learning.encoder='gru'"),
        (dict(type="prompt_tuning", num_virtual_tokens=0), "actor.prompt_learning.num_virtual_tokens=0"),
        (dict(type="prompt_tuning", num_virtual_tokens=200), "actor.prompt_learning.num_virtual_tokens=200"),
    ]:
        with pytest.raises(ConfigError, match=field.replace("[", r"\[")) as e:
            cfg(**pl)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="SFT stage only"):
        from aligner.config import ActorRoleConfig

        AlignerConfig(stage="ppo", actor=ActorRoleConfig(prompt_learning=PromptLearningConfig(type="prompt_tuning")))


# ---- the Policy: frozen base, prompt-only optimizer and checkpoint, export / reload ------------
MODEL = tiny_model_config(max_seq_len=48)


def _policy(typ="prompt_tuning", enc="mlp", par=None, dims=None):
    from aligner.actor.policy import Policy
    from aligner.parallel.dims import ParallelDims

    optim = OptimConfig(lr=5e-2, warmup_steps=0, schedule="constant")
    pl = PromptLearningConfig(type=typ, num_virtual_tokens=N_VIRT, encoder=enc, encoder_hidden_size=16)
    return Policy(
        MODEL, par or ParallelConfig(), optim, dims or ParallelDims(device_type="cpu"), total_steps=10, seed=7, prompt_learning=pl
    )


def _sft_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 64, (4, 10), generator=g)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, 5:] = 1
    loss_mask[2, 8:] = 0  # a shorter row
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}


@pytest.mark.parametrize("typ,enc", [("prompt_tuning", "mlp"), ("p_tuning", "lstm")])
def test_policy_trains_only_the_prompt_and_reloads(tmp_path, typ, enc):
    pol = _policy(typ, enc)
    module = pol.runtime.module
    opt_params = {id(p) for g in pol.runtime.optimizer.param_groups for p in g["params"]}
    prompt_params = {id(p) for p in module.model.prompt.parameters()}
    assert opt_params == prompt_params, "only the prompt's parameters are in the optimizer"
    assert all(p.requires_grad == (n.startswith("model.prompt.")) for n, p in module.named_parameters())
    base0 = {k: v.detach().clone() for k, v in module.state_dict().items() if not k.startswith("model.prompt.")}
    prompt0 = {k: v.detach().clone() for k, v in module.model.prompt.state_dict().items()}
    losses = [pol.sft_step(_sft_batch(), 2)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0] - 1e-3, losses
    for k, v in module.state_dict().items():
        if not k.startswith("model.prompt."):
            assert torch.equal(v, base0[k]), f"{k}: the frozen base must stay bitwise unchanged"
    assert all(not torch.equal(v, prompt0[k]) for k, v in module.model.prompt.state_dict().items())

    # checkpoint: the prompt (and its Adam state) only; a fresh policy loads it to the same logits
    pol.save(str(tmp_path / "ckpt"))
    x = _sft_batch(1)["input_ids"]
    with torch.no_grad():
        want = module(x)
    fresh = _policy(typ, enc)
    with torch.no_grad():
        assert float((fresh.runtime.module(x) - want).abs().max()) > 1e-4
    fresh.load(str(tmp_path / "ckpt"))
    with torch.no_grad():
        torch.testing.assert_close(fresh.runtime.module(x), want, atol=0, rtol=0)
    import torch.distributed.checkpoint as dcp

    saved = set(dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata)
    assert {k for k in saved if k.startswith("model.")} == {f"model.{k}" for k, _ in module.named_parameters() if "prompt" in k}
    assert fresh.runtime.step_count == 4 and fresh.sft_step(_sft_batch(), 2)["loss"] == pytest.approx(pol.sft_step(_sft_batch(), 2)["loss"])

    # export: prompt.safetensors + prompt.json; reloaded onto the base, the same logits
    tensors = prompt_state_dict(module)
    out = save_prompt(tensors, module.model.prompt.spec(), str(tmp_path / "prompt"), base_model="(seeded)")
    assert json.loads((tmp_path / "prompt" / PROMPT_JSON).read_text())["type"] == typ
    prompt, meta = load_prompt(out)
    assert meta["num_virtual_tokens"] == N_VIRT
    from aligner.model.llama import build_model

    base = build_model(MODEL, "lm", seed=7)
    attach_prompt(base, prompt)
    with torch.no_grad():
        torch.testing.assert_close(base(x), module(x), atol=0, rtol=0)
        torch.testing.assert_close(tensors["prompt_embeddings"], module.model.prompt(), atol=0, rtol=0)


def test_greedy_generate_equals_stepwise_argmax():
    pol = _policy()
    prompts = [[5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15], [3]]
    res = pol.greedy(prompts, 6, stop_ids=[])
    model = pol.runtime.module
    for p, (ids, lps, reason) in zip(prompts, res):
        seq = list(p)
        for tok, lp in zip(ids, lps):  # one row at a time: the batched-by-length decode equals it
            with torch.no_grad():
                logits = model(torch.tensor([seq]))[0, -1]
            assert tok == int(logits.argmax())
            assert lp == pytest.approx(float(torch.log_softmax(logits, -1).max()), abs=1e-5)
            seq.append(tok)
        assert len(ids) == 6 and reason == "length"
    first = res[0][0][0]
    stopped = greedy_generate(pol.full_logits, prompts[:1], 6, stop_ids=[first])[0]
    assert stopped[0] == [first] and stopped[2] == "stop"


def test_text_init_equals_peft_prompt_tuning_init_text(tmp_path):
    peft = pytest.importorskip("peft", reason="PEFT's PromptTuningInit.TEXT is the peer of init=text")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    words = ["<unk>", "add", "the", "two", "numbers", "carefully"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(tmp_path / "tok")
    emb = torch.nn.Embedding(len(words), 16)
    for n, text in ((7, "add the numbers"), (2, "add the two numbers carefully")):  # repeated, and truncated
        ids = AutoTokenizer.from_pretrained(tmp_path / "tok")(text)["input_ids"]  # as the SFT stage passes them
        pl = PromptLearningConfig(type="prompt_tuning", num_virtual_tokens=n, init="text", init_text=text)
        ours = build_prompt(pl, emb.weight, 0, ids)
        cfg = peft.PromptTuningConfig(
            task_type="CAUSAL_LM",
            num_virtual_tokens=n,
            token_dim=16,
            num_transformer_submodules=1,
            prompt_tuning_init="TEXT",
            prompt_tuning_init_text=text,
            tokenizer_name_or_path=str(tmp_path / "tok"),
        )
        peer = peft.tuners.prompt_tuning.PromptEmbedding(cfg, emb)
        torch.testing.assert_close(ours.embedding.weight.detach(), peer.embedding.weight.detach(), atol=0, rtol=0)
