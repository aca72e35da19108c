"""KTO (Ethayarajh et al. 2024): the loss and its KL reference point equal to TRL's KTOTrainer (its own
``_compute_loss`` and ``_compute_kl_logps``, run on a stand-in trainer whose model returns fixed per-token
log-probs) and to the paper's formula, in value and gradient; the KTO step on micro-batches equal to the
whole-batch loss; the batch's mismatched pairs as TRL builds them; data without labels refused."""

from __future__ import annotations

import json
import types
from collections import defaultdict

import pytest
import torch

from aligner import algorithms as alg
from aligner.errors import UserError

TOL = dict(atol=1e-6, rtol=1e-6)


def _inputs(seed: int, b: int = 8, t: int = 9):
    g = torch.Generator().manual_seed(seed)
    tok = -torch.rand(b, t - 1, generator=g, dtype=torch.float64) * 2  # per-token log-probs, [B, T-1]
    ref = tok.sum(-1) + torch.randn(b, generator=g, dtype=torch.float64) * 2
    kl_tok = -torch.rand(b, t - 1, generator=g, dtype=torch.float64) * 2
    ref_kl = kl_tok.sum(-1) - torch.rand(b, generator=g, dtype=torch.float64) * 3  # a positive mean log-ratio: z0 > 0
    labels = torch.tensor([True, False, True, True, False, False, True, False])[:b]
    return tok, ref, kl_tok, ref_kl, labels


def _ours(tok, ref, kl_tok, ref_kl, labels, beta, wd, wu):
    z0 = alg.kto_reference_point(kl_tok.sum(-1), ref_kl)
    losses, _ = alg.kto_loss(tok.sum(-1), ref, labels, z0, beta, wd, wu)
    return losses.mean(), z0


def _trl(tok, ref, kl_tok, ref_kl, labels, beta, wd, wu):
    """TRL's KTOTrainer._compute_loss (precomputed reference log-probs, loss_type="kto") on a stand-in."""
    pytest.importorskip("trl", reason="TRL is the reference implementation: pip install trl (the test extra)")
    from trl import KTOTrainer

    b, t = tok.shape[0], tok.shape[1] + 1
    ids, kl_ids = torch.ones(b, t, dtype=torch.long), torch.ones(b, t, dtype=torch.long)
    ones = torch.ones(b, t, dtype=torch.long)

    def model(input_ids, labels=None, **kw):
        if input_ids is kl_ids:
            return types.SimpleNamespace(log_probs=kl_tok)
        return types.SimpleNamespace(log_probs=tok, entropy=torch.zeros_like(tok), mean_logits=torch.zeros_like(tok))

    acc = types.SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x)
    stub = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True),
        accelerator=acc,
        calculate_KL=True,
        precompute_ref_logps=True,
        loss_type="kto",
        beta=beta,
        desirable_weight=wd,
        undesirable_weight=wu,
        aux_loss_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    stub._compute_kl_logps = types.MethodType(KTOTrainer._compute_kl_logps, stub)
    inputs = {
        "input_ids": ids,
        "attention_mask": ones,
        "completion_mask": ones,
        "KL_input_ids": kl_ids,
        "KL_attention_mask": ones,
        "KL_completion_mask": ones,
        "label": labels,
        "ref_logps": ref,
        "ref_KL_logps": ref_kl,
    }
    loss = KTOTrainer._compute_loss(stub, model, inputs, return_outputs=False)
    return loss, stub._metrics["train"]["kl"][-1]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("beta,wd,wu", [(0.1, 1.0, 1.0), (0.5, 1.0, 1.33)])
def test_kto_equals_trl(seed, beta, wd, wu):
    tok, ref, kl_tok, ref_kl, labels = _inputs(seed)
    x = tok.clone().requires_grad_(True)
    want, want_kl = _trl(x, ref, kl_tok, ref_kl, labels, beta, wd, wu)
    want.backward()
    y = tok.clone().requires_grad_(True)
    got, z0 = _ours(y, ref, kl_tok, ref_kl, labels, beta, wd, wu)
    got.backward()
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(y.grad, x.grad, **TOL)
    assert float(z0) == pytest.approx(want_kl, abs=1e-9) and float(z0) > 0


