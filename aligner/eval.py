"""`python -m aligner.eval ifeval [conf=PRESET] [key=value ...] [--out FILE] [--limit N]`: a policy on IFEval.

IFEval (Zhou et al. 2023, arXiv 2311.07911): 541 prompts, 834 verifiable constraints of 25 types.
The command composes the preset's PPO config (:func:`aligner.cli.load_config`; ``conf=smollm2_ifeval``
by default) and uses of it:

    actor.init                      the policy (an HF dir, or a run's output_dir with hf/ inside)
    tokenizer.path                  its tokenizer (and chat template; data.apply_chat_template)
    data.eval_path                  the IFEval prompts (IFEval's input_data.jsonl, or any file of
                                    prompt rows in its schema: instruction_id_list, kwargs)
    rollout.sampling.max_new_tokens the response budget, stated in the result
    rollout.max_batch_size          the engine's KV-cache slots

and runs, in this process (no Ray):

    check     every row's constraints against IFEval's checkers (:func:`aligner.data.ifeval.check_rows`):
              an unknown id or kwargs that do not fit is one file:line error, exit 2, before the model loads
    generate  one greedy response per prompt with aligner's rollout engine
              (:class:`aligner.rollout.torch_engine.engine.TorchEngine`, continuous batching over chunks of
              4 x rollout.max_batch_size prompts, a progress line after each), the prompt
              rendered by the tokenizer's chat template; a response that reaches the budget is "cut"
    score     IFEval's four numbers, strict and loose at prompt and instruction level, and accuracy
              per constraint family and per id (:func:`aligner.reward.ifeval.ifeval_metrics`)

Output: the result JSON (``--out``, default ``<output_dir>/ifeval.json``) holding the four numbers,
``cut_rows``, ``max_new_tokens``, mean response length (tokens), generation wall time and
tokens/s, the per-family and per-id tables; and beside it ``<out stem>.responses.jsonl``: each
prompt's key, prompt, response, finish reason, length and strict verdicts. A summary is printed.
``--limit N`` evaluates the first N prompts only (a fixed subset). ``--rescore FILE`` scores the
responses of an earlier evaluation (its ``.responses.jsonl``) again, without generating.

The same scoring runs during training on the first ``task.num_eval`` held-out prompts
(``data.eval_path``) through :func:`aligner.trainers.evaluation.evaluate_greedy`, logged as
``eval_prompt_strict`` and the others.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from aligner.cli import load_config, setup_logging
from aligner.config import AlignerConfig, ConfigError
from aligner.errors import UserError

log = logging.getLogger("aligner.eval")
BENCHMARKS = ("ifeval",)
DEFAULT_PRESET = "smollm2_ifeval"


def load_eval_prompts(cfg: AlignerConfig, tok, limit: int = 0) -> list[dict]:
    """The encoded IFEval prompts of ``data.eval_path`` ({"prompt_ids", "prompt", "metadata", "source"}), checked.

    Prompts are not truncated (a prompt longer than the model's context is an error). Raises
    ValueError / FileNotFoundError naming file:line for a missing file, a malformed row or
    constraints the checkers cannot score.
    """
    from aligner.data.encode import encode_records
    from aligner.data.formats import load_records
    from aligner.data.ifeval import check_rows
    from aligner.data.pipeline import as_user_turn

    path = cfg.data.eval_path
    if not path:
        raise ValueError("data.eval_path is empty: set it to IFEval's input_data.jsonl (docs/ifeval.md says where to get it)")
    recs = load_records(path, "prompt", kind="prompt").records
    if limit:
        recs = recs[:limit]
    check_rows(recs)
    if cfg.data.apply_chat_template:
        recs = [as_user_turn(r, "", True) for r in recs]
    full = cfg.model.max_seq_len
    data_cfg = dataclasses.replace(cfg.data, max_prompt_len=full, max_seq_len=full, truncation="error")
    return encode_records(recs, tok, data_cfg, "prompt").examples


def generate_greedy(cfg: AlignerConfig, tok, prompt_ids: list[list[int]], max_new_tokens: int):
    """(generations, seconds, engine): one greedy response per prompt from ``actor.init`` with the TorchEngine."""
    import torch

    from aligner.config import SamplingConfig
    from aligner.model.hf import load_hf_model
    from aligner.rollout.torch_engine.engine import TorchEngine
    from aligner.runtime.role import resolve_init

    model_dir = resolve_init(cfg.actor.init)
    if model_dir is None:
        raise ValueError("actor.init is empty: give the model to evaluate (an HF dir or a run's output_dir)")
    model, _ = load_hf_model(model_dir)
    if cfg.trainer.num_threads > 0:
        torch.set_num_threads(cfg.trainer.num_threads)
    engine = TorchEngine(model, eos_token_id=tok.eos_token_id, max_batch_size=cfg.rollout.max_batch_size)
    sampling = SamplingConfig(temperature=0.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens)
    chunk = 4 * engine.max_batch_size  # the engine refills its slots within a chunk; a log line after each
    t0, gens = time.perf_counter(), []
    for start in range(0, len(prompt_ids), chunk):
        gens += engine.generate(prompt_ids[start : start + chunk], sampling)
        done, tokens = len(gens), sum(len(g.token_ids) for g in gens)
        log.info("ifeval: %d/%d responses, %d tokens, %.0f tokens/s", done, len(prompt_ids), tokens, tokens / (time.perf_counter() - t0))
    return gens, time.perf_counter() - t0, engine


def evaluate_ifeval(cfg: AlignerConfig, out: Path, limit: int = 0) -> dict:
    """Run the whole evaluation (module docstring); returns the result dict written to `out`."""
    from aligner.data.pipeline import resolve_tokenizer

    tok = resolve_tokenizer(cfg.tokenizer, cfg.task, cfg.output_dir)
    examples = load_eval_prompts(cfg, tok, limit)
    budget = cfg.rollout.sampling.max_new_tokens
    log.info("ifeval: %d prompts from %s, greedy, max_new_tokens=%d, model %s", len(examples), cfg.data.eval_path, budget, cfg.actor.init)
    gens, seconds, engine = generate_greedy(cfg, tok, [e["prompt_ids"] for e in examples], budget)
    responses = [tok.decode(g.token_ids, skip_special_tokens=True) for g in gens]
    generation = {
        "generate_seconds": seconds,
        "tokens_per_second": sum(len(g.token_ids) for g in gens) / seconds if seconds > 0 else 0.0,
        "engine": {"max_batch_size": engine.max_batch_size, "decode_attention": engine.decode_attention, **engine.layout},
    }
    finish = [(g.finish_reason, len(g.token_ids)) for g in gens]
    return score_and_write(cfg, out, examples, responses, finish, budget, generation)


def rescore_ifeval(cfg: AlignerConfig, responses_path: Path, out: Path, limit: int = 0) -> dict:
    """Score the responses of an earlier evaluation again (``--rescore FILE``: its ``.responses.jsonl``,
    joined on ``key`` with the prompts of ``data.eval_path``) with IFEval's checkers, without generating.
    Raises FileNotFoundError for a missing file; ValueError naming file:line for a row that is not JSON or lacks
    the fields, and naming the file for a prompt without a response row."""
    from aligner.data.pipeline import resolve_tokenizer

    tok = resolve_tokenizer(cfg.tokenizer, cfg.task, cfg.output_dir)
    examples = load_eval_prompts(cfg, tok, limit)
    if not Path(responses_path).is_file():
        raise FileNotFoundError(f"--rescore {responses_path}: no such file (an evaluation's <out>.responses.jsonl)")
    rows = {}
    for i, line in enumerate(Path(responses_path).read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{responses_path}:{i}: invalid JSON ({e.msg})") from None
            if not isinstance(r, dict) or not {"key", "response", "finish_reason", "response_tokens"} <= set(r):
                raise ValueError(f"{responses_path}:{i}: a response row needs key, response, finish_reason and response_tokens")
            rows[r["key"]] = r
    missing = [e["metadata"].get("key") for e in examples if e["metadata"].get("key") not in rows]
    if missing:
        raise ValueError(f"{responses_path} has no response for {len(missing)} of the {len(examples)} prompts (first key {missing[0]})")
    picked = [rows[e["metadata"].get("key")] for e in examples]
    finish = [(r["finish_reason"], int(r["response_tokens"])) for r in picked]
    budget = cfg.rollout.sampling.max_new_tokens
    return score_and_write(cfg, out, examples, [r["response"] for r in picked], finish, budget, {"rescored": str(responses_path)})


def score_and_write(
    cfg: AlignerConfig, out: Path, examples: list[dict], responses: list[str], finish: list[tuple[str, int]], budget: int, generation: dict
) -> dict:
    """IFEval's numbers for `responses` (one per example; `finish`: (finish reason, tokens) each), written to
    `out` and its ``.responses.jsonl`` (the checkers are deterministic, so the numbers and the stored verdicts agree)."""
    from aligner.reward.ifeval import ifeval_metrics, verdicts

    prompts = [e["prompt"] for e in examples]
    metas = [e["metadata"] for e in examples]
    res = ifeval_metrics(prompts, responses, metas, [f == "length" for f, _ in finish])
    result = {
        "benchmark": "ifeval",
        "model": cfg.actor.init,
        "data": cfg.data.eval_path,
        "decoding": "greedy",
        "chat_template": bool(cfg.data.apply_chat_template),
        "max_new_tokens": budget,
        **{k: res[k] for k in ("prompt_strict", "instruction_strict", "prompt_loose", "instruction_loose")},
        "cut_rows": res["cut_rows"],
        "n_prompts": res["n_prompts"],
        "n_instructions": res["n_instructions"],
        "mean_response_tokens": sum(n for _, n in finish) / len(finish),
        "generate_seconds": 0.0,
        "tokens_per_second": 0.0,
        **generation,
        "per_family": res["per_family"],
        "per_instruction": res["per_instruction"],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    rows_path = out.with_name(out.stem + ".responses.jsonl")
    with open(rows_path, "w", encoding="utf-8") as f:
        for e, (reason, n), r in zip(examples, finish, responses):
            v = verdicts(e["prompt"], r, e["metadata"])
            row = {
                "key": e["metadata"].get("key"),
                "source": e["source"],
                "prompt": e["prompt"],
                "response": r,
                "finish_reason": reason,
                "response_tokens": n,
                "strict": [s for _, s, _ in v],
                "loose": [lo for _, _, lo in v],
            }
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    out.write_text(json.dumps(result, indent=2, default=str))
    return result


def mcnemar_exact(before: Sequence[bool], after: Sequence[bool]) -> dict:
    """McNemar's exact test on paired binary verdicts (McNemar 1947; the exact form is the two-sided
    binomial sign test on the discordant pairs).

    before, after: one verdict per item (e.g. IFEval's prompt-level strict pass of each of the 541
    prompts), in the same order. b = items passed after and failed before, c = the reverse; under the
    null hypothesis each discordant item is b or c with probability 1/2, so
    p = min(1, 2 * sum_{k <= min(b, c)} C(b + c, k) / 2^(b + c)) (p = 1 when b + c = 0).
    Returns {"n", "b", "c", "p_value"}. Raises ValueError when the lengths differ or are 0.
    """
    if len(before) != len(after) or not before:
        raise ValueError(f"mcnemar_exact: {len(before)} verdicts before and {len(after)} after: give one pair per item, at least one")
    b = sum(1 for x, y in zip(before, after) if y and not x)
    c = sum(1 for x, y in zip(before, after) if x and not y)
    n = b + c
    if n == 0:
        return {"n": len(before), "b": 0, "c": 0, "p_value": 1.0}
    from fractions import Fraction
    from math import comb

    tail = Fraction(sum(comb(n, k) for k in range(min(b, c) + 1)), 2**n)
    return {"n": len(before), "b": b, "c": c, "p_value": float(min(Fraction(1), 2 * tail))}


def summary(result: dict) -> str:
    """The four numbers, the cut rows and the per-family table as text."""
    pct = lambda x: f"{100 * x:5.1f}%"  # noqa: E731
    lines = [
        f"IFEval ({result['n_prompts']} prompts, {result['n_instructions']} constraints), greedy, "
        f"max_new_tokens={result['max_new_tokens']}, model {result['model']}",
        f"  prompt-level strict       {pct(result['prompt_strict'])}",
        f"  instruction-level strict  {pct(result['instruction_strict'])}",
        f"  prompt-level loose        {pct(result['prompt_loose'])}",
        f"  instruction-level loose   {pct(result['instruction_loose'])}",
        f"  rows cut at the limit     {result['cut_rows']} of {result['n_prompts']}",
        f"  mean response             {result['mean_response_tokens']:.0f} tokens; "
        + (
            f"rescored from {result['rescored']}"
            if "rescored" in result
            else f"generation {result['generate_seconds']:.0f} s ({result['tokens_per_second']:.0f} tokens/s)"
        ),
        "  per family (n, strict, loose):",
    ]
    lines += [f"    {k:20s} {v['n']:4d} {pct(v['strict'])} {pct(v['loose'])}" for k, v in result["per_family"].items()]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse, validate, evaluate; returns the exit code (2 for bad configuration or input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    setup_logging()
    ap = argparse.ArgumentParser(prog="python -m aligner.eval", description=__doc__.splitlines()[0], add_help=True)
    ap.add_argument("benchmark", choices=BENCHMARKS)
    ap.add_argument("--out", default="", help="result JSON (default <output_dir>/ifeval.json)")
    ap.add_argument("--limit", type=int, default=0, help="evaluate the first N prompts only (0: all)")
    ap.add_argument("--rescore", default="", help="score an earlier evaluation's .responses.jsonl again instead of generating")
    args, overrides = ap.parse_known_args(argv)
    bad = [o for o in overrides if o.startswith("-") or "=" not in o]
    if bad:
        print(f"aligner eval: error: {bad[0]!r} is neither an option (--out, --limit) nor a key=value override", file=sys.stderr)
        return 2
    if not any(o.startswith("conf=") for o in overrides):
        overrides = [f"conf={DEFAULT_PRESET}", *overrides]
    try:
        if args.limit < 0:
            raise UserError(f"--limit {args.limit} is invalid: give 0 (all prompts) or a positive count")
        cfg = load_config("ppo", overrides)
        out = Path(args.out or os.path.join(cfg.output_dir, "ifeval.json"))
        if args.rescore and Path(args.rescore).resolve() == out.with_name(out.stem + ".responses.jsonl").resolve():
            raise UserError(f"--rescore {args.rescore} is the file --out would write: give another --out")
        result = rescore_ifeval(cfg, Path(args.rescore), out, args.limit) if args.rescore else evaluate_ifeval(cfg, out, args.limit)
    except (ConfigError, UserError, ValueError, FileNotFoundError, ImportError) as e:
        print(f"aligner eval: error: {e}", file=sys.stderr)
        return 2
    print(summary(result))
    print(f"wrote {out} and {out.with_name(out.stem + '.responses.jsonl')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
