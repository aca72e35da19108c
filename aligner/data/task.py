"""The built-in task: multi-digit addition ("12+39=" -> "51" then EOS), a function of TaskConfig.seed.

Owns: problem generation, the rule checker :func:`check_answer`, every split of the task
(SFT demonstrations, preference pairs, RL prompts, and held-out eval versions of each),
the task's own tokenizer (:func:`build_task_tokenizer`) and :func:`write_task_files`, which
materializes the splits as jsonl in the standard formats (sft, pairs, prompt) so that the
task goes through the same loading path as user data.

The SFT demonstrations are deliberately imperfect so that PPO has something to fix: for
problems with a carry, a fraction ``carry_error_rate`` (default 60%) of demonstrations
"forget the carry" (each column's digit sum mod 10, e.g. 15+27 -> "32"). An SFT model then
answers carry problems wrong greedily (the majority answer) while the correct answer still
appears in the data (sampling finds it, the RM and the rule reward prefer it). The preference
pairs contrast the correct sum with the problem's carry mistake: a dropped carry where one is
due (or, for a quarter of those, a carry too many), a phantom carry where none is, so the RM
must learn when, and how many times, a carry happens. Problems
without a carry are always demonstrated correctly, so held-out greedy accuracy of an SFT
model is about the fraction of carry-free problems: ~47% with the default 1-2 digit operands.

Tool demonstrations (``task.tool_demo_rate`` > 0, the ``tiny_tools`` preset; docs/environments.md): that
fraction of the SFT demonstrations, drawn uniformly over the problems, is a conversation in which
the model calls the calculator (:func:`tool_call_text`, the Hermes tag format of
aligner.envs.tool_env), reads its result back (:func:`tool_response_text`, the user message the
tool environment sends for a template without a tool format) and then answers; those answers are
always right, the direct ones keep their carry errors. An SFT model then answers directly and
greedily (the majority) and calls the tool on a minority of samples: RL can find that the call pays
on carry problems.

Determinism: every split draws from ``random.Random(f"{seed}:{split}")`` (Python's string
seeding is independent of PYTHONHASHSEED). The held-out problems are drawn first and
excluded from every train split.
"""

from __future__ import annotations

import json
import os
import random
import re
from typing import Optional

from aligner.config import TaskConfig

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
_PROMPT_RE = re.compile(r"^\s*(\d+)\s*\+\s*(\d+)\s*=\s*$")
# Characters of the task tokenizer, in priority order (cut to the vocabulary budget).
_ALPHABET = "0123456789+=-▁?\n" + "abcdefghijklmnopqrstuvwxyz" + "<|>" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ.,:!*/()#'\"" + "{}_"


def _draw_operand(rng: random.Random, cfg: TaskConfig) -> int:
    width = rng.randint(cfg.min_digits, cfg.max_digits)
    lo = 0 if width == 1 else 10 ** (width - 1)
    return rng.randint(lo, 10**width - 1)


def make_prompt(a: int, b: int) -> str:
    """The prompt text of problem a + b, e.g. ``make_prompt(12, 39) == "12+39="``."""
    return f"{a}+{b}="


def parse_prompt(prompt: str) -> tuple[int, int]:
    """(a, b) of a task prompt "a+b="; ValueError naming the prompt when it is not one."""
    m = _PROMPT_RE.match(prompt)
    if m is None:
        raise ValueError(f"not an addition-task prompt: {prompt!r} (expected digits '+' digits '=', e.g. '12+39=')")
    return int(m.group(1)), int(m.group(2))


def has_carry(a: int, b: int) -> bool:
    """True when adding a and b column by column (base 10) carries at least once."""
    while a or b:
        if a % 10 + b % 10 >= 10:
            return True
        a, b = a // 10, b // 10
    return False


def forget_carry(a: int, b: int) -> str:
    """The "forgot the carry" answer: each column's digit sum mod 10 (15+27 -> "32", 95+17 -> "2")."""
    digits, place = 0, 1
    while a or b:
        digits += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return str(digits)


def check_answer(prompt: str, response: str) -> bool:
    """True iff `response` (stripped of surrounding whitespace) is exactly the decimal sum.

    prompt: "a+b=" (ValueError otherwise); response: decoded text without special tokens.
    """
    a, b = parse_prompt(prompt)
    return response.strip() == str(a + b)


def mistake_breakdown(prompts: list[str], responses: list[str]) -> dict[str, float]:
    """Greedy answers to task prompts split by whether the problem has a carry.

    Returns accuracy_carry / accuracy_no_carry (fraction correct in each group) and
    dropped_carry (fraction of carry problems answered with the dropped-carry sum, the mistake
    the SFT demonstrations teach and the RM's pairs penalize); a group with no problems is left out.
    Raises ValueError for a prompt that is not "a+b=".
    """
    carry = {True: [0, 0, 0], False: [0, 0, 0]}  # n, correct, dropped
    for prompt, response in zip(prompts, responses):
        a, b = parse_prompt(prompt)
        c = carry[has_carry(a, b)]
        c[0] += 1
        c[1] += response.strip() == str(a + b)
        c[2] += has_carry(a, b) and response.strip() == forget_carry(a, b)
    out = {}
    for group, (n, ok, _dropped) in (("carry", carry[True]), ("no_carry", carry[False])):
        if n:
            out[f"accuracy_{group}"] = ok / n
    if carry[True][0]:
        out["dropped_carry"] = carry[True][2] / carry[True][0]
    return out


