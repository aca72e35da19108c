"""Ray worker shells of the policy roles: ActorWorker (policy + rollout engine) and RefWorker.

Thin (docs/design.md, "Thin Ray shells over Ray-free classes"): every computation is a method of :class:`aligner.actor.policy.Policy` or of
the rollout engine; this module only declares how the driver calls them (dispatch modes of
:mod:`aligner.workers.group`) and owns the engine's layout and refit.

The rollout engine lives in the actor's own processes. Its layout (rollout.parallel tp/pp)
is built over the actor's ranks: dp_infer = world / (tp_infer * pp_infer) replicas, so
freed pipeline stages become extra replicas (NeMo-Aligner's reshard). ``generate`` is
broadcast: every rank receives all prompts, each replica generates its contiguous share,
and the first rank of each replica returns it.

rollout.backend=trtllm builds a TensorRT-LLM replica per tp * pp contiguous ranks instead
(its first rank owns the ``AsyncLLM``; aligner.rollout.trtllm_engine.ColocatedTrtllmEngine), wakes
it at the start of refit and puts it to sleep at the end of generate, and reports the same
refit dict (seconds, bytes, weight_version) as the torch engine. That path has not run on a GPU.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from aligner.actor.policy import Policy
from aligner.config import AlignerConfig, OptimConfig, SamplingConfig, TrainableRoleConfig, prompt_learning_of
from aligner.nn.lora import disable_adapters, merged_state_dict
from aligner.parallel.dims import ParallelDims
from aligner.parallel.parallelize import build_parallel_model, decode_layer_split
from aligner.reward.remote import StreamedScores, stream_chunk
from aligner.rollout import build_engine
from aligner.rollout.weight_sync.broadcast import WeightSender, join_sync_group
from aligner.rollout.weight_sync.refit import iter_buckets, refit, rollout_dims
from aligner.runtime.ports import free_port
from aligner.workers.dispatch import dispatch, split_batch
from aligner.workers.episodes import generate_episodes
from aligner.workers.reward import StreamedJudge, remote_reward_client


class PolicyWorker:
    """Policy on the role's layout: training (SFT, PPO) and log-probs. Reference = frozen PolicyWorker."""

    def __init__(
        self,
        cfg: AlignerConfig,
        role: str,
        total_steps: int = 1,
        init: str = "",
        dims: Optional[ParallelDims] = None,
        prompt_init_ids: Optional[list] = None,
    ):
        self.cfg, self.role_name = cfg, role
        self.dims = dims or ParallelDims()
        role_cfg = cfg.role(role)
        # the reference has no optim (it never steps); its engine still builds an optimizer, left unused
        optim = role_cfg.optim if isinstance(role_cfg, TrainableRoleConfig) else OptimConfig()
        torch.manual_seed(cfg.trainer.seed)
        lora = role_cfg.lora if isinstance(role_cfg, TrainableRoleConfig) else None
        self.policy = Policy(
            cfg.model,
            role_cfg.parallel,
            optim,
            self.dims,
            total_steps,
            init=init if init else role_cfg.init,
            seed=cfg.trainer.seed,
            prompt_learning=prompt_learning_of(cfg) if role == "actor" else None,  # SFT prompt learning (aligner.model.prompt)
            prompt_init_ids=prompt_init_ids,
            lora=lora,
            micro_batch_tokens=cfg.trainer.micro_batch_tokens,
        )

    @dispatch("dp_split")
    def log_probs(self, batch: dict, temperature: float = 1.0) -> torch.Tensor:
        return self.policy.log_probs(batch, self.cfg.trainer.micro_batch_size, temperature, self.cfg.trainer.shared_prompt_pack_len)

    @dispatch("dp_split")
    def log_probs_with_routing(self, batch: dict, temperature: float = 1.0) -> dict:
        """log_probs and the MoE routing of the response tokens (:meth:`Policy.log_probs_with_routing`)."""
        return self.policy.log_probs_with_routing(batch, self.cfg.trainer.micro_batch_size, temperature)

    @dispatch("dp_split")
    def ref_log_probs(self, batch: dict, temperature: float = 1.0) -> torch.Tensor:
        """log_probs of the base model (LoRA adapters disabled): the reference policy of LoRA PPO."""
        with disable_adapters(self.policy.runtime.module):
            return self.policy.log_probs(batch, self.cfg.trainer.micro_batch_size, temperature, self.cfg.trainer.shared_prompt_pack_len)

    @dispatch("dp_split")
    def sft_step(self, batch: dict) -> dict:
        return self.policy.sft_step(batch, self.cfg.trainer.micro_batch_size)

    @dispatch("dp_split")
    def sft_eval(self, batch: dict) -> dict:
        return self.policy.sft_eval(batch, self.cfg.trainer.micro_batch_size)

    @dispatch("dp_split")
    def ppo_update(self, batch: dict, temperature: float = 1.0) -> dict:
        """Remote wrapper of :meth:`Policy.ppo_update` (one optimizer step on a mini-batch, split over dp)
        with this run's algorithm, micro_batch_size and shared_prompt_pack_len; batch holds
        :data:`aligner.protocol.ACTOR_UPDATE_FIELDS`."""
        t = self.cfg.trainer
        return self.policy.ppo_update(batch, self.cfg.algorithm, t.micro_batch_size, temperature, t.shared_prompt_pack_len)

    @dispatch("broadcast")
    def save(self, role_dir: str) -> None:
        self.policy.save(role_dir)

    @dispatch("broadcast")
    def load(self, role_dir: str) -> None:
        self.policy.load(role_dir)

    @dispatch("broadcast")
    def export_hf(self, out_dir: str, tokenizer_path: str = "") -> Optional[str]:
        return self.policy.export_hf(out_dir, tokenizer_path)

    @dispatch("broadcast")
    def export_prompt(self, out_dir: str, base_model: str, extra: Optional[dict] = None) -> Optional[str]:
        """Prompt learning: out_dir/prompt.safetensors + prompt.json (aligner.model.prompt.save_prompt);
        collective, rank 0 writes and returns the path."""
        from aligner.model.prompt import save_prompt

        tensors = self.policy.prompt_tensors()
        if self.dims.rank != 0:
            return None
        return save_prompt(tensors, self.policy.runtime.module.model.prompt.spec(), out_dir, base_model, extra)


