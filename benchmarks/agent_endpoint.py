"""What the OpenAI-compatible endpoint adds to a call (docs/agents.md): the same greedy chat turns
sampled by the engine's generate directly and through the endpoint with the real `openai` client.

    python benchmarks/agent_endpoint.py --calls 30 --tokens 16

The engine is the test suite's bigram Llama (tests/toolkit/agent.py, fp32, CPU); each call's prompt
is the chat template's rendering of one user turn (~30 tokens); the endpoint's answer is the same
tokens (checked). Prints the median seconds per call each way, alternating the ways call by call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import openai  # noqa: E402

from aligner.config import SamplingConfig  # noqa: E402
from aligner.rollout.agent.openai_server import OpenAIEndpoint  # noqa: E402
from tests.toolkit.agent import MAX_SEQ_LEN, agent_tokenizer, bigram_engine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=16, help="max_tokens per call (the bigram writes 8 and stops)")
    args = ap.parse_args()
    tok = agent_tokenizer(tempfile.mkdtemp())
    engine = bigram_engine(tok)
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=args.tokens)
    direct, served = [], []
    with OpenAIEndpoint(engine, tok, max_seq_len=MAX_SEQ_LEN, token="bench") as ep:
        client = openai.OpenAI(base_url=ep.url, api_key="bench", max_retries=0)
        for i in range(args.calls + 2):  # the first two of each way warm up
            messages = [{"role": "user", "content": f"{i}+{i}="}]
            ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
            t0 = time.perf_counter()
            want = engine.generate([ids], sampling)[0].token_ids
            t1 = time.perf_counter()
            r = client.chat.completions.create(
                model=ep.model_name,
                messages=messages,
                temperature=0,
                max_tokens=args.tokens,
                user=f"b{i}",
                extra_body={"return_token_ids": True},
            )
            t2 = time.perf_counter()
            assert r.choices[0].model_extra["token_ids"] == want
            if i >= 2:
                direct.append(t1 - t0)
                served.append(t2 - t1)
    d, s = statistics.median(direct), statistics.median(served)
    print(
        f"calls={args.calls} tokens/call={len(want)}: generate {d * 1e3:.2f} ms, through the endpoint {s * 1e3:.2f} ms (+{(s - d) * 1e3:.2f} ms, {s / d:.2f}x)"
    )


if __name__ == "__main__":
    main()
