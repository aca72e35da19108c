"""The SPIN trainer behind `python -m aligner.spin`: self-play fine-tuning (Chen et al. 2024, arXiv:2401.01335).

``spin.iterations`` rounds over the SFT data (every format the SFT stage reads; the built-in task's
demonstrations when data.train_path is empty). At each round's start the reference becomes the current policy
(p_theta_t), the policy answers ``spin.prompts_per_iteration`` SFT prompts (sampled without replacement, seeded by
the round) greedily with its rollout engine, and each answer that differs from the data's response makes a pair:
chosen = the SFT response y, rejected = the model's y'. The round then runs ``trainer.max_steps / iterations``
DPO steps on those pairs with SPIN's loss (:func:`aligner.algorithms.spin_loss`, DPO's sigmoid with beta =
``spin.lam``), through the DPO stage's machinery (:class:`aligner.trainers.dpo.DPOTrainer`). Held-out metrics are
the DPO ones on pairs built the same way from up to ``trainer.eval_batch_size`` held-out SFT prompts.

Simplifications: greedy generation (the paper samples); a resumed run rebuilds its round's pairs and reference
from the resumed policy, not the round's start.
"""

from __future__ import annotations

import logging
import random

from aligner.config import AlignerConfig
from aligner.data.sampler import DataIterator
from aligner.trainers.dpo import DPOTrainer
from aligner.trainers.evaluation import gather_generations, greedy_sampling
from aligner.workers.spin import SPINWorker

log = logging.getLogger("aligner")


def prompt_and_response(example: dict) -> tuple[list[int], list[int]]:
    """An encoded SFT example (input_ids, loss_mask) -> (prompt ids, response ids): the response is the run of
    loss tokens (the first loss token on). Raises ValueError for an example without one."""
    mask = list(example["loss_mask"])
    if 1 not in mask:
        raise ValueError(f"{example.get('source', 'an SFT example')}: no response tokens")
    start = mask.index(1)
    ids = list(example["input_ids"])
    return ids[:start], ids[start:]


def spin_pairs(prompts: list[list[int]], real: list[list[int]], generated: list[list[int]]) -> list[dict]:
    """SPIN's pairs (Chen et al. 2024, section 4): chosen = prompt + the data's response y, rejected = prompt + the
    model's response y'; a y' equal to y is dropped (its loss gradient is 0). Returns pair examples
    {"chosen_ids", "rejected_ids", "prompt_len"} (:func:`aligner.data.collate.collate_pairs`)."""
    if not len(prompts) == len(real) == len(generated):
        raise ValueError(f"spin_pairs: {len(prompts)} prompts, {len(real)} responses, {len(generated)} generations")
    return [
        {"chosen_ids": p + y, "rejected_ids": p + g, "prompt_len": len(p)}
        for p, y, g in zip(prompts, real, generated)
        if list(y) != list(g)
    ]


class SPINTrainer(DPOTrainer):
    """SPIN of the actor role; see the module docstring."""

    name, role, data_kind = "spin", "actor", "sft"
    train_method, eval_method = "spin_step", "spin_eval"

    def __init__(self, cfg: AlignerConfig):
        super().__init__(cfg)
        self.round = -1  # the round whose pairs self.it holds (-1: none yet)
        self.pairs_eval: list[dict] = []

    def worker_cls(self) -> type:
        return SPINWorker

    def load_inputs(self) -> None:
        """The SFT stage's data (the rounds' prompts and responses); the pair iterator is built per round."""
        super().load_inputs()
        self.sft = self.data
        self.steps_per_round = max(1, -(-self.cfg.trainer.max_steps // self.cfg.spin.iterations))

    def _generate(self, prompts: list[list[int]]) -> list[list[int]]:
        sampling = greedy_sampling(self.cfg, max(len(p) for p in prompts))
        self.group.refit().get()
        gens = gather_generations(self.group.generate(prompts, sampling, list(range(len(prompts)))).get())
        return [list(g.token_ids) for g in gens]

    def start_round(self, r: int) -> None:
        """Round r: the reference := the policy, the round's generations and pairs, a fresh pair iterator."""
        cfg = self.cfg
        rng = random.Random(cfg.data.shuffle_seed * 1000 + r)
        train = rng.sample(self.sft.train, min(cfg.spin.prompts_per_iteration, len(self.sft.train)))
        held = self.sft.eval[: cfg.trainer.eval_batch_size]
        parts = [prompt_and_response(e) for e in train + held]
        gens = self._generate([p for p, _ in parts])
        pairs = spin_pairs([p for p, _ in parts], [y for _, y in parts], gens)
        n_train = sum(1 for (p, y), g in zip(parts[: len(train)], gens[: len(train)]) if y != g)
        self.group.reset_reference().get()
        self.pairs_train, self.pairs_eval = pairs[:n_train], pairs[n_train:]
        if len(self.pairs_train) < 1:
            raise RuntimeError(f"spin round {r}: the policy reproduced every SFT response of the round: nothing left to learn")
        self.it = DataIterator(self.pairs_train, seed=cfg.data.shuffle_seed + r)
        self.round = r
        log.info(
            "spin: round %d: %d / %d train and %d / %d held-out generations differ from the data (pairs)",
            r,
            n_train,
            len(train),
            len(self.pairs_eval),
            len(held),
        )

    def run_step(self) -> dict:
        r = min(self.step // self.steps_per_round, self.cfg.spin.iterations - 1)
        if r != self.round:
            self.start_round(r)
        return {**super().run_step(), "spin_round": float(r), "spin_pairs": float(len(self.pairs_train))}

    def evaluate(self) -> dict:
        """DPO metrics on the round's held-out pairs ({} before the first round)."""
        if not self.pairs_eval:
            return {}
        self.data = type(self.sft)(train=self.pairs_train, eval=self.pairs_eval, format=self.sft.format, stats=self.sft.stats)
        try:
            return super().evaluate()
        finally:
            self.data = self.sft

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.round = -1  # the round's pairs and reference are rebuilt from the resumed policy


def run_spin(cfg: AlignerConfig) -> int:
    """Run the SPIN stage for a validated config; returns the exit code."""
    return SPINTrainer(cfg).run()
