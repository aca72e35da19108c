"""The checks of a whole run across its sections, one function per concern, run by :func:`validate_run`
when an :class:`~aligner.config.run.AlignerConfig` is built (after each section checked its own fields,
:meth:`AlignerConfig.validate <aligner.config.run.AlignerConfig.validate>`).

What is checked here needs two sections at once: the reference of a LoRA actor, lengths against the
model, prompt learning's layouts, GPUs of the roles against the cluster, the on-policy shortcut and the
group estimators; the package probes of a chosen backend (:mod:`aligner.config.probes`) run here too.
:data:`CROSS_CHECKS` says which stages and settings each check applies to, in the order they run. The
checks receive the config typed by :class:`aligner.config.view.RunView`: nothing here imports the module
that builds the config. Every check raises :class:`ConfigError` naming the field, the bad value and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from aligner.config.agent import AGENT_ENV
from aligner.config.common import GROUP_ESTIMATORS, MODEL_ROLES, STAGES, _check
from aligner.config.probes import check_loggers, check_trtllm, check_vllm
from aligner.config.roles import PromptLearningConfig
from aligner.config.view import RunView


def validate_run(cfg: RunView) -> None:
    """The checks across sections of a config whose sections are valid each, in :data:`CROSS_CHECKS`' order,
    those that apply to its stage and settings (the package probes among them: ``rollout.backend=trtllm`` /
    ``vllm``, the loggers of ``trainer.loggers``). Resolves ``algorithm.decoupled_loss`` and
    ``trainer.ref_ahead`` when they are None (:func:`validate_staleness`). Raises ConfigError at the first."""
    for check in CROSS_CHECKS:
        if check.applies(cfg):
            check.run(cfg)


def validate_shared_limits(cfg: RunView) -> None:
    """What one section's fields allow of another's: the reference of a LoRA actor, SPIN's full reference
    copy, the data length within the model's."""
    _check(
        not (cfg.ref_from_actor and cfg.ref.init and cfg.ref.init != cfg.actor.init),
        "ref.init",
        cfg.ref.init,
        "with actor.lora.rank > 0 the reference is the actor's frozen base (actor.init); leave ref.init empty",
    )
    _check(
        cfg.stage != "spin" or cfg.actor.lora.rank == 0,
        "actor.lora.rank",
        cfg.actor.lora.rank,
        "SPIN's reference is the policy at each round's start, a full copy: set actor.lora.rank=0",
    )
    _check(
        cfg.data.max_seq_len <= cfg.model.max_seq_len,
        "data.max_seq_len",
        cfg.data.max_seq_len,
        f"must not exceed model.max_seq_len={cfg.model.max_seq_len}",
    )


def _hf_dir_file(init: str, name: str) -> Optional[str]:
    """`name` in the HF directory `init` names (itself, or a run dir's hf/), or None."""
    import os

    for d in (init, os.path.join(init, "hf")):
        path = os.path.join(d, name)
        if init and os.path.isfile(path):
            return path
    return None


def _vocab_of(init: str) -> tuple[Optional[int], Optional[dict]]:
    """(config.json's vocab_size, tokenizer.json's model.vocab) of the checkpoint `init` names (None where absent)."""
    import json

    size = vocab = None
    if path := _hf_dir_file(init, "config.json"):
        with open(path) as f:
            size = json.load(f).get("vocab_size")
    if path := _hf_dir_file(init, "tokenizer.json"):
        with open(path) as f:
            vocab = (json.load(f).get("model") or {}).get("vocab")
    return size, vocab


