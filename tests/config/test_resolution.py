"""What a composed config resolves to before any worker starts.

- where the KL goes (reward or loss) and which roles a run starts because of it; the KL fields nobody
  set follow the advantage estimator, and a preset's reward-KL values do not block another estimator;
- only the init paths of the roles a run starts are checked;
- one data-order rule for every stage (``data.shuffle_seed``);
- model dimensions come from the init checkpoint's config.json, not the preset, and an
  explicit ``model.*`` override that disagrees with the checkpoint is an error naming both.
"""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from aligner import algorithms as alg
from aligner.cli import load_config
from aligner.config import (
    LOSS_KL_COEF,
    PRESETS,
    REWARD_KL_COEF,
    AlgorithmConfig,
    ConfigError,
    follow_the_estimator,
    hydra_schema,
)
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
        (["algorithm.advantage=grpo", "trainer.n_samples_per_prompt=2"], False, ("actor", "ref")),  # the loss KL by default
        (["algorithm.advantage=grpo", "trainer.n_samples_per_prompt=2", "algorithm.kl_loss_coef=0"], False, ("actor",)),
        (["algorithm.advantage=grpo", "trainer.n_samples_per_prompt=2", "algorithm.kl_in_reward=true"], True, ("actor", "ref")),
        (["algorithm.advantage=rloo", "trainer.n_samples_per_prompt=2", "algorithm.kl_coef=0"], True, ("actor",)),
    ],
)
def test_kl_placement_and_the_roles_it_starts(overrides, in_reward, roles):
    cfg = load_config("ppo", RULE + overrides)
    assert cfg.algorithm.resolved_kl_in_reward is in_reward
    assert cfg.roles_used() == roles


# ---- KL defaults follow the advantage estimator ------------------------------------------------
PRESETS_GROUP = {
    "tiny": 1,
    "tiny_tools": 4,
    "tiny_agent": 4,
    "smollm2_135m": 8,
    "smollm2_ifeval": 8,
    "llama2_7b": 1,
    "llama2_13b": 1,
    "llama2_70b": 1,
}  # n_samples_per_prompt


@pytest.mark.parametrize("preset", PRESETS)
def test_grpo_on_every_preset_composes_with_the_kl_in_the_loss(preset):
    """`conf=PRESET algorithm.advantage=grpo` (and a group of samples): a preset's reward-KL settings,
    tuned for its own estimator, do not block it; the KL becomes grpo's loss term."""
    group = [] if PRESETS_GROUP[preset] >= 2 else ["trainer.n_samples_per_prompt=2"]
    a = load_config("ppo", [f"conf={preset}", "algorithm.advantage=grpo", *group]).algorithm
    assert (a.kl_in_reward, a.kl_coef, a.kl_loss_coef, a.kl_controller) == (False, 0.0, LOSS_KL_COEF, "fixed")
    assert a.uses_reference and not a.reward_kl_coef_used


def test_presets_list_their_group_sizes():
    assert set(PRESETS_GROUP) == set(PRESETS)
    for preset, n in PRESETS_GROUP.items():
        assert load_config("ppo", [f"conf={preset}"]).trainer.n_samples_per_prompt == n


@pytest.mark.parametrize("advantage", sorted(alg.ADVANTAGE_ESTIMATORS))
def test_the_kl_fields_nobody_set_follow_the_estimator(advantage):
    """grpo: the KL in the loss (0.04, DeepSeekMath), none in the reward; every other estimator: in the reward
    (0.05), no loss term. The same in a config built in code and one composed with no preset KL value."""
    want = (False, 0.0, LOSS_KL_COEF) if advantage == "grpo" else (True, REWARD_KL_COEF, 0.0)
    a = AlgorithmConfig(advantage=advantage)
    assert (a.kl_in_reward, a.kl_coef, a.kl_loss_coef) == want
    composed = load_config("ppo", ["conf=smollm2_135m", f"algorithm.advantage={advantage}", "actor.init=", "ref.init="]).algorithm
    assert (composed.kl_in_reward, composed.kl_coef, composed.kl_loss_coef) == want


