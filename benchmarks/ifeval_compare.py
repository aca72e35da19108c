"""Compare two IFEval results of `python -m aligner.eval ifeval` (before / after training) as Markdown.

Reads two result JSONs and the ``<stem>.responses.jsonl`` written beside each, and prints:

- the four IFEval numbers (prompt- and instruction-level accuracy, strict and loose), the rows cut
  at max_new_tokens and the mean response length in tokens, before, after and the difference;
- accuracy per constraint family (instruction level, strict), before and after;
- how many prompts changed verdict (prompt-level strict) in each direction;
- ``--samples K`` prompts drawn with a seeded generator (``--seed``; not chosen by their verdicts),
  each with both responses (cut to ``--chars`` characters) and their strict verdicts, for a person
  to read for reward hacking (a response that satisfies constraints without addressing the request).

Both results must come from the same prompts and the same max_new_tokens (else ValueError).

    python benchmarks/ifeval_compare.py BEFORE.json AFTER.json [--samples 5] [--seed 0] [--chars 600]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def load(path: Path) -> tuple[dict, dict[int, dict]]:
    """(result JSON, {prompt key: response row}) of one `aligner.eval ifeval` output."""
    result = json.loads(path.read_text())
    rows = [json.loads(line) for line in path.with_name(path.stem + ".responses.jsonl").read_text().splitlines() if line.strip()]
    return result, {r["key"]: r for r in rows}


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def summary_table(before: dict, after: dict) -> str:
    lines = ["| IFEval | before | after | change |", "| --- | --- | --- | --- |"]
    for key, name in [
        ("prompt_strict", "prompt-level strict"),
        ("instruction_strict", "instruction-level strict"),
        ("prompt_loose", "prompt-level loose"),
        ("instruction_loose", "instruction-level loose"),
    ]:
        d = 100 * (after[key] - before[key])
        lines.append(f"| {name} | {pct(before[key])} | {pct(after[key])} | {d:+.1f} points |")
    n = before["n_prompts"]
    lines.append(f"| rows cut at {before['max_new_tokens']} tokens | {before['cut_rows']} of {n} | {after['cut_rows']} of {n} | |")
    b, a = before["mean_response_tokens"], after["mean_response_tokens"]
    lines.append(f"| mean response (tokens) | {b:.0f} | {a:.0f} | {a / b:.2f}x |")
    return "\n".join(lines)


def family_table(before: dict, after: dict) -> str:
    lines = ["| family | constraints | before | after |", "| --- | --- | --- | --- |"]
    for fam, b in sorted(before["per_family"].items()):
        a = after["per_family"][fam]
        lines.append(f"| {fam} | {b['n']} | {pct(b['strict'])} | {pct(a['strict'])} |")
    return "\n".join(lines)


def flips(rows_b: dict[int, dict], rows_a: dict[int, dict]) -> tuple[int, int]:
    """(prompts failed before and passed after, prompts passed before and failed after), prompt-level strict."""
    up = sum(1 for k in rows_b if not all(rows_b[k]["strict"]) and all(rows_a[k]["strict"]))
    down = sum(1 for k in rows_b if all(rows_b[k]["strict"]) and not all(rows_a[k]["strict"]))
    return up, down


def quote(text: str, chars: int) -> str:
    text = text if len(text) <= chars else text[:chars] + f" [... {len(text) - chars} more characters]"
    return "\n".join("> " + line if line else ">" for line in text.splitlines() or [""])


def samples(rows_b: dict[int, dict], rows_a: dict[int, dict], k: int, seed: int, chars: int) -> str:
    keys = random.Random(seed).sample(sorted(rows_b), k)
    out = []
    for key in keys:
        b, a = rows_b[key], rows_a[key]
        out.append(f"#### IFEval key {key}\n\n**Prompt:**\n\n{quote(b['prompt'], chars)}\n")
        for name, r in (("before", b), ("after", a)):
            verdict = ", ".join("pass" if v else "fail" for v in r["strict"])
            out.append(
                f"**{name}** ({r['response_tokens']} tokens, {r['finish_reason']}; strict verdicts: {verdict}):\n\n{quote(r['response'], chars)}\n"
            )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chars", type=int, default=600)
    args = ap.parse_args()
    (before, rows_b), (after, rows_a) = load(args.before), load(args.after)
    if set(rows_b) != set(rows_a) or before["max_new_tokens"] != after["max_new_tokens"]:
        raise ValueError(f"{args.before} and {args.after} score different prompts or budgets: compare runs of the same command")
    print(f"before: {before['model']}\nafter:  {after['model']}\n")
    print(summary_table(before, after), "\n")
    up, down = flips(rows_b, rows_a)
    print(f"prompt-level strict: {up} prompts fail before and pass after, {down} pass before and fail after\n")
    print(family_table(before, after), "\n")
    if args.samples:
        print(samples(rows_b, rows_a, args.samples, args.seed, args.chars))


if __name__ == "__main__":
    main()
