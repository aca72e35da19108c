"""What the loops cost on IFEval: prompt-level strict among responses that ended and those cut at the limit.

    python benchmarks/ifeval_diagnose.py RESPONSES.jsonl [--data data/ifeval/input_data.jsonl] [--json OUT]

RESPONSES.jsonl is the ``<out>.responses.jsonl`` that ``python -m aligner.eval ifeval`` writes (one row per
prompt: key, prompt, response, finish_reason, response_tokens, strict and loose verdicts); --data is
IFEval's input_data.jsonl, which gives each row's constraint ids and kwargs (joined on ``key``).

Prints, for the ended (finish_reason "stop") and the cut ("length") responses: their count, prompt- and
instruction-level strict, mean length; the same per constraint family (instruction-level strict); and two
answers to "what would ending the loops alone be worth":

- de-looped: each cut response truncated where its first repeat begins (the first line, else the first
  sentence, equal to an earlier one), then scored again with IFEval's checkers (the same verifiers as
  the evaluation): what the same text would score had the model stopped where it began repeating;
- at the ended rate: the cut prompts scored at the ended responses' prompt-level rate (an upper
  reference, not a measurement: the prompts that loop may be the harder ones).

Also the constant-response floor ("hello world. " thirty times for every prompt), scored the same way.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SENTENCE = re.compile(r"(?<=[.!?])\s+")


def deloop(text: str) -> str:
    """`text` cut before its first repeat: the first non-empty line equal to an earlier one (stripped),
    else the first sentence equal to an earlier one; unchanged when nothing repeats."""
    lines = text.split("\n")
    seen, out = set(), []
    for ln in lines:
        key = ln.strip()
        if key and key in seen:
            return "\n".join(out).rstrip()
        if key:
            seen.add(key)
        out.append(ln)
    parts = SENTENCE.split(text)
    seen_s, kept = set(), []
    for s in parts:
        key = s.strip()
        if key and key in seen_s:
            return " ".join(kept).rstrip()
        if key:
            seen_s.add(key)
        kept.append(s)
    return text


def load(responses: Path, data: Path) -> list[dict]:
    """The responses joined with their IFEval rows (instruction_id_list, kwargs) on key."""
    rows = {json.loads(x)["key"]: json.loads(x) for x in data.read_text().splitlines() if x.strip()}
    out = []
    for line in responses.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        meta = rows[r["key"]]
        out.append({**r, "instruction_id_list": meta["instruction_id_list"], "kwargs": meta["kwargs"]})
    return out


def diagnose(rows: list[dict]) -> dict:
    """The tables of the module docstring as a dict (fractions in [0, 1])."""
    from aligner.reward.ifeval import family, verdicts

    def group(sel):
        g = [r for r in rows if sel(r)]
        n_ins = sum(len(r["strict"]) for r in g)
        return {
            "n": len(g),
            "prompt_strict": sum(all(r["strict"]) for r in g) / max(len(g), 1),
            "instruction_strict": sum(sum(r["strict"]) for r in g) / max(n_ins, 1),
            "mean_tokens": sum(r["response_tokens"] for r in g) / max(len(g), 1),
        }

    ended, cut = (lambda r: r["finish_reason"] != "length"), (lambda r: r["finish_reason"] == "length")
    res = {"all": group(lambda r: True), "ended": group(ended), "cut": group(cut)}
    fam: dict[str, dict[str, list[int]]] = defaultdict(lambda: {"ended": [0, 0], "cut": [0, 0]})
    for r in rows:
        side = "cut" if cut(r) else "ended"
        for cid, ok in zip(r["instruction_id_list"], r["strict"]):
            fam[family(cid)][side][0] += 1
            fam[family(cid)][side][1] += int(ok)
    res["per_family"] = {
        k: {s: {"n": v[s][0], "strict": v[s][1] / v[s][0] if v[s][0] else None} for s in ("ended", "cut")} for k, v in sorted(fam.items())
    }
    # de-looped cut responses, scored again
    passes, changed = 0, 0
    for r in rows:
        if not cut(r):
            passes += all(r["strict"])
            continue
        text = deloop(r["response"])
        changed += text != r["response"]
        v = verdicts(r["prompt"], text, {"instruction_id_list": r["instruction_id_list"], "kwargs": r["kwargs"]})
        passes += all(s for _, s, _ in v)
    n = len(rows)
    res["delooped"] = {"prompt_strict": passes / n, "cut_rows_shortened": changed}
    e = res["ended"]
    res["cut_at_ended_rate"] = {"prompt_strict": (e["prompt_strict"] * e["n"] + e["prompt_strict"] * res["cut"]["n"]) / n}
    const = "hello world. " * 30
    res["constant_floor"] = {
        "prompt_strict": sum(
            all(s for _, s, _ in verdicts(r["prompt"], const, {"instruction_id_list": r["instruction_id_list"], "kwargs": r["kwargs"]}))
            for r in rows
        )
        / n
    }
    return res


def table(res: dict) -> str:
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    lines = [
        "| responses | n | prompt-level strict | instruction-level strict | mean tokens |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for k in ("all", "ended", "cut"):
        g = res[k]
        lines.append(f"| {k} | {g['n']} | {pct(g['prompt_strict'])} | {pct(g['instruction_strict'])} | {g['mean_tokens']:.0f} |")
    lines += ["", "| family | ended: n | ended: strict | cut: n | cut: strict |", "| --- | ---: | ---: | ---: | ---: |"]
    for k, v in res["per_family"].items():
        lines.append(f"| {k} | {v['ended']['n']} | {pct(v['ended']['strict'])} | {v['cut']['n']} | {pct(v['cut']['strict'])} |")
    lines += [
        "",
        f"prompt-level strict as measured: {pct(res['all']['prompt_strict'])}",
        f"cut responses de-looped (cut before the first repeat, {res['delooped']['cut_rows_shortened']} shortened) and re-scored: "
        f"{pct(res['delooped']['prompt_strict'])}",
        f"cut prompts at the ended responses' rate (reference, not a measurement): {pct(res['cut_at_ended_rate']['prompt_strict'])}",
        f"constant response ('hello world. ' x 30): {pct(res['constant_floor']['prompt_strict'])}",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("responses", type=Path)
    ap.add_argument("--data", type=Path, default=ROOT / "data" / "ifeval" / "input_data.jsonl")
    ap.add_argument("--json", type=Path, default=None, help="also write the result dict here")
    args = ap.parse_args(argv)
    res = diagnose(load(args.responses, args.data))
    print(table(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
