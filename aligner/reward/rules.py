"""Rule-based rewards (``reward.type=rule``), a registry by name (``reward.rule=NAME``).

Owns: :data:`RULES`, :func:`score` and :func:`score_samples` (the rule rewards of a rollout batch's
samples, or their episodes' rewards). Every rule maps one (prompt, response, metadata)
to a float in [0, 1]:

- "task_accuracy": the built-in addition task's checker (aligner.data.task.check_answer):
  1.0 when the response is exactly the sum, else 0.0.
- "gsm8k": 1.0 when the response's final number (after its last "####" if any, else its
  last number) equals ``metadata["answer"]`` (the gsm8k reference after "####"), compared
  as numbers after removing thousands separators, else 0.0 (as in the GSM8K paper's
  exact-match metric, Cobbe et al. 2021).
- "gsm8k_format": the answer format taught by reward (verl's GSM8K reward and DeepSeekMath's
  format rewards score the same two things): 0.5 when the response's last non-empty line is
  ``#### <number>`` (:func:`gsm8k_formatted`), plus 0.5 when that number equals
  ``metadata["answer"]``; an unformatted response scores 0.0 even when its last number is right.
- "digit_fraction": the fraction of the response's non-space characters that are digits
  (0.0 for an empty response): a dense formatting reward for numeric answers. A random
  policy starts near 10/vocab, so fast tests use it to check that PPO raises a reward.
- "ifeval", "ifeval_all", "ifeval_loose": IFEval's verifiers on the row's constraints
  (metadata ``instruction_id_list`` and ``kwargs``): the fraction satisfied (strict), all or
  nothing (strict), the fraction (loose) (:mod:`aligner.reward.ifeval`; ``pip install 'aligner[ifeval]'``).
  Their rows are checked before any worker starts (:func:`check_rule_rows`).
- "code_tests": the fraction of the row's tests (metadata ``tests``: ``{"inputs": [stdin, ...],
  "outputs": [expected stdout, ...]}``) that the response's program passes, each run in a
  sandbox with CPU, memory, file-size, process and wall-clock limits, without network and with
  nothing of the host writable where the host allows it; 0.0 when a run hits a limit
  (:mod:`aligner.reward.sandbox`, which says what is enforced where). Rows checked before any
  worker starts.
"""

from __future__ import annotations

import re
from typing import Callable, Optional, Sequence

import torch

from aligner.data.task import check_answer
from aligner.reward import ifeval as _ifeval
from aligner.reward import sandbox as _sandbox

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _task_accuracy(prompt: str, response: str, metadata: dict) -> float:
    return 1.0 if check_answer(prompt, response) else 0.0


def extract_final_number(text: str) -> Optional[str]:
    """The number after the last "####" in `text`, else the last number in it; commas removed; None if none."""
    tail = text.rsplit("####", 1)[1] if "####" in text else text
    nums = _NUMBER.findall(tail)
    if not nums:
        return None
    return (nums[0] if "####" in text else nums[-1]).replace(",", "").rstrip(".")


def _same_number(a: str, b: str) -> bool:
    try:
        return abs(float(a) - float(b)) < 1e-6
    except ValueError:
        return a == b


def _gsm8k(prompt: str, response: str, metadata: dict) -> float:
    if "answer" not in metadata:
        raise ValueError("reward.rule=gsm8k needs metadata['answer'] (the reference after '####'): use data.format=gsm8k data")
    got = extract_final_number(response)
    ref = str(metadata["answer"]).replace(",", "").strip()
    return 1.0 if got is not None and _same_number(got, ref) else 0.0


_FORMAT_LINE = re.compile(r"^####\s*(-?\d[\d,]*(?:\.\d+)?)\.?$")


