"""Ray worker groups on CPU: rendezvous, tp x dp process groups, dispatch modes, placement,
concurrency of split roles, and failure reporting (exceptions, SIGKILL, over-asking).

One local Ray instance (8 logical CPUs, 127.0.0.1, no dashboard) serves the whole module.
The pure helpers (batch split / concat, node-group planning) are tested without Ray.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from dataclasses import dataclass

import pytest
import torch

from aligner.config import AlignerConfig, ClusterConfig, ParallelConfig, RefRoleConfig, ResourceConfig, TrainableRoleConfig
from aligner.errors import WorkerDiedError, WorkerError
from aligner.workers.dispatch import concat_results, dispatch, dispatched_methods, split_batch
from aligner.workers.group import CoreSharing, WorkerGroup, core_shares, get_all, get_all_across_groups, start_groups
from aligner.workers.placement import PlacementError, RoleRequest, create_placement, plan_from_config, plan_node_groups
from tests.toolkit.ray import NUM_CPUS

pytestmark = pytest.mark.distributed


# ---- worker classes (plain Python; pickled by value into the actors) --------------------
class MeshWorker:
    """Reports its coordinates and runs all-reduces over its tp and dp groups."""

    def __init__(self, tag: str, dims) -> None:
        self.tag, self.dims = tag, dims
        self.seen: list = []

    @dispatch("broadcast")
    def collectives(self) -> dict:
        import torch.distributed as dist

        d = self.dims
        tp = torch.tensor([float(d.rank + 1)])
        dist.all_reduce(tp, group=d.tp_group)
        dp = torch.tensor([float(d.rank + 1)])
        dist.all_reduce(dp, group=d.dp_group)
        return {
            "rank": d.rank,
            "coords": (d.dp_rank, d.pp_rank, d.tp_rank),
            "tp_sum": tp.item(),
            "dp_sum": dp.item(),
            "env": {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")},
            "threads": torch.get_num_threads(),
            "tag": self.tag,
        }

    @dispatch("dp_split")
    def scale(self, batch: dict, factor: float) -> dict:
        self.seen.append(list(batch["ids"]))
        return {"x": batch["x"] * factor, "ids": batch["ids"], "by_rank": [self.dims.rank] * len(batch["ids"]), "temp": batch["temp"]}

    @dispatch("broadcast")
    def last_seen(self) -> list:
        return self.seen[-1]

    @dispatch("rank0")
    def whoami(self) -> int:
        return self.dims.rank


class SleepWorker:
    """Busy work and failures on demand."""

    def __init__(self, dims) -> None:
        self.dims = dims

    @dispatch("broadcast")
    def busy(self, seconds: float) -> float:
        t0 = time.monotonic()
        time.sleep(seconds)
        return time.monotonic() - t0

    @dispatch("broadcast")
    def progressing(self, seconds: float) -> float:
        """`seconds` of work in steps of 50 ms, each a progress beat (as a decode step is)."""
        from aligner.runtime import progress

        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            time.sleep(0.05)
            progress.beat()
        return time.monotonic() - t0

    @dispatch("broadcast")
    def busy_by_rank(self, seconds: list) -> float:
        """Sleep seconds[rank]: ranks that work alone at different speeds."""
        time.sleep(seconds[self.dims.rank])
        return seconds[self.dims.rank]

    @dispatch("broadcast")
    def threads(self) -> int:
        return torch.get_num_threads()

    @dispatch("broadcast")
    def fail_on(self, bad_rank: int) -> int:
        if self.dims.rank == bad_rank:
            raise ValueError(f"boom from rank {bad_rank}")
        return self.dims.rank


class WaitWorker:
    """A call that waits for another (concurrent) one: it would wait forever if calls ran one at a time."""

    def __init__(self) -> None:
        import threading

        self.released = threading.Event()

    @dispatch("broadcast")
    def wait_released(self, timeout_s: float) -> bool:
        return self.released.wait(timeout_s)

    @dispatch("broadcast", concurrent=True)
    def release(self) -> str:
        self.released.set()
        return "released"


class BrokenInit:
    def __init__(self) -> None:
        raise RuntimeError("cannot build this worker")


# ---- fixtures ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_local(ray_cluster):
    """The session's Ray instance, with this module's worker classes pickled by value."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield ray_cluster