def validate_teacher(cfg: RunView) -> None:
    """On-policy distillation: ``algorithm.distill_coef`` > 0 exactly with a teacher (``teacher.init``), whose
    vocabulary and tokenizer must be the student's (the per-token KL compares the two models' log-probs of the same
    token ids): a teacher checkpoint whose config.json vocab_size or tokenizer.json vocabulary differs from the
    student's (``actor.init``, else ``model.vocab_size``) is refused, both named. ``reward.type=none`` (distillation
    as the only signal) needs ``distill_coef`` > 0 and no dynamic sampling (every score is 0)."""
    a, t = cfg.algorithm, cfg.teacher
    _check(
        bool(t.init) or a.distill_coef == 0,
        "algorithm.distill_coef",
        a.distill_coef,
        "the per-token reverse KL needs a teacher: set teacher.init=<an HF dir or run dir of the same tokenizer>, or distill_coef=0",
    )
    _check(
        not t.init or a.distill_coef > 0,
        "teacher.init",
        t.init,
        "a teacher is used only by on-policy distillation: set algorithm.distill_coef > 0 (e.g. 1.0), or teacher.init=''",
    )
    _check(
        cfg.reward.type != "none" or a.distill_coef > 0,
        "reward.type",
        cfg.reward.type,
        "no reward and no distillation leaves nothing to learn: set algorithm.distill_coef > 0 with teacher.init "
        "(on-policy distillation alone), or a reward.type of model, rule, remote or judge",
    )
    _check(
        cfg.reward.type != "none" or not a.dynamic_sampling,
        "algorithm.dynamic_sampling",
        a.dynamic_sampling,
        "reward.type=none scores every sample 0, so every group would be dropped: set dynamic_sampling=false",
    )
    if not t.init:
        return
    t_size, t_vocab = _vocab_of(t.init)
    s_size, s_vocab = _vocab_of(cfg.actor.init)
    student = cfg.actor.init or "model"
    s_size = s_size if s_size is not None else cfg.model.vocab_size
    if t_size is not None and t_size != s_size:
        why = f"the teacher's vocab_size={t_size} differs from the student's ({student}: vocab_size={s_size})"
    elif t_vocab is not None and s_vocab is not None and t_vocab != s_vocab:
        why = f"the teacher's tokenizer.json vocabulary differs from the student's ({student})"
    else:
        return
    _check(
        False,
        "teacher.init",
        t.init,
        f"{why}: distillation compares log-probs of the same token ids; give a teacher with the student's tokenizer",
    )


def validate_staleness(cfg: RunView) -> None:
    """The split rollout placement and bounded staleness (docs/rollout.md): what they need, and the
    decoupled loss resolved (``algorithm.decoupled_loss=None`` follows ``trainer.max_staleness > 0``)."""
    r, t, a = cfg.rollout, cfg.trainer, cfg.algorithm
    if a.decoupled_loss is None:
        a.decoupled_loss = t.max_staleness > 0
    _check(
        a.policy_loss == "ppo" or not a.decoupled_loss,
        "algorithm.policy_loss",
        a.policy_loss,
        f"samples from stale weights (trainer.max_staleness={t.max_staleness}, algorithm.decoupled_loss) train with "
        "AReaL's decoupled PPO objective: set policy_loss=ppo, or trainer.max_staleness=0 and algorithm.decoupled_loss=false",
    )
    if cfg.stage != "ppo":
        return
    if r.placement == "split":
        _check(
            not r.interruptible or (r.parallel.tp_size == 1 and r.parallel.pp_size == 1),
            "rollout.parallel",
            f"tp_size={r.parallel.tp_size}, pp_size={r.parallel.pp_size}",
            "interruptible generation swaps weights on engines of one rank (the ranks of a tp/pp engine would "
            "swap at different decode steps): set tp_size=1 and pp_size=1 with rollout.parallel.dp_size replicas, "
            "or rollout.interruptible=false",
        )
    if r.interruptible:
        validate_interruptible(cfg)
    resolve_ref_ahead(cfg)
    _check(
        t.max_staleness == 0 or r.placement == "split",
        "trainer.max_staleness",
        t.max_staleness,
        "generation runs ahead of the update only on its own workers: set rollout.placement=split, or max_staleness=0",
    )
    _check(
        t.max_staleness <= 1 or not a.dynamic_sampling,
        "trainer.max_staleness",
        t.max_staleness,
        "dynamic sampling refills a batch when the step takes it, which keeps a resumed run on the same prompts "
        "only with at most one batch queued: set max_staleness=1 (or 0), or algorithm.dynamic_sampling=false",
    )
    # the decoupled loss without the old-log-prob forward: the proximal policy is then the update's own
    # forward, detached, which is exact for an on-policy update (one epoch, one mini-batch:
    # validate_on_policy refuses the rest), since every micro-batch runs the weights before the step


