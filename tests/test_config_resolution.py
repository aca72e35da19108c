"""What a composed config resolves to before any worker starts (issue 16, items 2-4).

- where the KL goes (reward or loss) and which roles a run starts because of it;
- only the init paths of the roles a run starts are checked;
- one data-order rule for every stage (``data.shuffle_seed``);
- model dimensions come from the init checkpoint's config.json, not the preset, and an
  explicit ``model.*`` override that disagrees with the checkpoint is an error naming both.
"""

from __future__ import annotations

import json

import pytest
import torch

from aligner.cli import load_config
from aligner.config import ConfigError
from aligner.model.hf import save_hf
from aligner.model.llama import build_model
from tests.toolkit.models import tiny_model_config

RULE = ["reward.type=rule", "reward.rule=digit_fraction", "actor.init=", "critic.init=", "reward.init=", "ref.init="]


@pytest.mark.parametrize(
    "overrides,in_reward,roles",
    [
        ([], True, ("actor", "critic", "ref")),  # gae: KL in the per-token reward
        (["algorithm.advantage=rloo", "trainer.n_samples_per_prompt=2"], True, ("actor", "ref")),
        (["algorithm.advantage=reinforce_pp"], True, ("actor", "ref")),
        (
            ["algorithm.advantage=grpo", "trainer.n_samples_per_prompt=2", "algorithm.kl_coef=0", "algorithm.kl_loss_coef=0.04"],
            False,
            ("actor", "ref"),
        ),  # GRPO: KL as a loss term
        (["algorithm.advantage=grpo", "trainer.n_samples_per_prompt=2", "algorithm.kl_coef=0"], False, ("actor",)),
        (["algorithm.advantage=grpo", "trainer.n_samples_per_prompt=2", "algorithm.kl_in_reward=true"], True, ("actor", "ref")),
        (["algorithm.advantage=rloo", "trainer.n_samples_per_prompt=2", "algorithm.kl_coef=0"], True, ("actor",)),
    ],
)
def test_kl_placement_and_the_roles_it_starts(overrides, in_reward, roles):
    cfg = load_config("ppo", RULE + overrides)
    assert cfg.algorithm.resolved_kl_in_reward is in_reward
    assert cfg.roles_used() == roles


def test_trainer_puts_the_kl_in_the_reward_only_where_configured():
    from aligner.trainers.ppo import PPOTrainer

    prompts = [{"prompt_ids": [1, 2], "prompt": "p", "metadata": {}}]
    grpo = load_config(
        "ppo", RULE + ["algorithm.advantage=grpo", "trainer.n_samples_per_prompt=2", "algorithm.kl_coef=0", "algorithm.kl_loss_coef=0.1"]
    )
    rloo = load_config("ppo", RULE + ["algorithm.advantage=rloo", "trainer.n_samples_per_prompt=2", "algorithm.kl_coef=0.3"])
    assert PPOTrainer(grpo, None, prompts, prompts).reward_kl_coef() == 0.0
    assert PPOTrainer(rloo, None, prompts, prompts).reward_kl_coef() == pytest.approx(0.3)


@pytest.mark.parametrize(
    "overrides",
    [
        ["reward.init=/nonexistent/rm"],  # a rule reward reads no reward.init
        ["critic.init=/nonexistent/critic", "algorithm.advantage=rloo", "trainer.n_samples_per_prompt=2"],  # no critic
        ["ref.init=/nonexistent/ref", "algorithm.kl_coef=0"],  # no KL: no reference
    ],
)
def test_paths_of_roles_the_run_does_not_start_are_not_checked(overrides):
    load_config("ppo", RULE + overrides).check_paths()


def test_critic_falls_back_to_reward_init_and_says_so():
    cfg = load_config("ppo", RULE + ["reward.type=model", "reward.init=/nonexistent/rm"])
    with pytest.raises(
        ConfigError, match=r"reward.init \(the critic starts from it: critic.init is empty\)='/nonexistent/rm' does not exist"
    ):
        cfg.check_paths(("critic",))


