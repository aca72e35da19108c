"""The rollout worker group of the split placement (``rollout.placement=split``, docs/rollout.md).

Thin (docs/design.md, "Thin Ray shells over Ray-free classes"): the group's ranks form
``rollout.parallel``'s layout, dp engine replicas of tp x pp ranks each, and every rank holds its
shard of aligner's :class:`~aligner.rollout.torch_engine.engine.TorchEngine`, built from the policy's model
config with the run's seed; the weights arrive from the actor's rank 0 over the weight-sync group
(:mod:`aligner.rollout.weight_sync.broadcast`) after each update instead of by the in-place refit of the
colocated placement: every rank receives the full tensors of the broadcast and keeps its tp shard of
its pp stage's layers (``update_weights``). ``generate`` is broadcast like the actor's: every rank
gets all prompts, each replica generates its contiguous share, and its lead rank returns (replica,
generations).

With ``rollout.backend=trtllm`` (GPU only; nothing of it has run on a GPU) the group's ranks form
TensorRT-LLM replicas of tp x pp ranks instead (:func:`aligner.workers.actor.build_trtllm_side`, as the
colocated actor does, but awake: no sleep between generations): each rank receives the broadcast
on its own GPU and offers CUDA IPC handles of its bucket, and the replica's owner sends the merged
handles to its ``AsyncLLM`` (:class:`aligner.rollout.trtllm_engine.ColocatedTrtllmEngine`).

With ``rollout.backend=vllm`` (CPU) every rank holds a :class:`~aligner.rollout.vllm_engine.VllmEngine` in its
own process (tp = pp = 1, dp replicas), which receives the broadcast as a refit (:mod:`aligner.rollout.vllm_engine`).

The group runs on its own node group (``rollout.resources``), so while it generates the actor can
train on the previous batch (``trainer.max_staleness`` >= 1, :mod:`aligner.trainers.producer`).

Interruptible generation (``rollout.interruptible``, docs/rollout.md): :meth:`RolloutWorker.receive_weights_beside`
is a concurrent call (:func:`aligner.workers.dispatch.dispatch`): it runs on the worker's side thread while
a generate call is in flight, receives the whole sync into buffers of its own and stages it; the
engine's decode loop applies it at its next step boundary (:mod:`aligner.rollout.weight_sync.staging`).
"""

from __future__ import annotations

import time
from typing import Optional

from aligner.config import AlignerConfig, SamplingConfig
from aligner.parallel.dims import ParallelDims
from aligner.rollout.weight_sync.broadcast import SyncGroup, join_sync_group, receive_weights, receive_weights_staged
from aligner.workers.actor import (
    build_trtllm_side,
    generate_share,
    request_share,
    streamed_reward,
    sync_backend,
    sync_host,
    torch_rollout_engine,
)
from aligner.workers.dispatch import dispatch, split_batch
from aligner.workers.reward import remote_reward_client