def resolve_ref_ahead(cfg: RunView) -> None:
    """``trainer.ref_ahead`` (docs/rollout.md): the reference's log-probs of a queued batch computed beside the
    update. None resolves to on exactly where it applies (max_staleness >= 1, a reference group) and the
    reference has devices of its own (``cluster.placement=split``, no ``ref.colocate_with``); true where it
    cannot apply is refused."""
    t = cfg.trainer
    # with dynamic sampling the batch trained is assembled only when the step takes it (the kept groups)
    applies = t.max_staleness >= 1 and "ref" in cfg.roles_used() and not cfg.algorithm.dynamic_sampling
    if t.ref_ahead is None:
        t.ref_ahead = applies and cfg.cluster.placement == "split" and not cfg.ref.colocate_with
        return
    _check(
        applies or not t.ref_ahead,
        "trainer.ref_ahead",
        t.ref_ahead,
        "the reference's log-probs go ahead only of a queued batch, with a reference group (a KL term, no LoRA actor) "
        "and no dynamic sampling: set trainer.max_staleness >= 1 with rollout.placement=split, or trainer.ref_ahead=false",
    )


def validate_interruptible(cfg: RunView) -> None:
    """``rollout.interruptible`` (docs/rollout.md): syncs that land between decode steps need the split
    placement's own engines, aligner's continuous scheduler (it checks for staged weights between steps)
    and generation ahead of the update (max_staleness >= 1: with 0 no generation is in flight at a sync)."""
    r, t = cfg.rollout, cfg.trainer
    _check(
        r.placement == "split",
        "rollout.interruptible",
        r.interruptible,
        f"a sync lands mid-generation only on the split placement's own engines (rollout.placement={r.placement}): "
        "set rollout.placement=split, or rollout.interruptible=false",
    )
    _check(
        r.backend == "torch" and r.scheduler == "continuous",
        "rollout.interruptible",
        r.interruptible,
        f"weights are swapped between the continuous scheduler's decode steps of aligner's torch engine "
        f"(rollout.backend={r.backend}, rollout.scheduler={r.scheduler}): set rollout.backend=torch and "
        "rollout.scheduler=continuous, or rollout.interruptible=false",
    )
    _check(
        t.max_staleness >= 1,
        "rollout.interruptible",
        r.interruptible,
        f"with trainer.max_staleness={t.max_staleness} no generation is in flight when a sync lands: "
        "set trainer.max_staleness >= 1, or rollout.interruptible=false",
    )


def validate_episodes(cfg: RunView) -> None:
    """env.name set: what the engine's episodes need (docs/environments.md). The environment runs between
    the decode steps of aligner's continuous scheduler, on one engine rank per replica, and its final
    reward is reward.rule's."""
    r = cfg.rollout
    _check(
        cfg.stage == "ppo", "env.name", cfg.env.name, f"episodes are played by the PPO stage only (stage={cfg.stage}): leave env.name empty"
    )
    _check(r.backend == "torch", "rollout.backend", r.backend, "episodes (env.name) run on aligner's own engine: set rollout.backend=torch")
    _check(
        r.scheduler == "continuous",
        "rollout.scheduler",
        r.scheduler,
        "episodes (env.name) need the continuous scheduler, which keeps each episode's KV-cache slot between turns",
    )
    _check(
        r.parallel.tp_size == 1 and r.parallel.pp_size == 1,
        "rollout.parallel",
        f"tp_size={r.parallel.tp_size}, pp_size={r.parallel.pp_size}",
        "episodes (env.name) run on engines of one rank (tp_size=pp_size=1; the environment would run on every "
        "tensor-parallel rank): use rollout.parallel.dp_size replicas instead",
    )
    _check(
        cfg.reward.type == "rule",
        "reward.type",
        cfg.reward.type,
        "an episode's reward is the environment's, which scores the final turn with reward.rule: set reward.type=rule",
    )


