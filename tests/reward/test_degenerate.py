"""aligner.reward.degenerate: the text shapes a format verifier passes without content, each with its reason,
and the answers it must leave alone (a letter signed "[Your Name]", a markdown link, placeholders the prompt
asks for, a short answer the constraints allow). The degenerate examples are the shapes SmolLM2-135M wrote
after rejection sampling on IFEval's verifiers alone (docs/ifeval.md)."""

from __future__ import annotations

import pytest

from aligner.reward.degenerate import degenerate_reason

ANSWER = (
    "Wilderness preservation protects forests, rivers and the animals that live there. *Protected land keeps water "
    "clean* for the towns downstream, and *old forests store carbon* that would otherwise warm the climate."
)


@pytest.mark.parametrize(
    "response,reason",
    [
        ("\"My company's slogan is:\n" + "*\n" * 40, "repetition"),  # an empty bulleted list, looped
        ("<<cover letter>>\n\n" + "[Company]\n\n" * 30, "repetition"),
        ("Kalimchaturi, " + "aar-ar-ar-ar, " * 40, "repetition"),  # a loop inside one line
        ("Subject: [Your Email Address] - [Your Friend's Email Address]\n\nSee you soon, I hope all is well.", "placeholder"),
        ("*This is the first section*\n\nForests matter because they hold water and soil in place.", "placeholder"),
        ("*highlighted section part 1* Raymond was a count of Tripoli in the twelfth century.", "placeholder"),
        ("SECTION 1\n[content of section 1]\nSECTION 2\nThe rest of the essay follows here.", "placeholder"),
        ("Yes.", "no content"),
        ("", "no content"),
    ],
)
def test_degenerate_shapes_are_named(response, reason):
    assert degenerate_reason(response, {}) == reason


@pytest.mark.parametrize(
    "response,meta",
    [
        (ANSWER, {}),
        ("Dear Ms. Lee,\n\nI am writing to apply for the engineer role at your company.\n\nSincerely,\n[Your Name]", {}),
        ("See [the guide](https://example.com/guide) and [the notes](https://example.com/notes) for the full steps.", {}),
        (
            "Meet me at [address] on [date] with the signed forms.",
            {"instruction_id_list": ["detectable_content:number_placeholders"], "kwargs": [{"num_placeholders": 2}]},
        ),
        ("My answer is yes.", {"instruction_id_list": ["detectable_format:constrained_response"], "kwargs": [{}]}),
        (
            "Paris.",
            {"instruction_id_list": ["length_constraints:number_words"], "kwargs": [{"num_words": 5, "relation": "less than"}]},
        ),
        ("Step 1: add 3 and 4.\nStep 2: multiply by 2.\nStep 3: subtract 1.\nThe answer is 13.", {}),  # short distinct lines
    ],
)
def test_answers_are_not_degenerate(response, meta):
    assert degenerate_reason(response, meta) == ""


def test_placeholders_count_only_when_the_prompt_does_not_ask_for_them():
    text = "Send it to [address] before [date], then call [name]."
    assert degenerate_reason(text, {}) == "placeholder"
    asked = {"instruction_id_list": ["punctuation:no_comma", "detectable_content:number_placeholders"], "kwargs": [{}, {}]}
    assert degenerate_reason(text, asked) == ""
    # a word count of at least N does not allow a few words
    atleast = {"instruction_id_list": ["length_constraints:number_words"], "kwargs": [{"num_words": 5, "relation": "at least"}]}
    assert degenerate_reason("Paris.", atleast) == "no content"
