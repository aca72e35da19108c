#!/usr/bin/env bash
# GPU suite: one command for a single-GPU H100/H200 machine (PyTorch, Triton and transformers
# preinstalled, no network, no Ray). Runs, each under its own time limit (about 9 minutes in all):
#   1. the gpu-marked tests that need no Ray (tests/gpu; none of them imports ray);
#   2. MFU of aligner's training step on a ~1.1B-parameter Llama in bf16 mixed precision
#      (benchmarks/training_throughput.py --gpu: 6 * params * tokens / time / peak bf16);
#   3. TorchEngine decode tokens/s on the same 1.1B model in bf16 against the memory-bandwidth
#      bound (weight bytes / measured device copy bandwidth, per decode step) and against HF
#      generate on the same weights (greedy, no stop token, prompt 128, 256 new tokens);
#   4. the phases of a single-process PPO step built from the Ray-free classes
#      (benchmarks/ppo_step.py --aligner-only --device cuda).
# Writes everything to the results file (default benchmarks/gpu_results.txt) with device, date
# and versions. A step that fails or times out is recorded as such; the suite goes on.
#
#   bash benchmarks/gpu_suite.sh [RESULTS_FILE]
set -u
cd "$(dirname "$0")/.."
OUT="${1:-benchmarks/gpu_results.txt}"
PY="${PYTHON:-python}"
# the benchmark scripts import aligner from this checkout (no pip install on the GPU machine)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false TRL_EXPERIMENTAL_SILENCE=1

step() {  # step NAME SECONDS CMD...: run one part under a time limit, record its exit status
  local name="$1" limit="$2"; shift 2
  echo "=== ${name} (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "${limit}" "$@"
  local rc=$?
  echo "=== ${name}: exit ${rc}$([ ${rc} -eq 124 ] && echo ' (timed out)') in $((SECONDS - t0))s"
  echo
}

decode_bench() {
  "$PY" - <<'EOF'
"""TorchEngine decode vs the memory-bandwidth bound and vs HF generate (bf16, CUDA, greedy, full length)."""
import statistics, sys, time
import torch
sys.path.insert(0, "benchmarks")
from aligner.config import ModelConfig, SamplingConfig
from aligner.model.llama import build_model
from aligner.rollout.torch_engine import TorchEngine
from generation import hf_model

torch.manual_seed(0)
P, NEW = 128, 256
cfg = ModelConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=22, num_heads=32,
                  num_kv_heads=4, max_seq_len=P + NEW)
model = build_model(cfg, seed=0, device="cuda").to(torch.bfloat16).eval()
weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
# copy bandwidth: read + write of a 1 GiB buffer
src = torch.empty(2**30, dtype=torch.uint8, device="cuda"); dst = torch.empty_like(src)
for _ in range(3): dst.copy_(src)
torch.cuda.synchronize(); t0 = time.perf_counter()
for _ in range(20): dst.copy_(src)
torch.cuda.synchronize(); bw = 2 * 20 * src.numel() / (time.perf_counter() - t0)
del src, dst
hf = hf_model(cfg, {k: v.clone() for k, v in model.state_dict().items()}).to("cuda", torch.bfloat16)
engine = TorchEngine(model, max_batch_size=64, cuda_graphs=True)
print(f"device {torch.cuda.get_device_name()}; {weight_bytes / 1e9:.2f} GB of bf16 weights; copy bandwidth {bw / 1e9:.0f} GB/s")
print(f"{'batch':>5} {'bound tok/s':>12} {'ours tok/s':>11} {'of bound':>9} {'HF tok/s':>9} {'ours/HF':>8}")
for b in (1, 8, 32, 64):
    ids = torch.randint(4, cfg.vocab_size, (b, P), device="cuda")
    def ours():
        torch.cuda.synchronize(); t0 = time.perf_counter()
        gens = engine.generate(ids.tolist(), SamplingConfig(temperature=0.0, max_new_tokens=NEW))
        torch.cuda.synchronize(); assert all(len(g.token_ids) == NEW for g in gens)
        return time.perf_counter() - t0
    def theirs():
        torch.cuda.synchronize(); t0 = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize(); return time.perf_counter() - t0
    ours(); theirs()
    a, h = [], []
    for _ in range(3):
        a.append(ours()); h.append(theirs())
    bound = b * bw / weight_bytes  # every decode step reads every weight once (KV-cache reads not counted)
    ta, th = b * NEW / statistics.median(a), b * NEW / statistics.median(h)
    print(f"{b:>5} {bound:>12,.0f} {ta:>11,.0f} {100 * ta / bound:>8.0f}% {th:>9,.0f} {ta / th:>7.2f}x")
print("(times include prefill of the 128-token prompt; the bound counts decode weight reads only)")
EOF
}

{
  echo "# aligner GPU suite, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "command: bash benchmarks/gpu_suite.sh ${1:-}"
  "$PY" - <<'EOF'
import platform, torch, transformers
try:
    import triton; tv = triton.__version__
except Exception:  # noqa: BLE001
    tv = "not installed"
dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA DEVICE"
print(f"device: {dev}; torch {torch.__version__} (CUDA {torch.version.cuda}), triton {tv}, "
      f"transformers {transformers.__version__}, python {platform.python_version()}")
EOF
  echo
  step "gpu tests (no Ray)" 150 "$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider
  step "training MFU, ~1.1B Llama, bf16" 150 "$PY" benchmarks/training_throughput.py --gpu
  step "TorchEngine decode vs bandwidth bound and HF generate" 150 decode_bench
  step "single-process PPO step phases (Ray-free classes)" 90 "$PY" benchmarks/ppo_step.py --aligner-only --device cuda --repeats 3
} 2>&1 | tee "$OUT"
echo "results: $OUT"
