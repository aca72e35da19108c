"""An MoE policy through the stages on Ray (CPU): SFT with expert parallelism, then PPO from it.

- SFT on the built-in task with a Mixtral-style model (4 experts, top-2), dp=2 x ep=2 (DDP), once for
  the module: the router statistics are logged, the HF export is a ``MixtralForCausalLM`` whose
  logits transformers reproduces (1e-5);
- the RM and DPO stages from it with ep=2 as well;
- PPO from that checkpoint (the model's MoE dimensions adopted from its config.json), the actor at
  dp=2 x ep=2: refit of the expert-parallel weights into the engine, whose rollout log-probs equal
  the trainer's recomputed ones (the mismatch metric), the engine's and the trainer's top-k experts
  agree (moe_routing_mismatch), and the MoE metrics in the step's row.
"""

from __future__ import annotations

import json

import pytest
import torch

from aligner.cli import load_config
from aligner.tracking import read_metrics
from aligner.trainers.ppo import PPOTrainer
from aligner.trainers.sft import SFTTrainer
from tests.toolkit.overrides import FAST

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MOE = [
    "model.num_experts=4",
    "model.num_experts_per_tok=2",
    "actor.parallel.dp_size=2",
    "actor.parallel.ep_size=2",
    "actor.parallel.dp_backend=ddp",
]


@pytest.fixture(scope="module")
def moe_sft(ray_cluster, tmp_path_factory):
    """One MoE SFT run (dp=2 x ep=2, 6 steps) that both tests start from: its run dir."""
    root = tmp_path_factory.mktemp("moe")
    sft = root / "sft"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        cfg = load_config("sft", FAST + MOE + ["trainer.max_steps=6", "trainer.eval_every=6", f"output_dir={sft}", "task.num_sft=400"])
        assert SFTTrainer(cfg).run() == 0
    return sft


def test_moe_sft_then_ppo_with_expert_parallelism(moe_sft, tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from aligner.model.hf import load_hf_model

    monkeypatch.chdir(tmp_path)
    sft = moe_sft
    last = read_metrics(sft / "metrics.jsonl")[-1]
    assert 0.9 < last["moe_aux_loss"] < 4.0 and last["moe_max_load"] >= 1.0 and last["moe_dropped"] == 0.0

    ours, mcfg = load_hf_model(sft / "hf")
    assert mcfg.num_experts == 4
    hf = transformers.AutoModelForCausalLM.from_pretrained(sft / "hf")
    assert type(hf).__name__ == "MixtralForCausalLM"
    x = torch.randint(0, mcfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert float((hf.eval()(x).logits - ours.eval()(x)).abs().max()) < 1e-5

    ppo = tmp_path / "ppo"
    over = (
        FAST
        + MOE[2:]
        + [f"actor.init={sft}", "reward.type=rule", "trainer.max_steps=2", "trainer.micro_batch_size=16", f"output_dir={ppo}"]
    )
    assert PPOTrainer(load_config("ppo", over)).run() == 0
    rows = [r for r in read_metrics(ppo / "metrics.jsonl") if "log_probs_abs_diff_max" in r]
    assert len(rows) == 2
    for r in rows:
        assert r["log_probs_abs_diff_max"] < 1e-4  # engine (ep=1, all experts) vs trainer (ep=2)
        print(f"moe_routing_mismatch {r['moe_routing_mismatch']:.6f}, log_probs_abs_diff_max {r['log_probs_abs_diff_max']:.2e}")
        assert r["moe_routing_mismatch"] < 1e-3  # top-k expert sets, (response token, layer) pairs
        assert r["refit_bytes"] > 0 and "actor/moe_aux_loss" in r and "critic/moe_aux_loss" in r


def test_moe_reward_model_and_dpo_with_expert_parallelism(moe_sft, tmp_path, monkeypatch):
    """The RM (an MoE score model, exported as MixtralForSequenceClassification) and DPO (an MoE policy
    against its frozen MoE reference), each at dp=2 x ep=2 from the few-step MoE SFT run."""
    from aligner.trainers.dpo import DPOTrainer
    from aligner.trainers.rm import RMTrainer

    monkeypatch.chdir(tmp_path)
    sft = moe_sft
    ep = ["parallel.dp_size=2", "parallel.ep_size=2", "parallel.dp_backend=ddp"]
    common = FAST + ["trainer.max_steps=3", "trainer.eval_every=3", "trainer.micro_batch_size=8", "task.num_pairs=200"]
    rm = tmp_path / "rm"
    assert RMTrainer(load_config("rm", common + [f"reward.{o}" for o in ep] + [f"reward.init={sft}", f"output_dir={rm}"])).run() == 0
    last = read_metrics(rm / "metrics.jsonl")[-1]
    assert "moe_aux_loss" in last and 0.0 <= last["eval_accuracy"] <= 1.0
    assert json.loads((rm / "hf" / "config.json").read_text())["architectures"] == ["MixtralForSequenceClassification"]
    dpo = tmp_path / "dpo"
    assert DPOTrainer(load_config("dpo", common + [f"actor.{o}" for o in ep] + [f"actor.init={sft}", f"output_dir={dpo}"])).run() == 0
    rows = read_metrics(dpo / "metrics.jsonl")
    assert rows[0]["dpo_loss"] == pytest.approx(0.6931472, abs=1e-5)  # the policy starts as its reference
    assert "moe_aux_loss" in rows[-1] and "task_accuracy" in rows[-1]