def phantom_carry(a: int, b: int, rng: random.Random) -> str:
    """A "phantom carry" answer for a problem without a carry: the sum with a carry added into a
    random column (+10 or +100 for 1-2 digit operands), e.g. 12+31 -> "53" or "143"."""
    correct = a + b
    place = 10 ** rng.randint(1, max(1, len(str(max(a, b)))))
    return str(correct + place)


# Fraction of carry problems whose rejected answer over-carries (a phantom carry on top of the
# real ones) instead of dropping the carry. Without it over-carrying never appeared as a rejected
# answer, the RM scored it well, and PPO learned it from a weak SFT policy (docs/data.md, "The built-in
# task": 60+38 -> "101" on the 2026-11-22 machine).
OVER_CARRY_FRACTION = 0.25


def _wrong_answer(rng: random.Random, a: int, b: int) -> tuple[str, str]:
    """The plausible wrong answer of a problem and its kind: a carry mistake in either direction.

    Where a carry is due: dropped_carry (what the imperfect SFT demonstrations do), or with
    probability OVER_CARRY_FRACTION over_carry (the sum plus a phantom carry, :func:`phantom_carry`);
    where none is: phantom_carry. Both directions appear so that "the larger answer is better" is
    no shortcut: the reward model has to learn when, and how many times, a carry happens.
    """
    if not has_carry(a, b):
        return phantom_carry(a, b, rng), "phantom_carry"
    if rng.random() < OVER_CARRY_FRACTION:
        return phantom_carry(a, b, rng), "over_carry"
    return forget_carry(a, b), "dropped_carry"


def _problems(cfg: TaskConfig, split: str, n: int, exclude: frozenset) -> list[tuple[int, int]]:
    rng = random.Random(f"{cfg.seed}:{split}")
    out = []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 100 * n + 10000:
            raise ValueError(
                f"task: cannot draw {n} {split} problems outside the held-out set with "
                f"task.min_digits={cfg.min_digits}, task.max_digits={cfg.max_digits}: raise task.max_digits or lower task.num_eval"
            )
        p = (_draw_operand(rng, cfg), _draw_operand(rng, cfg))
        if p not in exclude:
            out.append(p)
    return out


def eval_problems(cfg: TaskConfig) -> list[tuple[int, int]]:
    """The held-out problems (distinct pairs, disjoint from every train split)."""
    rng = random.Random(f"{cfg.seed}:eval")
    space = (10**cfg.max_digits) ** 2
    if cfg.num_eval > space // 4:
        raise ValueError(f"task.num_eval={cfg.num_eval} is too large for task.max_digits={cfg.max_digits}: use at most {space // 4}")
    seen: dict = {}
    while len(seen) < cfg.num_eval:
        seen.setdefault((_draw_operand(rng, cfg), _draw_operand(rng, cfg)), None)
    return list(seen)


def tool_call_text(a: int, b: int) -> str:
    """The calculator call for a + b in the Hermes tag format (compact JSON), e.g.
    ``<tool_call>{"name":"calculator","arguments":{"expression":"12+39"}}</tool_call>``."""
    call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a}+{b}"}}, separators=(",", ":"))
    return f"<tool_call>{call}</tool_call>"


def tool_response_text(a: int, b: int) -> str:
    """The calculator's result as the tool environment returns it to a template without a tool format."""
    return f"<tool_response>\n{a + b}\n</tool_response>"


def tool_demo(a: int, b: int) -> dict:
    """An SFT row in which the model calls the calculator, reads the result and answers (every
    assistant turn is trained; the tool's response is not)."""
    return {
        "messages": [
            {"role": "user", "content": make_prompt(a, b)},
            {"role": "assistant", "content": tool_call_text(a, b)},
            {"role": "user", "content": tool_response_text(a, b)},
            {"role": "assistant", "content": str(a + b)},
        ],
        "correct": True,
        "tool": True,
    }


