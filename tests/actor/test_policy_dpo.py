"""DPO: aligner.algorithms.dpo_loss against the papers' formulas, and Policy.dpo_step against TRL's DPOTrainer.

The peer check builds one policy and one (different) reference as HF dirs, runs
:meth:`Policy.dpo_step` on three preference pairs of different prompt and response lengths in
micro-batches of one pair (the reference's log-probs from
:meth:`Policy.pair_sequence_log_probs`), and TRL 1.16's ``DPOTrainer.compute_loss`` on the same
pairs (its own collator) with HF ``LlamaForCausalLM`` s of the same weights. The loss, the mean
chosen / rejected rewards, reward accuracy and margin, and every parameter's gradient must agree
within 1e-5 (fp32). TRL 1.16 has no standalone loss function and its ``sigmoid`` loss ignores
``label_smoothing``; conservative DPO is TRL's ``2 (1 - eps) sigmoid - (1 - 2 eps) robust``
combination (the same per-pair loss, see :func:`aligner.algorithms.dpo_loss`) and RPO its
``sigmoid + alpha sft``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from aligner import algorithms as alg
from aligner.actor.policy import Policy, pair_rows
from aligner.config import DPOConfig, OptimConfig, ParallelConfig
from aligner.data.collate import collate_pairs
from aligner.model.hf import save_hf
from aligner.model.llama import build_model
from aligner.parallel.dims import ParallelDims
from tests.toolkit.models import tiny_model_config

CFG = tiny_model_config(init_std=0.2)
OPTIM = OptimConfig(lr=1e-3, warmup_steps=0, schedule="constant", grad_clip=0.0)


# ---- the formulas ---------------------------------------------------------------------------------
def _logps():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(5, generator=g) * 3 for _ in range(4)]


def test_sigmoid_dpo_is_rafailov_eq7_and_rewards_are_beta_log_ratios():
    pc, pr, rc, rr = _logps()
    beta = 0.3
    losses, cr, rj = alg.dpo_loss(pc, pr, rc, rr, beta)
    for i in range(5):
        z = beta * ((pc[i] - rc[i]) - (pr[i] - rr[i]))
        assert float(losses[i]) == pytest.approx(math.log1p(math.exp(-float(z))), rel=1e-5)  # -log sigmoid(z)
    torch.testing.assert_close(cr, beta * (pc - rc))
    torch.testing.assert_close(rj, beta * (pr - rr))
    # equal policy and reference: every loss is log 2, every reward 0
    same, _, zero = alg.dpo_loss(pc, pr, pc, pr, beta)
    torch.testing.assert_close(same, torch.full((5,), math.log(2.0)))
    assert not zero.any()


def test_label_smoothing_is_conservative_dpo_and_ipo_is_azar_eq17_length_normalized():
    pc, pr, rc, rr = _logps()
    beta, eps = 0.5, 0.2
    z = beta * ((pc - rc) - (pr - rr))
    cdpo, _, _ = alg.dpo_loss(pc, pr, rc, rr, beta, label_smoothing=eps)
    torch.testing.assert_close(cdpo, -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z))
    lc, lr = torch.tensor([1.0, 2, 3, 4, 5]), torch.tensor([5.0, 4, 3, 2, 0])  # a 0 length counts as 1 (TRL's clamp)
    ipo, _, _ = alg.dpo_loss(pc, pr, rc, rr, beta, "ipo", chosen_lens=lc, rejected_lens=lr)
    torch.testing.assert_close(ipo, ((pc - rc) / lc - (pr - rr) / lr.clamp(min=1) - 1 / (2 * beta)) ** 2)
    # IPO's minimum: the length-normalized margin equals 1 / (2 beta)
    at_min, _, _ = alg.dpo_loss(torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([0.0]), 0.5, "ipo",
                                chosen_lens=torch.tensor([1.0]), rejected_lens=torch.tensor([1.0]))  # fmt: skip
    assert float(at_min) == 0.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"loss_type": "hinge"}, "unknown DPO loss type 'hinge': valid choices are ipo, sigmoid"),
        ({"beta": 0.0}, r"beta=0.0 is invalid: must be > 0"),
        ({"label_smoothing": 0.5}, r"label_smoothing=0.5 is invalid: must be in \[0, 0.5\)"),
        ({"loss_type": "ipo", "label_smoothing": 0.1}, "applies to loss_type=sigmoid only"),
        ({"loss_type": "ipo"}, "give chosen_lens and rejected_lens"),
    ],
)
def test_dpo_loss_rejects_bad_arguments(kwargs, match):
    pc, pr, rc, rr = _logps()
    args = {"beta": 0.1, **kwargs}
    with pytest.raises(ValueError, match=match):
        alg.dpo_loss(pc, pr, rc, rr, **args)


def test_pair_rows_interleaves_pairs_with_their_response_masks():
    ex = [
        {"chosen_ids": [1, 5, 6, 7], "rejected_ids": [1, 5, 8], "prompt_len": 2},
        {"chosen_ids": [1, 9, 9, 4], "rejected_ids": [1, 9, 9, 3, 3], "prompt_len": 3},
    ]
    rows = pair_rows(collate_pairs(ex, pad_id=0))
    assert rows["input_ids"].tolist() == [[1, 5, 6, 7, 0], [1, 5, 8, 0, 0], [1, 9, 9, 4, 0], [1, 9, 9, 3, 3]]
    assert rows["prompt_lens"].tolist() == [2, 2, 3, 3]
    assert rows["response_mask"].tolist() == [[1, 1], [1, 0], [1, 0], [1, 1]]
    # an empty prompt: the first token is not scored (it has no position before it)
    empty = pair_rows(collate_pairs([{"chosen_ids": [7, 8, 9], "rejected_ids": [6], "prompt_len": 0}], pad_id=0))
    assert empty["prompt_lens"].tolist() == [1, 1] and empty["response_mask"].tolist() == [[1, 1], [0, 0]]


# ---- against TRL ------------------------------------------------------------------------------------
PAIRS = [  # (prompt, chosen, rejected) token ids; different lengths on every side
    ([1, 10, 11, 12], [20, 21, 2], [22, 2]),
    ([1, 13], [23, 2], [24, 25, 26, 2]),
    ([1, 14, 15], [27, 28, 29, 30, 2], [31, 2]),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """HF dirs of a policy (seed 0) and a reference (seed 1) of CFG."""
    out = tmp_path_factory.mktemp("dpo_trl")
    paths = {}
    for name, seed in (("policy", 0), ("ref", 1)):
        paths[name] = save_hf(build_model(CFG, kind="lm", seed=seed).state_dict(), CFG, str(out / name), kind="lm")
    paths["out"] = str(out)
    return paths


def _ours(paths, dpo: DPOConfig) -> tuple[dict, dict]:
    dims = ParallelDims(device_type="cpu")
    pol = Policy(CFG, ParallelConfig(), OPTIM, dims, init=paths["policy"], seed=0)
    ref = Policy(CFG, ParallelConfig(), OptimConfig(), dims, init=paths["ref"], seed=0)
    ex = [{"chosen_ids": p + c, "rejected_ids": p + r, "prompt_len": len(p)} for p, c, r in PAIRS]
    batch = collate_pairs(ex, pad_id=0)
    batch.update(ref.pair_sequence_log_probs(batch, micro_batch_size=2))
    stats = pol.dpo_step(batch, dpo, micro_batch_size=1)  # three micro-batches of one pair
    grads = {n: p.grad.clone() for n, p in pol.runtime.module.named_parameters()}
    return stats, grads


def _word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{f"w{i}": i for i in range(3, CFG.vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def _trl(paths, loss_types: list[str], weights: list[float], beta: float, eps: float) -> tuple[float, dict, dict]:
    trl = pytest.importorskip("trl", reason="TRL is the peer the DPO loss is checked against (pip install 'aligner[test]')")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    policy = AutoModelForCausalLM.from_pretrained(paths["policy"], dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(paths["ref"], dtype=torch.float32)
    args = trl.DPOConfig(
        output_dir=paths["out"] + "/trl",
        beta=beta,
        loss_type=loss_types,
        loss_weights=weights,
        label_smoothing=eps,
        use_cpu=True,
        report_to=[],
        bf16=False,
        max_length=None,
        per_device_train_batch_size=len(PAIRS),
    )
    ds = Dataset.from_dict({"prompt": ["w4 w5"], "chosen": [" w6"], "rejected": [" w7"]})  # required; never read here
    trainer = trl.DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=ds, processing_class=_word_tokenizer())
    inputs = DataCollatorForPreference(pad_token_id=0)([{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r} for p, c, r in PAIRS])
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return float(loss.detach()), metrics, {n: p.grad for n, p in trainer.model.named_parameters()}


CASES = {  # name: (DPOConfig, TRL loss types, TRL loss weights)
    "sigmoid": (DPOConfig(beta=0.5), ["sigmoid"], [1.0]),
    "ipo": (DPOConfig(beta=0.5, loss_type="ipo"), ["ipo"], [1.0]),
    "cdpo": (DPOConfig(beta=0.5, label_smoothing=0.2), ["sigmoid", "robust"], [2 * (1 - 0.2), -(1 - 2 * 0.2)]),
    "rpo": (DPOConfig(beta=0.5, rpo_alpha=0.7), ["sigmoid", "sft"], [1.0, 0.7]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_dpo_step_equals_trl_dpo_trainer(checkpoints, case):
    dpo, loss_types, weights = CASES[case]
    theirs_loss, theirs, theirs_grads = _trl(checkpoints, loss_types, weights, dpo.beta, dpo.label_smoothing)
    ours, ours_grads = _ours(checkpoints, dpo)
    assert ours["loss"] == pytest.approx(theirs_loss, abs=1e-5)
    for our_key, their_key in (
        ("rewards_chosen", "rewards/chosen"),
        ("rewards_rejected", "rewards/rejected"),
        ("reward_accuracy", "rewards/accuracies"),
        ("reward_margin", "rewards/margins"),
        ("logps_chosen", "logps/chosen"),
        ("logps_rejected", "logps/rejected"),
    ):
        assert ours[our_key] == pytest.approx(theirs[their_key], abs=1e-5), our_key
    assert abs(ours["rewards_chosen"]) > 1e-3 and abs(ours["reward_margin"]) > 1e-3  # the reference differs from the policy
    assert set(ours_grads) == set(theirs_grads)
    for name, g in ours_grads.items():
        torch.testing.assert_close(g, theirs_grads[name], atol=1e-5, rtol=1e-5, msg=name)
