"""Shared pytest fixtures: the location of ../shared (absent in a user's clone) and test env."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"

# Local Ray tests: no token auth files, no usage stats; DeepSpeed's JIT cache inside the repo.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".torch_extensions"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def shared_path(*parts: str) -> Path:
    """Path under ../shared, or skip the test with the reason when it is absent."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} is absent: ../shared/ sits beside the project only in the dev/CI checkout")
    return path


@pytest.fixture
def shared():
    return shared_path
