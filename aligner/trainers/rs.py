"""The rejection-sampling trainer behind `python -m aligner.rs` (NeMo-Aligner's RS stage).

Rejection-sampling fine-tuning as Llama 2 describes it (Touvron et al. 2023, arXiv 2307.09288,
section 3.2.3: "sample K outputs from the model and select the best candidate with our reward")
and NeMo-Aligner runs it as a stage of its own: one trainer step is one round,

    sample    ``rs.prompts_per_round`` training prompts (the data iterator's next batch), each
              ``rs.num_samples`` times, from the newest policy: refit, then the actor's rollout engine
              with ``rollout.sampling`` (temperature > 0) and per-sample seeds (trainer.seed, round, index)
    score     every response with the run's reward, through the PPO stage's plumbing: a rule on the
              driver (:func:`aligner.reward.rules.score`), a reward model's or an LLM judge's worker group
              (:class:`aligner.workers.reward.RewardWorker`), or a remote endpoint
              (:class:`aligner.workers.reward.RemoteRewardRole`)
    select    per prompt, the best-scoring response among the candidates (with ``rs.eos_only`` those that
              ended with EOS; with ``rs.reject_degenerate`` not loops, placeholders or empty text,
              :mod:`aligner.reward.degenerate`), kept when its reward is >= ``rs.threshold`` (:func:`select_best`); a round that
              keeps nothing stops the run (UserError, exit 2) before any update on an empty set
    train     ceil(rs.epochs * kept / trainer.global_batch_size) optimizer steps of the SFT loss (next-token
              NLL on response tokens, EOS included) on the kept (prompt, response) rows, the actor's layout
              (``actor.parallel``) and optimizer (``actor.optim``)
    pairs     with ``rs.write_pairs``: per prompt, a (chosen, rejected) pair from the same samples
              (:func:`select_pairs`), written per round under output_dir/rs_pairs and, at the end, together as
              one preference dataset the DPO stage reads

Rounds: ``trainer.max_steps``. Evaluation (before the first round, every ``trainer.eval_every`` rounds
and after the last) is the held-out greedy accuracy of :func:`aligner.trainers.evaluation.evaluate_greedy`
on the eval split of the prompts (``data.eval_path``, else ``data.eval_fraction`` of the train file; on
IFEval-style rows also IFEval's four numbers). Checkpoints hold the actor (weights, optimizer, schedule),
the round and the prompt iterator's position; ``resume=true`` continues from the last complete round.

Logged per round: kept, kept_fraction (kept / prompts), reward_mean_all, reward_mean_kept,
ended_fraction (responses that ended with EOS), with rs.reject_degenerate degenerate_fraction (of all responses)
and degenerate_passing (degenerate responses the reward alone would have kept as candidates), response_len_all, response_len_kept (tokens, EOS
included), the SFT steps' mean loss, grad_norm and lr, pairs, and the phase times.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from aligner.config import AlignerConfig
from aligner.data.collate import collate_sft
from aligner.errors import UserError
from aligner.protocol import build_sequences
from aligner.reward.degenerate import degenerate_reason
from aligner.reward.rules import ROW_CHECKS, check_rule_rows, get_rule, score
from aligner.trainers.batching import sample_seed
from aligner.trainers.evaluation import evaluate_greedy, gather_generations
from aligner.trainers.supervised import SupervisedTrainer, first, log_init, tiny_sft_init
from aligner.workers.actor import ActorWorker
from aligner.workers.group import CoreSharing, role_worker_group
from aligner.workers.placement import local_shortfall, placement_from_config
from aligner.workers.reward import JudgeScores, RemoteRewardRole, RewardWorker

log = logging.getLogger("aligner")


# ---- selection: pure functions on scores -------------------------------------------------------
def select_best(
    scores: torch.Tensor, ended: torch.Tensor, threshold: float, eos_only: bool, eligible: Optional[torch.Tensor] = None
) -> list[int]:
    """The sample kept for each prompt: rejection sampling's best-of-N (Llama 2, section 3.2.3).

    scores: [P, N] float rewards of N samples for each of P prompts; ended: [P, N] bool, True where the
    response ended with EOS (finish_reason "stop"); threshold: a prompt's best is kept when its reward
    >= threshold; eos_only: only ended samples are candidates; eligible: [P, N] bool or None, False where a
    sample is never a candidate (with rs.reject_degenerate: a degenerate response, aligner.reward.degenerate).
    Returns P sample indices in [0, N), or -1 where nothing is kept. Ties go to the lowest sample index
    (the order the engine was given, so a fixed seed keeps a fixed sample). A NaN score is never kept.
    The threshold is compared in the scores' dtype (a float32 score of 0.95 meets threshold=0.95).
    Raises ValueError when the shapes differ.
    """
    eligible = _eligible(scores, ended, eligible, "select_best")
    threshold = float(torch.tensor(threshold, dtype=scores.dtype))
    keep = []
    for row, fin, ok in zip(scores.tolist(), ended.tolist(), eligible.tolist()):
        best, idx = -math.inf, -1
        for j, (s, e, g) in enumerate(zip(row, fin, ok)):
            if (eos_only and not e) or math.isnan(s) or not g:
                continue
            if s > best:
                best, idx = s, j
        keep.append(idx if idx >= 0 and best >= threshold else -1)
    return keep


def select_pairs(
    scores: torch.Tensor, ended: torch.Tensor, threshold: float, eligible: Optional[torch.Tensor] = None
) -> list[Optional[tuple[int, int]]]:
    """A verifier-ranked preference pair for each prompt, from the same N samples.

    chosen: the best eligible sample that ended with EOS and scores >= threshold (with a rule such as
    ifeval_all at threshold 1: passes every constraint and ended); rejected: among the samples that score
    below threshold, were cut at the token limit or are not eligible (degenerate), a degenerate one first
    (text that passes the verifier without content is what the pair should teach against most), then the
    lowest score, a cut sample before an ended one at equal score (a loop), then the lowest index.
    scores: [P, N] float; ended: [P, N] bool; eligible: [P, N] bool or None (all eligible). Returns P
    entries: (chosen index, rejected index), or None where the prompt has no passing sample or no failing
    one. Raises ValueError when the shapes differ.
    """
    eligible = _eligible(scores, ended, eligible, "select_pairs")
    chosen = select_best(scores, ended, threshold, eos_only=True, eligible=eligible)
    threshold = float(torch.tensor(threshold, dtype=scores.dtype))
    out: list[Optional[tuple[int, int]]] = []
    for c, row, fin, ok in zip(chosen, scores.tolist(), ended.tolist(), eligible.tolist()):
        losers = [(g, s, e, j) for j, (s, e, g) in enumerate(zip(row, fin, ok)) if not e or not s >= threshold or not g]
        if c < 0 or not losers:
            out.append(None)
            continue
        g, s, e, j = min(losers, key=lambda t: (t[0], t[1] if not math.isnan(t[1]) else -math.inf, t[2], t[3]))
        out.append((c, j))
    return out


def _eligible(scores: torch.Tensor, ended: torch.Tensor, eligible: Optional[torch.Tensor], who: str) -> torch.Tensor:
    """`eligible` checked against scores and ended ([P, N] each), or all True when None."""
    if eligible is None:
        eligible = torch.ones_like(ended, dtype=torch.bool)
    if scores.dim() != 2 or scores.shape != ended.shape or eligible.shape != ended.shape:
        raise ValueError(
            f"{who}: scores {tuple(scores.shape)}, ended {tuple(ended.shape)} and eligible {tuple(eligible.shape)} must all be [P, N]"
        )
    return eligible


def sft_rows(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], max_len: int) -> list[dict]:
    """SFT examples {"input_ids", "loss_mask"} of (prompt, response) token lists: loss on response tokens
    only (EOS included when the response has it), cut to `max_len` tokens."""
    rows = []
    for p, r in zip(prompt_ids, response_ids):
        ids = (list(p) + list(r))[:max_len]
        mask = ([0] * len(p) + [1] * len(r))[:max_len]
        rows.append({"input_ids": ids, "loss_mask": mask})
    return rows


def round_batches(n_rows: int, epochs: float, batch_size: int, seed: int) -> list[list[int]]:
    """Row indices of a round's SFT steps: ceil(epochs * n_rows / batch_size) batches of batch_size rows,
    drawn from a seeded shuffle of the rows, reshuffled after each pass (every batch full: the loss is
    normalized over a fixed global batch)."""
    if n_rows < 1:
        raise ValueError("round_batches: no rows to train on")
    steps = max(1, math.ceil(epochs * n_rows / batch_size))
    rng = random.Random(seed)
    order: list[int] = []
    while len(order) < steps * batch_size:
        perm = list(range(n_rows))
        rng.shuffle(perm)
        order += perm
    return [order[i * batch_size : (i + 1) * batch_size] for i in range(steps)]


# ---- the trainer -------------------------------------------------------------------------------
class RSTrainer(SupervisedTrainer):
    """Rejection sampling on the actor role (see the module docstring)."""

    name, role, data_kind = "rs", "actor", "prompt"
    train_method = "sft_step"
    eval_before_training = True
    bar_keys = ("kept_fraction", "reward_mean_all", "loss")
    plot_keys = (
        "kept_fraction",
        "reward_mean_all",
        "reward_mean_kept",
        "ended_fraction",
        "response_len_all",
        "eval_accuracy",
        "eval_prompt_strict",
        "eval_instruction_strict",
        "loss",
        "time/generate",
        "time/train",
    )

    def __init__(self, cfg: AlignerConfig):
        super().__init__(cfg)
        self.init = tiny_sft_init(cfg, cfg.actor.init)
        self.reward_group = None
        self.remote: Optional[RemoteRewardRole] = None
        self.sharing: Optional[CoreSharing] = None  # trainer.num_threads=0: the busy groups share the node's cores

    # ---- hooks of the supervised stages ----------------------------------------------------------
    def init_path(self) -> str:
        return self.init

    def worker_cls(self) -> type:
        return ActorWorker

    def optimizer_steps(self) -> int:
        """An upper bound of the run's optimizer steps (the LR schedule's length): rounds x the steps of a
        round that keeps every prompt."""
        c, rs = self.cfg, self.cfg.rs
        return c.trainer.max_steps * max(1, math.ceil(rs.epochs * rs.prompts_per_round / c.trainer.global_batch_size))

    def worker_kwargs(self) -> dict:
        log_init(self.cfg, "the policy", self.init, "actor.init")
        return {
            "cfg": self.cfg,
            "role": "actor",
            "total_steps": self.optimizer_steps(),
            "init": self.init,
            "eos_token_id": self.tokenizer.eos_token_id,
        }

    def collate(self, examples: list[dict]) -> dict:
        return collate_sft(examples, self.pad_id)

    def final_results(self) -> tuple[dict, dict]:
        return {}, {}  # the last round's evaluation is the stage's result

    # ---- phases ----------------------------------------------------------------------------------
    def check(self) -> Optional[int]:
        """plan_only, then the paths and inits of every role the run starts, and the machine."""
        cfg = self.cfg
        if cfg.plan_only:
            return super().check()
        cfg.check_paths(cfg.roles_used())
        self.check_init()
        why = local_shortfall(cfg, cfg.roles_used())
        if why:
            raise UserError(
                f"this machine cannot hold the run ({why}): lower actor.resources.cpus_per_worker or the parallel sizes, "
                "or submit to a Ray cluster that has them (cluster.address=auto)"
            )
        return None

    def claim_inputs(self) -> dict[str, str]:
        return {"actor.init": self.init, "reward.init": self.cfg.reward.init if self.cfg.reward.type in ("model", "judge") else ""}

    def load_inputs(self) -> None:
        """Tokenizer, the prompt splits, and the reward's check of every row (before any worker starts)."""
        super().load_inputs()
        if self.cfg.reward.type == "rule":
            check_rule_can_score(self.cfg.reward.rule, self.data.train + self.data.eval)
        if self.cfg.rs.write_pairs and os.path.abspath(self.cfg.rs.write_pairs).startswith(
            str(self.out.resolve()) + os.sep + "checkpoints"
        ):
            raise UserError(f"rs.write_pairs={self.cfg.rs.write_pairs!r} is inside the checkpoints dir: give a path outside it")
        log.info(
            "rs: %d training prompts, %d held out; %d prompts x %d samples a round, %d rounds, keep reward >= %g%s",
            len(self.data.train),
            len(self.data.eval),
            self.cfg.rs.prompts_per_round,
            self.cfg.rs.num_samples,
            self.cfg.trainer.max_steps,
            self.cfg.rs.threshold,
            " among responses that ended" if self.cfg.rs.eos_only else "",
        )

    def worker_groups(self) -> dict:
        groups = {"actor": self.group} if self.group is not None else {}
        if self.reward_group is not None:
            groups["reward"] = self.reward_group
        return groups

    def start(self) -> None:
        """The actor group (training + rollout engine); the reward group for a reward model or judge; the
        remote reward's client."""
        cfg = self.cfg
        roles = cfg.roles_used()
        self.placement = placement_from_config(cfg, roles, restarting=self.restarts_spent() > 0)
        t0 = time.perf_counter()
        self.group = role_worker_group(cfg, "actor", ActorWorker, self.placement, kwargs=self.worker_kwargs())
        if "reward" in roles:
            self.reward_group = role_worker_group(cfg, "reward", RewardWorker, self.placement, kwargs={"cfg": cfg})
        if cfg.reward.type == "remote":
            self.remote = RemoteRewardRole(cfg.reward)
        self.sharing = CoreSharing(self.worker_groups()) if cfg.trainer.num_threads == 0 else None
        log.info("rs: worker groups %s ready in %.1f s", ", ".join(roles), time.perf_counter() - t0)

    def phase(self, *roles: str) -> None:
        """With trainer.num_threads=0 the busy groups share the node's cores."""
        if self.sharing is not None:
            self.sharing.phase([r for r in roles if r in self.worker_groups()])

    def stop(self) -> None:
        if self.remote is not None:
            self.remote.shutdown()
            self.remote = None
        if self.reward_group is not None:
            self.reward_group.shutdown()
            self.reward_group = None
        super().stop()

    # ---- one round -------------------------------------------------------------------------------
    def scores(self, rows: list[dict], gens: list, responses: list[str]) -> torch.Tensor:
        """Rewards [B] float32 of B samples (rows[i]: the prompt example of sample i)."""
        rc = self.cfg.reward
        if rc.type == "rule":
            return score(rc.rule, [r["prompt"] for r in rows], responses, [dict(r.get("metadata") or {}) for r in rows])
        if rc.type == "judge":
            self.phase("reward")
            return JudgeScores(self.reward_group.judge_scores({"prompt": [r["prompt"] for r in rows], "response": responses})).get()
        seq = build_sequences([r["prompt_ids"] for r in rows], [g.token_ids for g in gens], self.pad_id)
        batch = {"input_ids": seq["input_ids"], "attention_mask": seq["attention_mask"]}
        if rc.type == "remote":
            meta = [{"prompt": r["prompt"], "response": t, "metadata": dict(r.get("metadata") or {})} for r, t in zip(rows, responses)]
            return self.remote.scores(batch, meta).get()
        self.phase("reward")
        return self.reward_group.scores(batch).get().float()

    def run_step(self) -> dict:
        """One round: sample, score, select, fine-tune (module docstring); its metrics."""
        cfg, rs = self.cfg, self.cfg.rs
        rnd, n = self.step + 1, rs.num_samples
        prompts = self.it.next_batch(rs.prompts_per_round)
        rows = [p for p in prompts for _ in range(n)]
        seeds = [sample_seed(cfg.trainer.seed, rnd, i) for i in range(len(rows))]
        t0 = time.perf_counter()
        self.phase("actor")
        self.group.refit().get()
        gens = gather_generations(self.group.generate([r["prompt_ids"] for r in rows], cfg.rollout.sampling, seeds).get())
        if len(gens) != len(rows):
            raise RuntimeError(f"the actor returned {len(gens)} generations for {len(rows)} samples")
        t1 = time.perf_counter()
        responses = [self.tokenizer.decode(g.token_ids, skip_special_tokens=True) for g in gens]
        flat = self.scores(rows, gens, responses)
        t2 = time.perf_counter()
        p = len(prompts)
        sc = flat.view(p, n)
        ended = torch.tensor([g.finish_reason == "stop" for g in gens]).view(p, n)
        lens = torch.tensor([len(g.token_ids) for g in gens], dtype=torch.float32).view(p, n)
        reasons = [degenerate_reason(t, r.get("metadata")) for r, t in zip(rows, responses)] if rs.reject_degenerate else [""] * len(rows)
        eligible = torch.tensor([not w for w in reasons]).view(p, n)
        keep = select_best(sc, ended, rs.threshold, rs.eos_only, eligible)
        kept = [(i, j) for i, j in enumerate(keep) if j >= 0]
        npairs = self.write_round_pairs(rnd, prompts, responses, sc, ended, eligible) if rs.write_pairs else 0
        if not kept:
            cand = sc[ended] if rs.eos_only else sc.flatten()
            best = f"{float(cand.max()):.4g}" if cand.numel() else "none"
            off = [f"rs.{k}=false" for k in ("eos_only", "reject_degenerate") if getattr(rs, k)]
            raise UserError(
                f"rs.threshold={rs.threshold:g}{' with rs.reject_degenerate' if rs.reject_degenerate else ''} kept no response in round {rnd}: {p} prompts x {n} samples, best reward {best}"
                f"{f' among the {int(ended.sum())} that ended with EOS' if rs.eos_only else ''}; nothing was trained on it. "
                "Lower rs.threshold, raise rs.num_samples or rollout.sampling.max_new_tokens"
                + (", or set " + " or ".join(off) if off else "")
            )
        examples = sft_rows([prompts[i]["prompt_ids"] for i, _ in kept], [gens[i * n + j].token_ids for i, j in kept], cfg.data.max_seq_len)
        self.phase("actor")
        steps = []
        for idx in round_batches(len(examples), rs.epochs, cfg.trainer.global_batch_size, cfg.trainer.seed * 7_919 + rnd):
            steps.append({k: first(v) for k, v in self.group.sft_step(self.collate([examples[i] for i in idx])).get().items()})
        t3 = time.perf_counter()
        kept_scores = torch.tensor([float(sc[i, j]) for i, j in kept])
        kept_lens = torch.tensor([float(lens[i, j]) for i, j in kept])
        metrics = {
            "kept": float(len(kept)),
            "kept_fraction": len(kept) / p,
            "reward_mean_all": float(flat.mean()),
            "reward_mean_kept": float(kept_scores.mean()),
            "ended_fraction": float(ended.float().mean()),
            "response_len_all": float(lens.mean()),
            "response_len_kept": float(kept_lens.mean()),
            "sft_steps": float(len(steps)),
            "loss": sum(s["loss"] for s in steps) / len(steps),
            "grad_norm": steps[-1]["grad_norm"],
            "lr": steps[-1]["lr"],
            "time/generate": t1 - t0,
            "time/score": t2 - t1,
            "time/train": t3 - t2,
            "tokens_per_s": sum(len(g.token_ids) for g in gens) / max(t1 - t0, 1e-9),
        }
        if rs.write_pairs:
            metrics["pairs"] = float(npairs)
        if rs.reject_degenerate:
            metrics["degenerate_fraction"] = sum(bool(w) for w in reasons) / len(reasons)
            metrics["degenerate_passing"] = float(((sc >= rs.threshold) & (ended | (not rs.eos_only)) & ~eligible).sum())
        log.info(
            "rs: round %d: kept %d/%d prompts (reward of kept %.3f, of all %.3f; %.0f%% ended; lengths kept %.0f, all %.0f tokens); "
            "%d SFT steps, loss %.4f; generate %.0f s, score %.0f s, train %.0f s",
            rnd,
            len(kept),
            p,
            metrics["reward_mean_kept"],
            metrics["reward_mean_all"],
            100 * metrics["ended_fraction"],
            metrics["response_len_kept"],
            metrics["response_len_all"],
            len(steps),
            metrics["loss"],
            t1 - t0,
            t2 - t1,
            t3 - t2,
        )
        return metrics

    def evaluate(self) -> dict:
        """Held-out greedy accuracy (and IFEval's numbers on IFEval-style rows) as eval_<key>."""
        if not self.data.eval:
            return {}
        self.phase("actor")
        res = evaluate_greedy(self.group, self.data.eval, self.tokenizer, self.cfg).metrics
        return {f"eval_{k}": float(v) for k, v in res.items()}

    # ---- pairs for DPO ---------------------------------------------------------------------------
    def pairs_dir(self) -> Path:
        return self.out / "rs_pairs"

    def write_round_pairs(
        self, rnd: int, prompts: list[dict], responses: list[str], sc: torch.Tensor, ended: torch.Tensor, eligible: torch.Tensor
    ) -> int:
        """output_dir/rs_pairs/round_<rnd>.jsonl (atomically): this round's pairs as {"prompt", "chosen",
        "rejected", "chosen_reward", "rejected_reward", "rejected_cut", "rejected_degenerate"}, pairs with an empty side left out; returns how many."""
        n = sc.shape[1]
        lines = []
        for i, pair in enumerate(select_pairs(sc, ended, self.cfg.rs.threshold, eligible)):
            if pair is None:
                continue
            c, r = pair
            if not responses[i * n + c].strip() or not responses[i * n + r].strip():
                continue  # an empty response (EOS first) is no preference text: the DPO stage refuses such a row
            row = {
                "prompt": prompt_text(prompts[i]),
                "chosen": responses[i * n + c],
                "rejected": responses[i * n + r],
                "chosen_reward": float(sc[i, c]),
                "rejected_reward": float(sc[i, r]),
                "rejected_cut": not bool(ended[i, r]),
                "rejected_degenerate": not bool(eligible[i, r]),
            }
            lines.append(json.dumps(row, ensure_ascii=False))
        d = self.pairs_dir()
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".round_{rnd:05d}.jsonl.tmp"
        tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        os.replace(tmp, d / f"round_{rnd:05d}.jsonl")
        return len(lines)

    def finish(self) -> None:
        """HF export, curves, summary; with rs.write_pairs the pairs of rounds 1..last as one file."""
        super().finish()
        if self.cfg.rs.write_pairs:
            path = Path(self.cfg.rs.write_pairs)
            path.parent.mkdir(parents=True, exist_ok=True)
            n = 0
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                for rnd in range(1, self.step + 1):
                    part = self.pairs_dir() / f"round_{rnd:05d}.jsonl"
                    if part.exists():
                        text = part.read_text(encoding="utf-8")
                        n += text.count("\n")
                        f.write(text)
            os.replace(tmp, path)
            log.info("rs: %d preference pairs in %s (python -m aligner.dpo data.train_path=%s data.format=pairs)", n, path, path)


def prompt_text(example: dict) -> str:
    """The prompt as the user wrote it (before any chat template): what a preference dataset's "prompt" holds."""
    return example["prompt"]


def check_rule_can_score(rule: str, examples: list[dict]) -> None:
    """UserError naming file:line when rule `rule` cannot score an example: the rule's own row check
    (:func:`aligner.reward.rules.check_rule_rows`), or, for a rule without one, the rule called on an
    empty response of every row (a missing metadata field raises there)."""
    try:
        if rule in ROW_CHECKS:
            check_rule_rows(rule, examples)
            return
        fn = get_rule(rule)
    except ValueError as e:
        raise UserError(str(e)) from None
    for e in examples:
        try:
            fn(e["prompt"], "", dict(e.get("metadata") or {}))
        except (ValueError, KeyError, TypeError) as err:
            raise UserError(f"{e.get('source', '?')}: reward.rule={rule} cannot score this row: {err}") from None


def run_rs(cfg: AlignerConfig) -> int:
    """Run the rejection-sampling stage for a validated config; returns the exit code."""
    return RSTrainer(cfg).run()
