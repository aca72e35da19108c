"""Ray worker shell of the reward role: scoring (PPO) and Bradley-Terry training (RM stage); and the
reward role of ``reward.type=remote``, which has no worker: :class:`RemoteRewardRole` calls the
endpoint from the driver's threads, so the calls overlap the Ray futures of the inference phase."""

from __future__ import annotations

from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Optional

import torch

from aligner.config import AlignerConfig
from aligner.config.roles import RewardRoleConfig
from aligner.parallel.dims import ParallelDims
from aligner.reward.judge import Judge
from aligner.reward.remote import RemoteReward, resolve_token
from aligner.reward.reward_model import RewardModel
from aligner.reward.streaming import StreamedResponses
from aligner.workers.dispatch import dispatch


class RewardWorker:
    """RewardModel on the reward role's layout; initialized from reward.init (SFT policy or an RM)."""

    def __init__(self, cfg: AlignerConfig, total_steps: int = 1, init: str = "", dims: Optional[ParallelDims] = None):
        self.cfg = cfg
        self.dims = dims or ParallelDims()
        torch.manual_seed(cfg.trainer.seed)
        rc = cfg.reward
        self.judge: Optional[Judge] = None
        if cfg.stage in ("ppo", "rs") and rc.type == "judge":  # a generative reward model: an LLM and its engine, no scalar head
            self.judge = build_judge(cfg, init or rc.init, self.dims)
            return
        lora = rc.lora if cfg.stage == "rm" else None  # PPO's reward model is frozen (its init is an HF export)
        self.rm = RewardModel(
            cfg.model,
            rc.parallel,
            rc.optim,
            self.dims,
            total_steps,
            init=init or rc.init,
            seed=cfg.trainer.seed + 2,
            lora=lora,
            micro_batch_tokens=cfg.trainer.micro_batch_tokens,
        )

    @dispatch("dp_split")
    def scores(self, batch: dict) -> torch.Tensor:
        return self.rm.scores(batch, self.cfg.trainer.micro_batch_size)

    @dispatch("dp_split")
    def judge_scores(self, batch: dict) -> dict:
        """reward.type=judge: {"prompt": [B] texts, "response": [B] texts} (this replica's share) ->
        {"scores": [B] float32 in [0, 1], "unparsed": [B] bool} (:meth:`aligner.reward.judge.Judge.scores`)."""
        if self.judge is None:
            raise RuntimeError("judge_scores on a reward worker that holds a reward model: set reward.type=judge")
        return self.judge.scores(batch["prompt"], batch["response"])

    @dispatch("dp_split")
    def bt_step(self, batch: dict) -> dict:
        return self.rm.bt_step(batch, self.cfg.trainer.micro_batch_size)

    @dispatch("dp_split")
    def bt_eval(self, batch: dict) -> dict:
        return self.rm.bt_eval(batch, self.cfg.trainer.micro_batch_size)

    @dispatch("broadcast")
    def save(self, role_dir: str) -> None:
        self.rm.save(role_dir)

    @dispatch("broadcast")
    def load(self, role_dir: str) -> None:
        self.rm.load(role_dir)

    @dispatch("broadcast")
    def export_hf(self, out_dir: str, tokenizer_path: str = "", stats: Optional[dict] = None) -> Optional[str]:
        return self.rm.export_hf(out_dir, tokenizer_path, extra_files={"reward_stats.json": stats} if stats else None)


def build_judge(cfg: AlignerConfig, init: str, dims: ParallelDims) -> Judge:
    """The judge of reward.type=judge: the causal LM of the HF directory `init` with its tokenizer,
    on a TorchEngine of one rank (greedy, continuous scheduler) in rollout.dtype on this rank's device."""
    from aligner.data.tokenizer import load_tokenizer
    from aligner.model.hf import load_hf_model
    from aligner.rollout.torch_engine.engine import TorchEngine

    tok = load_tokenizer(init)
    model, model_cfg = load_hf_model(init)
    model = model.to(device=dims.device, dtype=getattr(torch, cfg.rollout.dtype)).eval()
    engine = TorchEngine(model, eos_token_id=tok.eos_token_id, max_batch_size=cfg.rollout.max_batch_size)
    rc = cfg.reward
    return Judge(engine, tok, rc.judge_rubric, rc.judge_max_new_tokens, rc.judge_max_score, model_cfg.max_seq_len)


class JudgeScores:
    """The pending scores of the judge group's :meth:`RewardWorker.judge_scores`, waited on like a
    group's future: ``get`` gives the scores [B] float32 and keeps ``unparsed`` [B] bool."""

    def __init__(self, future) -> None:
        self.future = future
        self.unparsed: Optional[torch.Tensor] = None

    def get(self, timeout_s: Optional[float] = None) -> torch.Tensor:
        out = self.future.get(timeout_s)
        self.unparsed = out["unparsed"]
        return out["scores"]


class RemoteScores:
    """The pending scores of one :meth:`RemoteRewardRole.scores` call, waited on like a group's future
    (:func:`aligner.workers.group.get_all`)."""

    def __init__(self, future: Future) -> None:
        self.future = future

    def get(self, timeout_s: Optional[float] = None) -> torch.Tensor:
        """Scores [B] float32; RemoteRewardError after the endpoint's retries, TimeoutError after `timeout_s`."""
        try:
            return self.future.result(timeout_s)
        except FutureTimeout:
            raise TimeoutError(f"remote reward scores not ready within {timeout_s} s") from None


