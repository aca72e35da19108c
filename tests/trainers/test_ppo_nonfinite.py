"""Non-finite guards: NaN/Inf updates are skipped and counted, N in a row stop the run, NaN weights are never saved."""

from __future__ import annotations

import pytest
import torch

from aligner.actor.policy import Policy
from aligner.cli import UserError, load_config
from aligner.config import OptimConfig, ParallelConfig
from aligner.parallel.dims import ParallelDims
from aligner.protocol import build_sequences
from aligner.trainers.ppo import PhaseTimer, PPOTrainer
from tests.toolkit.models import tiny_model_config

CFG = tiny_model_config(vocab_size=32)


def _policy():
    return Policy(CFG, ParallelConfig(), OptimConfig(lr=1e-2, warmup_steps=0), ParallelDims(), total_steps=10, seed=0)


def _batch(advantage: float):
    seq = build_sequences([[1, 5, 6], [1, 7]], [[8, 9, 2], [4, 2]], pad_id=0)
    mask = seq["response_mask"]
    return {**seq, "old_log_probs": torch.full_like(mask, -3.0) * mask, "advantages": torch.full_like(mask, advantage) * mask}


def test_nonfinite_gradient_skips_the_update_and_a_finite_one_applies(tmp_path):
    from aligner.config import AlgorithmConfig

    pol = _policy()
    before = {k: v.clone() for k, v in pol.runtime.module.state_dict().items()}
    out = pol.ppo_update(_batch(float("inf")), AlgorithmConfig(), micro_batch_size=2)
    assert out["skipped"] == 1.0 and pol.runtime.skipped_steps == 1 and pol.runtime.step_count == 0
    assert all(torch.equal(before[k], v) for k, v in pol.runtime.module.state_dict().items())
    out = pol.ppo_update(_batch(1.0), AlgorithmConfig(), micro_batch_size=2)
    assert out["skipped"] == 0.0 and pol.runtime.step_count == 1
    assert any(not torch.equal(before[k], v) for k, v in pol.runtime.module.state_dict().items())


def test_nan_weights_are_never_checkpointed(tmp_path):
    pol = _policy()
    pol.save(str(tmp_path / "ok"))
    with torch.no_grad():
        pol.runtime.module.model.norm.weight[0] = float("nan")
    with pytest.raises(ValueError, match="NaN/Inf"):
        pol.save(str(tmp_path / "bad"))
    assert not (tmp_path / "bad").exists() and not (tmp_path / "bad.tmp").exists()
    assert (tmp_path / "ok").exists()


def test_n_nonfinite_steps_in_a_row_stop_the_run():
    cfg = load_config("ppo", ["trainer.max_nonfinite=3"])
    trainer = PPOTrainer(cfg, tokenizer=None, train_prompts=[{"prompt_ids": [1]}], eval_prompts=[])
    for _ in range(2):
        out = trainer._skip_step(PhaseTimer(), "reward")
        assert out["skipped_nonfinite"] == 1.0
    with pytest.raises(UserError, match="3 PPO steps in a row had a non-finite reward"):
        trainer._skip_step(PhaseTimer(), "reward")
    assert trainer.nonfinite_total == 3
