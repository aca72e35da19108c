"""Benchmark: multi-turn generation on the tiny_tools policy's real tool episodes:
episodes continued from the KV cache against re-prefilling each turn's whole context, and against
single-turn generation of as many tokens.

An engine that cannot continue an episode (aligner's before it played episodes, or a server without session
affinity) generates each turn as a new request whose prompt is the whole conversation so far: the
prompt, the earlier turns and the observations are prefilled again at every turn. aligner's
continuous scheduler keeps each episode's KV-cache slot and feeds the observation's tokens as that
row's decode inputs, batched with the other rows.

Input: a tiny_tools policy (``python -m aligner.sft conf=tiny_tools`` then ``python -m aligner.ppo
conf=tiny_tools``; --model is its HF export, default outputs/tiny_tools/ppo/hf) and the task's held-out
prompts through its chat template; greedy episodes of the tool environment with the calculator (at
most 2 model turns: a call, then the answer). Three ways, alternating, --repeats times each:

- ``episodes``: one generate() call with the episodes' turn_end callback;
- ``re-prefill``: the first turns in one call, then the second turns of the episodes that called the
  tool in a second call whose prompts are the whole context (prompt, call, tool response); the
  tokens are checked to equal the episodes' (greedy);
- ``single-turn``: one call whose responses are as long as each episode's tokens (own and
  observation), with no stop token: the decode positions of the episodes without an environment.

Printed per way: wall seconds (median), prompt tokens prefilled per episode, decode steps.

    python benchmarks/episodes.py --model /path/to/tiny_tools/ppo/hf
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

from aligner.config import SamplingConfig  # noqa: E402
from aligner.envs import EnvSpec, TokenEpisodes, make_env  # noqa: E402
from aligner.reward.rules import get_rule  # noqa: E402
from aligner.rollout.torch_engine.engine import TorchEngine  # noqa: E402


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="outputs/tiny_tools/ppo/hf", help="a tiny_tools policy's HF export (with its tokenizer)")
    ap.add_argument("--episodes", type=int, default=256, help="held-out problems (at most task.num_eval = 256)")
    ap.add_argument("--max-new-tokens", type=int, default=72)
    ap.add_argument("--repeats", type=int, default=5)
    return ap.parse_args()


def main() -> None:
    args = parse()
    tok, model, texts, prompts = C.tiny_tools_inputs(args.model, args.episodes)
    engine = TorchEngine(model, eos_token_id=tok.eos_token_id, max_batch_size=len(prompts))
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=args.max_new_tokens)
    spec = EnvSpec(reward_fn=get_rule("task_accuracy"), tools=("calculator",), chat_template=tok.chat_template)

    def driver():
        return TokenEpisodes(
            lambda: make_env("tool", spec), tok, [(t, {}) for t in texts], max_turns=2, timeout_s=30, stop_ids=engine.stop_ids(greedy)
        )

    def episodes():
        d = driver()
        gens = engine.generate(prompts, greedy, turn_end=d)
        return [g.token_ids for g in gens], dict(engine.last_stats)

    def reprefill():
        d = driver()
        first = engine.generate(prompts, greedy)
        st = dict(engine.last_stats)
        out = [list(g.token_ids) for g in first]
        cont, idx = [], []
        for i, g in enumerate(first):
            obs = d(i, g.token_ids, args.max_new_tokens - len(g.token_ids))
            if obs:
                out[i] += obs
                cont.append(prompts[i] + out[i])
                idx.append(i)
        if cont:
            budgets = [args.max_new_tokens - len(out[i]) for i in idx]
            second = engine.generate(cont, greedy, max_new_tokens=budgets)
            for i, g in zip(idx, second):
                out[i] += g.token_ids
            for k in ("prefilled_tokens", "decode_steps"):
                st[k] += engine.last_stats[k]
        return out, st

    lengths: list[int] = []

    plain = TorchEngine(model, eos_token_id=None, max_batch_size=len(prompts))  # no stop token: every response runs to its length

    def single():
        plain.generate(
            prompts, SamplingConfig(temperature=0.0, max_new_tokens=args.max_new_tokens, stop_token_ids=[]), max_new_tokens=lengths
        )
        return None, dict(plain.last_stats)

    ref, ref_stats = episodes()
    lengths[:] = [len(t) for t in ref]
    ways = {"episodes": episodes, "re-prefill": reprefill, "single-turn": single}
    times: dict[str, list[float]] = {k: [] for k in ways}
    stats: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            tokens, st = fn()
            times[name].append(time.perf_counter() - t0)
            stats[name] = st
            if name == "re-prefill":
                same = sum(a == b for a, b in zip(tokens, ref))
                assert same >= 0.95 * len(ref), f"re-prefill gave other tokens in {len(ref) - same} episodes"
    n = len(prompts)
    called = ref_stats["observation_tokens"] > 0
    print(C.cpu_line())
    print(C.command_line())
    print(
        f"{n} greedy tool episodes of {args.model}: {ref_stats['turns'] / n:.2f} model turns and "
        f"{ref_stats['observation_tokens'] / n:.1f} observation tokens per episode ({'tools called' if called else 'no tool called'}), "
        f"{sum(lengths) / n:.1f} tokens after the prompt; fp32, median of {args.repeats}"
    )
    print(f"{'way':<12} {'seconds':>8} {'x episodes':>10} {'prefilled/episode':>18} {'decode steps':>13}")
    base = statistics.median(times["episodes"])
    for name in ways:
        t = statistics.median(times[name])
        print(f"{name:<12} {t:8.3f} {t / base:10.2f} {stats[name]['prefilled_tokens'] / n:18.1f} {stats[name]['decode_steps']:13d}")


if __name__ == "__main__":
    main()