class ActorWorker(PolicyWorker):
    """The actor: a trainable PolicyWorker that also owns the rollout engine and its refit."""

    def __init__(
        self,
        cfg: AlignerConfig,
        role: str = "actor",
        total_steps: int = 1,
        init: str = "",
        eos_token_id: Optional[int] = None,
        dims: Optional[ParallelDims] = None,
        prompt_init_ids: Optional[list] = None,
        tokenizer=None,
    ):
        super().__init__(cfg, role, total_steps, init, dims, prompt_init_ids)
        self.eos_token_id = eos_token_id
        self.tokenizer = tokenizer  # env.name set: renders the episodes' observations (aligner.workers.episodes); reward.stream: decodes
        self.reward_client = None  # reward.stream: the remote reward's client, made on first use
        self.judges: list = []  # reward.stream with a judge: the reward group's worker handles (set_judges)
        self.engine = None
        self.infer_dims = None
        self.trtllm = None  # rollout.backend=trtllm: this rank's TrtllmReplica (set with the engine)
        self._refitted = False  # a full refit has run (LoRA refits only the adapted linears after it)
        self.sender: Optional[WeightSender] = None  # rollout.placement=split: the weight-sync group's sending end

    def _build_engine(self) -> None:
        """The rollout engine on the engine layout (rollout.parallel) over this group's ranks.

        rollout.backend=torch: a TorchEngine per rank; its weights start as the seeded init.
        rollout.backend=trtllm: :meth:`_build_trtllm_engine`. rollout.backend=vllm: a VllmEngine
        (:func:`aligner.rollout.vllm_engine.rollout_engine`) in this process. The first refit replaces the weights.
        """

        if self.cfg.rollout.backend == "trtllm":
            self._build_trtllm_engine()
            return
        if self.cfg.rollout.backend == "vllm":  # vLLM in this process, an actor of one rank (config validation)
            from aligner.rollout.vllm_engine import rollout_engine

            self.infer_dims = ParallelDims()
            self.engine = rollout_engine(self.cfg, self.policy.model_cfg, self.eos_token_id)
            return
        rp = self.cfg.rollout.parallel
        if self.dims.world_size == 1:
            self.infer_dims = ParallelDims()
        else:
            self.infer_dims = rollout_dims(self.dims.world_size, self.dims.rank, rp.tp_size, rp.pp_size)
        self.engine = torch_rollout_engine(self.cfg, self.policy.model_cfg, self.infer_dims, self.eos_token_id)

    def _build_trtllm_engine(self) -> None:
        """A TensorRT-LLM replica per tp * pp contiguous ranks, colocated with the trainer (GPU only):
        :func:`build_trtllm_side` over the actor's ranks and nodes, the engine asleep between generations.
        Nothing of this has run on a GPU (aligner/rollout/trtllm_engine.py says what has)."""
        build_trtllm_side(self, self.policy.model_cfg, self.cfg.actor.resources.num_nodes, sleep=True)

    @dispatch("broadcast")
    def refit(self) -> dict:
        """Copy the current policy weights into the engine (collective). Returns seconds, bytes, weight_version.

        rollout.backend=trtllm: the engine is woken first (it sleeps from the end of generate); the
        wake is counted in seconds.
        """
        if self.policy.prompt_cfg is not None:  # generate runs the policy's own forward: nothing to copy
            return {"seconds": 0.0, "bytes": 0, "weight_version": self.policy.runtime.step_count}
        if self.engine is None:
            self._build_engine()
        t0 = time.perf_counter()
        trtllm = self.cfg.rollout.backend == "trtllm"
        if trtllm:
            self.engine.onload()
        # LoRA: after the first refit only the adapted linears change (the base is frozen). Not for
        # TensorRT-LLM, whose sleep may return weight memory without its contents (full refits there)
        nbytes = self._push_weights(self.engine, adapted_only=self._refitted and not trtllm)
        self._refitted = True
        return {"seconds": time.perf_counter() - t0, "bytes": nbytes, "weight_version": self.engine.weight_version}

    def _push_weights(self, sink, adapted_only: bool) -> int:
        """The policy's full HF tensors, in buckets of rollout.refit_bucket_mb, into `sink` (a rollout
        engine, or the weight-sync sender of the split placement); collective over the actor's ranks.
        LoRA: merged weights, only the adapted linears' with `adapted_only`. Returns the bytes handed over."""
        eng = self.policy.runtime
        adapted_only = adapted_only and eng.lora is not None
        sharded = eng.fsdp or eng.backend == "deepspeed" or self.dims.ep_size > 1
        if not sharded:
            return refit(
                eng.module,
                sink,
                bucket_mb=self.cfg.rollout.refit_bucket_mb,
                tp_group=self.dims.tp_group,
                pp_group=self.dims.pp_group,
                adapted_only=adapted_only,
            ).bytes
        # FSDP2 / DeepSpeed / expert parallel: full tensors on every rank, sent in the same buckets
        sd = self.policy.full_state_dict()
        if eng.lora is not None:
            sd = merged_state_dict(sd, eng.lora.alpha / eng.lora.rank, only_adapted=adapted_only)
        for bucket in iter_buckets(sd.items(), self.cfg.rollout.refit_bucket_mb):
            sink.update_weights(bucket)
        sink.finish_weight_update()
        return sum(v.numel() * v.element_size() for v in sd.values())

    # ---- the split placement: the weights go to engines in another worker group ----------------
    @dispatch("broadcast")
    def model_config(self):
        """The policy's ModelConfig (the rollout group builds its engines from it)."""
        return self.policy.model_cfg

    @dispatch("broadcast")
    def sync_address(self, loopback: bool) -> Optional[tuple[str, int]]:
        """Rank 0: (host, port) of the weight-sync group's store it will serve; None elsewhere."""
        if self.dims.rank != 0:
            return None
        host = sync_host(loopback)
        return host, free_port(host)

    @dispatch("broadcast")
    def join_weight_sync(self, host: str, port: int, world_size: int, loopback: bool) -> None:
        """Rank 0 joins the sync group as its sender (rank 0 of it); the other ranks get a no-op sender
        (they run the same collective walk of the weights)."""
        group = None
        if self.dims.rank == 0:
            group = join_sync_group(host, port, 0, world_size, bind_host=sync_host(loopback), backend=sync_backend(self.dims.device))
        self.sender = WeightSender(group, dtype=getattr(torch, self.cfg.rollout.dtype))

    @dispatch("broadcast")
    def send_weights(self) -> dict:
        """Broadcast the current policy to the rollout group (collective with its receive_weights).
        Returns seconds, bytes (full tensors handed over) and the number of syncs so far."""
        t0 = time.perf_counter()
        nbytes = self._push_weights(self.sender, adapted_only=self.sender.weight_version > 0)
        return {"seconds": time.perf_counter() - t0, "bytes": nbytes, "weight_version": self.sender.weight_version}

    @dispatch("broadcast")
    def generate(
        self, prompt_ids: list, sampling: SamplingConfig, seeds: list, episodes: Optional[list] = None, reward_rows: Optional[list] = None
    ) -> Optional[tuple[int, list]]:
        """All prompts in; this replica's contiguous share generated. Returns (replica, generations) on the
        replica's first rank, None elsewhere. The driver concatenates shares in replica order.

        episodes: None, or one (prompt text, metadata) per prompt: each prompt plays an episode of
        ``env.name`` (:func:`aligner.workers.episodes.generate_episodes`; torch backend, one engine
        rank per replica, as the config check requires).
        reward_rows: None, or one {"prompt": text, "metadata": dict} per prompt: the replica's lead rank
        sends each response to the remote reward as it finishes (``reward.stream``; torch backend) and
        its Generations come back with ``extra["score"]`` (:class:`aligner.reward.remote.StreamedScores`).

        With prompt learning the engine (which has no virtual-token input) is not used: every rank
        runs greedy decoding through the policy's forward (:meth:`Policy.greedy`; temperature 0
        only) and rank 0 returns all generations as replica 0's."""
        if self.policy.prompt_cfg is not None:
            return self._generate_prompt_learning(prompt_ids, sampling)
        if self.engine is None:
            raise RuntimeError("generate before refit: call refit() first so the engine holds the policy weights")
        if self.cfg.rollout.backend == "trtllm":
            return self._generate_trtllm(prompt_ids, sampling, seeds)
        d = self.infer_dims
        lead = d.tp_rank == 0 and d.pp_rank == 0
        share = split_batch(request_share(prompt_ids, seeds, episodes, reward_rows if lead else None), d.dp_size)[d.dp_rank]
        gens = generate_share(self.engine, self.cfg, self.tokenizer, share, sampling, self.streamed_reward)
        return (d.dp_rank, gens) if lead else None

    @dispatch("broadcast")
    def set_judges(self, judges: list) -> None:
        """``reward.stream`` with ``reward.type=judge``: the reward group's worker handles, which this
        worker's engine sends finished responses to (:class:`aligner.workers.reward.StreamedJudge`)."""
        self.judges = list(judges)

    def streamed_reward(self, prompt_ids: list, rows: list[dict]):
        """The scorer of a share whose responses are scored as they finish (:func:`streamed_reward`)."""
        if self.reward_client is None and self.cfg.reward.type == "remote":
            self.reward_client = remote_reward_client(self.cfg.reward)
        return streamed_reward(self.cfg, self.tokenizer, prompt_ids, rows, self.reward_client, self.judges, self.infer_dims.dp_rank)

    def _generate_prompt_learning(self, prompt_ids: list, sampling: SamplingConfig) -> Optional[tuple[int, list]]:
        """generate for prompt learning: greedy through the policy's forward (see :meth:`generate`)."""
        from aligner.rollout.base import Generation

        if sampling.temperature != 0:
            raise ValueError("prompt learning generates greedily only (sampling.temperature=0): it is for the SFT stage's evaluation")
        stop = sorted({*sampling.stop_token_ids, *([] if self.eos_token_id is None else [self.eos_token_id])})
        res = self.policy.greedy(prompt_ids, sampling.max_new_tokens, stop)
        gens = [Generation(ids, lps, reason, self.policy.runtime.step_count) for ids, lps, reason in res]
        return (0, gens) if self.dims.rank == 0 else None

    def _generate_trtllm(self, prompt_ids: list, sampling: SamplingConfig, seeds: list) -> Optional[tuple[int, list]]:
        """generate for rollout.backend=trtllm: each replica owner generates its contiguous share, then
        every rank puts the engine to sleep until the next refit wakes it (collective)."""
        r = self.trtllm
        share = split_batch({"p": prompt_ids, "s": seeds}, r.replicas)[r.replica]
        gens = self.engine.generate(share["p"], sampling, seeds=share["s"]) if r.owner and share["p"] else []
        self.engine.offload()
        return (r.replica, gens) if r.owner else None