def _pids_gone(pids: list[int], within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.2)
    return False


def _pg_states() -> dict:
    from ray.util.placement_group import placement_group_table

    return {k: v["state"] for k, v in placement_group_table().items()}


# ---- pure helpers (no Ray) ------------------------------------------------------------
def test_split_and_concat_round_trip_uneven():
    batch = {"x": torch.arange(7.0).view(7, 1), "ids": list(range(7)), "temp": 0.5}
    chunks = split_batch(batch, 3)
    assert [c["ids"] for c in chunks] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [c["temp"] for c in chunks] == [0.5, 0.5, 0.5]
    back = concat_results(chunks)
    assert torch.equal(back["x"], batch["x"]) and back["ids"] == batch["ids"] and back["temp"] == [0.5] * 3
    assert concat_results([None, None]) is None

    @dataclass
    class B:
        tokens: torch.Tensor
        n: int

    parts = split_batch(B(tokens=torch.arange(4), n=3), 2)
    assert [p.tokens.tolist() for p in parts] == [[0, 1], [2, 3]] and parts[1].n == 3
    assert split_batch([1, 2, 3, 4], 2) == [[1, 2], [3, 4]]
    with pytest.raises(ValueError, match=r"batch\['y'\] has 2 samples but batch\['x'\] has 3"):
        split_batch({"x": [1, 2, 3], "y": torch.zeros(2)}, 2)
    with pytest.raises(ValueError, match="dp_size=4"):
        split_batch([1, 2], 4)


def test_dispatch_declarations_and_node_group_plans():
    assert dispatched_methods(MeshWorker) == {"collectives": "broadcast", "scale": "dp_split", "last_seen": "broadcast", "whoami": "rank0"}
    with pytest.raises(ValueError, match="valid modes are broadcast, dp_split, rank0"):
        dispatch("scatter")
    a = RoleRequest(role="actor", world_size=16, num_nodes=2, gpus_per_node=8, cpus_per_worker=4)
    c = RoleRequest(role="critic", world_size=16, num_nodes=2, gpus_per_node=8, cpus_per_worker=2)
    split = plan_node_groups({"actor": a, "critic": c}, "split")
    assert [s.name for s in split] == ["actor", "critic"]
    assert split[0].bundles == [{"CPU": 32.0, "GPU": 8.0}] * 2 and split[0].strategy == "STRICT_SPREAD"
    colo = plan_node_groups({"actor": a, "critic": c}, "colocated")
    assert len(colo) == 1 and [r.role for r in colo[0].requests] == ["actor", "critic"]
    ref = RoleRequest(role="ref", world_size=16, num_nodes=2, gpus_per_node=8)
    linked = plan_node_groups({"actor": a, "critic": c, "ref": ref}, "split", {"ref": "actor"})
    assert [[r.role for r in s.requests] for s in linked] == [["actor", "ref"], ["critic"]]
    with pytest.raises(ValueError, match="world_size"):
        RoleRequest(role="actor", world_size=6, num_nodes=1, gpus_per_node=8)
    with pytest.raises(ValueError, match="ref.colocate_with='nobody'"):
        plan_node_groups({"actor": a, "ref": ref}, "split", {"ref": "nobody"})