class RolloutWorker:
    """One engine replica of the rollout group: receives weights, generates its share of the prompts.

    cfg: the run's config (``rollout.*`` settings, the seed). model_cfg: the policy's ModelConfig
    (:meth:`aligner.workers.actor.ActorWorker.model_config`). eos_token_id: the stop token.
    dims: this rank's ParallelDims in the rollout group (dp = replicas; given by the worker shell).
    """

    def __init__(
        self, cfg: AlignerConfig, model_cfg, eos_token_id: Optional[int] = None, dims: Optional[ParallelDims] = None, tokenizer=None
    ):
        self.cfg = cfg
        self.tokenizer = tokenizer  # env.name set: renders the episodes' observations; reward.stream: decodes
        self.reward_client = None  # reward.stream: the remote reward's client, made on first use
        self.judges: list = []  # reward.stream with a judge: the reward group's worker handles (set_judges)
        self.dims = dims or ParallelDims()
        self.eos_token_id = eos_token_id
        self.trtllm = None  # rollout.backend=trtllm: this rank's TrtllmReplica
        self.engine = None
        if cfg.rollout.backend == "trtllm":  # a TensorRT-LLM replica per tp x pp ranks, awake: these GPUs are its own
            build_trtllm_side(self, model_cfg, cfg.rollout.resources.num_nodes, sleep=False)
        elif cfg.rollout.backend == "vllm":  # vLLM in this rank's process: one engine per rank (tp = pp = 1)
            from aligner.rollout.vllm_engine import rollout_engine

            self.engine = rollout_engine(cfg, model_cfg, eos_token_id)
        else:  # the group's layout is rollout.parallel: dp replicas of tp x pp engine ranks
            self.engine = torch_rollout_engine(cfg, model_cfg, self.dims, eos_token_id, interruptible=cfg.rollout.interruptible)
        self.group: Optional[SyncGroup] = None

    @dispatch("broadcast")
    def join_weight_sync(self, host: str, port: int, world_size: int, loopback: bool) -> None:
        """Join the actor's weight-sync group as receiver 1 + this rank (the actor's rank 0 sends)."""
        self.group = join_sync_group(
            host, port, 1 + self.dims.rank, world_size, bind_host=sync_host(loopback), backend=sync_backend(self.dims.device)
        )

    @dispatch("broadcast")
    def receive_weights(self) -> dict:
        """One sync into the engine (collective with the actor's send_weights). Returns seconds, bytes,
        buckets, tensors and the engine's weight_version."""
        return self._timed_receive("receive_weights", receive_weights)

    @dispatch("broadcast", concurrent=True)
    def receive_weights_beside(self) -> dict:
        """One sync (collective with the actor's send_weights) received beside a generate call in flight
        (``rollout.interruptible``): staged, and applied at the engine's next decode step boundary, or at
        once when it is idle (:func:`aligner.rollout.weight_sync.broadcast.receive_weights_staged`). Returns seconds
        (until staged), bytes, buckets, tensors and "applied"."""
        return self._timed_receive("receive_weights_beside", receive_weights_staged)

    def _timed_receive(self, name: str, receive) -> dict:
        """receive(group, engine)'s dict with its wall "seconds"; RuntimeError before join_weight_sync."""
        if self.group is None:
            raise RuntimeError(f"{name} before join_weight_sync")
        t0 = time.perf_counter()
        out = receive(self.group, self.engine)
        return {**out, "seconds": time.perf_counter() - t0}

    @dispatch("broadcast", concurrent=True)
    def alive(self) -> bool:
        """True: answered beside a generate call in flight (the producer's liveness check before a sync)."""
        return True

    @dispatch("broadcast")
    def generate(
        self, prompt_ids: list, sampling: SamplingConfig, seeds: list, episodes: Optional[list] = None, reward_rows: Optional[list] = None
    ) -> Optional[tuple[int, list]]:
        """All prompts in; this replica's contiguous share generated: (replica, generations) on the replica's
        lead rank (tp and pp rank 0), None on its other ranks, which run the same decode steps in step
        with it. episodes: as :meth:`aligner.workers.actor.ActorWorker.generate`'s."""
        if self.trtllm is not None:  # each replica's owner generates its share through AsyncLLM
            r = self.trtllm
            share = split_batch({"p": prompt_ids, "s": seeds}, r.replicas)[r.replica]
            gens = self.engine.generate(share["p"], sampling, seeds=share["s"]) if r.owner and share["p"] else []
            return (r.replica, gens) if r.owner else None
        d = self.dims
        lead = d.tp_rank == 0 and d.pp_rank == 0
        share = split_batch(request_share(prompt_ids, seeds, episodes, reward_rows if lead else None), d.dp_size)[d.dp_rank]
        gens = generate_share(self.engine, self.cfg, self.tokenizer, share, sampling, self.streamed_reward)
        return (d.dp_rank, gens) if lead else None

    @dispatch("broadcast")
    def set_judges(self, judges: list) -> None:
        """As :meth:`aligner.workers.actor.ActorWorker.set_judges`."""
        self.judges = list(judges)

    def streamed_reward(self, prompt_ids: list, rows: list[dict]):
        """The scorer of a share whose responses are scored as they finish (:func:`aligner.workers.actor.streamed_reward`)."""
        if self.reward_client is None and self.cfg.reward.type == "remote":
            self.reward_client = remote_reward_client(self.cfg.reward)
        return streamed_reward(self.cfg, self.tokenizer, prompt_ids, rows, self.reward_client, self.judges, self.dims.rank)
