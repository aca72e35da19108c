"""From config to encoded train/eval examples: the one data path every stage uses.

Owns: :func:`resolve_tokenizer` (tokenizer.path, or the built-in task's tokenizer trained on
first use) and :func:`load_data` (files or the built-in task -> validated records -> encoded
examples for a kind: sft | pairs | prompt). The built-in task is written to jsonl first and
read back through the same loader as user files.

When ``data.eval_path`` is empty and a train file is given, ``data.eval_fraction`` of its
records (a seeded choice by ``data.shuffle_seed``) is held out as the eval split.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass, field

from aligner.config import DataConfig, TaskConfig, TokenizerConfig
from aligner.data.encode import EncodeResult, encode_records
from aligner.data.formats import load_records
from aligner.data.task import build_task_tokenizer, write_task_files
from aligner.data.tokenizer import load_tokenizer

log = logging.getLogger("aligner.data")

_TASK_SPLIT = {"sft": "sft", "pairs": "pairs", "prompt": "rl"}


@dataclass
class DataSplits:
    """Encoded examples of both splits plus what the loading and encoding steps reported."""

    train: list[dict]
    eval: list[dict]
    format: str
    stats: dict = field(default_factory=dict)  # skipped_invalid, skipped_tied, skipped_long, truncated, boundary_mismatch, reasons


def resolve_tokenizer(tok_cfg: TokenizerConfig, task_cfg: TaskConfig, work_dir: str):
    """tokenizer.path loaded by :func:`load_tokenizer`, or (path "") the task tokenizer built in work_dir/task."""
    path = tok_cfg.path or build_task_tokenizer(task_cfg, os.path.join(work_dir, "task"))
    return load_tokenizer(path, tok_cfg.chat_template)


def task_paths(task_cfg: TaskConfig, kind: str, work_dir: str) -> tuple[str, str]:
    """(train, eval) jsonl paths of the built-in task for `kind`, written under work_dir/task."""
    files = write_task_files(task_cfg, os.path.join(work_dir, "task"))
    split = _TASK_SPLIT[kind]
    return files[f"{split}_train"], files[f"{split}_eval"]


def load_data(kind: str, data_cfg: DataConfig, task_cfg: TaskConfig, tokenizer, work_dir: str) -> DataSplits:
    """Encoded train/eval examples for `kind` (sft | pairs | prompt); see aligner.data.encode for their keys.

    Raises ValueError (file:line) for invalid rows unless data.skip_invalid, for over-long rows
    under data.truncation=error, and for a format that cannot supply `kind`.
    """
    if kind not in _TASK_SPLIT:
        raise ValueError(f"kind={kind!r} is unknown: valid kinds are {', '.join(_TASK_SPLIT)}")
    if data_cfg.train_path:
        train_path, eval_path = data_cfg.train_path, data_cfg.eval_path
    else:
        train_path, eval_path = task_paths(task_cfg, kind, work_dir)
    train = load_records(train_path, data_cfg.format, kind, data_cfg.skip_invalid)
    stats = {"skipped_invalid": train.num_skipped, "skipped_tied": train.num_tied, "reasons": list(train.reasons)}
    if eval_path:
        ev = load_records(eval_path, data_cfg.format, kind, data_cfg.skip_invalid)
        stats["skipped_invalid"] += ev.num_skipped
        stats["skipped_tied"] += ev.num_tied
        stats["reasons"] += ev.reasons
        train_recs, eval_recs = train.records, ev.records
    else:
        train_recs, eval_recs = _hold_out(train.records, data_cfg.eval_fraction, data_cfg.shuffle_seed)
    if not eval_recs:
        log.warning(
            "data: no held-out split: %d %s rows of %s and data.eval_fraction=%g hold out none; set data.eval_path "
            "or a larger data.eval_fraction to evaluate on rows the model does not train on",
            len(train_recs),
            kind,
            train_path,
            data_cfg.eval_fraction,
        )
    if data_cfg.apply_chat_template or data_cfg.prompt_suffix:
        train_recs = [as_user_turn(r, data_cfg.prompt_suffix, data_cfg.apply_chat_template) for r in train_recs]
        eval_recs = [as_user_turn(r, data_cfg.prompt_suffix, data_cfg.apply_chat_template) for r in eval_recs]
    enc_train = encode_records(train_recs, tokenizer, data_cfg, kind)
    enc_eval = encode_records(eval_recs, tokenizer, data_cfg, kind) if eval_recs else EncodeResult(examples=[])
    for name, attr in (
        ("skipped_long", "num_skipped"),
        ("truncated", "num_truncated"),
        ("boundary_mismatch", "num_boundary_mismatch"),
        ("unk", "num_unk"),
    ):
        stats[name] = getattr(enc_train, attr) + getattr(enc_eval, attr)
    stats["skipped_invalid"] += enc_train.num_invalid + enc_eval.num_invalid  # rows the chat template cannot split
    stats["reasons"] += enc_train.reasons + enc_eval.reasons
    log.info(
        "data: %s %d train / %d eval examples from %s (format %s); %s",
        kind,
        len(enc_train.examples),
        len(enc_eval.examples),
        train_path,
        train.format,
        {k: v for k, v in stats.items() if k != "reasons"},
    )
    return DataSplits(train=enc_train.examples, eval=enc_eval.examples, format=train.format, stats=stats)


def as_user_turn(record: dict, suffix: str = "", chat: bool = True) -> dict:
    """A plain-text record with `suffix` appended to its prompt and, when `chat`, as a conversation.

    With `chat` the prompt becomes one user message (``messages``) and each plain answer
    (``response``, ``chosen``, ``rejected``) one assistant message, so the encoders render them
    through the tokenizer's chat template (``data.apply_chat_template``: an instruct model sees
    its own format, as TRL's conversational datasets and verl's GSM8K preprocessing do). The
    prompt text (with the suffix) stays in ``prompt`` for rule rewards. Records that already hold
    messages, or have no text prompt, are returned unchanged.
    """
    if "messages" in record or not isinstance(record.get("prompt"), str) or not record["prompt"]:
        return record
    out = dict(record, prompt=record["prompt"] + suffix)
    if not chat:
        return out
    out["messages"] = [{"role": "user", "content": out["prompt"]}]
    for key in ("response", "chosen", "rejected"):
        if isinstance(out.get(key), str):
            out[key] = [{"role": "assistant", "content": out[key]}]
    return out


def _hold_out(records: list[dict], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    n_eval = int(round(len(records) * fraction))
    if n_eval == 0:
        return records, []
    if n_eval >= len(records):
        raise ValueError(f"data.eval_fraction={fraction} leaves no training rows out of {len(records)}: lower it or set data.eval_path")
    idx = list(range(len(records)))
    random.Random(seed).shuffle(idx)
    held = set(idx[:n_eval])
    return [r for i, r in enumerate(records) if i not in held], [r for i, r in enumerate(records) if i in held]
