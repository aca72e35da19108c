"""The KTO trainer behind `python -m aligner.kto`: Kahneman-Tversky optimization of the policy (Ethayarajh et al.
2024, arXiv:2402.01306) from completions labelled desirable or undesirable, against a frozen reference.

The DPO stage's machinery (:class:`aligner.trainers.dpo.DPOTrainer`: the policy and its frozen reference in the
actor's workers, the same init, checkpoints, export, eval and task accuracy), with the KTO loss
(:func:`aligner.algorithms.kto_loss`, ``kto.beta``, ``kto.desirable_weight``, ``kto.undesirable_weight``) and the
KL reference point z0 of TRL's ``KTOTrainer``: each prompt of the global batch paired with the previous example's
completion (a rotation by one), z0 the clamped batch mean of the policy-reference log-ratio of those pairs.

Data: rows ``{"prompt", "completion", "label": true|false}`` (``data.format=unpaired``, TRL's unpaired preference
format), or preference pairs (pairs, hh, and the built-in task's pairs when data.train_path is empty), each made
two examples, the chosen one desirable and the rejected one undesirable (TRL's ``unpair_preference_dataset``).
Data without labels (any other format) is refused in one line before any worker starts.
"""

from __future__ import annotations

import logging
import random

from aligner.config import AlignerConfig
from aligner.data.encode import encode_records
from aligner.data.formats import load_records
from aligner.data.pipeline import DataSplits, load_data
from aligner.data.sampler import DataIterator
from aligner.data.tokenizer import load_tokenizer
from aligner.errors import UserError
from aligner.protocol import build_sequences
from aligner.runtime.role import check_tokenizer_fits
from aligner.trainers.dpo import DPOTrainer
from aligner.trainers.supervised import tokenizer_path
from aligner.workers.kto import KTOWorker

log = logging.getLogger("aligner")

LABELLED_FORMATS = ("unpaired", "pairs", "hh")  # data KTO can train on: labels, or pairs made unpaired


def unpair(pairs: list[dict]) -> list[dict]:
    """Encoded preference pairs (chosen_ids, rejected_ids, prompt_len) -> unpaired examples, two a pair:
    {"ids", "prompt_len", "label"}: the chosen completion desirable (true), the rejected one undesirable."""
    out = []
    for p in pairs:
        out.append({"ids": list(p["chosen_ids"]), "prompt_len": int(p["prompt_len"]), "label": True})
        out.append({"ids": list(p["rejected_ids"]), "prompt_len": int(p["prompt_len"]), "label": False})
    return out


def collate_unpaired(examples: list[dict], pad_id: int, max_seq_len: int) -> dict:
    """Unpaired examples -> the KTO batch of :mod:`aligner.actor.kto`: input_ids [B, T], prompt_lens [B],
    response_mask [B, R], label [B] bool, and the mismatched rows kl_input_ids, kl_prompt_lens, kl_response_mask:
    prompt i with the completion of example i - 1 (mod B; TRL's rotation), cut to max_seq_len tokens.
    Raises ValueError for fewer than 2 examples (a mismatched pair needs another example)."""
    import torch

    if len(examples) < 2:
        raise ValueError(f"a KTO batch needs at least 2 examples for its KL pairs, got {len(examples)}")
    prompts = [e["ids"][: e["prompt_len"]] for e in examples]
    completions = [e["ids"][e["prompt_len"] :] for e in examples]
    main = build_sequences(prompts, completions, pad_id)
    rotated = [completions[-1]] + completions[:-1]
    kl_completions = [c[: max(1, max_seq_len - len(p))] for p, c in zip(prompts, rotated)]
    kl = build_sequences(prompts, kl_completions, pad_id)
    return {
        "input_ids": main["input_ids"],
        "prompt_lens": main["prompt_lens"],
        "response_mask": main["response_mask"],
        "label": torch.tensor([bool(e["label"]) for e in examples]),
        "kl_input_ids": kl["input_ids"],
        "kl_prompt_lens": kl["prompt_lens"],
        "kl_response_mask": kl["response_mask"],
    }


def _encode_unpaired(records: list[dict], tokenizer, data_cfg) -> list[dict]:
    """Normalized unpaired records -> examples {"ids", "prompt_len", "label"} (the completion encoded as an SFT
    response: its loss-mask tokens are the completion)."""
    labels = {r["source"]: r["label"] for r in records}
    as_sft = [{**r, "response": r["completion"]} for r in records]
    out = []
    for ex in encode_records(as_sft, tokenizer, data_cfg, "sft").examples:
        mask = list(ex["loss_mask"])
        if 1 not in mask:
            continue
        out.append({"ids": list(ex["input_ids"]), "prompt_len": mask.index(1), "label": labels[ex["source"]]})
    return out