def test_a_restart_waits_for_the_cluster_to_hold_the_groups_again(monkeypatch, caplog):
    """After a lost node (trainer.restart_wait_s): the cluster check is polled until a replacement joins;
    a cluster still too small after the wait is the usual PlacementError, saying how long it waited."""
    from aligner.workers import placement

    specs = plan_node_groups({"actor": RoleRequest(role="actor", world_size=2, cpus_per_worker=1)}, "split")
    checks = []

    def short_until_the_third_check(s):
        checks.append(s)
        if len(checks) < 3:
            raise PlacementError("the cluster cannot hold the requested placement (actor: 2 CPU asked, 0 alive)")

    monkeypatch.setattr(placement, "check_cluster", short_until_the_third_check)
    with caplog.at_level(logging.WARNING, logger="aligner"):
        waited = placement.wait_for_cluster(specs, wait_s=5.0, poll_s=0.05)
    assert len(checks) == 3 and 0.09 <= waited < 5.0
    assert "waiting up to 5 s" in caplog.text
    checks.clear()

    def never(s):
        checks.append(s)
        raise PlacementError("cannot hold it")

    monkeypatch.setattr(placement, "check_cluster", never)
    with pytest.raises(PlacementError, match=r"cannot hold it\n\(waited 0 s for it: trainer.restart_wait_s=0.2\)"):
        placement.wait_for_cluster(specs, wait_s=0.2, poll_s=0.05)
    assert len(checks) >= 2, "polled, not checked once"
    with pytest.raises(PlacementError, match="^cannot hold it$"):  # no wait (the first start): checked once, the message unchanged
        placement.wait_for_cluster(specs, wait_s=0.0, poll_s=0.05)


def test_core_shares_split_each_node_among_its_busy_cpu_workers():
    def w(rank, node, cores=8, gpu=False):
        return {"rank": rank, "node_ip": node, "node_cores": cores, "on_gpu": gpu}

    info = {
        "actor": [w(0, "a"), w(1, "a"), w(2, "b")],
        "critic": [w(0, "a")],
        "reward": [w(0, "b", gpu=True)],
        "ref": [w(0, "b", cores=3)],
    }
    assert core_shares(info, ["actor"]) == {("actor", 0): 4, ("actor", 1): 4, ("actor", 2): 8}
    assert core_shares(info, ["actor", "critic", "reward"]) == {("actor", 0): 2, ("actor", 1): 2, ("actor", 2): 8, ("critic", 0): 2}
    assert core_shares(info, ["ref", "actor", "ref"]) == {("actor", 0): 4, ("actor", 1): 4, ("actor", 2): 4, ("ref", 0): 1}
    assert core_shares(info, ["reward", "missing"]) == {}


def test_start_groups_starts_side_by_side_and_cleans_up_after_a_failure():
    """start_groups builds the groups in threads at once (each maker here waits for all of them to have
    started), returns them in the makers' order, and when one fails shuts down those that started and
    raises the first failing role's error."""
    import threading

    class Fake:
        def __init__(self, role):
            self.role, self.closed = role, False

        def shutdown(self):
            self.closed = True

    def maker(role, barrier, fail=False):
        def make():
            barrier.wait(timeout=10)  # every maker runs before any returns: a sequential start would time out here
            if fail:
                raise WorkerError(role, 0, f"{role} failed")
            built.append(Fake(role))
            return built[-1]

        return make

    built: list = []
    barrier = threading.Barrier(3)
    groups = start_groups({r: maker(r, barrier) for r in ("actor", "critic", "ref")})
    assert list(groups) == ["actor", "critic", "ref"] and [g.role for g in groups.values()] == ["actor", "critic", "ref"]
    assert not any(g.closed for g in groups.values())
    built.clear()
    barrier = threading.Barrier(3)
    makers = {"actor": maker("actor", barrier), "critic": maker("critic", barrier, fail=True), "ref": maker("ref", barrier, fail=True)}
    with pytest.raises(WorkerError, match="critic failed"):
        start_groups(makers)
    assert [g.role for g in built] == ["actor"] and built[0].closed


def test_plan_from_aligner_config():
    cfg = AlignerConfig(
        actor=TrainableRoleConfig(parallel=ParallelConfig(tp_size=2, dp_size=2), resources=ResourceConfig(cpus_per_worker=2)),
        ref=RefRoleConfig(colocate_with="actor", parallel=ParallelConfig(tp_size=2, dp_size=2)),
    )
    specs = plan_from_config(cfg, ["actor", "critic", "ref"])
    assert [[r.role for r in s.requests] for s in specs] == [["actor", "ref"], ["critic"]]
    assert specs[0].bundles == [{"CPU": 8.0}] and specs[1].bundles == [{"CPU": 1.0}]
    colo = AlignerConfig(
        cluster=ClusterConfig(placement="colocated"),
        critic=TrainableRoleConfig(parallel=ParallelConfig(dp_size=2), resources=ResourceConfig(num_nodes=2)),
    )
    with pytest.raises(ValueError, match=r"critic.resources \(num_nodes=2"):
        plan_from_config(colo, ["actor", "critic"])


