"""One name, one meaning: a bare "stage" is a job, a pipeline stage is always qualified.

docs/design.md's Terms: a *stage* is a job (sft, rm, dpo, rs, kto, spin, ppo, plan): the config field
``stage``, ``conf/stage/``, ``python -m aligner.<stage>``, the ``stage`` a checkpoint records. A pipeline
stage is "pipeline stage" (or "pp stage") in prose and carries ``pp`` / ``pipeline`` in identifiers
(``is_first_pp_stage``, ``prune_to_pp_stage``); DeepSpeed's ``zero_stage`` is a ZeRO stage.

What is checked:
- every identifier of aligner/ (definitions, arguments, names, attributes, keywords, imports; read from
  the AST) and every module file name: the words "stage" / "stages" in it (split at ``_`` and at case
  changes) follow "pp", "pipeline" or "zero", or the identifier is one of the job names
  (:data:`JOB_NAMES`); the names the pipeline meaning had before the rule are gone from aligner/,
  tests/ and benchmarks/;
- the prose of aligner/ (docstrings, comments, messages), docs/*.md and README.md: no phrase that can
  only mean a pipeline stage left unqualified ("the last stage", "stage 0", "virtual stage").

Not checked: whether a qualified prose "stage" or a job name is used in the right sense; the verb "to
stage" and "staged" / "staging" (another word, weights staged for a later step boundary).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.toolkit.paths import REPO

ALIGNER = REPO / "aligner"

# Identifiers that name the job: the config field and its values, the checks per job, resume's check that
# an output_dir holds a run of the same job.
JOB_NAMES = {"stage", "stages", "STAGES", "STAGE_TRAINED_ROLES", "previous_stage", "_check_same_stage"}
QUALIFIERS = {"pp", "pipeline", "zero"}
# What the pipeline meaning was called before the rule; none may come back.
OLD_PIPELINE_NAMES = ("is_first_stage", "is_last_stage", "prune_to_stage", "from_last_stage", "stage_layer_ids", "layers_on_stage")
# Phrases whose "stage" can only be a pipeline stage (a job has no stage 0, no next or virtual stage).
UNQUALIFIED = re.compile(
    r"\b(?:first|last|next|previous|later|neighbouring) stages?\b"
    r"|(?<!pipeline )(?<!pp )(?<!PP )(?<!ZeRO )\b[Ss]tages? (?:\d|s\b|i\b)"
    r"|\bvirtual stages?\b"
    r"|\bstage-to-stage\b|\bstage to stage\b"
)


def _words(identifier: str) -> list[str]:
    """``is_first_pp_stage`` -> [is, first, pp, stage]; ``StageLink`` -> [stage, link]."""
    return [w.lower() for part in identifier.split("_") for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z0-9]+", part)]


def _unqualified_stage(identifier: str) -> bool:
    """True when a word "stage"/"stages" of `identifier` has no pp/pipeline/zero before it (job names aside)."""
    if identifier in JOB_NAMES:
        return False
    words = _words(identifier)
    return any(w in ("stage", "stages") and (i == 0 or words[i - 1] not in QUALIFIERS) for i, w in enumerate(words))


def _identifiers(tree: ast.AST):
    """(line, identifier) of every name `tree` defines or uses."""
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield n.lineno, n.name
        elif isinstance(n, ast.arg):
            yield n.lineno, n.arg
        elif isinstance(n, ast.Name):
            yield n.lineno, n.id
        elif isinstance(n, ast.Attribute):
            yield n.lineno, n.attr
        elif isinstance(n, ast.keyword) and n.arg:
            yield n.value.lineno, n.arg
        elif isinstance(n, ast.alias):
            yield n.lineno, (n.asname or n.name.rsplit(".", 1)[-1])


def unqualified_identifiers(root: Path) -> list[str]:
    """'path:line: name' for every identifier under `root` with a bare pipeline-sense "stage"."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        if _unqualified_stage(path.stem):
            bad.append(f"{rel}: module name {path.stem}")
        for line, name in _identifiers(ast.parse(path.read_text(), str(path))):
            if _unqualified_stage(name):
                bad.append(f"{rel}:{line}: {name}")
    return sorted(set(bad))


def unqualified_prose(paths: list[Path]) -> list[str]:
    """'path:line: phrase' for every phrase in `paths` that can only mean an unqualified pipeline stage."""
    bad = []
    for path in paths:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            bad += [f"{path.relative_to(REPO)}:{i}: {m.group(0)!r}" for m in UNQUALIFIED.finditer(line)]
    return bad


def test_words_split_at_underscores_and_case():
    assert _words("is_first_pp_stage") == ["is", "first", "pp", "stage"]
    assert _words("StageLink") == ["stage", "link"] and _unqualified_stage("StageLink")
    assert _words("STAGE_TRAINED_ROLES") == ["stage", "trained", "roles"]
    assert _unqualified_stage("is_last_stage") and _unqualified_stage("stage_layer_ids")
    assert not _unqualified_stage("is_last_pp_stage") and not _unqualified_stage("pipeline_stage_factor")
    assert not _unqualified_stage("zero_stage") and not _unqualified_stage("stage")
    assert not _unqualified_stage("receive_weights_staged")  # another word


def test_the_phrases_catch_an_unqualified_pipeline_stage_only():
    assert UNQUALIFIED.search("the last stage samples") and UNQUALIFIED.search("Stage 0 schedules")
    assert UNQUALIFIED.search("between virtual stages") and UNQUALIFIED.search("stage s receives")
    for ok in ("the last pipeline stage samples", "pipeline stage 0", "pp stage 1", "DeepSpeed ZeRO stage 3", "the SFT stage"):
        assert not UNQUALIFIED.search(ok), ok


def test_no_identifier_in_aligner_uses_a_bare_stage_for_a_pipeline_stage():
    bad = unqualified_identifiers(ALIGNER)
    assert not bad, "a bare 'stage' is a job; name a pipeline stage with pp_ (docs/design.md, Terms):\n" + "\n".join(bad)


@pytest.mark.parametrize("root", ["aligner", "tests", "benchmarks"])
def test_the_old_pipeline_names_are_gone(root):
    pattern = re.compile(r"\b(" + "|".join(OLD_PIPELINE_NAMES) + r")\b")
    bad = [
        f"{p.relative_to(REPO)}:{i}: {m.group(0)}"
        for p in sorted((REPO / root).rglob("*.py"))
        if p != Path(__file__).resolve() and ".venv" not in p.parts
        for i, line in enumerate(p.read_text().splitlines(), 1)
        for m in pattern.finditer(line)
    ]
    assert not bad, "renamed with pp_ (is_first_pp_stage, prune_to_pp_stage, ...):\n" + "\n".join(bad)


def test_prose_qualifies_a_pipeline_stage():
    paths = [*sorted(ALIGNER.rglob("*.py")), REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    bad = unqualified_prose(paths)
    assert not bad, "say 'pipeline stage' (or 'pp rank N'): a bare 'stage' is a job:\n" + "\n".join(bad)
