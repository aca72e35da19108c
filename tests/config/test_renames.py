"""Renamed and removed config fields (aligner/config/renames.py): a renamed field's old name on the command line sets
the new field and logs one deprecation line naming the new name; where the old name cannot be rewritten (a YAML
mapping), the error names the new one. A removed field is refused wherever it is set, the error saying what to set.

No field is renamed in this release, so the rename mechanism is tested with a stand-in entry (``logprob_chunk``
renamed to ``logprob_chunk_size``) patched into RENAMED."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from aligner.cli import load_config
from aligner.config import ConfigError, renames
from aligner.config.renames import REMOVED, RENAMED, renamed_overrides
from tests.toolkit.paths import REPO


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setitem(renames.RENAMED, "logprob_chunk", "logprob_chunk_size")


def test_an_old_name_sets_the_new_field_with_one_line_each(stand_in, caplog):
    with caplog.at_level(logging.WARNING, logger="aligner"):
        cfg = load_config("ppo", ["actor.parallel.logprob_chunk=64", "ref.parallel.logprob_chunk=32"])
    assert (cfg.actor.parallel.logprob_chunk_size, cfg.ref.parallel.logprob_chunk_size) == (64, 32)
    lines = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert lines == [
        "actor.parallel.logprob_chunk is deprecated: it is now actor.parallel.logprob_chunk_size "
        "(the old name is accepted until the next release)",
        "ref.parallel.logprob_chunk is deprecated: it is now ref.parallel.logprob_chunk_size "
        "(the old name is accepted until the next release)",
    ]


def test_the_new_name_logs_nothing_and_other_overrides_pass_unchanged(stand_in, caplog):
    with caplog.at_level(logging.WARNING, logger="aligner"):
        cfg = load_config("ppo", ["actor.parallel.logprob_chunk_size=64"])
    assert cfg.actor.parallel.logprob_chunk_size == 64
    assert not [r for r in caplog.records if "deprecated" in r.getMessage()]
    same = ["trainer.max_steps=3", "output_dir=runs/logprob_chunk", "actor.parallel.tp_size=1"]
    assert renamed_overrides(same) == same  # only a key's last part is renamed, never a value


def test_an_old_name_in_a_mapping_is_refused_with_the_new_name(stand_in):
    """A YAML file (or a dict override) with the old key is not rewritten: the error names the new field."""
    with pytest.raises(ConfigError) as e:
        load_config("ppo", ["actor.parallel={logprob_chunk:2}"])
    msg = str(e.value)
    assert msg.endswith("; logprob_chunk is now logprob_chunk_size") and "\n" not in msg


def test_renamed_and_removed_fields_are_absent_from_the_config_and_renamed_ones_exist_under_the_new_name():
    from aligner.config import ParallelConfig

    fields = set(ParallelConfig.__dataclass_fields__)
    for old, new in RENAMED.items():
        assert new in fields and old not in fields, (old, new)
    assert not fields & set(REMOVED)


@pytest.mark.parametrize(
    "override", ["actor.parallel.num_micro_batches=4", "critic.parallel.num_microbatches=4", "actor.parallel={num_micro_batches:4}"]
)
def test_a_removed_field_is_refused_with_what_to_set_instead(override):
    """parallel.num_micro_batches was read by nothing: setting it changed nothing. Now it is refused, naming the
    field that sets a step's micro-batches."""
    with pytest.raises(ConfigError) as e:
        load_config("ppo", [override])
    msg = str(e.value)
    field = "num_microbatches" if "num_microbatches" in override else "num_micro_batches"
    assert f"; {field} was removed: " in msg and msg.endswith("set trainer.micro_batch_size") and "\n" not in msg


def test_the_command_line_refuses_a_removed_field_with_one_line_and_exit_2():
    """`python -m aligner.sft actor.parallel.num_micro_batches=4` as a user runs it (through the supervising
    parent): exit 2 before any worker starts, one stderr line naming the field and the fix."""
    r = subprocess.run(
        [sys.executable, "-m", "aligner.sft", "actor.parallel.num_micro_batches=4", "--cfg", "job"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "num_micro_batches was removed" in lines[0], r.stderr
    assert lines[0].endswith("set trainer.micro_batch_size")
