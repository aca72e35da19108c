"""Two IFEval runs side by side on the same prompts, with McNemar's exact test on the paired prompt verdicts.

    python benchmarks/ifeval_paired.py BEFORE.responses.jsonl AFTER.responses.jsonl [--json OUT]

Both files are ``python -m aligner.eval ifeval``'s per-prompt rows (key, response, finish_reason,
response_tokens, strict verdicts), joined on ``key``. Prints prompt- and instruction-level strict, rows cut at
the limit and mean length of each, the prompts passed by one and not the other (b: after only, c: before
only) and McNemar's exact two-sided p-value (:func:`aligner.eval.mcnemar_exact`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aligner.eval import mcnemar_exact  # noqa: E402


def rows(path: Path) -> dict:
    return {r["key"]: r for r in (json.loads(x) for x in path.read_text().splitlines() if x.strip())}


def compare(before: dict, after: dict) -> dict:
    keys = [k for k in before if k in after]
    if len(keys) != len(before) or len(keys) != len(after):
        raise SystemExit(f"the two files cover different prompts ({len(before)} and {len(after)} rows, {len(keys)} shared)")

    def stats(d):
        ins = sum(len(d[k]["strict"]) for k in keys)
        return {
            "prompt_strict": sum(all(d[k]["strict"]) for k in keys) / len(keys),
            "instruction_strict": sum(sum(d[k]["strict"]) for k in keys) / ins,
            "cut_rows": sum(d[k]["finish_reason"] == "length" for k in keys),
            "mean_tokens": sum(d[k]["response_tokens"] for k in keys) / len(keys),
        }

    test = mcnemar_exact([all(before[k]["strict"]) for k in keys], [all(after[k]["strict"]) for k in keys])
    return {"before": stats(before), "after": stats(after), "mcnemar": test}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    res = compare(rows(a.before), rows(a.after))
    b, f = res["before"], res["after"]
    print("| IFEval | before | after |\n| --- | ---: | ---: |")
    print(f"| prompt-level strict | {100 * b['prompt_strict']:.1f}% | {100 * f['prompt_strict']:.1f}% |")
    print(f"| instruction-level strict | {100 * b['instruction_strict']:.1f}% | {100 * f['instruction_strict']:.1f}% |")
    print(f"| rows cut at the limit | {b['cut_rows']} | {f['cut_rows']} |")
    print(f"| mean response (tokens) | {b['mean_tokens']:.0f} | {f['mean_tokens']:.0f} |")
    m = res["mcnemar"]
    print(f"McNemar (exact, two-sided) on {m['n']} prompts: {m['b']} pass after only, {m['c']} before only, p = {m['p_value']:.3g}")
    if a.json:
        a.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
