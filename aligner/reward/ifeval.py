"""IFEval's verifiers (Zhou et al. 2023, arXiv 2311.07911) as rule rewards and as the benchmark's scorer.

Owns: the offline Punkt model the checkers need (:func:`ensure_punkt`), the row check
(:func:`check_row`: a constraint id the verifiers do not know, kwargs that do not fit it), one
response's verdicts (:func:`verdicts`: strict and loose per constraint), the IFEval aggregate
(:func:`ifeval_metrics`: prompt- and instruction-level accuracy, strict and loose, and
per-constraint-family accuracy) and the rule rewards registered in :mod:`aligner.reward.rules`:

- "ifeval": the fraction of a prompt's constraints the response satisfies, strict (IFEval's
  instruction-level score of one prompt; Tülu 3's RLVR reward, Lambert et al. 2024, is the
  all-or-nothing one below);
- "ifeval_all": 1.0 when every constraint is satisfied (strict), else 0.0 (IFEval's
  prompt-level score of one prompt);
- "ifeval_loose": the fraction, loose (IFEval's loose variant: the best of eight lightly edited
  copies of the response: first and/or last line removed, ``*`` removed).

A row carries IFEval's schema in its metadata (extra fields of a prompt row, kept by
:mod:`aligner.data.formats`): ``instruction_id_list`` (list[str], ids such as
``"punctuation:no_comma"``) and ``kwargs`` (list[dict], one per id: that checker's arguments).

The checkers are not rewritten here: they are the ``if-verifiable`` package's copy of Google's
``instruction_following_eval`` (``if_verifiable.ifeval``), and the strict/loose logic is that
package's :func:`if_verifiable.common.evaluate_instructions`, which follows Google's
``evaluation_lib`` (the same eight loose variants). Two differences of that function from
Google's are corrected here, both to Google's behaviour: an empty response (after
``strip_thinking``) returns no verdicts there, here every constraint fails; an unknown id is
skipped there, here it is refused by :func:`check_row` before anything runs. That function also
drops a leading ``<think>...</think>`` block (reasoning models; SmolLM2 writes none).

The schema, the checker registry, the row check and the offline Punkt model are
:mod:`aligner.data.ifeval`.
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any, Optional, Sequence

from aligner.data.ifeval import ID_FIELD, KWARGS_FIELD, build_checker, check_row, check_rows, family, registry  # noqa: F401 (re-exported)


def verdicts(prompt: str, response: str, metadata: dict) -> list[tuple[str, bool, bool]]:
    """(instruction id, strict pass, loose pass) for each constraint of the row, in order.

    prompt: the request text (for checkers that read it); response: the decoded response.
    Computed by ``if_verifiable.common.evaluate_instructions`` (Google's evaluation_lib logic);
    an empty response fails every constraint, as in Google's evaluation_lib.

    Deterministic: IFEval's checkers draw a kwarg they cannot use at random (``keywords:letter_frequency``
    with a ``letter`` that is not a-z, such as "#" in IFEval's row 1122 and "!" in 1129, checks a random
    letter instead), so Google's reference gives those rows a random verdict; here ``random`` is seeded
    with 0 for the call (and restored after), so one response gets one verdict on every scoring.
    """
    from if_verifiable.common import evaluate_instructions

    ids, kwargs = list(metadata[ID_FIELD]), list(metadata[KWARGS_FIELD])
    state = random.getstate()  # IFEval's checkers draw missing or unusable kwargs from `random` (below)
    random.seed(0)
    try:
        results, _ = evaluate_instructions(response, ids, kwargs, prompt, registry())
    finally:
        random.setstate(state)
    if not results:  # an empty response: if-verifiable returns no verdicts, Google's evaluation_lib fails each
        return [(cid, False, False) for cid in ids]
    if len(results) != len(ids):
        raise ValueError(f"IFEval checkers returned {len(results)} verdicts for {len(ids)} constraints {ids}: check the row with check_row")
    return [(r.instruction_id, bool(r.strict_pass), bool(r.loose_pass)) for r in results]


def _fraction(prompt: str, response: str, metadata: dict, loose: bool = False) -> float:
    v = verdicts(prompt, response, _need(metadata))
    return sum(x[2 if loose else 1] for x in v) / len(v)


def _need(metadata: dict) -> dict:
    if ID_FIELD not in metadata or KWARGS_FIELD not in metadata:
        raise ValueError(
            f"reward.rule=ifeval* needs metadata {ID_FIELD!r} and {KWARGS_FIELD!r} (IFEval's schema): "
            "use prompts from python -m aligner.data.ifeval_prompts or IFEval's input_data.jsonl"
        )
    return metadata


def reward_fraction(prompt: str, response: str, metadata: dict) -> float:
    """Rule "ifeval": the fraction of the row's constraints satisfied, strict, in [0, 1]."""
    return _fraction(prompt, response, metadata)