def test_ppo_data_order_follows_data_shuffle_seed_as_sft_and_rm_do():
    from aligner.trainers.ppo import PPOTrainer

    prompts = [{"prompt_ids": [i], "prompt": str(i), "metadata": {}} for i in range(64)]

    def first_batch(*overrides):
        cfg = load_config("ppo", RULE + list(overrides))
        return [p["prompt"] for p in PPOTrainer(cfg, None, prompts, prompts).next_prompts()]

    base = first_batch()
    assert first_batch("trainer.seed=7") == base  # the model/sampling seed does not reorder the data
    assert first_batch("data.shuffle_seed=7") != base


# ---- the checkpoint's own dimensions -------------------------------------------------------


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """An HF Llama dir whose dimensions differ from the tiny preset's (context 1024, GQA 4/2, 3 layers)."""
    cfg = tiny_model_config(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=3, max_seq_len=1024, rope_theta=100000.0)
    out = tmp_path_factory.mktemp("ckpt") / "hf"
    save_hf({k: v for k, v in build_model(cfg, seed=0).state_dict().items()}, cfg, out)
    return out


def test_lengths_are_checked_against_the_checkpoint_not_the_preset(hf_dir):
    cfg = load_config("ppo", RULE + [f"actor.init={hf_dir}", "data.max_seq_len=512", "data.max_prompt_len=256"])
    assert cfg.model.max_seq_len == 1024
    assert (cfg.model.num_layers, cfg.model.num_kv_heads, cfg.model.hidden_size) == (3, 2, 64)
    assert cfg.model.rope_theta == 100000.0
    with pytest.raises(ConfigError, match="data.max_seq_len=2048.*must not exceed model.max_seq_len=1024"):
        load_config("ppo", RULE + [f"actor.init={hf_dir}", "data.max_seq_len=2048"])


def test_layouts_are_checked_against_the_checkpoints_heads(hf_dir):
    with pytest.raises(ConfigError, match="actor.parallel.tp_size=4.*num_kv_heads=2|actor.parallel.tp_size=3"):
        load_config("ppo", RULE + [f"actor.init={hf_dir}", "actor.parallel.tp_size=3"])


def test_an_explicit_model_override_that_disagrees_names_both_values(hf_dir):
    with pytest.raises(ConfigError) as e:
        load_config("ppo", RULE + [f"actor.init={hf_dir}", "model.max_seq_len=64"])
    msg = str(e.value)
    assert "model.max_seq_len=64" in msg and "1024" in msg and f"actor.init='{hf_dir}'" in msg, msg
    # an explicit override that agrees is fine
    assert load_config("ppo", RULE + [f"actor.init={hf_dir}", "model.max_seq_len=1024"]).model.max_seq_len == 1024


def test_sft_and_rm_read_their_own_roles_checkpoint(hf_dir):
    assert load_config("sft", [f"actor.init={hf_dir}", "data.max_seq_len=512"]).model.max_seq_len == 1024
    assert load_config("rm", [f"reward.init={hf_dir}", "data.max_seq_len=512"]).model.max_seq_len == 1024


def test_another_roles_checkpoint_is_checked_against_its_own_dimensions(hf_dir, tmp_path):
    small = tiny_model_config(vocab_size=512, num_heads=2, max_seq_len=128)
    rm_dir = tmp_path / "rm"
    save_hf(build_model(small, kind="score", seed=0).state_dict(), small, rm_dir, kind="score")
    base = [f"actor.init={hf_dir}", f"reward.init={rm_dir}", "reward.type=model", "data.max_seq_len=256"]
    # the critic starts from the RM (critic.init empty): one check of that checkpoint, naming where it comes from
    with pytest.raises(ConfigError, match=r"data.max_seq_len=256 .*critic model's max_seq_len=128 \(reward.init \(the critic"):
        load_config("ppo", [o for o in RULE if not o.startswith(("reward.", "actor.init"))] + base)
    with pytest.raises(ConfigError, match=r"critic.parallel.tp_size=4 .*must divide model.num_heads=2"):
        load_config(
            "ppo",
            [o for o in RULE if not o.startswith(("reward.", "actor.init"))]
            + [f"actor.init={hf_dir}", f"reward.init={rm_dir}", "reward.type=model", "critic.parallel.tp_size=4"],
        )


def test_an_unsupported_architecture_is_a_config_error_naming_the_field(tmp_path):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64}))
    with pytest.raises(ConfigError, match=r"actor.init='.*gpt2'.*model_type 'gpt2' is not supported"):
        load_config("ppo", RULE + [f"actor.init={d}"])
    assert torch is not None