def request_share(prompt_ids: list, seeds: list, episodes: Optional[list], reward_rows: Optional[list]) -> dict:
    """The requests of a generate call as one splittable dict: "p" prompt ids, "s" seeds, and "e"
    episode rows / "r" streamed-reward rows when given."""
    return {"p": prompt_ids, "s": seeds, **({"e": episodes} if episodes else {}), **({"r": reward_rows} if reward_rows else {})}


def generate_share(engine, cfg: AlignerConfig, tokenizer, share: dict, sampling: SamplingConfig, scorer=None) -> list:
    """Generate a replica's share (:func:`request_share`): plain responses, episodes when "e" is there;
    with "r" each response is scored as it finishes by the object ``scorer(prompt_ids, rows)`` returns
    (:func:`streamed_reward`) and its Generation comes back with ``extra["score"]``. [] for an empty share."""
    if not share["p"]:
        return []
    if "e" in share:
        return generate_episodes(engine, cfg, tokenizer, share["p"], sampling, share["s"], share["e"])
    if "r" not in share or scorer is None:
        return engine.generate(share["p"], sampling, seeds=share["s"])
    streamed = scorer(share["p"], share["r"])
    gens = engine.generate(share["p"], sampling, seeds=share["s"], on_finish=streamed.finished)
    streamed.attach(gens)
    return gens


