"""Weight sync across processes (aligner.rollout.weight_sync.broadcast): the actor's rank 0
broadcasts its full tensors, bucket by bucket, to rollout engines in other processes over a gloo
group made apart from the default one; after a sync every engine holds the trainer's weights
exactly, and generates what an engine refitted in the trainer's own process generates."""

from __future__ import annotations

import pytest
import torch

from aligner.config import SamplingConfig
from aligner.model.llama import build_model
from aligner.rollout.torch_engine.engine import TorchEngine
from aligner.rollout.weight_sync.broadcast import (
    SyncGroup,
    WeightSender,
    bucket_spec,
    join_sync_group,
    pack_bucket,
    receive_weights,
    receive_weights_staged,
    unpack_bucket,
)
from aligner.rollout.weight_sync.refit import refit
from tests.toolkit.engine import ENGINE_CFG
from tests.toolkit.spawn import free_port, run_distributed

PROMPTS = [[3, 9, 4], [7, 1], [5, 5, 5, 2]]


def _sync_battery(rank: int, world_size: int, port: int, bucket_mb: float, staged: bool = False) -> dict:
    """Rank 0 trains a model one SGD step and sends it twice (the second after another step);
    ranks 1.. hold engines built from another seed and receive. Each rank returns its weights
    after each sync and, on the receivers, the greedy tokens of the second sync. staged: the
    receivers' engines are interruptible and receive with receive_weights_staged, the first sync
    while idle (applied at once), the second while a call is marked decoding (staged, applied when
    it ends), as the rollout worker's side thread does."""
    torch.manual_seed(0)
    group = join_sync_group("127.0.0.1", port, rank, world_size)
    out: dict = {"weights": [], "stats": []}
    if rank == 0:
        model = build_model(ENGINE_CFG, seed=1)
        sender = WeightSender(group)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            loss = model(torch.tensor([[1, 2, 3, 4]])).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            stats = refit(model, sender, bucket_mb=bucket_mb)
            out["stats"].append({"bytes": stats.bytes, "buckets": stats.buckets, "sent": sender.bytes_sent})
            out["weights"].append({k: v.detach().clone() for k, v in model.state_dict().items()})
        # the colocated path: the same weights refitted into an engine in this process
        local = TorchEngine(build_model(ENGINE_CFG, seed=5).eval(), compile="off")
        refit(model, local, bucket_mb=bucket_mb)
        out["tokens"] = [g.token_ids for g in local.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=6))]
    else:
        engine = TorchEngine(build_model(ENGINE_CFG, seed=7 + rank).eval(), compile="off", interruptible=staged)
        for i in range(2):
            if not staged:
                out["stats"].append(receive_weights(group, engine))
            elif i == 0:
                out["stats"].append(receive_weights_staged(group, engine))
                assert out["stats"][-1]["applied"] is True
            else:
                with engine.weight_staging.decoding(engine):
                    out["stats"].append(receive_weights_staged(group, engine))
                    assert out["stats"][-1]["applied"] is False and engine.weight_version == 1
            out["weights"].append({k: v.detach().clone() for k, v in engine.model.state_dict().items()})
        out["tokens"] = [g.token_ids for g in engine.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=6))]
        out["version"] = engine.weight_version
    group.close()
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("bucket_mb,staged", [(0.01, False), (256, False), (0.01, True)])
def test_broadcast_sync_gives_every_engine_the_trainers_weights_exactly(bucket_mb, staged):
    """Two receivers, two syncs, small buckets (many) and one bucket: weights equal bit for bit
    (fp32 on both ends), every byte the sender handed over is received, and the receivers' greedy
    tokens equal an engine refitted in the sender's own process. staged: the same through the
    interruptible engines' staged receive, idle and mid-call."""
    res = run_distributed(_sync_battery, world_size=3, args=(free_port(), bucket_mb, staged))
    sender = res[0]
    if bucket_mb < 1:
        assert sender["stats"][0]["buckets"] > 3
    for r in res[1:]:
        assert r["version"] == 2
        for i in range(2):
            want, got = sender["weights"][i], r["weights"][i]
            assert set(got) <= set(want)
            for k, v in got.items():
                assert torch.equal(v, want[k]), k
            assert r["stats"][i]["bytes"] == sender["stats"][i]["bytes"]
            assert r["stats"][i]["buckets"] == sender["stats"][i]["buckets"]
        assert r["tokens"] == sender["tokens"]
    assert not torch.equal(sender["weights"][0]["lm_head.weight"], sender["weights"][1]["lm_head.weight"])


def test_sender_checks_and_non_sender_ranks_send_nothing():
    """Only rank 0 of a sync group may send; an actor rank that is not the sender (group None)
    runs the same refit walk as a no-op that still counts the version."""
    s = WeightSender(None)
    s.update_weights([("lm_head.weight", torch.zeros(2, 2))])
    s.finish_weight_update()
    assert (s.bytes_sent, s.weight_version) == (0, 1)
    with pytest.raises(ValueError, match="sender is rank 0"):
        WeightSender(SyncGroup(pg=None, rank=1, world_size=2, device=torch.device("cpu"), store=None))
    with pytest.raises(ValueError, match="rank=3 is invalid"):
        join_sync_group("127.0.0.1", free_port(), 3, 2)


def test_wire_form_round_trips_mixed_dtypes_at_aligned_offsets():
    """A bucket whose tensors have odd byte sizes and different dtypes (bf16 of 3 elements, then fp32,
    int64, a 0-d tensor, an empty one) comes back equal, dtype and shape kept, each a view of the flat
    buffer; without the alignment padding the fp32 view after 6 bytes of bf16 would be refused."""
    g = torch.Generator().manual_seed(0)
    bucket = [
        ("a", torch.randn(3, generator=g).to(torch.bfloat16)),
        ("b", torch.randn(2, 5, generator=g)),
        ("c", torch.arange(7, dtype=torch.int64)),
        ("d", torch.tensor(2.5, dtype=torch.float16)),
        ("e", torch.empty(0, 4)),
    ]
    head, flat = pack_bucket(bucket, torch.device("cpu"))
    spec, size = bucket_spec(head)
    assert flat.dtype == torch.uint8 and flat.numel() == size and size % 16 == 0
    got = unpack_bucket(spec, flat)
    assert [n for n, _ in got] == [n for n, _ in bucket]
    for (_, want), (_, t) in zip(bucket, got):
        assert t.dtype == want.dtype and t.shape == want.shape and torch.equal(t, want)
        assert t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()  # a view, no copy