def test_kto_equals_the_paper_formula():
    """Eq. 7-8: z0 = max(0, mean KL-pair log-ratio); v = lambda_D sigma(beta (r - z0)) for desirable and
    lambda_U sigma(beta (z0 - r)) for undesirable; L = E[lambda_y - v] (lambda_y - v = lambda_y (1 - sigma))."""
    tok, ref, kl_tok, ref_kl, labels = _inputs(3)
    beta, wd, wu = 0.2, 1.0, 1.5
    z0 = max(0.0, float(sum(kl_tok.sum(-1)[j] - ref_kl[j] for j in range(len(ref))) / len(ref)))
    terms = []
    for i in range(len(ref)):
        r = float(tok[i].sum() - ref[i])
        lam = wd if labels[i] else wu
        v = lam * torch.sigmoid(torch.tensor(beta * ((r - z0) if labels[i] else (z0 - r)), dtype=torch.float64))
        terms.append(lam - v)
    got, got_z0 = _ours(tok, ref, kl_tok, ref_kl, labels, beta, wd, wu)
    assert float(got_z0) == pytest.approx(z0, abs=1e-12)
    assert float(got) == pytest.approx(float(sum(terms) / len(terms)), abs=1e-12)


def test_reference_point_is_clamped_and_detached():
    kl = torch.tensor([-1.0, -2.0], requires_grad=True)
    assert float(alg.kto_reference_point(kl, torch.zeros(2))) == 0.0
    assert not alg.kto_reference_point(kl, torch.full((2,), -5.0)).requires_grad


def test_kl_pairs_rotate_completions_by_one_as_trl():
    from aligner.trainers.kto import collate_unpaired

    ex = [{"ids": [1, 10 + i] + [20 + i] * (1 + i), "prompt_len": 2, "label": i % 2 == 0} for i in range(4)]
    b = collate_unpaired(ex, pad_id=0, max_seq_len=64)
    for i in range(4):
        j = (i - 1) % 4
        n = int(b["kl_response_mask"][i].sum())
        p = int(b["kl_prompt_lens"][i])
        assert b["kl_input_ids"][i, :p].tolist() == [1, 10 + i]
        assert b["kl_input_ids"][i, p : p + n].tolist() == [20 + j] * (1 + j)
    assert b["label"].tolist() == [True, False, True, False]


def test_kto_step_equals_the_whole_batch_loss():
    """kto_step on micro-batches of one example: the gradients equal one backward of the mean KTO loss, and the
    reference point is the whole batch's."""
    from aligner.actor.kto import kto_reference_point, kto_sequence_log_probs, kto_step
    from aligner.actor.policy import Policy
    from aligner.config import KTOConfig, OptimConfig, ParallelConfig
    from aligner.parallel.dims import ParallelDims
    from aligner.trainers.kto import collate_unpaired
    from tests.toolkit.models import tiny_model_config

    cfg = tiny_model_config(init_std=0.2)
    optim = OptimConfig(lr=1e-3, warmup_steps=0, schedule="constant", grad_clip=0.0)
    g = torch.Generator().manual_seed(0)
    ex = []
    for i in range(5):
        p, c = int(torch.randint(2, 6, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g))
        ex.append({"ids": torch.randint(4, 64, (p + c,), generator=g).tolist(), "prompt_len": p, "label": i % 2 == 0})
    batch = collate_unpaired(ex, 0, 64)
    kto = KTOConfig(beta=0.5, undesirable_weight=1.3)
    dims = ParallelDims(device_type="cpu")
    pol = Policy(cfg, ParallelConfig(), optim, dims, seed=0)
    ref = Policy(cfg, ParallelConfig(), optim, dims, seed=1)
    ref_logps = kto_sequence_log_probs(ref, batch, 5)
    kl = kto_sequence_log_probs(pol, batch, 5, kl=True)
    ref_kl = kl - torch.linspace(0.2, 1.0, 5)  # a reference the policy has moved away from: z0 = 0.6
    z0 = kto_reference_point(pol, kl, ref_kl)
    assert float(z0) > 0
    full = {**batch, "ref_logps": ref_logps, "z0": z0}
    # the whole-batch loss, one backward
    from aligner.model.llama import build_model, select_positions
    from aligner.nn.vocab import vocab_parallel_log_probs
    from aligner.protocol import response_index

    model = build_model(cfg, kind="lm", seed=0)
    idx = response_index(batch["prompt_lens"], batch["response_mask"].shape[1], batch["input_ids"].shape[1] - 1)
    lp = vocab_parallel_log_probs(select_positions(model(batch["input_ids"]), idx), batch["input_ids"].gather(1, idx + 1))
    seq = (lp * batch["response_mask"]).sum(-1)
    losses, _ = alg.kto_loss(seq, ref_logps, batch["label"], z0, kto.beta, kto.desirable_weight, kto.undesirable_weight)
    losses.mean().backward()
    metrics = kto_step(pol, full, kto, micro_batch_size=1)
    assert metrics["loss"] == pytest.approx(float(losses.mean().detach()), abs=1e-6)
    assert metrics["kl"] == pytest.approx(float(z0), abs=1e-7)
    got = dict(pol.runtime.module.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name].grad, p.grad, atol=1e-6, rtol=1e-4, msg=name)


