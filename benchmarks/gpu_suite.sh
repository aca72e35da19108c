#!/usr/bin/env bash
# GPU suite: one command for a single-GPU H100/H200 machine (PyTorch, Triton and transformers
# preinstalled, no network, no Ray). Runs, each under its own time limit (about 7 minutes in all
# where step 5 skips; the longest step, decode, runs last):
#   1. the gpu-marked tests that need no Ray (every gpu test file but the trtllm PPO one);
#   2. MFU of aligner's training step on a ~1.1B-parameter Llama in bf16 mixed precision
#      (benchmarks/training_throughput.py --gpu: 6 * params * tokens / time / peak bf16);
#   3. the phases of a single-process PPO step built from the Ray-free classes, every role on
#      the GPU (benchmarks/ppo_step.py --aligner-only);
#   4. two PPO steps with rollout.backend=trtllm (tests/trainers/test_ppo_trtllm_gpu.py: Ray worker
#      groups, TensorRT-LLM beside the actor); it needs tensorrt_llm and ray and records its skip
#      reason (-rs) where they are missing, as on the machines this suite has run on so far;
#   5. TorchEngine decode tokens/s on the same 1.1B model in bf16 against the memory-bandwidth
#      bound (weight bytes / measured device copy bandwidth, per decode step) and against HF
#      generate on the same weights (greedy, no stop token, prompt 128, 256 new tokens), for the
#      static and continuous schedulers (benchmarks/generation.py --gpu --engines static,continuous;
#      without --engines it also times both compiled, which takes longer than this step's limit).
# Writes everything to the results file (default benchmarks/gpu_results_<date>.txt) with device, date
# and versions. A step that fails or times out is recorded as such; the suite goes on.
#
#   bash benchmarks/gpu_suite.sh [RESULTS_FILE]
set -u
cd "$(dirname "$0")/.."
OUT="${1:-benchmarks/gpu_results_$(date -u +%F).txt}"
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
  # the gpu test files by name: collecting all of tests/ imports ray, omegaconf and datasets
  step "gpu tests (no Ray)" 240 "$PY" -m pytest -q -rs -m gpu -p no:cacheprovider \
    tests/runtime/test_device_placement_gpu.py tests/rollout/test_trtllm_engine_gpu.py tests/parallel/test_te_backend_gpu.py
  step "training MFU, ~1.1B Llama, bf16" 150 "$PY" benchmarks/training_throughput.py --gpu
  step "single-process PPO step phases (Ray-free classes)" 90 "$PY" benchmarks/ppo_step.py --aligner-only --repeats 3
  step "PPO steps with rollout.backend=trtllm (Ray + TensorRT-LLM)" 300 "$PY" -m pytest -q -rs \
    tests/trainers/test_ppo_trtllm_gpu.py -p no:cacheprovider
  # two of generation.py's four variants: the compiled ones took 53-69 s each to compile at the first
  # batch size and more at each other one, past the step's limit (H200, 2026-11-26)
  step "TorchEngine decode vs bandwidth bound and HF generate" 330 "$PY" benchmarks/generation.py --gpu --engines static,continuous
} 2>&1 | tee "$OUT"
echo "results: $OUT"
