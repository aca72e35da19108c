"""Training samples from an agent's recorded calls (aligner.rollout.agent.record), on hand-made records."""

from __future__ import annotations

import pytest

from aligner.rollout.agent.record import AgentRecorder, CallRecord, build_samples
from aligner.rollout.base import generations_to_padded, own_tokens_mask, token_versions_to_padded


def rec(call, prompt, completion, lps, version=0, parent=None, reason="", versions=None):
    return CallRecord("e", call, 0, prompt, completion, lps, version, versions, "stop", parent, reason)


def test_a_chain_is_one_sample_with_the_agents_tokens_masked():
    r0 = rec(0, [1, 2], [3, 4], [-0.1, -0.2], version=5)
    r1 = rec(1, [1, 2, 3, 4, 9, 9], [6], [-0.3], version=6, parent=0)  # the agent added 9 9
    r2 = rec(2, [1, 2, 3, 4, 9, 9, 6, 8], [7, 2], [-0.4, -0.5], version=6, parent=1, versions=[6, 7])
    (s,) = build_samples([r0, r1, r2])
    g = s.generation
    assert s.prompt_ids == [1, 2]
    assert g.token_ids == [3, 4, 9, 9, 6, 8, 7, 2]
    assert g.own_mask == [True, True, False, False, True, False, True, True]
    assert g.rollout_log_probs == [-0.1, -0.2, 0.0, 0.0, -0.3, 0.0, -0.4, -0.5]
    assert g.token_versions == [5, 5, 5, 5, 6, 6, 6, 7]  # an added token: the version of the completion before it
    assert g.weight_version == 5 and g.extra["added_tokens"] == 3 and g.extra["records"] == [0, 1, 2]
    # the trainer's helpers take it as they take an engine's episode
    _, lp, _ = generations_to_padded([g])
    assert own_tokens_mask([g], 8).tolist() == [[float(m) for m in g.own_mask]]
    assert token_versions_to_padded([g], 8).tolist() == [g.token_versions] and lp.shape == (1, 8)


def test_segments_branches_and_bad_parents():
    recorder = AgentRecorder()
    with recorder.lock():
        recorder.add(rec(0, [1], [2], [-1.0]))
        recorder.add(rec(1, [1, 2, 3], [4], [-1.0], parent=0))
        recorder.add(rec(2, [1, 2, 5], [6], [-1.0], parent=0))  # a second continuation of record 0: a branch
        recorder.add(rec(3, [7], [8], [-1.0], reason="the prompt does not extend ..."))
    recs = recorder.records("e")
    assert recs[2].parent is None and recs[2].break_reason.startswith("branch") and recorder.breaks == 2
    samples = build_samples(recs)
    assert [s.prompt_ids + s.generation.token_ids for s in samples] == [[1, 2, 3, 4], [1, 2, 5, 6], [7, 8]]
    assert recorder.pop("e") == recs and recorder.records("e") == []
    with pytest.raises(ValueError, match="does not start with its parent's"):
        build_samples([rec(0, [1], [2], [-1.0]), rec(1, [1, 3], [4], [-1.0], parent=0)])
    with pytest.raises(ValueError, match="must be an earlier record"):
        build_samples([rec(0, [1], [2], [-1.0], parent=0)])
