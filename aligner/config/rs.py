"""The rejection-sampling stage's own fields (:class:`RSConfig`, section ``rs``).

Rejection sampling, as NeMo-Aligner's RS stage and Llama 2's rejection-sampling fine-tuning
(Touvron et al. 2023, arXiv 2307.09288, section 3.2.3) do it: each round samples
``num_samples`` responses per prompt from the newest policy, scores them with the run's reward
(``reward.*``), keeps the best response of each prompt whose reward is at least ``threshold``
and fine-tunes the policy on the kept set with the SFT loss. The number of rounds is
``trainer.max_steps`` (one trainer step is one round).
"""

from __future__ import annotations

from dataclasses import dataclass

from aligner.config.common import _check


@dataclass(kw_only=True)
class RSConfig:
    """Rejection sampling: how many samples, which to keep, how long to fine-tune on them, pairs for DPO."""

    num_samples: int = 4  # N: responses sampled per prompt each round (rollout.sampling sets temperature, top_p, max_new_tokens)
    prompts_per_round: int = 64  # training prompts sampled each round (the data iterator walks the train split in epochs)
    threshold: float = 1.0  # a prompt's best response is kept when its reward >= threshold (reward units: a rule's [0, 1])
    eos_only: bool = True  # only responses that ended with EOS are candidates (a response cut at max_new_tokens is never kept)
    # responses that loop, fill in placeholders or carry no words (aligner.reward.degenerate) are never kept and rank with
    # the rejected side of the pairs: a format verifier (IFEval's) passes such text
    reject_degenerate: bool = False
    epochs: float = 1.0  # SFT passes over each round's kept set: ceil(epochs * kept / trainer.global_batch_size) optimizer steps
    # "" = no pairs; else a preference dataset (jsonl {"prompt", "chosen", "rejected"}, TRL's standard type) written at the
    # end from every round's samples: chosen = the best response that ended and scores >= threshold, rejected = the
    # worst that scores < threshold or was cut at max_new_tokens; `python -m aligner.dpo data.train_path=PATH data.format=pairs`
    write_pairs: str = ""

    def validate(self, prefix: str = "rs") -> None:
        _check(
            self.num_samples >= 2,
            f"{prefix}.num_samples",
            self.num_samples,
            "must be >= 2: rejection sampling keeps the best of several samples per prompt (e.g. 4 or 8)",
        )
        _check(self.prompts_per_round >= 1, f"{prefix}.prompts_per_round", self.prompts_per_round, "must be >= 1 (e.g. 64)")
        _check(self.epochs > 0, f"{prefix}.epochs", self.epochs, "must be > 0 (SFT passes over the kept set, e.g. 1)")