def streamed_reward(cfg: AlignerConfig, tokenizer, prompt_ids: list, rows: list[dict], client, judges: list, replica: int):
    """What scores a share's responses as they finish (``reward.stream``): the remote reward's
    :class:`~aligner.reward.remote.StreamedScores` on `client`, or the judges'
    :class:`~aligner.workers.reward.StreamedJudge` (the first call to judge ``replica mod len(judges)``);
    ``ceil(B / reward.max_concurrency)`` responses (at most reward.batch_size) per request or call."""
    rc = cfg.reward
    chunk = stream_chunk(len(rows), rc.batch_size, rc.max_concurrency)
    if rc.type == "judge":
        return StreamedJudge(judges, tokenizer, rows, chunk, first=replica)
    return StreamedScores(client, tokenizer, prompt_ids, rows, chunk)


def torch_rollout_engine(cfg: AlignerConfig, model_cfg, dims: ParallelDims, eos_token_id: Optional[int], interruptible: bool = False):
    """aligner's TorchEngine on the engine layout `dims` (rollout.parallel over some worker group's
    ranks): a model of `model_cfg` built with the run's seed in rollout.dtype (the first refit or
    weight sync replaces the weights), and the engine settings of ``cfg.rollout``. interruptible: weight
    syncs may land between decode steps (the split placement's ``rollout.interruptible``)."""
    rp = cfg.rollout.parallel
    # decode's pipeline stages balanced with the head counted (unless the config gives a split)
    split = rp.pp_layer_split or (decode_layer_split(model_cfg, dims.pp_size) if dims.pp_size > 1 else None)
    model = build_parallel_model(model_cfg, "lm", dims, layer_split=split, seed=cfg.trainer.seed)
    model = model.to(device=dims.device, dtype=getattr(torch, cfg.rollout.dtype))
    return build_engine(
        "torch",
        model,
        eos_token_id=eos_token_id,
        tp_group=dims.tp_group,
        pp_group=dims.pp_group,
        max_batch_size=cfg.rollout.max_batch_size,
        scheduler=cfg.rollout.scheduler,
        micro_batches=cfg.rollout.micro_batches or None,
        cuda_graphs=cfg.rollout.cuda_graphs,
        compile=cfg.rollout.compile,
        seed=cfg.trainer.seed,
        interruptible=interruptible,
    )