# ---- Ray groups --------------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.slow
def test_tp2_dp2_group_collectives_dispatch_and_shutdown(ray_local):
    parallel = ParallelConfig(tp_size=2, dp_size=2)
    group = WorkerGroup.create("actor", MeshWorker, parallel, ResourceConfig(cpus_per_worker=1), kwargs={"tag": "t"}, num_threads=2)
    try:
        pg_id = group.placement.placement_group.id.hex()
        out = group.collectives().get(timeout_s=120)
        # Megatron order: tp fastest. tp groups {0,1} {2,3}; dp groups {0,2} {1,3}; values rank+1.
        assert [o["rank"] for o in out] == [0, 1, 2, 3]
        assert [o["coords"] for o in out] == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]
        assert [o["tp_sum"] for o in out] == [3.0, 3.0, 7.0, 7.0]
        assert [o["dp_sum"] for o in out] == [4.0, 6.0, 4.0, 6.0]
        assert [o["env"]["RANK"] for o in out] == ["0", "1", "2", "3"]
        assert {o["env"]["WORLD_SIZE"] for o in out} == {"4"} and [o["env"]["LOCAL_RANK"] for o in out] == ["0", "1", "2", "3"]
        assert {(o["env"]["MASTER_ADDR"], o["env"]["MASTER_PORT"]) for o in out} == {
            (out[0]["env"]["MASTER_ADDR"], out[0]["env"]["MASTER_PORT"])
        }
        assert out[0]["env"]["MASTER_ADDR"] == "127.0.0.1"
        assert {o["threads"] for o in out} == {2} and {o["tag"] for o in out} == {"t"}

        batch = {"x": torch.arange(7.0).view(7, 1), "ids": list(range(7)), "temp": 0.7}
        res = group.scale(batch, 10.0).get(timeout_s=60)
        assert torch.equal(res["x"], torch.arange(7.0).view(7, 1) * 10) and res["ids"] == list(range(7))
        assert res["by_rank"] == [0, 0, 0, 0, 2, 2, 2]  # tp_rank 0 of each dp replica, in order
        assert res["temp"] == [0.7, 0.7]
        assert group.last_seen().get(timeout_s=60) == [[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6], [4, 5, 6]]
        assert group.whoami().get(timeout_s=60) == 0
        pids = [i["pid"] for i in group.worker_info()]
    finally:
        group.shutdown()
    assert _pids_gone(pids), "actor processes survived shutdown"
    assert _pg_states()[pg_id] == "REMOVED"
    with pytest.raises(RuntimeError, match="shut down"):
        group.whoami()