def sft_records(cfg: TaskConfig, split: str = "train") -> list[dict]:
    """SFT rows {"prompt", "response", "correct"}: train has carry errors at carry_error_rate, eval is all
    correct; with tool_demo_rate > 0 every train row is a conversation ({"messages", "correct", "tool"})
    and that fraction of them, drawn from their own random stream, are tool conversations (:func:`tool_demo`)."""
    held = eval_problems(cfg)
    if split == "eval":
        return [{"prompt": make_prompt(a, b), "response": str(a + b), "correct": True} for a, b in held]
    rng = random.Random(f"{cfg.seed}:sft_errors")
    tools = random.Random(f"{cfg.seed}:sft_tools")
    rows = []
    for a, b in _problems(cfg, "sft", cfg.num_sft, frozenset(held)):
        wrong = has_carry(a, b) and rng.random() < cfg.carry_error_rate
        answer = forget_carry(a, b) if wrong else str(a + b)
        if cfg.tool_demo_rate <= 0:
            rows.append({"prompt": make_prompt(a, b), "response": answer, "correct": not wrong})
        elif tools.random() < cfg.tool_demo_rate:
            rows.append(tool_demo(a, b))
        else:  # one file, one format: the direct answers as conversations too
            turns = [{"role": "user", "content": make_prompt(a, b)}, {"role": "assistant", "content": answer}]
            rows.append({"messages": turns, "correct": not wrong, "tool": False})
    return rows


def pair_records(cfg: TaskConfig, split: str = "train") -> list[dict]:
    """Preference rows {"prompt", "chosen" (correct), "rejected" (plausibly wrong), "rejected_kind"}."""
    held = eval_problems(cfg)
    problems = held if split == "eval" else _problems(cfg, "pairs", cfg.num_pairs, frozenset(held))
    rng = random.Random(f"{cfg.seed}:pairs_{split}")
    rows = []
    for a, b in problems:
        wrong, kind = _wrong_answer(rng, a, b)
        rows.append({"prompt": make_prompt(a, b), "chosen": str(a + b), "rejected": wrong, "rejected_kind": kind})
    return rows


def rl_records(cfg: TaskConfig, split: str = "train") -> list[dict]:
    """RL prompt rows {"prompt", "answer"} (answer: the reference sum, for rule rewards and metrics)."""
    held = eval_problems(cfg)
    problems = held if split == "eval" else _problems(cfg, "rl", cfg.num_rl, frozenset(held))
    return [{"prompt": make_prompt(a, b), "answer": str(a + b)} for a, b in problems]


TASK_SPLITS = {
    "sft_train": (sft_records, "train"),
    "sft_eval": (sft_records, "eval"),
    "pairs_train": (pair_records, "train"),
    "pairs_eval": (pair_records, "eval"),
    "rl_train": (rl_records, "train"),
    "rl_eval": (rl_records, "eval"),
}


def write_task_files(cfg: TaskConfig, out_dir: str) -> dict[str, str]:
    """Write every split as jsonl under `out_dir`; returns {split name: path}.

    Keys: sft_train, sft_eval (format sft), pairs_train, pairs_eval (format pairs),
    rl_train, rl_eval (format prompt, with the extra field "answer" kept as metadata).
    Files are rewritten only when their content would change (so concurrent readers and
    repeated runs see identical bytes).
    """
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for name, (fn, split) in TASK_SPLITS.items():
        path = os.path.join(out_dir, f"{name}.jsonl")
        text = "".join(json.dumps(r) + "\n" for r in fn(cfg, split))
        _write_if_changed(path, text)
        paths[name] = path
    return paths


def _write_if_changed(path: str, text: str) -> None:
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def build_task_tokenizer(cfg: TaskConfig, out_dir: str, corpus: Optional[list[str]] = None) -> str:
    """Train the task's BPE tokenizer and save it as ``out_dir/tokenizer.json``; returns that path.

    Single digits are always their own tokens (the pre-tokenizer isolates digits and
    punctuation; spaces become "▁" via Metaspace and are restored on decode). Special
    tokens: <pad>=0, <bos>=1, <eos>=2, <unk>=3. The initial alphabet is the task's
    characters first, then letters and punctuation while the budget allows, so the
    vocabulary size is <= task.tokenizer_vocab_size (merges are learned only from
    `corpus`, default: every task split's text).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    budget = cfg.tokenizer_vocab_size - len(SPECIAL_TOKENS)
    alphabet = list(_ALPHABET[:budget])
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.Split(Regex(r"[^\w▁]"), behavior="isolated"),
        ]
    )
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="never")
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.tokenizer_vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    if corpus is None:
        corpus = []
        for fn, split in TASK_SPLITS.values():
            for r in fn(cfg, split):
                corpus.extend(str(v) for k, v in r.items() if k in ("prompt", "response", "chosen", "rejected"))
                corpus.extend(m["content"] for m in r.get("messages", ()))
        if cfg.tool_demo_rate > 0:  # the default chat template's role tags, which tool conversations are rendered with
            corpus.extend(["<|user|>", "<|assistant|>"] * len(corpus))
    tok.train_from_iterator(corpus, trainer=trainer)
    vocab = tok.get_vocab_size()
    assert vocab <= cfg.tokenizer_vocab_size, (vocab, cfg.tokenizer_vocab_size)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "tokenizer.json")
    _write_if_changed(path, tok.to_str())
    return path
