"""Our Llama against HF transformers on the same weights, and HF import/export round trips."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    LlamaConfig,
    Qwen2Config,
)
from transformers import (
    LlamaForCausalLM as HFLlama,
)
from transformers import (
    LlamaForSequenceClassification as HFLlamaScore,
)
from transformers import (
    Qwen2ForCausalLM as HFQwen2,
)

from aligner.model.hf import CheckpointError, load_hf_model, load_hf_state_dict, model_config_to_hf, save_hf
from aligner.model.llama import build_model, default_position_ids, last_token_scores
from tests.toolkit.models import tiny_model_config

BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2, max_position_embeddings=128)
CASES = {
    "mha": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2),
    "mqa_tied": dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
    "llama3_rope": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "attention_bias": dict(num_attention_heads=4, num_key_value_heads=2, attention_bias=True),
}


def _hf_dir(tmp_path, hf_model):
    d = tmp_path / "hf"
    hf_model.save_pretrained(d)
    return d


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers_llama(tmp_path, case):
    torch.manual_seed(0)
    hf = HFLlama(LlamaConfig(**BASE, **CASES[case])).eval()
    ours, cfg = load_hf_model(_hf_dir(tmp_path, hf))
    x = torch.randint(0, 96, (3, 40))  # 40 > original_max_position_embeddings: scaled RoPE regime
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, atol=1e-5, rtol=0)
    assert cfg.tie_word_embeddings == CASES[case].get("tie_word_embeddings", False)


def test_qwen2_qkv_bias_matches_transformers(tmp_path):
    torch.manual_seed(1)
    hf = HFQwen2(Qwen2Config(**BASE, num_attention_heads=4, num_key_value_heads=2)).eval()
    ours, cfg = load_hf_model(_hf_dir(tmp_path, hf))
    assert cfg.attention_bias and not cfg.o_proj_bias
    x = torch.randint(0, 96, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, atol=1e-5, rtol=0)


def test_padding_mask_and_positions_match_transformers(tmp_path):
    """Left-padded rows with an explicit mask and positions give HF's logits on the real tokens."""
    torch.manual_seed(2)
    hf = HFLlama(LlamaConfig(**BASE, **CASES["gqa"])).eval()
    ours, _ = load_hf_model(_hf_dir(tmp_path, hf))
    x = torch.randint(0, 96, (2, 12))
    attn = torch.ones(2, 12, dtype=torch.long)
    attn[1, :5] = 0
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    seg = attn.clone()  # padding = segment 0, real tokens = segment 1
    with torch.no_grad():
        ref = hf(x, attention_mask=attn, position_ids=pos).logits
        got = ours(x, position_ids=pos, segment_ids=seg)
    torch.testing.assert_close(got[attn.bool()], ref[attn.bool()], atol=1e-5, rtol=0)


def test_packed_segments_equal_separate_sequences():
    cfg = tiny_model_config(max_seq_len=256)
    m = build_model(cfg, seed=3)
    a, b = torch.randint(0, 64, (1, 5)), torch.randint(0, 64, (1, 7))
    packed = torch.cat([a, b], 1)
    seg = torch.tensor([[1] * 5 + [2] * 7])
    assert default_position_ids(1, 12, "cpu", seg).tolist() == [list(range(5)) + list(range(7))]
    with torch.no_grad():
        out = m(packed, segment_ids=seg)
        torch.testing.assert_close(out[:, :5], m(a), atol=1e-5, rtol=0)
        torch.testing.assert_close(out[:, 5:], m(b), atol=1e-5, rtol=0)


def test_export_import_bit_exact_and_transformers_loads(tmp_path):
    cfg = tiny_model_config(max_seq_len=256)
    m = build_model(cfg, seed=4)
    save_hf(m.state_dict(), cfg, tmp_path / "out", max_shard_bytes=40_000)  # forces a sharded index
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    m2, cfg2 = load_hf_model(tmp_path / "out")
    assert cfg2 == cfg
    for (k, v), (k2, v2) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k
    hf = HFLlama.from_pretrained(tmp_path / "out").eval()
    x = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, m(x), atol=1e-5, rtol=0)


def test_score_model_exports_as_sequence_classification(tmp_path):
    cfg = tiny_model_config(num_kv_heads=4, max_seq_len=256)
    m = build_model(cfg, kind="score", seed=5)
    torch.nn.init.normal_(m.score.weight)
    save_hf(m.state_dict(), cfg, tmp_path / "rm", kind="score")
    assert json.loads((tmp_path / "rm" / "config.json").read_text())["architectures"] == ["LlamaForSequenceClassification"]
    hf = HFLlamaScore.from_pretrained(tmp_path / "rm").eval()
    x = torch.randint(1, 64, (2, 9))  # no pad id (0) inside: HF pools the last token
    with torch.no_grad():
        ours = last_token_scores(m(x), torch.ones_like(x))
        torch.testing.assert_close(hf(x).logits[:, 0], ours, atol=1e-5, rtol=0)


def test_bad_checkpoints_name_the_file(tmp_path):
    cfg = tiny_model_config(num_kv_heads=4, max_seq_len=256)
    save_hf(build_model(cfg, seed=0).state_dict(), cfg, tmp_path / "ok")
    # truncated safetensors
    bad = tmp_path / "trunc"
    bad.mkdir()
    (bad / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
    data = (tmp_path / "ok" / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        load_hf_state_dict(bad)
    # a checkpoint of another size
    other = tmp_path / "other"
    big = tiny_model_config(hidden_size=48, num_kv_heads=4, max_seq_len=256)
    save_hf(build_model(big, seed=0).state_dict(), big, other)
    (other / "config.json").write_text(json.dumps(model_config_to_hf(cfg)))
    with pytest.raises(CheckpointError, match="has shape"):
        load_hf_model(other)
    with pytest.raises(CheckpointError, match="config.json"):
        load_hf_model(tmp_path / "missing")
    # NaN weights are never written
    sd = build_model(cfg, seed=0).state_dict()
    sd["model.norm.weight"][0] = float("nan")
    with pytest.raises(CheckpointError, match="NaN"):
        save_hf(sd, cfg, tmp_path / "nan")
    assert not (tmp_path / "nan").exists()