@pytest.mark.distributed
@pytest.mark.slow
def test_split_roles_run_concurrently_and_colocated_share_bundles(ray_local):
    one = ParallelConfig()
    req = lambda role: RoleRequest.from_parts(role, one, ResourceConfig(cpus_per_worker=1))  # noqa: E731
    split = create_placement({"actor": req("actor"), "critic": req("critic")}, "split")
    actor = WorkerGroup("actor", SleepWorker, split.role("actor"), one)
    critic = WorkerGroup("critic", SleepWorker, split.role("critic"), one)
    try:
        assert split.role("actor").placement_group.id != split.role("critic").placement_group.id
        t0 = time.monotonic()
        futures = [actor.busy(3.0), critic.busy(3.0)]
        results = get_all(futures, timeout_s=60)
        wall = time.monotonic() - t0
        assert all(r[0] >= 3.0 for r in results)
        assert wall < 4.5, f"two 3 s calls on separate node groups took {wall:.1f} s (sequential would be 6 s)"
        # threads follow the work: a role alone gets the node's cores, two busy roles share them
        cores = CoreSharing({"actor": actor, "critic": critic})
        node = cores.info["actor"][0]["node_cores"]
        assert cores.phase(["actor"]) == {("actor", 0): node} or node == 1
        assert actor.threads().get(timeout_s=60) == [node] and critic.threads().get(timeout_s=60) == [1]
        cores.phase(["actor", "critic"])
        assert get_all([actor.threads(), critic.threads()], timeout_s=60) == [[max(1, node // 2)], [max(1, node // 2)]]
        assert cores.phase(["critic", "actor"]) == {}  # unchanged shares make no calls
        assert [i["num_threads"] for i in actor.worker_info()] == [max(1, node // 2)]
    finally:
        actor.shutdown()
        critic.shutdown()
    colo = create_placement({"actor": req("actor"), "critic": req("critic")}, "colocated")
    a, c = colo.role("actor"), colo.role("critic")
    assert a.placement_group.id == c.placement_group.id and a.num_cpus == 0.5 == c.num_cpus
    g1 = WorkerGroup("actor", SleepWorker, a, one)
    g2 = WorkerGroup("critic", SleepWorker, c, one)
    pg_id = a.placement_group.id.hex()
    try:
        assert get_all([g1.fail_on(-1), g2.fail_on(-1)], timeout_s=60) == [[0], [0]]
        g1.shutdown()
        assert _pg_states()[pg_id] == "CREATED"  # still held by critic
    finally:
        g1.shutdown()
        g2.shutdown()
    assert _pg_states()[pg_id] == "REMOVED"


@pytest.mark.distributed
@pytest.mark.slow
def test_workers_run_at_the_driver_s_priority(ray_local):
    """The local instance's workers are not niced below the driver (Ray's default worker_niceness is 15,
    which let any other process on the machine take the CPU from a run's compute)."""
    import ray

    driver = os.getpriority(os.PRIO_PROCESS, 0)
    worker = ray.get(ray.remote(num_cpus=0)(lambda: os.getpriority(os.PRIO_PROCESS, 0)).remote(), timeout=120)
    assert worker <= driver, (worker, driver)


def test_a_concurrent_call_runs_beside_the_call_in_flight(ray_local):
    """dispatch(..., concurrent=True) (the rollout worker's staged weight receive): the call
    runs on the worker's side thread while a plain call is in flight, and releases it; a second plain
    call still waits behind the first. concurrent is broadcast only."""
    one = ParallelConfig()
    placed = create_placement({"w": RoleRequest.from_parts("w", one, ResourceConfig(cpus_per_worker=1))}, "split")
    group = WorkerGroup("w", WaitWorker, placed.role("w"), one)
    try:
        waiting = group.wait_released(30.0)
        queued = group.wait_released(0.0)  # behind the first: runs after it, so finds the event set
        assert group.release().get(timeout_s=20) == ["released"]
        assert waiting.get(timeout_s=20) == [True] and queued.get(timeout_s=20) == [True]
    finally:
        group.shutdown()
        placed.remove()
    with pytest.raises(ValueError, match="concurrent=True with dispatch mode 'rank0'"):
        dispatch("rank0", concurrent=True)


def test_worker_exception_reaches_driver_with_role_rank_traceback(ray_local):
    group = WorkerGroup.create("critic", SleepWorker, ParallelConfig(dp_size=2), ResourceConfig())
    with pytest.raises(WorkerError) as info:
        group.fail_on(1).get(timeout_s=60)
    err = info.value
    assert (err.role, err.rank, err.method) == ("critic", 1, "fail_on")
    msg = str(err)
    assert "critic rank 1" in msg and "Traceback (most recent call last)" in msg
    assert "ValueError: boom from rank 1" in msg and "in fail_on" in msg
    with pytest.raises(RuntimeError, match="shut down after critic rank 1 failed"):
        group.fail_on(-1)
    with pytest.raises(WorkerError, match=r"(?s)reward rank 0 failed in BrokenInit.__init__.*cannot build this worker"):
        WorkerGroup.create("reward", BrokenInit, ParallelConfig(), ResourceConfig())


@pytest.mark.distributed
@pytest.mark.slow
def test_sigkilled_worker_is_reported_within_seconds(ray_local):
    group = WorkerGroup.create("actor", SleepWorker, ParallelConfig(dp_size=2), ResourceConfig())
    pids = [i["pid"] for i in group.worker_info()]
    future = group.busy(60.0)
    time.sleep(0.5)
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError) as info:
        future.get(timeout_s=30)
    elapsed = time.monotonic() - t0
    assert elapsed < 10.0, f"death of rank 1 reported after {elapsed:.1f} s"
    assert info.value.role == "actor" and info.value.rank == 1 and "actor rank 1" in str(info.value)
    assert _pids_gone(pids), "the rest of the group was not killed"


@pytest.mark.distributed
def test_over_asking_placement_is_refused_before_any_actor(ray_local):
    before = _pg_states()
    t0 = time.monotonic()
    with pytest.raises(PlacementError) as info:
        WorkerGroup.create("actor", SleepWorker, ParallelConfig(dp_size=2), ResourceConfig(cpus_per_worker=64))
    msg = str(info.value)
    assert time.monotonic() - t0 < 5.0
    assert "128 CPU in total, the cluster has 8" in msg
    assert "actor: 1 node(s) x 2 worker(s)" in msg and "cpus_per_worker=64" in msg
    assert f"CPU={NUM_CPUS}" in msg and "ray.cluster_resources()" in msg
    assert _pg_states() == before  # nothing was created

    # Second guard: the cluster has the CPUs, but they are held by another placement group.
    hold = create_placement({"other": RoleRequest(role="other", world_size=1, cpus_per_worker=NUM_CPUS - 2)})
    try:
        with pytest.raises(PlacementError, match=r"(?s)not placed within 1 s.*available now: CPU=2"):
            create_placement({"critic": RoleRequest(role="critic", world_size=4)}, timeout_s=1.0)
    finally:
        hold.remove()
    assert sum(s != "REMOVED" for s in _pg_states().values()) == sum(s != "REMOVED" for s in before.values())


class _Fut:
    """A finished call: returns `value` or raises `error` from get()."""

    def __init__(self, value=None, error=None):
        self.value, self.error = value, error

    def get(self, timeout_s=None):
        if self.error is not None:
            raise self.error
        return self.value


def test_a_death_is_reported_before_the_errors_it_caused_in_its_peers():
    """The weight sync spans two groups: when the receiver's process dies, the sender's collective fails
    first ("connection closed by peer"); the death must be what the driver sees, so the run restarts."""
    peer = WorkerError("actor", 0, "RuntimeError: Connection closed by peer", "send_weights")
    death = WorkerDiedError("rollout", 0, "the worker process died", "receive_weights")
    with pytest.raises(WorkerDiedError, match="rollout"):
        get_all_across_groups([_Fut(error=peer), _Fut(error=death)])
    with pytest.raises(WorkerError, match="actor"):
        get_all_across_groups([_Fut(error=peer), _Fut(value=1)])
    assert get_all_across_groups([_Fut(value=1), _Fut(value=2)]) == [1, 2]


@pytest.mark.distributed
def test_hang_watchdog_names_the_rank_and_its_stack(ray_local):
    """trainer.hang_timeout_s: a call without progress for that long raises WorkerHungError,
    a WorkerDiedError (the automatic restart handles it), naming role, rank and method, with the Python
    stack the worker's faulthandler wrote (it shows where the worker is stuck); the group is shut down."""
    from aligner.errors import WorkerHungError

    one = ParallelConfig()
    placed = create_placement({"actor": RoleRequest.from_parts("actor", one, ResourceConfig(cpus_per_worker=1))}, "split")
    group = WorkerGroup("actor", SleepWorker, placed.role("actor"), one, hang_timeout_s=1.0)
    try:
        assert group.busy(0.1).get(timeout_s=60)[0] >= 0.1  # a call within the limit passes
        assert group.progressing(4.0).get(timeout_s=60)[0] >= 4.0  # 4x the limit, progressing: not a hang
        t0 = time.monotonic()
        with pytest.raises(WorkerHungError) as err:
            group.busy(120.0).get(timeout_s=60)
        took = time.monotonic() - t0
        assert isinstance(err.value, WorkerDiedError)
        assert (err.value.role, err.value.rank, err.value.method) == ("actor", 0, "busy")
        text = err.value.traceback_text
        assert "no progress in busy() for 1 s (trainer.hang_timeout_s)" in text
        assert "in busy" in text and "test_group.py" in text, text
        assert took < 20, f"the hang was reported {took:.1f} s after the call (limit 1 s + grace)"
        with pytest.raises(RuntimeError, match="shut down"):
            group.busy(0.1)
        assert not any(os.path.exists(p) for p in group.stack_files.values()), "the stack files outlive the group"
    finally:
        group.shutdown()
        placed.remove()


def test_per_rank_busy_seconds_and_the_straggler_line(ray_local):
    """trainer.straggler_factor: each rank's seconds inside calls since the last look,
    as min / median / max / slowest-rank metrics, and one straggler line naming role, rank, pid and
    host when a rank was busy more than the factor times its group's median (and at least 1 s)."""
    from aligner.workers.group import rank_busy_metrics

    par = ParallelConfig(dp_size=3)
    placed = create_placement({"rollout": RoleRequest.from_parts("rollout", par, ResourceConfig(cpus_per_worker=1))}, "split")
    group = WorkerGroup("rollout", SleepWorker, placed.role("rollout"), par)
    try:
        lines: list[str] = []
        group.busy_by_rank([0.3, 1.5, 0.3]).get(timeout_s=60)
        m = rank_busy_metrics({"rollout": group}, 1.5, lines.append)
        assert m["ranks/rollout/slowest_rank"] == 1.0
        assert 1.5 <= m["ranks/rollout/busy_s_max"] < 2.5 and 0.3 <= m["ranks/rollout/busy_s_min"] < 1.0
        assert m["ranks/rollout/busy_s_median"] == pytest.approx(m["ranks/rollout/busy_s_min"], abs=0.3)
        pid = group.worker_info()[1]["pid"]
        assert len(lines) == 1 and f"straggler: rollout rank 1 (pid {pid}," in lines[0] and "trainer.straggler_factor=1.5" in lines[0]
        group.busy_by_rank([0.2, 0.2, 0.2]).get(timeout_s=60)  # even ranks, and the counters start again
        m = rank_busy_metrics({"rollout": group}, 1.5, lines.append)
        assert len(lines) == 1 and m["ranks/rollout/busy_s_max"] < 1.0
        assert rank_busy_metrics({"rollout": group}, 0.0, lines.append)["ranks/rollout/busy_s_max"] < 0.1  # nothing ran since
    finally:
        group.shutdown()
        placed.remove()


@pytest.mark.distributed
def test_a_stopped_worker_is_hung_even_when_its_call_was_progressing(ray_local):
    """A SIGSTOPped process beats no more, and its own watchdog cannot fire: the driver sees the beats'
    time stop and ends the call after the limit (+ grace), naming the rank."""
    import signal

    from aligner.errors import WorkerHungError

    one = ParallelConfig()
    placed = create_placement({"actor": RoleRequest.from_parts("actor", one, ResourceConfig(cpus_per_worker=1))}, "split")
    group = WorkerGroup("actor", SleepWorker, placed.role("actor"), one, hang_timeout_s=1.0)
    try:
        pid = group.worker_info()[0]["pid"]
        fut = group.progressing(60.0)
        time.sleep(2.0)  # past the limit, progressing
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(WorkerHungError, match="no progress in progressing"):
            fut.get(timeout_s=60)
        assert time.monotonic() - t0 < 20
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except (OSError, UnboundLocalError):
            pass
        group.shutdown()
        placed.remove()
