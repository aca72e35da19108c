"""aligner.runtime.progress: the beats that restart the hang watchdog's countdown."""

import time

import pytest

from aligner.runtime import progress


def test_beat_calls_the_hook_at_most_once_per_interval_and_not_after_uninstall():
    calls = []
    progress.install(lambda: calls.append(time.monotonic()), every_s=0.2)
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.9:
            progress.beat()
            time.sleep(0.01)
        assert 3 <= len(calls) <= 5, calls  # ~0.9 s / 0.2 s, never once per beat (about 80 beats)
        assert all(b - a >= 0.2 for a, b in zip(calls, calls[1:]))
    finally:
        progress.uninstall()
    n = len(calls)
    time.sleep(0.25)
    progress.beat()
    assert len(calls) == n


def test_beat_without_a_hook_does_nothing_and_a_bad_interval_is_refused():
    progress.uninstall()
    progress.beat()
    with pytest.raises(ValueError, match="every_s=0 is invalid"):
        progress.install(lambda: None, every_s=0)