def load_unpaired(cfg: AlignerConfig, tokenizer, work_dir: str) -> DataSplits:
    """The KTO train/eval examples (see the module docstring). Raises UserError (one line) for data without labels."""
    d = cfg.data
    fmt = "pairs"
    if d.train_path:
        fmt = load_records(d.train_path, d.format, None, d.skip_invalid).format  # invalid rows: as the loading below
        if fmt not in LABELLED_FORMATS:
            raise UserError(
                f"data.train_path={d.train_path!r} has format {fmt!r}, which has no labels: KTO trains on completions labelled "
                'desirable or undesirable: give rows {"prompt", "completion", "label": true|false} (data.format=unpaired) '
                "or preference pairs (pairs, hh), which are made unpaired"
            )
    if fmt != "unpaired":
        pairs = load_data("pairs", d, cfg.task, tokenizer, work_dir)
        return DataSplits(train=unpair(pairs.train), eval=unpair(pairs.eval), format=pairs.format, stats=pairs.stats)
    train = load_records(d.train_path, d.format, None, d.skip_invalid).records
    if d.eval_path:
        ev = load_records(d.eval_path, d.format, None, d.skip_invalid).records
    else:
        order = list(range(len(train)))
        random.Random(d.shuffle_seed).shuffle(order)
        n_eval = int(len(train) * d.eval_fraction)
        ev, train = [train[i] for i in order[:n_eval]], [train[i] for i in order[n_eval:]]
    for r in train + ev:
        if "label" not in r:
            raise UserError(f"{r['source']}: the row has no 'label': KTO needs \"label\": true|false on every row")
    enc_train = _encode_unpaired(train, tokenizer, d)
    enc_eval = _encode_unpaired(ev, tokenizer, d) if ev else []
    return DataSplits(train=enc_train, eval=enc_eval, format=fmt, stats={})


class KTOTrainer(DPOTrainer):
    """KTO training of the actor role against a frozen reference; see the module docstring."""

    name, role, data_kind = "kto", "actor", "unpaired"
    train_method, eval_method = "kto_step", "kto_eval"
    eval_keys = ("loss", "rewards_chosen", "rewards_rejected", "reward_margin", "kl")
    bar_keys = ("loss", "reward_margin", "tokens_per_s")
    plot_keys = (
        "loss",
        "eval_loss",
        "rewards_chosen",
        "rewards_rejected",
        "reward_margin",
        "eval_reward_margin",
        "kl",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "task_accuracy",
    )

    def worker_cls(self) -> type:
        return KTOWorker

    def load_inputs(self) -> None:
        """The tokenizer as the supervised stages (:meth:`SupervisedTrainer.load_inputs`), the unpaired examples
        of :func:`load_unpaired` and the train iterator."""
        cfg = self.cfg
        try:
            self.tok_path = tokenizer_path(cfg, str(self.out))
            self.tokenizer = load_tokenizer(self.tok_path, cfg.tokenizer.chat_template)
        except (OSError, ValueError) as e:
            raise UserError(f"tokenizer.path={cfg.tokenizer.path!r}: {e}") from None
        check_tokenizer_fits(len(self.tokenizer), self.init_path(), cfg.model, self.role)
        try:
            self.data = load_unpaired(cfg, self.tokenizer, str(self.out))
        except ValueError as e:
            raise UserError(str(e)) from None
        if len(self.data.train) < 2:
            raise UserError(f"{len(self.data.train)} KTO training examples after loading: check data.* (a batch needs 2)")
        log.info("kto: %d train / %d eval unpaired examples (%s data)", len(self.data.train), len(self.data.eval), self.data.format)
        self.it = DataIterator(self.data.train, seed=cfg.data.shuffle_seed)

    def collate(self, examples: list[dict]) -> dict:
        return collate_unpaired(examples, self.pad_id, self.cfg.data.max_seq_len)

    def num_tokens(self, batch: dict) -> int:
        return int((batch["input_ids"] != self.pad_id).sum())


def run_kto(cfg: AlignerConfig) -> int:
    """Run the KTO stage for a validated config; returns the exit code."""
    return KTOTrainer(cfg).run()