def reward_all(prompt: str, response: str, metadata: dict) -> float:
    """Rule "ifeval_all": 1.0 when all the row's constraints are satisfied (strict), else 0.0."""
    return float(all(s for _, s, _ in verdicts(prompt, response, _need(metadata))))


def reward_loose(prompt: str, response: str, metadata: dict) -> float:
    """Rule "ifeval_loose": the fraction of the row's constraints satisfied, loose, in [0, 1]."""
    return _fraction(prompt, response, metadata, loose=True)


# the scalars of ifeval_metrics logged by the periodic evaluation during training (as eval_<name>)
SCALAR_METRICS = ("prompt_strict", "instruction_strict", "prompt_loose", "instruction_loose", "cut_rows")

RULES = {"ifeval": reward_fraction, "ifeval_all": reward_all, "ifeval_loose": reward_loose}


def ifeval_metrics(
    prompts: Sequence[str], responses: Sequence[str], metadata: Sequence[dict], cut: Optional[Sequence[bool]] = None
) -> dict[str, Any]:
    """IFEval's four numbers and per-family accuracy for N responses (fractions in [0, 1]).

    Returns {"prompt_strict", "prompt_loose": fraction of prompts whose constraints all pass;
    "instruction_strict", "instruction_loose": fraction of all constraints that pass;
    "n_prompts", "n_instructions"; "per_family": {family: {"n", "strict", "loose"}};
    "per_instruction": {id: {"n", "strict", "loose"}}; "cut_rows" (when `cut` is given: how many
    responses ran to the token limit)}. Definitions as Google's evaluation_lib.print_report.
    """
    if not prompts or not len(prompts) == len(responses) == len(metadata):
        raise ValueError(
            f"ifeval_metrics: {len(prompts)} prompts, {len(responses)} responses, {len(metadata)} rows: give one of each, at least one"
        )
    all_s = all_l = n_ins = ins_s = ins_l = 0
    fam: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    per: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for p, r, m in zip(prompts, responses, metadata):
        v = verdicts(p, r, m)
        all_s += all(s for _, s, _ in v)
        all_l += all(lo for _, _, lo in v)
        for cid, s, lo in v:
            n_ins, ins_s, ins_l = n_ins + 1, ins_s + s, ins_l + lo
            for table, key in ((fam, family(cid)), (per, cid)):
                table[key][0] += 1
                table[key][1] += s
                table[key][2] += lo
    n = len(prompts)

    def rows(t):
        return {k: {"n": c[0], "strict": c[1] / c[0], "loose": c[2] / c[0]} for k, c in sorted(t.items())}

    out: dict[str, Any] = {
        "prompt_strict": all_s / n,
        "instruction_strict": ins_s / n_ins,
        "prompt_loose": all_l / n,
        "instruction_loose": ins_l / n_ins,
        "n_prompts": n,
        "n_instructions": n_ins,
        "per_family": rows(fam),
        "per_instruction": rows(per),
    }
    if cut is not None:
        out["cut_rows"] = int(sum(bool(c) for c in cut))
    return out
