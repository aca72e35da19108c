"""GSPO (Zheng et al. 2025) and CISPO (MiniMax-M1) as ``algorithm.policy_loss``: equal to the papers'
formulas and to TRL's GRPOTrainer loss (its real ``_compute_loss``, run on a minimal stand-in for the
trainer whose forward returns fixed log-probs) in value and gradient, in float64; ppo_update on
micro-batches equal to the whole-batch formula; what a sequence-level loss cannot honour refused
before anything starts."""

from __future__ import annotations

import types
from collections import defaultdict

import pytest
import torch

from aligner import algorithms as alg
from aligner.errors import ConfigError

TOL = dict(atol=1e-6, rtol=1e-6)


def _inputs(seed: int = 0, b: int = 6, r: int = 7, per_sequence_adv: bool = True):
    """Fixed float64 log-probs [B, R] (a leaf), old log-probs near them (some sequences clipped,
    some not), advantages (one per sequence, or per token) and a right-padded mask, every row >= 1 token."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, r + 1, (b,), generator=g)
    lens[0] = r
    mask = (torch.arange(r)[None] < lens[:, None]).double()
    lp = (-torch.rand(b, r, generator=g, dtype=torch.float64) * 3) * mask
    old = (lp + torch.randn(b, r, generator=g, dtype=torch.float64) * 0.4) * mask
    old[1] = (lp[1] + 0.5) * mask[1]  # s_1 = e^-0.5, below 1 - eps
    old[2] = (lp[2] - 0.5) * mask[2]  # s_2 = e^0.5, above 1 + eps
    if per_sequence_adv:
        adv = torch.randn(b, 1, generator=g, dtype=torch.float64)
        adv[1], adv[2] = -adv[1].abs(), adv[2].abs()  # both clipped sequences past the bound that binds
        adv = adv.expand(b, r) * mask
    else:
        adv = torch.randn(b, r, generator=g, dtype=torch.float64) * mask
    return lp, old, adv.contiguous(), mask


def _grad(fn, lp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = lp.detach().clone().requires_grad_(True)
    loss = fn(x)
    loss.backward()
    return loss.detach(), x.grad


# ---- against the papers' formulas ---------------------------------------------------------------


def _gspo_paper(lp, old, adv_seq, mask, eps_low, eps_high):
    """Zheng et al. 2025, eq. 5-7: J = 1/G sum_i min(s_i A_i, clip(s_i, 1 - eps, 1 + eps) A_i),
    s_i = (pi(y_i) / pi_old(y_i))^(1 / |y_i|); the loss is -J. Written per sequence with a Python loop."""
    terms = []
    for i in range(lp.shape[0]):
        keep = mask[i] > 0
        s = torch.exp((lp[i][keep] - old[i][keep]).sum() / keep.sum())
        a = adv_seq[i]
        terms.append(-torch.minimum(s * a, s.clamp(1 - eps_low, 1 + eps_high) * a))
    return torch.stack(terms).mean()


def _cispo_paper(lp, old, adv, mask, eps_high):
    """MiniMax-M1 eq. 4-5: J = 1 / sum_i |o_i| * sum_i sum_t sg(r_hat_i,t) A_i,t log pi(o_i,t),
    r_hat = clip(r, 1 - eps_low, 1 + eps_high) with no lower bound; the loss is -J."""
    keep = mask > 0
    r = torch.exp(lp[keep] - old[keep]).detach()
    return -(r.clamp(max=1 + eps_high) * adv[keep] * lp[keep]).sum() / keep.sum()


@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.05, 0.08), (3e-4, 4e-4)])
def test_gspo_equals_the_paper_sequence_objective(eps):
    lp, old, adv, mask = _inputs(1)
    low, high = eps
    want, want_g = _grad(lambda x: _gspo_paper(x, old, adv[:, 0], mask, low, high), lp)
    got, got_g = _grad(lambda x: alg.gspo_loss(x * mask, old, adv, mask, low, high)[0], lp)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got_g, want_g, **TOL)
    assert got_g.abs().sum() > 0 or eps[0] < 1e-3


def test_gspo_clips_whole_sequences():
    """A sequence whose mean log-ratio is past the bound gets no gradient on any token, whatever its token ratios."""
    lp, old, adv, mask = _inputs(2)
    old = old.clone()
    old[1] = (lp[1] - 1.0) * mask[1]  # s_1 = e > 1 + eps
    adv = adv.clone()
    adv[1] = mask[1]  # positive advantage: the upper clip binds
    loss, g = _grad(lambda x: alg.gspo_loss(x * mask, old, adv, mask, 0.2)[0], lp)
    assert g[1].abs().max() == 0
    _, m = alg.gspo_loss(lp, old, adv, mask, 0.2)
    assert m["seq_clipfrac"] >= 1 / 6 - 1e-12


def test_gspo_token_form_with_token_advantages():
    """GSPO-token (eq. 13-14): the gradient of token t is -A_i,t * s_i * grad log pi_t / |y_i| where unclipped."""
    lp, old, adv, mask = _inputs(3, per_sequence_adv=False)
    eps = 10.0  # nothing clipped
    _, g = _grad(lambda x: alg.gspo_loss(x * mask, old, adv, mask, eps)[0], lp)
    s = torch.exp(((lp - old) * mask).sum(-1) / mask.sum(-1))
    want = -adv * s[:, None] / mask.sum(-1, keepdim=True) / lp.shape[0] * mask
    torch.testing.assert_close(g, want, **TOL)


@pytest.mark.parametrize("eps_high", [0.2, 4.0])
def test_cispo_equals_the_paper_objective(eps_high):
    lp, old, adv, mask = _inputs(4, per_sequence_adv=False)
    want, want_g = _grad(lambda x: _cispo_paper(x, old, adv, mask, eps_high), lp)
    got, got_g = _grad(lambda x: alg.cispo_loss(x * mask, old, adv, mask, eps_high)[0], lp)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got_g, want_g, **TOL)
    # every token keeps its gradient, clipped ones included (PPO's clip would zero them)
    assert bool((got_g[mask > 0] != 0).all())


def test_cispo_weight_is_clipped_and_carries_no_gradient():
    lp, old, adv, mask = _inputs(5, per_sequence_adv=False)
    _, g = _grad(lambda x: alg.cispo_loss(x * mask, old, adv, mask, 0.1)[0], lp)
    w = torch.exp(lp - old).clamp(max=1.1)
    torch.testing.assert_close(g, -w * adv * mask / mask.sum(), **TOL)


# ---- against TRL's GRPOTrainer._compute_loss ---------------------------------------------------


def _trl_loss(lp: torch.Tensor, old, adv_seq, mask, *, level: str, loss_type: str, eps_low: float, eps_high: float):
    """TRL's GRPOTrainer._compute_loss (the library's code, unbound) on a stand-in `self` whose forward
    returns `lp` ([B, R], a leaf with gradient): one process, no accumulation, beta 0, no entropy
    bonus, no vLLM. Returns the loss (0-dim)."""
    trl = pytest.importorskip("trl", reason="TRL is the reference implementation: pip install trl (the test extra)")
    from trl import GRPOTrainer

    b, r = lp.shape

    class _Acc:
        num_processes = 1

        @staticmethod
        def gather(x):
            return x

        gather_for_metrics = gather

        @staticmethod
        def reduce(x, reduction="sum"):
            return x

    args = types.SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1)
    stub = types.SimpleNamespace(
        args=args,
        accelerator=_Acc(),
        model=types.SimpleNamespace(training=True),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        beta=0.0,
        loss_type=loss_type,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        use_vllm=False,
        current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp, torch.zeros_like(lp), None),
    )
    inputs = {
        "prompt_ids": torch.ones(b, 1, dtype=torch.long),
        "prompt_mask": torch.ones(b, 1, dtype=torch.long),
        "completion_ids": torch.ones(b, r, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": adv_seq,
        "old_per_token_logps": old,
        "num_items_in_batch": mask.sum(),
    }
    assert trl.__version__
    return GRPOTrainer._compute_loss(stub, None, inputs)


def test_trl_version_is_known():
    trl = pytest.importorskip("trl", reason="TRL is the reference implementation: pip install trl (the test extra)")
    major, minor = (int(x) for x in trl.__version__.split(".")[:2])
    assert (major, minor) >= (0, 20)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.1, 0.3)])
def test_gspo_equals_trl_sequence_level(seed, eps):
    """GRPOConfig(importance_sampling_level="sequence", loss_type="grpo") against policy_loss=gspo with
    loss_agg=seq-mean-token-mean: loss and gradient w.r.t. the per-token log-probs within 1e-6, float64."""
    lp, old, adv, mask = _inputs(seed)
    low, high = eps
    want, want_g = _grad(lambda x: _trl_loss(x, old, adv[:, 0], mask, level="sequence", loss_type="grpo", eps_low=low, eps_high=high), lp)
    got, got_g = _grad(lambda x: alg.gspo_loss(x * mask, old, adv, mask, low, high, "seq-mean-token-mean")[0], lp)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got_g * mask, want_g * mask, **TOL)
    assert (got_g * mask).abs().sum() > 0
    m = alg.gspo_loss(lp, old, adv, mask, low, high)[1]
    assert 0 < m["seq_clipfrac"] < 1, "the inputs must clip some sequences and not others"


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("eps_high", [0.2, 4.0])
def test_cispo_equals_trl(seed, eps_high):
    """GRPOConfig(loss_type="cispo", epsilon_high=1 + clip_eps_high) against policy_loss=cispo (token-mean)."""
    lp, old, adv, mask = _inputs(seed, per_sequence_adv=True)
    trl = lambda x: _trl_loss(x, old, adv[:, 0], mask, level="token", loss_type="cispo", eps_low=0.2, eps_high=1 + eps_high)  # noqa: E731
    want, want_g = _grad(trl, lp)
    got, got_g = _grad(lambda x: alg.cispo_loss(x * mask, old, adv, mask, eps_high, "token-mean")[0], lp)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got_g * mask, want_g * mask, **TOL)
    if eps_high == 0.2:
        assert alg.cispo_loss(lp, old, adv, mask, eps_high)[1]["clipfrac"] > 0, "the inputs must clip some weights"


# ---- the actor's update on micro-batches ---------------------------------------------------------


@pytest.mark.parametrize("policy_loss,loss_agg", [("gspo", "seq-mean-token-mean"), ("cispo", "token-mean")])
def test_ppo_update_equals_the_whole_batch_formula(policy_loss, loss_agg):
    """ppo_update on micro-batches of one row, then of two rows packed by shared prompt: the parameters'
    gradients equal one backward of the whole-batch loss (the sequence ratio needs every token of a row
    in the micro-batch that has the row)."""
    from aligner.actor.policy import Policy
    from aligner.config import AlgorithmConfig, OptimConfig, ParallelConfig
    from aligner.model.llama import build_model, select_positions
    from aligner.nn.vocab import vocab_parallel_log_probs
    from aligner.parallel.dims import ParallelDims
    from aligner.protocol import build_sequences, response_index
    from tests.toolkit.models import tiny_model_config

    cfg = tiny_model_config(init_std=0.2)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(4, 64, (n,), generator=g).tolist() for n in (3, 6)]
    responses = [torch.randint(4, 64, (n,), generator=g).tolist() for n in (5, 1, 3, 4)]
    seq = build_sequences([prompts[0], prompts[0], prompts[1], prompts[1]], responses, pad_id=0)
    mask = seq["response_mask"]
    adv = torch.randn(4, 1, generator=g).expand_as(mask) * mask
    algo = AlgorithmConfig(advantage="grpo", kl_loss_coef=0.0, clip_eps=0.1, clip_eps_high=0.3, loss_agg=loss_agg, policy_loss=policy_loss)
    optim = OptimConfig(lr=1e-3, warmup_steps=0, schedule="constant", grad_clip=0.0)
    for pack_len in (0, 4096):
        pol = Policy(cfg, ParallelConfig(), optim, ParallelDims(device_type="cpu"), seed=0)
        batch = {**{k: seq[k] for k in ("input_ids", "prompt_lens", "response_mask")}, "advantages": adv}
        with torch.no_grad():
            current = pol.log_probs(batch, micro_batch_size=4)
        batch["old_log_probs"] = (current - torch.randn(mask.shape, generator=g) * 0.3) * mask
        model = build_model(cfg, kind="lm", seed=0)
        idx = response_index(batch["prompt_lens"], mask.shape[1], batch["input_ids"].shape[1] - 1)
        lp = vocab_parallel_log_probs(select_positions(model(batch["input_ids"]), idx), batch["input_ids"].gather(1, idx + 1)) * mask
        if policy_loss == "gspo":
            want_loss = alg.gspo_loss(lp, batch["old_log_probs"], adv, mask, 0.1, 0.3, loss_agg)[0]
        else:
            want_loss = alg.cispo_loss(lp, batch["old_log_probs"], adv, mask, 0.3, loss_agg)[0]
        want_loss.backward()
        metrics = pol.ppo_update(batch, algo, micro_batch_size=1 if pack_len == 0 else 2, pack_len=pack_len)
        assert metrics["policy_loss"] == pytest.approx(float(want_loss.detach()), abs=1e-6)
        got = dict(pol.runtime.module.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(got[name].grad, p.grad, atol=1e-6, rtol=1e-4, msg=f"{policy_loss} pack_len={pack_len}: {name}")


# ---- settings a sequence-level loss cannot honour ----------------------------------------------


@pytest.mark.parametrize(
    "overrides,field,fix",
    [
        (["algorithm.policy_loss=gspo"], "algorithm.loss_agg='token-mean'", "set algorithm.loss_agg=seq-mean-token-mean"),
        (["algorithm.policy_loss=ppo2"], "algorithm.policy_loss='ppo2'", "valid choices are ppo, gspo, cispo"),
        (
            ["algorithm.policy_loss=cispo", "algorithm.dual_clip=3.0"],
            "algorithm.dual_clip=3.0",
            "set it to null or policy_loss=ppo",
        ),
        (
            ["algorithm.policy_loss=gspo", "algorithm.loss_agg=seq-mean-token-mean", "algorithm.decoupled_loss=true"],
            "algorithm.decoupled_loss=True",
            "or policy_loss=ppo",
        ),
    ],
)
def test_settings_a_policy_loss_cannot_honour_are_refused(overrides, field, fix):
    from aligner.cli import load_config

    with pytest.raises(ConfigError) as e:
        load_config("ppo", ["conf=tiny", *overrides])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(field) and fix in msg, msg


def test_stale_samples_with_gspo_are_refused_at_the_entry_point(capsys):
    """trainer.max_staleness > 0 turns the decoupled (PPO) loss on: with gspo, one line, exit 2, before any worker."""
    from aligner.cli import run

    def main(cfg):
        raise AssertionError("the run must be refused before it starts")

    overrides = [
        "conf=tiny",
        "algorithm.policy_loss=gspo",
        "algorithm.loss_agg=seq-mean-token-mean",
        "rollout.placement=split",
        "trainer.max_staleness=1",
    ]
    assert run("ppo", main, overrides) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "algorithm.policy_loss='gspo' is invalid" in err and "set policy_loss=ppo" in err, err


def test_ppo_stays_the_default():
    from aligner.cli import load_config

    cfg = load_config("ppo", ["conf=tiny"])
    assert cfg.algorithm.policy_loss == "ppo"
    cfg = load_config("ppo", ["conf=tiny", "algorithm.policy_loss=cispo", "algorithm.clip_eps_high=4.0"])
    assert cfg.algorithm.policy_loss == "cispo"