def validate_judge(cfg: RunView) -> None:
    """reward.type=judge: the judge is a trained causal LM (reward.init) on engines of one rank each."""
    r = cfg.reward
    _check(
        bool(r.init), "reward.init", r.init, "reward.type=judge needs the judge LLM's HF directory (with its tokenizer and chat template)"
    )
    _check(
        r.parallel.tp_size == 1 and r.parallel.pp_size == 1,
        "reward.parallel",
        f"tp_size={r.parallel.tp_size}, pp_size={r.parallel.pp_size}",
        "a judge runs on engines of one rank each (tp_size=pp_size=1): use reward.parallel.dp_size replicas",
    )


def validate_group_estimator(cfg: RunView) -> None:
    """A per-prompt group baseline (grpo, rloo, reinforce_pp_baseline) needs >= 2 samples per prompt that can differ."""
    a = cfg.algorithm
    _check(
        cfg.trainer.n_samples_per_prompt >= 2,
        "trainer.n_samples_per_prompt",
        cfg.trainer.n_samples_per_prompt,
        f"algorithm.advantage={a.advantage} needs >= 2 samples per prompt",
    )
    _check(
        cfg.rollout.sampling.temperature > 0,
        "rollout.sampling.temperature",
        cfg.rollout.sampling.temperature,
        f"greedy sampling gives every sample of a prompt the same response, so algorithm.advantage="
        f"{a.advantage} (a per-prompt group baseline) has zero advantages and trains nothing: "
        "sample with temperature > 0 (e.g. 1.0)",
    )


def validate_on_policy(cfg: RunView) -> None:
    """algorithm.recompute_old_log_probs=false is exact only for an on-policy update: say what breaks it."""
    a, t = cfg.algorithm, cfg.trainer
    f, v = "algorithm.recompute_old_log_probs", a.recompute_old_log_probs
    need = "false skips the old-log-prob forward, which is exact only for an on-policy update, but"
    samples = t.rollout_batch_size * t.n_samples_per_prompt
    _check(a.ppo_epochs == 1, f, v, f"{need} algorithm.ppo_epochs={a.ppo_epochs} reuses the batch: set it to true")
    _check(
        t.mini_batch_size >= samples,
        f,
        v,
        f"{need} trainer.mini_batch_size={t.mini_batch_size} splits the {samples} samples of a step into several "
        f"optimizer steps: set it to true, or trainer.mini_batch_size={samples}",
    )
    _check(not a.reward_kl_coef_used, f, v, f"{need} the KL in the reward needs the old log-probs before the update: set it to true")
    _check(a.tis_cap is None, f, v, f"{need} algorithm.tis_cap weighs by exp(old - rollout): set it to true")


def validate_prompt_learning(cfg: RunView) -> None:
    """actor.prompt_learning: SFT only, on layouts the virtual tokens support, within the model's positions."""
    pl = prompt_learning_of(cfg)
    if pl is None or not pl.enabled:
        return
    f = "actor.prompt_learning.type"
    p = cfg.actor.parallel
    _check(
        p.pp_size == 1,
        "actor.parallel.pp_size",
        p.pp_size,
        f"{f}={pl.type} supports pp_size=1 only (the virtual tokens live on the first pipeline stage, not implemented)",
    )
    _check(not p.sequence_parallel, "actor.parallel.sequence_parallel", p.sequence_parallel, f"{f}={pl.type} needs sequence_parallel=false")
    _check(p.cp_size == 1, "actor.parallel.cp_size", p.cp_size, f"{f}={pl.type} needs cp_size=1 (the virtual tokens are not split)")
    _check(p.dp_backend != "deepspeed", "actor.parallel.dp_backend", p.dp_backend, f"{f}={pl.type} supports fsdp2 or ddp")
    _check(
        not cfg.data.packing,
        "data.packing",
        cfg.data.packing,
        f"{f}={pl.type} prepends virtual tokens to each row: set data.packing=false",
    )
    _check(
        pl.num_virtual_tokens + cfg.data.max_seq_len <= cfg.model.max_seq_len,
        "actor.prompt_learning.num_virtual_tokens",
        pl.num_virtual_tokens,
        f"num_virtual_tokens + data.max_seq_len={cfg.data.max_seq_len} must not exceed model.max_seq_len={cfg.model.max_seq_len}",
    )
    _check(
        cfg.actor.lora.rank == 0,
        "actor.lora.rank",
        cfg.actor.lora.rank,
        f"LoRA and {f}={pl.type} together are not supported (each freezes the base for its own parameters): set one of them off",
    )
    _check(cfg.stage == "sft", f, pl.type, f"prompt learning is implemented for the SFT stage only (stage={cfg.stage}): set {f}=none")