def gsm8k_formatted(response: str) -> Optional[str]:
    """The number of the response's last non-empty line when that line is ``#### <number>``
    (commas removed), else None."""
    lines = [ln.strip() for ln in response.strip().splitlines() if ln.strip()]
    m = _FORMAT_LINE.match(lines[-1]) if lines else None
    return m.group(1).replace(",", "") if m else None


def _gsm8k_format(prompt: str, response: str, metadata: dict) -> float:
    if "answer" not in metadata:
        raise ValueError("reward.rule=gsm8k_format needs metadata['answer'] (the reference after '####'): use data.format=gsm8k data")
    got = gsm8k_formatted(response)
    if got is None:
        return 0.0
    return 0.5 + (0.5 if _same_number(got, str(metadata["answer"]).replace(",", "").strip()) else 0.0)


RULES: dict[str, Callable[[str, str, dict], float]] = {"task_accuracy": _task_accuracy, "gsm8k": _gsm8k, "gsm8k_format": _gsm8k_format}


def _digit_fraction(prompt: str, response: str, metadata: dict) -> float:
    chars = [c for c in response if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


RULES["digit_fraction"] = _digit_fraction
RULES.update(_ifeval.RULES)
RULES.update(_sandbox.RULES)
# rule -> a check of the prompt examples' metadata ({"metadata", "source"} each), run before any worker starts
ROW_CHECKS: dict[str, Callable[[list[dict]], None]] = {name: _ifeval.check_rows for name in _ifeval.RULES}
ROW_CHECKS.update({name: _sandbox.check_rows for name in _sandbox.RULES})


def check_rule_rows(name: str, examples: list[dict]) -> None:
    """Check that rule `name` can score every example (ValueError "file:line: ..." naming the fix); no-op for rules without a check."""
    if name not in ROW_CHECKS:
        return
    try:
        ROW_CHECKS[name](examples)
    except ImportError as e:  # the rule's optional packages are missing: one line, exit 2
        raise ValueError(f"reward.rule={name}: {e}") from None


def get_rule(name: str) -> Callable[[str, str, dict], float]:
    """The rule function called `name`; ValueError listing the valid names otherwise."""
    if name not in RULES:
        raise ValueError(f"reward.rule={name!r} is unknown: valid rules are {', '.join(RULES)}")
    return RULES[name]


def score(name: str, prompts: list[str], responses: list[str], metadata: Optional[list[dict]] = None) -> torch.Tensor:
    """Scores [B] float32 of rule `name` for B (prompt, response, metadata) triples.

    prompts / responses: decoded text (special tokens removed); metadata: per-row dicts
    (defaults to empty dicts). Raises ValueError for an unknown rule or mismatched lengths.
    """
    fn = get_rule(name)
    metadata = metadata if metadata is not None else [{} for _ in prompts]
    if not len(prompts) == len(responses) == len(metadata):
        raise ValueError(
            f"score: {len(prompts)} prompts, {len(responses)} responses, {len(metadata)} metadata rows: give one of each per sample"
        )
    return torch.tensor([fn(p, r, m) for p, r, m in zip(prompts, responses, metadata)], dtype=torch.float32)


def score_samples(name: str, samples: Sequence[dict], episodes: bool = False) -> torch.Tensor:
    """Rule rewards [B] float32 of B samples, each a dict with "prompt", "response" (decoded text) and
    "metadata" (a :class:`aligner.protocol.RolloutBatch`'s ``meta`` rows).

    episodes: the samples played multi-turn episodes (``env.name`` set; each sample's "episode" holds an
    :class:`aligner.envs.Episode`): the reward is each episode's total (its per-turn rewards plus the final
    one, which its environment computed with rule `name`; 0 for a failed episode), and the rule is not
    called again. Raises ValueError for an unknown rule; KeyError when `episodes` and a sample has none.
    """
    if episodes:
        return torch.tensor([s["episode"].total_reward for s in samples], dtype=torch.float32)
    return score(name, [s["prompt"] for s in samples], [s["response"] for s in samples], [s["metadata"] for s in samples])
