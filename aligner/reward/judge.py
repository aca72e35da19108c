"""The generative reward (``reward.type=judge``, docs/judge.md): an LLM prompted with a rubric
judges each (prompt, response) and its verdict, a number, is the score.

The judge is a causal LM in the reward group (``reward.init``: an HF directory with its tokenizer and
chat template, e.g. an instruct model), run by aligner's rollout engine (greedy, the continuous
scheduler, so a batch of judgements is one generate call). For every sample the rubric
(``reward.judge_rubric``, with the placeholders ``{prompt}`` and ``{response}``) is filled in, sent as
one user message through the judge's chat template, and the judge writes at most
``reward.judge_max_new_tokens`` tokens. The first number in that text is the verdict; the score is
``verdict / reward.judge_max_score``, in [0, 1]. A verdict with no number, or one outside
[0, judge_max_score], scores 0.0 and is counted (``reward/judge_unparsed``, the fraction of the
batch): a judge that cannot follow its rubric shows in the metrics instead of passing silently.
(The LLM-as-a-judge setup of Zheng et al. 2023, MT-Bench; the scored-verdict form of generative
reward models as in verl's and OpenRLHF's examples.)
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

import torch

from aligner.config import SamplingConfig

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def fill_rubric(rubric: str, prompt: str, response: str) -> str:
    """The rubric with ``{prompt}`` and ``{response}`` replaced (plain replacement: other braces in the
    rubric, or in the texts, stay as they are)."""
    return rubric.replace("{prompt}", prompt).replace("{response}", response)


def parse_verdict(text: str, max_score: float) -> Optional[float]:
    """The score in [0, 1] of a judge's output: its first number divided by `max_score`; None when it
    holds no number or the number is outside [0, max_score]."""
    m = _NUMBER.search(text)
    if m is None:
        return None
    value = float(m.group(0))
    if not 0 <= value <= max_score:
        return None
    return value / max_score


def judge_prompt_ids(tokenizer, rubric: str, prompts: Sequence[str], responses: Sequence[str]) -> list[list[int]]:
    """Token ids of each judgement's prompt: the filled rubric as one user message through the judge's
    chat template, with the generation prompt."""
    out = []
    for p, r in zip(prompts, responses):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": fill_rubric(rubric, p, r)}], tokenize=False, add_generation_prompt=True
        )
        out.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return out


class Judge:
    """A judge LLM and its engine. `engine`: a RolloutEngine holding the judge's weights; `tokenizer`:
    the judge's; `rubric`, `max_new_tokens`, `max_score`: the reward.judge_* settings."""

    def __init__(self, engine, tokenizer, rubric: str, max_new_tokens: int, max_score: float, max_seq_len: int) -> None:
        self.engine, self.tok, self.rubric = engine, tokenizer, rubric
        self.max_new_tokens, self.max_score, self.max_seq_len = max_new_tokens, max_score, max_seq_len

    def scores(self, prompts: Sequence[str], responses: Sequence[str]) -> dict[str, torch.Tensor]:
        """{"scores": [B] float32 in [0, 1], "unparsed": [B] bool} for B (prompt, response) texts.

        Raises ValueError naming the sample when a judgement's prompt and the verdict's budget do not
        fit the judge's max_seq_len (a cut judgement would judge something else)."""
        if not prompts:
            return {"scores": torch.zeros(0), "unparsed": torch.zeros(0, dtype=torch.bool)}
        ids = judge_prompt_ids(self.tok, self.rubric, prompts, responses)
        for i, x in enumerate(ids):
            if len(x) + self.max_new_tokens > self.max_seq_len:
                raise ValueError(
                    f"judgement {i} is {len(x)} tokens, which with reward.judge_max_new_tokens={self.max_new_tokens} exceeds the "
                    f"judge's max_seq_len={self.max_seq_len}: shorten reward.judge_rubric or rollout.sampling.max_new_tokens"
                )
        sampling = SamplingConfig(temperature=0.0, max_new_tokens=self.max_new_tokens)
        gens = self.engine.generate(ids, sampling)
        verdicts = [parse_verdict(self.tok.decode(g.token_ids, skip_special_tokens=True), self.max_score) for g in gens]
        return {
            "scores": torch.tensor([0.0 if v is None else v for v in verdicts], dtype=torch.float32),
            "unparsed": torch.tensor([v is None for v in verdicts], dtype=torch.bool),
        }