def test_values_set_are_honoured():
    # a preset's kl_coef where the KL stays in the reward (tiny's 0.2 with rloo as with gae)
    assert load_config("ppo", RULE + ["algorithm.advantage=rloo", "trainer.n_samples_per_prompt=2"]).algorithm.kl_coef == 0.2
    # command-line values: the KL in the reward for grpo; a loss term besides the reward KL for gae
    a = load_config("ppo", RULE + ["algorithm.advantage=grpo", "trainer.n_samples_per_prompt=2", "algorithm.kl_in_reward=true"]).algorithm
    assert (a.kl_in_reward, a.kl_coef, a.kl_loss_coef) == (True, 0.2, 0.0)
    a = load_config("ppo", RULE + ["algorithm.kl_loss_coef=0.1"]).algorithm
    assert (a.kl_in_reward, a.kl_coef, a.kl_loss_coef) == (True, 0.2, 0.1)
    a = AlgorithmConfig(advantage="grpo", kl_loss_coef=0.0)
    assert (a.kl_coef, a.kl_loss_coef, a.uses_reference) == (0.0, 0.0, False)


def test_kl_in_reward_false_on_the_command_line_moves_a_presets_kl_to_the_loss():
    a = load_config("ppo", RULE + ["algorithm.kl_in_reward=false"]).algorithm
    assert (a.kl_in_reward, a.kl_coef, a.kl_loss_coef) == (False, 0.0, LOSS_KL_COEF)


def test_a_preset_controller_follows_but_a_command_line_one_is_refused():
    """follow_the_estimator resets a preset's adaptive controller when the KL leaves the reward; given on the
    command line it stays, and resolve_kl refuses it (nothing would apply it)."""
    node = OmegaConf.create({"advantage": "grpo", "kl_in_reward": None, "kl_coef": 0.2, "kl_controller": "adaptive"})
    follow_the_estimator(node, explicit=set())
    assert (node.kl_coef, node.kl_controller) == (None, "fixed")
    node = OmegaConf.create({"advantage": "grpo", "kl_in_reward": None, "kl_coef": 0.0, "kl_controller": "adaptive"})
    follow_the_estimator(node, explicit={"algorithm.kl_controller", "algorithm.kl_coef"})
    assert (node.kl_coef, node.kl_controller) == (0.0, "adaptive")
    with pytest.raises(ConfigError, match="algorithm.kl_controller='adaptive' is invalid: the KL is not in the reward"):
        AlgorithmConfig(advantage="grpo", kl_coef=0.0, kl_controller="adaptive")
    node = OmegaConf.create({"advantage": "gae", "kl_in_reward": None, "kl_coef": 0.2, "kl_controller": "adaptive"})
    follow_the_estimator(node, explicit=set())  # the KL stays in the reward: the preset's values apply
    assert (node.kl_coef, node.kl_controller) == (0.2, "adaptive")


def test_the_schema_leaves_the_kl_fields_to_the_estimator_and_cfg_prints_them_resolved(capsys):
    from aligner.cli import run

    schema = hydra_schema()
    assert all(schema.algorithm[name] is None for name in ("kl_in_reward", "kl_coef", "kl_loss_coef"))
    assert run("ppo", lambda cfg: 1, ["algorithm.advantage=grpo", "trainer.n_samples_per_prompt=2", "--cfg"]) == 0
    printed = capsys.readouterr().out
    assert "  kl_in_reward: false\n" in printed and "  kl_coef: 0.0\n" in printed and "  kl_loss_coef: 0.04\n" in printed, printed


@pytest.mark.parametrize("preset", PRESETS)
def test_no_preset_sets_a_reward_kl_its_own_estimator_does_not_apply(preset):
    """follow_the_estimator resets such a value silently, so a preset file must not hold one."""
    from aligner.cli import compose

    a = compose("ppo", [f"conf={preset}"]).algorithm
    in_reward = a.advantage != "grpo" if a.kl_in_reward is None else a.kl_in_reward
    assert in_reward or (not a.kl_coef and a.kl_controller == "fixed"), (preset, a)


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