def build_trtllm_side(worker, model_cfg, num_nodes: int, sleep: bool) -> None:
    """Set ``worker.trtllm`` (its TrtllmReplica), ``worker._engine_dir`` and ``worker.engine`` (a
    ColocatedTrtllmEngine): this rank's side of a TensorRT-LLM replica per tp * pp contiguous ranks of its
    worker group (GPU only). worker: an ActorWorker (colocated, ``sleep=True``: the engine sleeps while
    the trainer runs) or the split placement's RolloutWorker (``sleep=False``: its GPUs are its own); it
    has ``cfg``, ``dims`` and ``eos_token_id``. num_nodes: the group's nodes.

    The replica's first rank writes the policy's HF config.json to a temporary directory and builds a
    TrtllmEngine from it with dummy weights; its Ray workers go into this rank's node bundle of the
    group's placement group (when the worker runs in one) with TRTLLM_WORKER_GPU_SHARE of a GPU each.
    Every rank wraps it (or None) in a ColocatedTrtllmEngine, which the weight updates and the sleep /
    wake protocol run through. Collective over the group (its CPU wait group). Raises ImportError
    without tensorrt_llm (``worker.engine`` then stays None)."""
    import tempfile

    from aligner.rollout.trtllm_engine import ColocatedTrtllmEngine, cpu_wait_group, ray_placement, trtllm_replica, write_engine_model_dir
    from aligner.workers.placement import TRTLLM_WORKER_GPU_SHARE

    cfg, dims = worker.cfg, worker.dims
    worker.trtllm = trtllm_replica(cfg, dims.world_size, dims.rank, worker.eos_token_id, num_nodes=num_nodes, sleep=sleep)
    group = cpu_wait_group()  # collective, before any owner starts its engine
    engine = None
    if worker.trtllm.owner:
        worker._engine_dir = tempfile.TemporaryDirectory(prefix="aligner-trtllm-")
        model_dir = write_engine_model_dir(model_cfg, worker._engine_dir.name)
        placement = ray_placement(worker.trtllm, _current_placement_group(), TRTLLM_WORKER_GPU_SHARE)
        engine = build_engine("trtllm", model_dir, cfg.rollout, **worker.trtllm.engine_kwargs, placement=placement)
    worker.engine = ColocatedTrtllmEngine(engine, dtype=cfg.rollout.dtype, group=group)


def sync_host(loopback: bool) -> str:
    """The address this worker uses in a weight-sync group: 127.0.0.1 when every member is on this node, else its node IP."""
    if loopback:
        return "127.0.0.1"
    import ray

    return ray.util.get_node_ip_address()


def sync_backend(device: torch.device) -> str:
    """gloo for CPU workers, NCCL for GPU ones."""
    return "nccl" if device.type == "cuda" else "gloo"


def _current_placement_group():
    """The Ray placement group this worker runs in, or None (no Ray, or not in one)."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    from ray.util.placement_group import get_current_placement_group

    return get_current_placement_group()
