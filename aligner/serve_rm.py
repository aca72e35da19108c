"""`python -m aligner.serve_rm`: serve an aligner reward model, or a rule reward, over HTTP for
``reward.type=remote`` (:mod:`aligner.reward.server`; the wire format is :mod:`aligner.reward.remote`'s).

    python -m aligner.serve_rm reward.init=outputs/rm                      # an RM run's output_dir or an HF dir
    python -m aligner.serve_rm reward.type=rule reward.rule=gsm8k port=5001
    ALIGNER_RM_TOKEN=secret python -m aligner.serve_rm reward.init=DIR host=0.0.0.0   # or token_file=PATH

Keys (``key=value``): reward.type (model | rule), reward.init, reward.rule, tokenizer (a tokenizer
path for requests without input_ids; default: the one saved in reward.init), host (default
127.0.0.1: this machine only; another address needs a token, or allow_no_token=1), port (default
5000; 0 = a free port), token_file (a file whose first line is the token; default: env
ALIGNER_RM_TOKEN; a token itself is refused on the command line, where other users see it),
allow_no_token (0 | 1, default 0), max_batch (samples per request, default 256),
max_request_bytes (default 16 MiB), request_timeout_s (seconds for a whole request to arrive,
default 60), max_connections (served at once, default 64), micro_batch_size (sequences per
forward, default 8). It prints ``serving <scorer> at <url>`` once listening; Ctrl-C (or SIGTERM) stops it.
A bad key or value: one line on stderr, exit 2, before any weights load.
"""

from __future__ import annotations

import signal
import sys
from typing import Optional, Sequence

from aligner.cli import setup_logging
from aligner.reward.remote import resolve_token
from aligner.reward.server import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_REQUEST_TIMEOUT_S,
    ModelScorer,
    RewardHTTPServer,
    RuleScorer,
)

DEFAULTS = {
    "reward.type": "model",
    "reward.init": "",
    "reward.rule": "task_accuracy",
    "tokenizer": "",
    "host": "127.0.0.1",
    "port": "5000",
    "token_file": "",
    "allow_no_token": "0",
    "max_batch": str(DEFAULT_MAX_BATCH),
    "max_request_bytes": str(DEFAULT_MAX_REQUEST_BYTES),
    "request_timeout_s": str(int(DEFAULT_REQUEST_TIMEOUT_S)),
    "max_connections": str(DEFAULT_MAX_CONNECTIONS),
    "micro_batch_size": "8",
}
INTS = {
    "port": (0, 65535),
    "allow_no_token": (0, 1),
    "max_batch": (1, None),
    "max_request_bytes": (1, None),
    "request_timeout_s": (1, None),
    "max_connections": (1, None),
    "micro_batch_size": (1, None),
}


class UsageError(ValueError):
    """A bad command line: the message names the key, the value and the fix."""


def parse_args(argv: Sequence[str]) -> dict:
    """``key=value`` arguments -> the settings (DEFAULTS overridden; ints converted); UsageError for a bad one."""
    out: dict = dict(DEFAULTS)
    for a in argv:
        key, eq, value = a.partition("=")
        if key == "token":
            raise UsageError(
                "token is not accepted on the command line (other users see a process's arguments): set the environment "
                "variable ALIGNER_RM_TOKEN, or token_file=PATH (a file holding the token)"
            )
        if not eq or key not in DEFAULTS:
            raise UsageError(f"{a!r} is not a key=value setting of serve_rm: valid keys are {', '.join(DEFAULTS)}")
        out[key] = value
    for key, (lo, hi) in INTS.items():
        try:
            v = int(out[key])
        except ValueError:
            raise UsageError(f"{key}={out[key]!r} is invalid: give an integer") from None
        if v < lo or (hi is not None and v > hi):
            raise UsageError(f"{key}={v} is invalid: must be in [{lo}, {hi if hi is not None else 'inf'}]")
        out[key] = v
    if out["reward.type"] not in ("model", "rule"):
        raise UsageError(f"reward.type={out['reward.type']!r} is invalid: serve_rm serves model or rule")
    if out["reward.type"] == "model" and not out["reward.init"]:
        raise UsageError("reward.init is empty: give the reward model's dir (reward.init=DIR), or reward.type=rule reward.rule=NAME")
    try:
        out["token"] = resolve_token("", out["token_file"])
    except ValueError as e:
        raise UsageError(str(e).replace("reward.token_file", "token_file")) from None
    return out


def build_server(settings: dict) -> RewardHTTPServer:
    """The server of `settings` (:func:`parse_args`), listening; ValueError for an unknown rule or a bad reward.init."""
    if settings["reward.type"] == "rule":
        scorer = RuleScorer(settings["reward.rule"])
    else:
        scorer = ModelScorer(settings["reward.init"], settings["micro_batch_size"], settings["tokenizer"])
    return RewardHTTPServer(
        scorer,
        host=settings["host"],
        port=settings["port"],
        token=settings["token"],
        max_batch=settings["max_batch"],
        max_request_bytes=settings["max_request_bytes"],
        request_timeout_s=settings["request_timeout_s"],
        max_connections=settings["max_connections"],
        allow_no_token=bool(settings["allow_no_token"]),
    )


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM stops serve_forever as Ctrl-C does


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m aligner.serve_rm [key=value ...]` -> exit code (2 for a bad setting, 0 after Ctrl-C / SIGTERM)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    setup_logging()
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    try:
        settings = parse_args(argv)
        server = build_server(settings)
    except (UsageError, ValueError, OSError) as e:
        print(f"aligner serve_rm: error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    auth = "token required" if settings["token"] else "no token"
    print(f"serving {server.scorer.name} at {server.url} ({auth}, max_batch={settings['max_batch']})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
