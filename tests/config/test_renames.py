"""Renamed config fields (aligner/config/renames.py): the old name on the command line sets the new field and logs one
deprecation line naming the new name; where the old name cannot be rewritten (a YAML mapping), the error names the new
one."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from aligner.cli import load_config
from aligner.config import ConfigError
from aligner.config.renames import RENAMED, renamed_overrides
from tests.toolkit.paths import REPO


def test_the_old_micro_batch_count_name_sets_the_new_field_with_one_line_each(caplog):
    with caplog.at_level(logging.WARNING, logger="aligner"):
        cfg = load_config("ppo", ["actor.parallel.num_microbatches=2", "critic.parallel.num_microbatches=3"])
    assert (cfg.actor.parallel.num_micro_batches, cfg.critic.parallel.num_micro_batches) == (2, 3)
    lines = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert lines == [
        "actor.parallel.num_microbatches is deprecated: it is now actor.parallel.num_micro_batches "
        "(the old name is accepted until the next release)",
        "critic.parallel.num_microbatches is deprecated: it is now critic.parallel.num_micro_batches "
        "(the old name is accepted until the next release)",
    ]
    assert all("\n" not in line for line in lines)


def test_the_new_name_logs_nothing_and_other_overrides_pass_unchanged(caplog):
    with caplog.at_level(logging.WARNING, logger="aligner"):
        cfg = load_config("ppo", ["actor.parallel.num_micro_batches=2"])
    assert cfg.actor.parallel.num_micro_batches == 2
    assert not [r for r in caplog.records if "deprecated" in r.getMessage()]
    same = ["trainer.max_steps=3", "output_dir=runs/num_microbatches", "actor.parallel.tp_size=1"]
    assert renamed_overrides(same) == same  # only a key's last part is renamed, never a value


def test_every_renamed_field_exists_under_its_new_name_only():
    from aligner.config import ParallelConfig

    fields = set(ParallelConfig.__dataclass_fields__)
    for old, new in RENAMED.items():
        assert new in fields and old not in fields, (old, new)


def test_an_old_name_in_a_mapping_is_refused_with_the_new_name():
    """A YAML file (or a dict override) with the old key is not rewritten: the error names the new field."""
    with pytest.raises(ConfigError) as e:
        load_config("ppo", ["actor.parallel={num_microbatches:2}"])
    msg = str(e.value)
    assert "num_microbatches" in msg and msg.endswith("num_microbatches is now num_micro_batches") and "\n" not in msg


def test_the_command_line_takes_the_old_name_with_one_stderr_line():
    """`python -m aligner.sft ... --cfg job` (Hydra's form, through the supervising parent as a user runs it; every
    form in-process: tests/cli/test_cli.py): exit 0, the composed config has the new field at the value the old one
    gave, and stderr holds one line: the deprecation."""
    r = subprocess.run(
        [sys.executable, "-m", "aligner.sft", "actor.parallel.num_microbatches=4", "--cfg", "job"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "num_micro_batches: 4" in r.stdout and "num_microbatches" not in r.stdout
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].endswith(
        "actor.parallel.num_microbatches is deprecated: it is now actor.parallel.num_micro_batches "
        "(the old name is accepted until the next release)"
    ), r.stderr