# ---- data ---------------------------------------------------------------------------------------


def _cfg(tmp_path, rows: list[dict], fmt: str = "auto"):
    from aligner.cli import load_config

    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_config("kto", ["conf=tiny", f"data.train_path={path}", f"data.format={fmt}", "data.eval_fraction=0"]), str(path)


def _tokenizer(cfg, tmp_path):
    from aligner.data.tokenizer import load_tokenizer
    from aligner.trainers.supervised import tokenizer_path

    return load_tokenizer(tokenizer_path(cfg, str(tmp_path)), cfg.tokenizer.chat_template)


def test_data_without_labels_is_refused_in_one_line(tmp_path, monkeypatch):
    from aligner.trainers.kto import load_unpaired

    monkeypatch.chdir(tmp_path)
    cfg, path = _cfg(tmp_path, [{"prompt": "1+1=", "completion": "2"}, {"prompt": "2+2=", "completion": "4"}])
    with pytest.raises(UserError) as e:
        load_unpaired(cfg, _tokenizer(cfg, tmp_path), str(tmp_path))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"data.train_path={path!r} has format 'prompt_completion', which has no labels"), msg
    cfg, path = _cfg(tmp_path, [{"prompt": "1+1=", "completion": "2"}], fmt="unpaired")
    with pytest.raises(ValueError) as e:  # the row's file:line (the trainer turns it into one error line, exit 2)
        load_unpaired(cfg, _tokenizer(cfg, tmp_path), str(tmp_path))
    assert f"{path}:1" in str(e.value) and "label" in str(e.value)


def test_unpaired_rows_and_pairs_made_unpaired(tmp_path, monkeypatch):
    from aligner.trainers.kto import load_unpaired

    monkeypatch.chdir(tmp_path)
    rows = [{"prompt": "1+1=", "completion": "2", "label": True}, {"prompt": "2+2=", "completion": "5", "label": False}]
    cfg, _ = _cfg(tmp_path, rows)
    data = load_unpaired(cfg, _tokenizer(cfg, tmp_path), str(tmp_path))
    assert data.format == "unpaired" and [e["label"] for e in data.train] == [True, False]
    tok = _tokenizer(cfg, tmp_path)
    first = data.train[0]
    assert tok.decode(first["ids"][first["prompt_len"] :], skip_special_tokens=True).strip() == "2"
    cfg, _ = _cfg(tmp_path, [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}])
    data = load_unpaired(cfg, tok, str(tmp_path))
    assert [e["label"] for e in data.train] == [True, False]
    assert data.train[0]["ids"][: data.train[0]["prompt_len"]] == data.train[1]["ids"][: data.train[1]["prompt_len"]]


def test_an_hh_pair_with_an_empty_reply_is_refused_or_skipped_under_skip_invalid(tmp_path, monkeypatch):
    from aligner.cli import load_config
    from aligner.trainers.kto import load_unpaired

    monkeypatch.chdir(tmp_path)
    hh = "\n\nHuman: 1+1=\n\nAssistant:"
    rows = [
        {"chosen": hh + " 2", "rejected": hh + " 3"},
        {"chosen": hh + " ", "rejected": hh + " 3"},
        {"chosen": hh + " 2", "rejected": hh + " 5"},
    ]
    _, path = _cfg(tmp_path, rows, fmt="hh")
    base = [
        "conf=tiny",
        f"data.train_path={path}",
        "data.format=hh",
        "data.eval_fraction=0",
        "data.max_prompt_len=48",
        "data.max_seq_len=64",
    ]
    cfg = load_config("kto", base)
    tok = _tokenizer(cfg, tmp_path)
    with pytest.raises(ValueError) as e:
        load_unpaired(cfg, tok, str(tmp_path))
    msg = str(e.value)
    assert (
        msg.startswith(f"{path}:2: field 'chosen' has an empty final assistant turn")
        and "data.skip_invalid=true" in msg
        and "\n" not in msg
    )
    cfg = load_config("kto", [*base, "data.skip_invalid=true"])
    data = load_unpaired(cfg, tok, str(tmp_path))  # the format's detection honours skip_invalid too
    assert [e["label"] for e in data.train] == [True, False, True, False] and data.stats["skipped_invalid"] == 1
