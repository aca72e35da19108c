"""End to end: `python -m aligner.sft conf=tiny actor.prompt_learning.type=prompt_tuning` (CPU).

A few steps from a seeded random base with the prompt initialized from a text: the run must
exit 0, log the greedy task accuracy (decoded with the virtual tokens), write
output_dir/prompt (prompt.safetensors + prompt.json naming the base) and the base's HF export
(no actor.init: the seeded base is written so the prompt has one to reload against), leave the
base bitwise equal to the seeded init, checkpoint the prompt only, and the exported prompt on
the exported base must give the logits of the checkpointed policy exactly.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_sft_prompt_tuning_exports_and_reloads(cluster_env, tmp_path):
    from aligner.actor.policy import Policy
    from aligner.cli import load_config
    from aligner.config import OptimConfig, ParallelConfig, PromptLearningConfig
    from aligner.model.hf import load_hf_model, load_hf_state_dict
    from aligner.model.llama import build_model
    from aligner.model.prompt import attach_prompt, load_prompt
    from aligner.parallel.dims import ParallelDims
    from aligner.tracking import read_metrics

    out = tmp_path / "run"
    args = [
        "conf=tiny",
        "actor.prompt_learning.type=prompt_tuning",
        "actor.prompt_learning.num_virtual_tokens=6",
        "actor.prompt_learning.init=text",
        "actor.prompt_learning.init_text=add the numbers",
        "trainer.max_steps=3",
        "trainer.progress=false",
        "task.num_eval=16",
        "trainer.eval_batch_size=16",
        f"output_dir={out}",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "aligner.sft", *args], cwd=tmp_path, env=cluster_env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = read_metrics(out / "metrics.jsonl")[-1]
    assert last["step"] == 3 and last["task_n"] == 16 and 0.0 <= last["task_accuracy"] <= 1.0

    meta = json.loads((out / "prompt" / "prompt.json").read_text())
    assert meta["type"] == "prompt_tuning" and meta["num_virtual_tokens"] == 6 and meta["base_model"] == str(out / "hf")
    cfg = load_config("sft", args)
    seeded = build_model(cfg.model, "lm", seed=cfg.trainer.seed).state_dict()
    exported = load_hf_state_dict(out / "hf")
    for k, v in seeded.items():
        assert torch.equal(exported[k], v), f"{k}: the frozen base changed"

    ckpt = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip() / "actor"
    import torch.distributed.checkpoint as dcp

    saved = {k for k in dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata if k.startswith("model.")}
    assert saved == {"model.model.prompt.embedding.weight"}, saved

    base, _ = load_hf_model(meta["base_model"])
    prompt, _ = load_prompt(str(out / "prompt"))
    reloaded = attach_prompt(base, prompt).eval()
    pl = PromptLearningConfig(type="prompt_tuning", num_virtual_tokens=6)  # random init: load() replaces it
    pol = Policy(cfg.model, ParallelConfig(), OptimConfig(), ParallelDims(device_type="cpu"), init=str(out / "hf"), prompt_learning=pl)
    before = pol.runtime.module.model.prompt.embedding.weight.detach().clone()
    pol.load(str(ckpt))
    assert not torch.equal(before, pol.runtime.module.model.prompt.embedding.weight)
    x = torch.randint(3, cfg.model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x), pol.runtime.module(x), atol=0, rtol=0)