def validate_rollout_lengths(cfg: RunView) -> None:
    """The longest prompt plus the response must fit the model (the engine's KV cache and RoPE positions),
    and the overlong-penalty ramp must lie inside the response budget."""
    s, d, m = cfg.rollout.sampling, cfg.data, cfg.model
    _check(
        d.max_prompt_len + s.max_new_tokens <= m.max_seq_len,
        "rollout.sampling.max_new_tokens",
        s.max_new_tokens,
        f"data.max_prompt_len={d.max_prompt_len} + max_new_tokens must not exceed model.max_seq_len={m.max_seq_len}: "
        f"lower it to {max(1, m.max_seq_len - d.max_prompt_len)} or shorten data.max_prompt_len",
    )
    _check(
        cfg.algorithm.overlong_buffer <= s.max_new_tokens,
        "algorithm.overlong_buffer",
        cfg.algorithm.overlong_buffer,
        f"must not exceed rollout.sampling.max_new_tokens={s.max_new_tokens} (the penalty ramps over the last buffer tokens of the budget)",
    )


def validate_cluster_devices(cfg: RunView) -> None:
    """Roles that ask for GPUs need a cluster with GPUs (plans for a GPU preset on 0 GPUs are meaningless)."""
    if cfg.cluster.gpus_per_node > 0:
        return
    for role in ("actor", "critic", "reward", "ref"):
        gpus = cfg.role(role).resources.gpus_per_node
        _check(
            gpus == 0,
            "cluster.gpus_per_node",
            cfg.cluster.gpus_per_node,
            f"conf={cfg.preset} runs its roles on GPUs ({role}.resources.gpus_per_node={gpus}): give the cluster's "
            "GPUs per node (e.g. cluster.gpus_per_node=8), or use conf=tiny for a CPU run",
        )


def prompt_learning_of(cfg: RunView) -> Optional[PromptLearningConfig]:
    """cfg.actor.prompt_learning, or None when the actor config has none (a plain TrainableRoleConfig built in code)."""
    return getattr(cfg.actor, "prompt_learning", None)


def longest_row(cfg: RunView) -> tuple[int, str]:
    """(the tokens one micro-batch must hold at least; the fields that bound it): PPO's longest row,
    prompt + response (data.max_prompt_len + rollout.sampling.max_new_tokens); RM's and DPO's
    pair of rows (2 x data.max_seq_len: a pair's chosen and rejected rows share a micro-batch);
    else data.max_seq_len."""
    if cfg.stage in ("rm", "dpo"):
        return 2 * cfg.data.max_seq_len, f"a pair of rows, 2 x data.max_seq_len={cfg.data.max_seq_len}"
    if cfg.stage == "ppo":
        d, s = cfg.data, cfg.rollout.sampling
        return (
            d.max_prompt_len + s.max_new_tokens,
            f"data.max_prompt_len={d.max_prompt_len} + rollout.sampling.max_new_tokens={s.max_new_tokens}",
        )
    return cfg.data.max_seq_len, f"data.max_seq_len={cfg.data.max_seq_len}"


STAGE_TRAINED_ROLES = {
    "sft": ("actor",),
    "dpo": ("actor",),
    "kto": ("actor",),
    "spin": ("actor",),
    "rs": ("actor",),
    "rm": ("reward",),
    "ppo": ("actor", "critic"),
}


