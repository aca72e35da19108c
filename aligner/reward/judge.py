"""The generative reward (``reward.type=judge``, docs/judge.md): an LLM prompted with a rubric
judges each (prompt, response) and its verdict, a number, is the score.

The judge is a causal LM in the reward group (``reward.init``: an HF directory with its tokenizer and
chat template, e.g. an instruct model), run by aligner's rollout engine (greedy, the continuous
scheduler, so a batch of judgements is one generate call). For every sample the rubric
(``reward.judge_rubric``, with the placeholders ``{prompt}`` and ``{response}``) is filled in one
pass, each text between ``<prompt>`` / ``<response>`` tags whose copies inside the text are defused
(:func:`fill_rubric`), sent as one user message through the judge's chat template, and the judge
writes at most ``reward.judge_max_new_tokens`` tokens. The verdict is that whole text parsed
strictly: one number (``N`` or ``N/judge_max_score``) and nothing else (:func:`parse_verdict`); the
score is ``verdict / reward.judge_max_score``, in [0, 1]. Any other answer ("10/10 is what it
claims; I rate it 2", no number, a number outside [0, judge_max_score]) is a failed verdict: it
scores 0.0, is counted (``reward/judge_unparsed``, the fraction of the batch) and logged (a warning
on the "aligner.reward" logger with the first such answer): a judge that cannot follow its rubric,
or a response that talks to the judge, shows in the metrics instead of passing silently.
(The LLM-as-a-judge setup of Zheng et al. 2023, MT-Bench; the scored-verdict form of generative
reward models as in verl's and OpenRLHF's examples.)
"""

from __future__ import annotations

import logging
import re
from typing import Optional, Sequence

import torch

from aligner.config import SamplingConfig

log = logging.getLogger("aligner.reward")

_PLACEHOLDER = re.compile(r"\{(prompt|response)\}")
_VERDICT = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(?:/\s*(\d+(?:\.\d+)?))?\s*\.?\s*")


def delimit(name: str, text: str) -> str:
    """`text` between ``<name>`` and ``</name>`` lines, any ``<name>`` / ``</name>`` tag inside it
    defused (``<\\/name>``, ``<\\name>``), so a response cannot close its block and write the rest of
    the judge's prompt."""
    inner = text.replace(f"</{name}>", f"<\\/{name}>").replace(f"<{name}>", f"<\\{name}>")
    return f"<{name}>\n{inner}\n</{name}>"


def fill_rubric(rubric: str, prompt: str, response: str) -> str:
    """The rubric with ``{prompt}`` and ``{response}`` replaced in one pass over the rubric, each by its
    text delimited (:func:`delimit`): braces inside the texts (a prompt holding ``{response}``) and
    other braces in the rubric stay as they are."""
    texts = {"prompt": delimit("prompt", prompt), "response": delimit("response", response)}
    return _PLACEHOLDER.sub(lambda m: texts[m.group(1)], rubric)


def parse_verdict(text: str, max_score: float) -> Optional[float]:
    """The score in [0, 1] of a judge's output, parsed strictly: the whole output (surrounding
    whitespace and a final period aside) is one number in [0, max_score], optionally written
    ``N/max_score``; the score is N / max_score. None for anything else ("8, no 2", "I rate it 7",
    a number out of range, a denominator other than max_score)."""
    m = _VERDICT.fullmatch(text)
    if m is None:
        return None
    value = float(m.group(1))
    if m.group(2) is not None and float(m.group(2)) != max_score:
        return None
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
        texts = [self.tok.decode(g.token_ids, skip_special_tokens=True) for g in gens]
        verdicts = [parse_verdict(t, self.max_score) for t in texts]
        failed = [t for t, v in zip(texts, verdicts) if v is None]
        if failed:  # counted in reward/judge_unparsed; the first one shown, cut
            log.warning(
                "judge: %d of %d verdicts are not a number in [0, %g] alone (scored 0.0), e.g. %r",
                len(failed), len(texts), self.max_score, " ".join(failed[0].split())[:120],
            )  # fmt: skip
        return {
            "scores": torch.tensor([0.0 if v is None else v for v in verdicts], dtype=torch.float32),
            "unparsed": torch.tensor([v is None for v in verdicts], dtype=torch.bool),
        }
