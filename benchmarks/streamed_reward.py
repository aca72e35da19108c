"""Benchmark: remote reward calls overlapped with generation (``reward.stream``) against
scoring after generation (``reward.stream=false``), on SmolLM2-135M-Instruct's GSM8K responses.

Both ways generate the same responses (same seeds) with aligner's continuous-batching engine and score
them on a remote reward endpoint (aligner's server, ``aligner.reward.server``, in this process on
127.0.0.1) with the GSM8K rule. The endpoint stands for a reward service on its own hardware (a reward
model or an LLM judge behind ``python -m aligner.serve_rm``): it scores one request at a time and each
request costs ``--request-ms + --sample-ms * samples`` of wall time, spent sleeping (no CPU: on this
2-core machine a computing server would take the cores the engine decodes on, which a separate
service's hardware does not).

- ``after``: generate the batch, then send it (the driver path: requests of ``--batch-size`` with
  ``--concurrency`` in flight);
- ``stream``: each response queued as its row ends, a request of ``ceil(B / concurrency)`` responses
  sent as soon as that many are queued (aligner.reward.remote.StreamedScores, the workers' path).

Printed per way, median of --repeats alternating rounds: generation + scoring seconds, the seconds
spent waiting for scores after generation returned, and the scores checked equal between the ways.

    python benchmarks/streamed_reward.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
import torch  # noqa: E402

from aligner.config import SamplingConfig  # noqa: E402
from aligner.data.tokenizer import load_tokenizer  # noqa: E402
from aligner.model.hf import load_hf_model  # noqa: E402
from aligner.reward.remote import RemoteReward, StreamedScores, stream_chunk  # noqa: E402
from aligner.reward.server import RewardHTTPServer, RuleScorer  # noqa: E402
from aligner.rollout.torch_engine.engine import TorchEngine  # noqa: E402


class ServiceScorer(RuleScorer):
    """The GSM8K rule behind a service that handles one request at a time at request_ms + sample_ms per sample."""

    def __init__(self, request_ms: float, sample_ms: float) -> None:
        super().__init__("gsm8k")
        self.request_s, self.sample_s = request_ms / 1000, sample_ms / 1000
        self.lock = threading.Lock()
        self.requests = 0

    def score(self, req):
        with self.lock:
            time.sleep(self.request_s + self.sample_s * len(req.prompts))
            self.requests += 1
            return super().score(req)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=64, help="GSM8K train questions (one response each)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-batch-size", type=int, default=32, help="the engine's slots")
    ap.add_argument("--request-ms", type=float, default=50.0, help="the service's cost per request")
    ap.add_argument("--sample-ms", type=float, default=20.0, help="the service's cost per sample")
    ap.add_argument("--batch-size", type=int, default=64, help="reward.batch_size")
    ap.add_argument("--concurrency", type=int, default=4, help="reward.max_concurrency")
    ap.add_argument("--repeats", type=int, default=3)
    return ap.parse_args()


def main() -> None:
    args = parse()
    model_dir = C.smollm2_dir()
    tok = load_tokenizer(str(model_dir))
    model, _ = load_hf_model(str(model_dir))
    model.eval()
    rows = C.gsm8k_rows(args.prompts)
    prompts = [
        tok(
            tok.apply_chat_template([{"role": "user", "content": r["question"]}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        for r in rows
    ]
    meta = [{"prompt": r["question"], "metadata": {"answer": r["answer"]}} for r in rows]
    engine = TorchEngine(model, eos_token_id=tok.eos_token_id, max_batch_size=args.max_batch_size)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.max_new_tokens)
    seeds = list(range(len(prompts)))
    scorer = ServiceScorer(args.request_ms, args.sample_ms)
    srv = RewardHTTPServer(scorer, host="127.0.0.1", port=0)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    client = RemoteReward(srv.url, batch_size=args.batch_size, max_concurrency=args.concurrency, max_retries=0, timeout_s=600)

    def after():
        gens = engine.generate(prompts, sampling, seeds=seeds)
        t_gen = time.perf_counter()
        texts = [tok.decode(g.token_ids, skip_special_tokens=True) for g in gens]
        s = client.score(
            [m["prompt"] for m in meta], texts, [m["metadata"] for m in meta], [p + g.token_ids for p, g in zip(prompts, gens)]
        )
        return s, t_gen, gens

    def stream():
        chunk = stream_chunk(len(prompts), args.batch_size, args.concurrency)
        streamed = StreamedScores(client, tok, prompts, meta, chunk)
        gens = engine.generate(prompts, sampling, seeds=seeds, on_finish=streamed.finished)
        t_gen = time.perf_counter()
        streamed.attach(gens)
        return torch.tensor([g.extra["score"] for g in gens]), t_gen, gens

    ways = {"after": after, "stream": stream}
    total: dict[str, list[float]] = {k: [] for k in ways}
    wait: dict[str, list[float]] = {k: [] for k in ways}
    requests: dict[str, int] = {}
    scores: dict[str, torch.Tensor] = {}
    tokens = 0
    for _ in range(args.repeats):
        for name, fn in ways.items():
            before = scorer.requests
            t0 = time.perf_counter()
            s, t_gen, gens = fn()
            t1 = time.perf_counter()
            total[name].append(t1 - t0)
            wait[name].append(t1 - t_gen)
            requests[name], scores[name] = scorer.requests - before, s
            tokens = sum(len(g.token_ids) for g in gens)
    assert torch.equal(scores["after"], scores["stream"]), "the two ways scored differently"
    srv.shutdown()
    client.close()
    print(C.cpu_line())
    print(C.command_line())
    print(
        f"{len(prompts)} GSM8K responses of SmolLM2-135M-Instruct (fp32, temperature 1, <= {args.max_new_tokens} tokens, "
        f"{tokens / len(prompts):.1f} on average, {args.max_batch_size} engine slots); the endpoint serial at "
        f"{args.request_ms:g} ms/request + {args.sample_ms:g} ms/sample (sleeping); median of {args.repeats}; "
        f"scores equal, mean {float(scores['stream'].mean()):.3f}"
    )
    print(f"{'way':<7} {'seconds':>8} {'waiting after generation':>25} {'requests':>9}")
    for name in ways:
        print(f"{name:<7} {statistics.median(total[name]):8.2f} {statistics.median(wait[name]):25.2f} {requests[name]:9d}")
    print(f"stream / after: {statistics.median(total['after']) / statistics.median(total['stream']):.2f}x")


if __name__ == "__main__":
    main()