def validate_interleaved(cfg: RunView) -> None:
    """A trained role with ``virtual_pp_size > 1`` runs, per dp rank and optimizer step, a number of
    micro-batches that is a multiple of its pp_size (the interleaved schedule's order needs it):
    ceil(ceil(samples / dp) / trainer.micro_batch_size), samples the step's global_batch_size (SFT, RM,
    DPO: rows, pairs, pairs) or mini_batch_size (PPO). With a token budget (``trainer.micro_batch_tokens``
    > 0) the count is only known per batch, and the runner pads each training pass with filler
    micro-batches up to a multiple of pp_size instead: nothing to check here."""
    t = cfg.trainer
    if t.micro_batch_tokens > 0:
        return
    samples = t.mini_batch_size if cfg.stage == "ppo" else t.global_batch_size
    for role in STAGE_TRAINED_ROLES.get(cfg.stage, ()):
        par = cfg.role(role).parallel
        if par.virtual_pp_size == 1:
            continue
        m = math.ceil(math.ceil(samples / par.dp_size) / t.micro_batch_size)
        _check(
            m % par.pp_size == 0,
            "trainer.micro_batch_size",
            t.micro_batch_size,
            f"{role}.parallel.virtual_pp_size={par.virtual_pp_size} needs micro-batches per dp rank and step in multiples of "
            f"{role}.parallel.pp_size={par.pp_size}, and {samples} samples over dp_size={par.dp_size} make {m}: choose a "
            "micro_batch_size that gives a multiple",
        )


def validate_micro_batch_tokens(cfg: RunView) -> None:
    """A token budget must hold the longest row the stage can produce (checked here, at config time,
    against the length bound; aligner.runtime.runner checks each batch's rows again) and runs on
    roles with fsdp2 or ddp, pipeline stages included (plain and interleaved 1F1B: the runner pads an
    interleaved training pass with filler micro-batches to a multiple of pp_size); DeepSpeed is
    refused (one backward per step there)."""
    budget = cfg.trainer.micro_batch_tokens
    longest, bound = longest_row(cfg)
    _check(
        budget >= longest,
        "trainer.micro_batch_tokens",
        budget,
        f"a micro-batch must hold the longest row, {bound} = {longest} tokens: set it to at least {longest}, or 0 for row-count micro-batches",
    )
    for role in MODEL_ROLES:
        par = cfg.role(role).parallel
        _check(
            par.dp_backend != "deepspeed",
            "trainer.micro_batch_tokens",
            budget,
            f"token-budget micro-batches need dp_backend fsdp2 or ddp ({role}.parallel has dp_backend={par.dp_backend}, "
            "which runs one backward per step); set trainer.micro_batch_tokens=0",
        )


# reward.type -> the range of its scores, where it is bounded (a rule's scores are in [0, 1])
BOUNDED_REWARDS = {"rule": (0.0, 1.0), "judge": (0.0, 1.0)}


def validate_rejection_sampling(cfg: RunView) -> None:
    """``stage=rs`` (aligner.rs): a sampled row (prompt + response) fits the SFT rows, a threshold a
    bounded reward can reach, and a reward the stage can call (no episodes, a reward model to load)."""
    d, s, rs = cfg.data, cfg.rollout.sampling, cfg.rs
    _check(
        d.max_prompt_len + s.max_new_tokens <= d.max_seq_len,
        "rollout.sampling.max_new_tokens",
        s.max_new_tokens,
        f"data.max_prompt_len={d.max_prompt_len} + max_new_tokens must fit data.max_seq_len={d.max_seq_len} "
        "(the kept responses are trained as SFT rows): lower it or raise data.max_seq_len",
    )
    _check(s.temperature > 0, "rollout.sampling.temperature", s.temperature, "must be > 0: greedy decoding gives N copies of one response")
    lo_hi = BOUNDED_REWARDS.get(cfg.reward.type)
    if lo_hi is not None:
        _check(
            rs.threshold <= lo_hi[1],
            "rs.threshold",
            rs.threshold,
            f"no response can be kept: reward.type={cfg.reward.type} scores in [{lo_hi[0]:g}, {lo_hi[1]:g}]; give a threshold <= {lo_hi[1]:g}",
        )
    _check(
        cfg.reward.type != "none",
        "reward.type",
        cfg.reward.type,
        "rejection sampling keeps the responses a reward ranks best: give reward.type=model, rule, remote or judge",
    )
    _check(not cfg.env.name, "env.name", cfg.env.name, "episodes are played by the PPO stage only: leave env.name empty for aligner.rs")
    _check(
        cfg.reward.type != "model" or bool(cfg.reward.init),
        "reward.init",
        cfg.reward.init,
        "reward.type=model scores with a trained reward model: give its run dir or HF export (python -m aligner.rm)",
    )


