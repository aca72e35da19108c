"""Benchmark: tool episodes whose tool answers slowly, environments stepped on the engine's thread
(``env.step_workers=0``) against stepped beside decoding (``env.step_workers=N``, parked rows).

Input: a tiny_tools policy (as benchmarks/episodes.py: ``--model`` is its HF export) and the task's
held-out prompts through its chat template; greedy episodes of the tool environment with the
calculator, whose every call is made to take ``--tool-ms`` longer (a sleep: a remote tool or a
sandboxed program, which takes wall time but not this process's CPU). With ``step_workers=0`` every
tool call holds the whole batch; with workers the calling rows are parked and the others decode. The
episodes are checked equal between the ways (greedy). Ways alternate, --repeats times each.

    python benchmarks/slow_tools.py --model /path/to/tiny_tools/ppo/hf --tool-ms 50
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
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--slots", type=int, default=32, help="the engine's max_batch_size")
    ap.add_argument("--tool-ms", type=float, default=50.0, help="added to every environment step, milliseconds")
    ap.add_argument("--workers", type=int, default=4, help="env.step_workers of the threaded way")
    ap.add_argument("--max-new-tokens", type=int, default=72)
    ap.add_argument("--repeats", type=int, default=3)
    return ap.parse_args()


def main() -> None:
    args = parse()
    tok, model, texts, prompts = C.tiny_tools_inputs(args.model, args.episodes)
    engine = TorchEngine(model, eos_token_id=tok.eos_token_id, max_batch_size=args.slots)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=args.max_new_tokens)
    spec = EnvSpec(reward_fn=get_rule("task_accuracy"), tools=("calculator",), chat_template=tok.chat_template)
    delay = args.tool_ms / 1000

    def slow_env():
        env = make_env("tool", spec)
        step = env.step

        def slow_step(turn):
            time.sleep(delay)
            return step(turn)

        env.step = slow_step
        return env

    def run(workers: int):
        d = TokenEpisodes(
            slow_env, tok, [(t, {}) for t in texts], max_turns=2, timeout_s=30, stop_ids=engine.stop_ids(greedy), step_workers=workers
        )
        try:
            gens = engine.generate(prompts, greedy, turn_end=d)
        finally:
            d.close()
        return [g.token_ids for g in gens], dict(engine.last_stats)

    ways = {"engine thread": 0, f"{args.workers} step threads": args.workers}
    times: dict[str, list[float]] = {k: [] for k in ways}
    stats: dict[str, dict] = {}
    ref = None
    for _ in range(args.repeats):
        for name, workers in ways.items():
            t0 = time.perf_counter()
            tokens, st = run(workers)
            times[name].append(time.perf_counter() - t0)
            stats[name] = st
            ref = ref or tokens
            assert tokens == ref, f"{name}: other episodes than the first way's"
    n = len(prompts)
    st = stats["engine thread"]
    print(C.cpu_line())
    print(C.command_line())
    print(
        f"{n} greedy tool episodes of {args.model}, {args.slots} engine slots, +{args.tool_ms:g} ms a tool call: "
        f"{st['turns'] / n:.2f} model turns per episode; fp32, median of {args.repeats}; episodes equal between the ways"
    )
    print(f"{'environments stepped on':<20} {'seconds':>8} {'decode steps':>13} {'parked decode rows':>19}")
    for name in ways:
        s = stats[name]
        print(f"{name:<20} {statistics.median(times[name]):8.3f} {s['decode_steps']:13d} {s.get('parked_rows', 0):19d}")


if __name__ == "__main__":
    main()