class StreamedJudge(StreamedResponses):
    """Judge verdicts requested while an engine generates (``reward.stream`` with ``reward.type=judge``):
    the engine's ``on_finish`` callback (:meth:`finished`) queues each response as its row ends, and as
    soon as ``chunk`` are queued they go to one judge replica of the reward group (its workers' actor
    handles, round-robin from ``first``) as a ``judge_scores`` call, so the judge works while the
    engine decodes the rest. :meth:`attach` sends what is left, waits, and writes each Generation's
    ``extra["score"]`` and ``extra["judge_unparsed"]``; when a judge call fails (an error, a dead
    worker) every Generation gets ``extra["judge_error"]`` instead (the driver checks the reward group
    and raises).

    Args:
        judges: the reward group's worker handles (:class:`aligner.workers.group.WorkerShell` actors; one
            judge replica each, the config keeps judges at tp = pp = 1).
        tokenizer: decodes each response as the driver would (special tokens dropped).
        rows: B dicts {"prompt": text, ...} in request order. chunk: responses per call (>= 1).
        first: the replica that gets the first call (a generating replica's index spreads the load).
    """

    def __init__(self, judges: list, tokenizer, rows: list[dict], chunk: int, first: int = 0) -> None:
        if not judges:
            raise ValueError("StreamedJudge: no judges (the reward group's handles: set_judges)")
        super().__init__(chunk)
        self.judges, self.tok, self.rows, self.next = judges, tokenizer, rows, int(first)
        self.sent: list[tuple[list[int], int, object]] = []  # (indices, judge replica, ObjectRef)

    def _send(self) -> None:
        idx, self.queued = self.queued, []
        batch = {
            "prompt": [self.rows[i]["prompt"] for i in idx],
            "response": [self.tok.decode(self.responses[i], skip_special_tokens=True) for i in idx],
        }
        replica = self.next % len(self.judges)
        self.next += 1
        self.sent.append((idx, replica, self.judges[replica].call.remote("judge_scores", ((batch,), {}))))

    def attach(self, gens) -> None:
        """After the engine returned its B Generations: judge the responses not sent yet, wait for every
        verdict, set ``score``, ``judge_unparsed`` and ``scored_while_generating`` (or ``judge_error``) in
        each Generation's extra."""
        import ray

        self.queue_unreported(gens)
        scores: dict[int, tuple[float, bool]] = {}
        for idx, replica, ref in self.sent:
            try:
                out = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - any failure of the judge's call is reported by the driver
                text = " ".join(str(e).split())[:300]
                for g in gens:
                    g.extra["judge_error"] = f"the judge (reward rank {replica}) failed while scoring streamed responses: {text}"
                return
            scores.update({i: (float(s), bool(u)) for i, s, u in zip(idx, out["scores"].tolist(), out["unparsed"].tolist())})
        for i, g in enumerate(gens):
            g.extra["score"], g.extra["judge_unparsed"] = scores[i]
            g.extra["scored_while_generating"] = i in self.early


def remote_reward_client(rc: RewardRoleConfig) -> RemoteReward:
    """The HTTP client of ``reward.type=remote`` with the reward section's url, token, timeout, retries,
    backoff, batch size and concurrency (the driver's :class:`RemoteRewardRole` and, with
    ``reward.stream``, each engine replica's lead worker hold one)."""
    return RemoteReward(
        rc.url,
        token=resolve_token(rc.token, rc.token_file),
        timeout_s=rc.timeout_s,
        max_retries=rc.max_retries,
        backoff_s=rc.backoff_s,
        batch_size=rc.batch_size,
        max_concurrency=rc.max_concurrency,
        max_response_bytes=rc.max_response_bytes,
        allow_plain_http_token=rc.allow_plain_http_token,
    )


class RemoteRewardRole:
    """``reward.type=remote``: the reward role as an HTTP endpoint (:class:`~aligner.reward.remote.RemoteReward`),
    called from the driver; no reward model is loaded anywhere.

    What overlaps: with ``reward.stream`` (the default) the engines' workers send each response as it
    finishes (:class:`~aligner.reward.remote.StreamedScores`), so scoring overlaps generation and the
    batch comes back scored; this role then only scores the evaluation. With ``reward.stream=false``
    :meth:`scores` sends the batch at once after generation, in requests of ``reward.batch_size`` with up
    to ``reward.max_concurrency`` in flight, and returns; the driver then issues the other roles' Ray
    calls (old and reference log-probs, values) and waits on all of them together.
    """

    def __init__(self, rc: RewardRoleConfig) -> None:
        self.client = remote_reward_client(rc)

    def scores(self, batch: dict, meta: list[dict]) -> RemoteScores:
        """Start scoring B samples: `batch` has input_ids / attention_mask [B, T] (right padded; each
        row's real tokens are sent as its input_ids), `meta` the B rows' {"prompt", "response", "metadata"}."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        lengths = mask.long().sum(-1).tolist()
        rows = [ids[i, :n].tolist() for i, n in enumerate(lengths)]
        fut = self.client.submit([m["prompt"] for m in meta], [m["response"] for m in meta], [m["metadata"] for m in meta], rows)
        return RemoteScores(fut)

    def shutdown(self) -> None:
        self.client.close()