@dataclass(frozen=True)
class CrossCheck:
    """One check across sections: `run` applies to a config whose stage is in `stages` (every stage when
    empty) and for which `when` holds."""

    run: Callable[[RunView], None]
    stages: tuple[str, ...] = ()
    when: Optional[Callable[[RunView], bool]] = None

    def applies(self, cfg: RunView) -> bool:
        return (not self.stages or cfg.stage in self.stages) and (self.when is None or self.when(cfg))


def validate_agent(cfg: RunView) -> None:
    """env.name=agent or agent.command set: what playing episodes through agent programs needs.

    The command is given and runs (:meth:`AgentConfig.validate`), env.name and agent.command go
    together, and the rollout is the colocated one of aligner's engine (the split placement,
    interruptible generation and dynamic sampling are not wired for agents). The rest of what
    episodes need (torch backend, continuous scheduler, one engine rank, a rule reward) is
    :func:`aligner.config.validation.validate_episodes`'s."""
    a = cfg.agent
    if cfg.env.name == AGENT_ENV:
        _check(
            bool(a.command),
            "agent.command",
            a.command,
            "env.name=agent runs the agent's program for each episode: set agent.command, e.g. agent.command='python examples/calculator_agent.py'",
        )
    elif a.command:
        _check(False, "env.name", cfg.env.name, "agent.command is set: set env.name=agent to play episodes through the agent program")
    if cfg.env.name != AGENT_ENV:
        return
    _check(
        cfg.rollout.placement != "split",
        "rollout.placement",
        cfg.rollout.placement,
        "agent episodes run on the actor's colocated engines only: set rollout.placement=colocated",
    )
    _check(not cfg.algorithm.dynamic_sampling, "algorithm.dynamic_sampling", True, "not supported with agent episodes: set it to false")


# every check across sections, in the order :func:`validate_run` runs them (the first failing one is reported)
CROSS_CHECKS = (
    CrossCheck(validate_shared_limits),
    CrossCheck(validate_agent),
    CrossCheck(validate_episodes, when=lambda cfg: bool(cfg.env.name)),
    CrossCheck(validate_judge, stages=("ppo", "rs"), when=lambda cfg: cfg.reward.type == "judge"),
    CrossCheck(validate_rejection_sampling, stages=("rs",)),
    CrossCheck(validate_prompt_learning),
    CrossCheck(validate_staleness),
    CrossCheck(validate_teacher, stages=("ppo",)),
    CrossCheck(validate_rollout_lengths, stages=("ppo",)),
    CrossCheck(validate_cluster_devices),
    CrossCheck(validate_micro_batch_tokens, when=lambda cfg: cfg.trainer.micro_batch_tokens > 0),
    CrossCheck(validate_interleaved),
    CrossCheck(check_trtllm, stages=("ppo",), when=lambda cfg: cfg.rollout.backend == "trtllm"),
    CrossCheck(check_vllm, stages=("ppo",), when=lambda cfg: cfg.rollout.backend == "vllm"),
    CrossCheck(check_loggers, stages=tuple(s for s in STAGES if s != "plan")),  # the planner logs no metrics
    CrossCheck(validate_on_policy, stages=("ppo",), when=lambda cfg: not cfg.algorithm.recompute_old_log_probs),
    CrossCheck(validate_group_estimator, stages=("ppo",), when=lambda cfg: cfg.algorithm.advantage in GROUP_ESTIMATORS),
)
