"""The repository root and ../shared (real data and tokenizers; only beside a development checkout)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"


def shared_path(*parts: str) -> Path:
    """Path under ../shared, or skip the calling test with the reason when it is absent."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} is absent: ../shared/ sits beside the project only in the dev/CI checkout")
    return path
