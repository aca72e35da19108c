"""LoRA end to end: ``python -m aligner.sft ... actor.lora.rank=8`` then a LoRA GRPO run from it.

The SFT run must export the merged HF model and a PEFT adapter in ``hf/adapter`` that
``PeftModel.from_pretrained`` loads on its base (``hf/adapter/base``: the run started from random
weights) with the merged model's logits; its checkpoint must hold only the adapters. The PPO run
(GRPO, rule reward, k3 KL loss) starts from the SFT export with no ref group (the reference is the
actor with adapters disabled), refits only the adapted linears after the first refit, and exports
its own adapter.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.toolkit.overrides import FAST
from tests.toolkit.paths import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _cli(env: dict, module: str, *args: str) -> subprocess.CompletedProcess:
    env = {**env, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_lora_sft_then_ppo_export_adapters_that_load_in_peft(cluster_env, tmp_path):
    peft = pytest.importorskip("peft", reason="PEFT loads the exported adapter")
    from transformers import LlamaForCausalLM

    sft = tmp_path / "sft"
    lora = ["actor.lora.rank=8", "actor.lora.alpha=16", "actor.lora.target_modules=[q_proj,v_proj,down_proj]"]
    proc = _cli(cluster_env, "aligner.sft", "conf=tiny", *FAST, *lora, "trainer.max_steps=4", f"output_dir={sft}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    adapter = sft / "hf" / "adapter"
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 8 and cfg["lora_alpha"] == 16
    base = LlamaForCausalLM.from_pretrained(cfg["base_model_name_or_path"], torch_dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(base, str(adapter)).eval()
    merged = LlamaForCausalLM.from_pretrained(sft / "hf", torch_dtype=torch.float32).eval()
    ids = torch.randint(0, merged.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = merged(input_ids=ids).logits
        torch.testing.assert_close(peft_model(input_ids=ids).logits, want, atol=1e-5, rtol=0)
        with peft_model.disable_adapter():
            assert (peft_model(input_ids=ids).logits - want).abs().max() > 1e-4, "the trained adapter must change the model"
    import torch.distributed.checkpoint as dcp

    ckpt = next((sft / "checkpoints").glob("step_*")) / "actor"
    saved = {k for k in dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata if k.startswith("model.")}
    assert saved and all(".lora." in k for k in saved), sorted(saved)[:5]

    ppo = tmp_path / "ppo"
    proc = _cli(
        cluster_env,
        "aligner.ppo",
        "conf=tiny",
        *FAST,
        *lora,
        f"actor.init={sft}",
        "reward.type=rule",
        "algorithm.advantage=grpo",
        "trainer.n_samples_per_prompt=4",
        "algorithm.kl_coef=0",
        "algorithm.kl_loss_coef=0.04",
        "trainer.max_steps=2",
        f"output_dir={ppo}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (ppo / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "refit_bytes" in r]
    full = sum(v.numel() * v.element_size() for v in merged.state_dict().values())
    assert steps and all(r["refit_bytes"] < full / 2 for r in steps), [r["refit_bytes"] for r in steps]
    assert all("kl_loss" in r for r in steps)
    assert (ppo / "hf" / "adapter" / "adapter_model.safetensors").is_file()
