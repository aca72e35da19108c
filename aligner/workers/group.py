"""Ray worker groups: one role's TP x PP x DP workers as Ray actors, and dispatch to them.

Owns: the generic Ray actor shell that hosts a plain (Ray-free) worker class, the rendezvous
a group arranges for itself (rank 0 picks a free port on its node; every rank gets RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT before the worker class is built), the
role's process groups (``ParallelDims.from_env``: gloo on CPU, NCCL on GPU), the dispatch
modes declared with :func:`dispatch`, batch splitting / result collection, futures, and
failure reporting (:class:`WorkerError`, :class:`WorkerDiedError`).

Dispatch modes (verl's ``@register``; docs/design.md, "Declared dispatch modes"):

    broadcast   same call on every rank; result: list indexed by rank
    dp_split    first positional argument (dict of tensors/lists, list, tuple, tensor or
                dataclass) split into dp_size contiguous chunks by dp_rank; every tp/pp rank
                of a replica gets its chunk, other arguments go to every rank; results are
                taken from tp_rank 0 of the last pp stage of each replica and concatenated
                in the original order
    rank0       called on rank 0 only; result: rank 0's return value

Rendezvous: a group whose workers all sit on one node uses 127.0.0.1 (and gloo on the
loopback interface); a multi-node group uses rank 0's node IP.

Simplifications: chunks of an uneven batch differ in size by at most one sample (numpy
``array_split`` rule); a failure in any worker kills the whole group (the other ranks may
be blocked in a collective with it), and the group cannot be used afterwards. On GPU each
actor sees one GPU (Ray sets CUDA_VISIBLE_DEVICES), so LOCAL_RANK is 0 there; on CPU it is
the worker's position among the group's workers on its node.

The dispatch decorator and batch splitting live in the Ray-free :mod:`aligner.workers.dispatch`.
"""

from __future__ import annotations

import inspect
import os
import socket
import time
import traceback
from typing import Any, Callable, Iterable, Mapping, Optional

from aligner.config import ParallelConfig, ResourceConfig
from aligner.errors import WorkerDiedError, WorkerError, WorkerHungError, disk_full_path
from aligner.parallel.dims import ParallelDims
from aligner.runtime import progress
from aligner.runtime.host import HOST_MALLOC_ENV
from aligner.runtime.ports import free_port
from aligner.workers.dispatch import DISPATCH_MODES, concat_results, dispatched_methods, is_concurrent, split_batch
from aligner.workers.placement import Placement, RolePlacement, RoleRequest, create_placement, threads_per_worker

# the driver declares a hang this long after the worker's own watchdog fired, so its stacks are written
HANG_GRACE_S = 5.0


# ---- the actor shell ---------------------------------------------------------------
def _loopback_ifname() -> str:
    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            return name
    return "lo"


class WorkerShell:
    """Hosts one rank of a role in a Ray actor: env, threads, process groups, the worker object.

    Ray-free itself (the group wraps it with ``ray.remote``); every method returns plain data.
    """

    def __init__(self, role: str, rank: int) -> None:
        self.role, self.rank = role, rank
        self.worker: Any = None
        self.dims: Optional[ParallelDims] = None
        self.num_threads = 0
        self.hang_timeout_s = 0.0
        self.stack_file: Optional[Any] = None  # where faulthandler writes the stacks of a call past hang_timeout_s
        self.busy_s = 0.0  # seconds spent in calls since the last take_busy()

    def node_id(self) -> str:
        """The Ray node id this worker runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def rendezvous_address(self, loopback: bool) -> tuple[str, int]:
        """An address and a port that was free on this node (rank 0 hosts the rendezvous;
        :func:`aligner.runtime.ports.free_port`).

        loopback: True when the whole group is on this node: 127.0.0.1 instead of the node IP.
        """
        import ray

        ip = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        return ip, free_port(ip)  # below the ephemeral range: no connection takes it before setup binds it

    def setup(
        self, env: dict[str, str], sizes: tuple[int, ...], backend: str, num_threads: int, worker_cls: type, packed: tuple[tuple, dict]
    ) -> None:
        """Set the env, torch threads and process groups, then build the worker.

        The worker class gets ``dims=`` (this rank's ParallelDims) when its constructor
        has a ``dims`` parameter. Exceptions come back as WorkerError.
        """
        args, kwargs = packed
        try:
            os.environ.update(env)
            if num_threads > 0:
                import torch

                os.environ["OMP_NUM_THREADS"] = str(num_threads)
                torch.set_num_threads(num_threads)
                self.num_threads = num_threads
            tp, pp, dp, ep, cp = sizes
            self.dims = ParallelDims.from_env(tp_size=tp, pp_size=pp, dp_size=dp, ep_size=ep, cp_size=cp, backend=backend)
            if "dims" in inspect.signature(worker_cls).parameters:
                kwargs = {**kwargs, "dims": self.dims}
            self.worker = worker_cls(*args, **kwargs)
        except Exception:
            raise WorkerError(
                self.role, self.rank, traceback.format_exc(), f"{getattr(worker_cls, '__name__', worker_cls)}.__init__"
            ) from None

    def set_threads(self, num_threads: int) -> int:
        """Set this CPU worker's torch intra-op threads (OpenMP) to `num_threads` (> 0); returns it.

        A phase that runs one role alone gives its workers the node's cores, and gives them back
        when other roles run beside it (:func:`share_node_cores`).
        """
        import torch

        if num_threads < 1:
            raise ValueError(f"num_threads={num_threads} is invalid: must be >= 1")
        torch.set_num_threads(num_threads)
        self.num_threads = num_threads
        return num_threads

    def watch_hangs(self, hang_timeout_s: float) -> str:
        """Arm the hang watchdog: a call without progress (:mod:`aligner.runtime.progress`) for
        `hang_timeout_s` seconds (> 0) writes the Python stack of every thread of this process to a file
        (faulthandler), and the process exits; returns the file's path."""
        import faulthandler
        import tempfile

        self.hang_timeout_s = float(hang_timeout_s)
        if self.stack_file is None:
            path = os.path.join(tempfile.gettempdir(), f"aligner-stacks-{self.role}-{self.rank}-{os.getpid()}.txt")
            self.stack_file = open(path, "w")  # noqa: SIM115 (kept open: faulthandler writes to its descriptor)
        faulthandler.cancel_dump_traceback_later()
        return self.stack_file.name

    def call(self, method: str, packed: tuple[tuple, dict]) -> Any:
        """Run ``worker.method(*args, **kwargs)``; an exception comes back as WorkerError. With the hang
        watchdog armed, a call without a progress beat for hang_timeout_s dumps the stacks (the driver
        reads them) and ends the process."""
        import faulthandler

        args, kwargs = packed
        armed = self.hang_timeout_s > 0 and self.stack_file is not None
        if armed:
            self.stack_file.seek(0)
            self.stack_file.truncate()
            limit, stack_file = self.hang_timeout_s, self.stack_file

            def arm() -> None:  # (re)start the countdown: the stacks, then the process exits, `limit` s from now
                faulthandler.dump_traceback_later(limit, repeat=False, file=stack_file, exit=True)
                os.utime(stack_file.name)  # the beat's time, for a driver on this node (a stopped process beats no more)

            arm()
            progress.install(arm, every_s=min(5.0, limit / 10))
        t0 = time.perf_counter()
        try:
            return getattr(self.worker, method)(*args, **kwargs)
        except Exception as e:
            raise WorkerError(self.role, self.rank, traceback.format_exc(), method, disk_full_path(e) or "") from None
        finally:
            self.busy_s += time.perf_counter() - t0
            if armed:
                progress.uninstall()
                faulthandler.cancel_dump_traceback_later()

    def call_beside(self, method: str, packed: tuple[tuple, dict]) -> Any:
        """Run ``worker.method(*args, **kwargs)`` on the shell's side thread, beside a :meth:`call` in
        flight (a method marked ``dispatch(..., concurrent=True)``); neither armed by the hang watchdog
        nor counted in busy seconds (it overlaps the call that is). Exceptions come back as WorkerError."""
        args, kwargs = packed
        try:
            return getattr(self.worker, method)(*args, **kwargs)
        except Exception as e:
            raise WorkerError(self.role, self.rank, traceback.format_exc(), method, disk_full_path(e) or "") from None

    def take_busy(self) -> float:
        """Seconds this rank spent in calls since the last take_busy() (and start counting again)."""
        busy, self.busy_s = self.busy_s, 0.0
        return busy

    def info(self) -> dict[str, Any]:
        """pid, node IP, rank coordinates, env rendezvous and torch threads of this worker."""
        import ray

        d = self.dims
        return {
            "role": self.role,
            "rank": self.rank,
            "pid": os.getpid(),
            "node_ip": ray.util.get_node_ip_address(),
            "dp_rank": d.dp_rank if d else 0,
            "pp_rank": d.pp_rank if d else 0,
            "tp_rank": d.tp_rank if d else 0,
            "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
            "master": f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
            "num_threads": self.num_threads,
            "node_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1),
            "on_gpu": bool(os.environ.get("CUDA_VISIBLE_DEVICES")) and _cuda_available(),
        }


_REMOTE_SHELL: Any = None
_REMOTE_SHELL_BESIDE: Any = None
SIDE_GROUP = "beside"  # the Ray concurrency group (one thread) of calls marked dispatch(..., concurrent=True)


def _remote_shell(beside: bool = False) -> Any:
    """The Ray actor class of WorkerShell; beside=True: with a one-thread concurrency group for the
    worker's concurrent methods (:meth:`WorkerShell.call_beside`), its other calls one at a time as before."""
    global _REMOTE_SHELL, _REMOTE_SHELL_BESIDE
    import ray

    if beside:
        if _REMOTE_SHELL_BESIDE is None:
            _REMOTE_SHELL_BESIDE = ray.remote(max_restarts=0, max_task_retries=0, concurrency_groups={SIDE_GROUP: 1})(WorkerShell)
        return _REMOTE_SHELL_BESIDE
    if _REMOTE_SHELL is None:
        _REMOTE_SHELL = ray.remote(max_restarts=0, max_task_retries=0)(WorkerShell)
    return _REMOTE_SHELL


# ---- futures -------------------------------------------------------------------------
class GroupFuture:
    """The pending result of one call on a worker group.

    ``refs`` are the per-rank Ray ObjectRefs (ray.get-able); :meth:`get` waits on all of
    them, reports the first failure as WorkerError / WorkerDiedError (killing the group),
    and returns the call's collected result.
    """

    def __init__(self, group: WorkerGroup, method: str, refs: dict[int, Any], collect: Callable[[dict[int, Any]], Any]) -> None:
        self.group, self.method, self._collect = group, method, collect
        self.refs_by_rank = refs
        self.started = time.monotonic()  # the hang watchdog counts from the call

    @property
    def refs(self) -> list:
        return list(self.refs_by_rank.values())

    def done(self) -> bool:
        """True when every rank has finished (successfully or not)."""
        import ray

        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)

    def get(self, timeout_s: Optional[float] = None) -> Any:
        """Wait for every rank and return the collected result.

        Raises WorkerError (a worker raised), WorkerDiedError (a worker process died;
        reported within ``group.poll_s`` of Ray noticing), TimeoutError after `timeout_s`.
        """
        return self._collect(self.group._wait(self.refs_by_rank, self.method, timeout_s, self.started))


def get_all(futures: Iterable[GroupFuture], timeout_s: Optional[float] = None) -> list[Any]:
    """Results of several futures (of one or several groups), in order."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    out = []
    for f in futures:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        out.append(f.get(left))
    return out


def get_all_across_groups(futures: Iterable[GroupFuture], peer_timeout_s: float = 60.0) -> list[Any]:
    """Results of the futures of one collective that spans several groups (the weight sync of the split
    placement): every future is waited for, and when some fail a process death (WorkerDiedError) is
    raised before the errors it caused in its peers ("connection closed by peer" in a collective), so
    the automatic restart sees the death. peer_timeout_s bounds the wait for the others once one failed.
    Raises the death, else the first WorkerError; TimeoutError only when none failed."""
    out: list[Any] = []
    errors: list[WorkerError] = []
    for f in futures:
        try:
            out.append(f.get(peer_timeout_s if errors else None))
        except WorkerError as e:
            errors.append(e)
            out.append(None)
        except TimeoutError:
            if not errors:
                raise
            out.append(None)
    if errors:
        raise next((e for e in errors if isinstance(e, WorkerDiedError)), errors[0])
    return out


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# ---- the group -------------------------------------------------------------------------
class WorkerGroup:
    """world_size Ray actors of one role on a placement, each hosting `worker_cls`.

    Every method of `worker_cls` marked with :func:`dispatch` becomes a method of the group
    that takes the same arguments and returns a :class:`GroupFuture`.

    role: name used in errors (actor, critic, ...).
    worker_cls: a plain Python class; built in each actor after the process groups exist,
        with ``dims=`` when its constructor takes it, plus `args` / `kwargs`.
    placement: where the workers go (from :func:`aligner.workers.placement.create_placement`).
    parallel: the role's tp/pp/dp sizes; its world size must equal the placement's.
    num_threads: torch threads per CPU worker; 0 = the role's resources.cpus_per_worker.
    env: extra environment variables set in every worker before it is built.
    hang_timeout_s: > 0 arms the hang watchdog (``trainer.hang_timeout_s``): a call that makes no
        progress for this long on some rank raises WorkerHungError (a WorkerDiedError, so the automatic
        restart handles it) naming the role, rank and method, with the Python stack the worker wrote
        (faulthandler) when the driver can read it; 0 = off. Progress is a beat
        (:func:`aligner.runtime.progress.beat`: the engines' decode steps, the actor's micro-batches);
        a call whose loop does not beat counts from its start. For a worker on another node the driver
        cannot see the beats: there the worker's own watchdog ends a call without progress, and the
        driver also ends one that runs longer than the limit (as it does for a stopped process).
    Raises ValueError for mismatched sizes or a method name that clashes with the group's
    own attributes; WorkerError when a worker fails to build (the group is then shut down).
    """

    def __init__(
        self,
        role: str,
        worker_cls: type,
        placement: RolePlacement,
        parallel: ParallelConfig,
        *,
        args: tuple = (),
        kwargs: Optional[dict] = None,
        num_threads: int = 0,
        env: Optional[Mapping[str, str]] = None,
        setup_timeout_s: float = 300.0,
        poll_s: float = 0.2,
        hang_timeout_s: float = 0.0,
    ) -> None:
        if parallel.world_size != placement.world_size:
            raise ValueError(
                f"{role}.parallel tp_size={parallel.tp_size} x cp_size={getattr(parallel, 'cp_size', 1)} x pp_size={parallel.pp_size} "
                f"x dp_size={parallel.dp_size} = "
                f"{parallel.world_size}, but the placement of {placement.role!r} holds {placement.world_size} workers: make them equal"
            )
        self.role, self.worker_cls, self.placement, self.poll_s = role, worker_cls, placement, poll_s
        self.hang_timeout_s = hang_timeout_s
        self.stack_files: dict[int, str] = {}  # rank -> the file its hang watchdog writes (hang_timeout_s > 0)
        self.dims = ParallelDims(
            tp_size=parallel.tp_size,
            pp_size=parallel.pp_size,
            dp_size=parallel.dp_size,
            ep_size=getattr(parallel, "ep_size", 1),
            cp_size=getattr(parallel, "cp_size", 1),
            world_size=parallel.world_size,
        )
        self.world_size = parallel.world_size
        self.actors: list[Any] = []
        self.failure: Optional[WorkerError] = None
        self._closed = False
        self.methods = dispatched_methods(worker_cls)
        self._bind_methods()
        try:
            self._start(args, dict(kwargs or {}), num_threads, dict(env or {}), setup_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    @classmethod
    def create(
        cls,
        role: str,
        worker_cls: type,
        parallel: ParallelConfig,
        resources: ResourceConfig,
        *,
        placement_timeout_s: float = 60.0,
        **kw: Any,
    ) -> WorkerGroup:
        """A group on its own new placement group (split placement of one role).

        Raises PlacementError before any actor starts when the cluster lacks the resources.
        """
        placed = create_placement({role: RoleRequest.from_parts(role, parallel, resources)}, timeout_s=placement_timeout_s)
        try:
            return cls(role, worker_cls, placed.role(role), parallel, **kw)
        except BaseException:
            placed.remove()
            raise

    # ---- startup ---------------------------------------------------------------------
    def _bind_methods(self) -> None:
        for name, mode in self.methods.items():
            if hasattr(type(self), name) or name in self.__dict__:
                raise ValueError(f"{self.worker_cls.__name__}.{name} clashes with WorkerGroup.{name}: rename the worker method")

            def call(*args: Any, _name: str = name, _mode: str = mode, **kwargs: Any) -> GroupFuture:
                return self.execute(_name, *args, mode=_mode, **kwargs)

            call.__name__ = name
            call.__doc__ = f"[{mode}] {getattr(self.worker_cls, name).__doc__ or ''}"
            setattr(self, name, call)

    def _start(self, args: tuple, kwargs: dict, num_threads: int, env: dict, timeout_s: float) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        rp = self.placement
        shell = _remote_shell(beside=any(is_concurrent(self.worker_cls, m) for m in self.methods))
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=rp.placement_group,
                placement_group_bundle_index=rp.bundle_index(rank),
                placement_group_capture_child_tasks=True,
            )
            opts = dict(num_cpus=rp.num_cpus, num_gpus=rp.num_gpus, scheduling_strategy=strategy)
            if rp.num_gpus == 0:  # CPU workers reuse freed host memory from their first allocation
                opts["runtime_env"] = {"env_vars": dict(HOST_MALLOC_ENV)}
            self.actors.append(shell.options(**opts).remote(self.role, rank))
        nodes = self._wait({r: a.node_id.remote() for r, a in enumerate(self.actors)}, "node_id", timeout_s)
        one_node = len(set(nodes.values())) == 1
        ip, port = self._wait({0: self.actors[0].rendezvous_address.remote(one_node)}, "rendezvous_address", timeout_s)[0]
        on_gpu = rp.num_gpus > 0
        threads = 0 if on_gpu else threads_per_worker(num_threads, rp.request.cpus_per_worker)
        backend = "nccl" if on_gpu else "gloo"
        if one_node and "GLOO_SOCKET_IFNAME" not in env and "GLOO_SOCKET_IFNAME" not in os.environ:
            env["GLOO_SOCKET_IFNAME"] = _loopback_ifname()
        init_ref = ray.put((args, kwargs))
        sizes = (self.dims.tp_size, self.dims.pp_size, self.dims.dp_size, self.dims.ep_size, self.dims.cp_size)
        refs = {}
        for rank, actor in enumerate(self.actors):
            rank_env = {
                **env,
                "RANK": str(rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": "0" if on_gpu else str(rp.local_rank(rank)),
                "LOCAL_WORLD_SIZE": str(rp.request.workers_per_node),
                "MASTER_ADDR": ip,
                "MASTER_PORT": str(port),
            }
            refs[rank] = actor.setup.remote(rank_env, sizes, backend, threads, self.worker_cls, init_ref)
        self._wait(refs, "setup", timeout_s)
        if self.hang_timeout_s > 0:
            refs = {r: a.watch_hangs.remote(self.hang_timeout_s) for r, a in enumerate(self.actors)}
            self.stack_files = self._wait(refs, "watch_hangs", timeout_s)

    # ---- calls -----------------------------------------------------------------------
    def execute(self, method: str, *args: Any, mode: str = "broadcast", **kwargs: Any) -> GroupFuture:
        """Call `method` on the workers with dispatch `mode`; returns a GroupFuture.

        Raises ValueError for an unknown mode or method, or a dp_split call without a batch;
        RuntimeError when the group is shut down.
        """
        import ray

        self._check_open()
        if mode not in DISPATCH_MODES:
            raise ValueError(f"mode={mode!r} is invalid: valid modes are {', '.join(DISPATCH_MODES)}")
        if not callable(getattr(self.worker_cls, method, None)):
            raise ValueError(f"{self.worker_cls.__name__} has no method {method!r}")
        if mode == "rank0":
            ref = self.actors[0].call.remote(method, ray.put((args, kwargs)))
            return GroupFuture(self, method, {0: ref}, lambda res: res[0])
        if is_concurrent(self.worker_cls, method):  # beside the call in flight (broadcast)
            packed = ray.put((args, kwargs))
            refs = {r: a.call_beside.options(concurrency_group=SIDE_GROUP).remote(method, packed) for r, a in enumerate(self.actors)}
            return GroupFuture(self, method, refs, lambda res: [res[r] for r in range(self.world_size)])
        if mode == "broadcast":
            packed = ray.put((args, kwargs))
            refs = {r: a.call.remote(method, packed) for r, a in enumerate(self.actors)}
            return GroupFuture(self, method, refs, lambda res: [res[r] for r in range(self.world_size)])
        return self._dp_split(method, args, kwargs)

    def _dp_split(self, method: str, args: tuple, kwargs: dict) -> GroupFuture:
        import ray

        if not args:
            raise ValueError(f"{self.role}.{method} is dp_split: pass the batch as the first positional argument")
        d = self.dims
        chunks = split_batch(args[0], d.dp_size)
        packed = [ray.put(((chunk, *args[1:]), kwargs)) for chunk in chunks]
        refs = {r: a.call.remote(method, packed[d.coords(r)[0]]) for r, a in enumerate(self.actors)}
        collect_ranks = [d.rank_of(dp, d.pp_size - 1, 0) for dp in range(d.dp_size)]
        return GroupFuture(self, method, refs, lambda res: concat_results([res[r] for r in collect_ranks]))

    def worker_info(self, timeout_s: Optional[float] = 60.0) -> list[dict[str, Any]]:
        """Per-rank info (pid, node_ip, dp/pp/tp rank, local_rank, master, num_threads), by rank."""
        self._check_open()
        res = self._wait({r: a.info.remote() for r, a in enumerate(self.actors)}, "info", timeout_s)
        return [res[r] for r in range(self.world_size)]

    def busy_seconds(self, timeout_s: Optional[float] = 60.0) -> list[float]:
        """Per rank, the seconds spent in calls since the last busy_seconds() (wall time inside the
        worker's methods, waits in collectives included), by rank."""
        self._check_open()
        res = self._wait({r: a.take_busy.remote() for r, a in enumerate(self.actors)}, "take_busy", timeout_s)
        return [res[r] for r in range(self.world_size)]

    def set_threads(self, threads: Mapping[int, int], timeout_s: Optional[float] = 60.0) -> None:
        """Set the torch threads of the ranks in `threads` ({rank: threads >= 1}) and wait."""
        self._check_open()
        self._wait({r: self.actors[r].set_threads.remote(n) for r, n in threads.items()}, "set_threads", timeout_s)

    # ---- waiting and failure -----------------------------------------------------------
    def _wait(self, refs: dict[int, Any], method: str, timeout_s: Optional[float], started: Optional[float] = None) -> dict[int, Any]:
        import ray
        from ray.exceptions import RayError, RayTaskError

        pending = {ref: rank for rank, ref in refs.items()}
        results: dict[int, Any] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=self.poll_s)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except RayTaskError as e:
                    cause = getattr(e, "cause", None)
                    err = cause if isinstance(cause, WorkerError) else WorkerError(self.role, rank, str(e), method)
                    self._fail(WorkerError(err.role, err.rank, err.traceback_text, err.method, err.disk_full))
                except RayError as e:  # RayActorError and other system errors: the process is gone
                    if started is not None and self._watchdog_fired(rank):  # its hang watchdog ended it
                        self._fail(self._hung(rank, method))
                    self._fail(WorkerDiedError(self.role, rank, f"the worker process died or became unreachable: {e}", method))
            if pending and deadline is not None and time.monotonic() > deadline:
                ranks = sorted(pending.values())
                raise TimeoutError(f"{self.role}.{method}() did not finish within {timeout_s:g} s on rank(s) {ranks}")
            if pending and started is not None and self.hang_timeout_s > 0:
                if time.monotonic() - started > self.hang_timeout_s + HANG_GRACE_S:
                    hung = [r for r in sorted(pending.values()) if self._no_progress(r)]
                    if hung:
                        self._fail(self._hung(hung[0], method))
        return results

    def _watchdog_fired(self, rank: int) -> bool:
        """Whether `rank`'s hang watchdog wrote its stacks (faulthandler's "Timeout (H:MM:SS)!" header) in
        the call in flight; False where the file is not readable from here (a worker on another node)."""
        try:
            with open(self.stack_files.get(rank, "")) as f:
                return f.read(9) == "Timeout ("
        except OSError:
            return False

    def _no_progress(self, rank: int) -> bool:
        """Whether `rank` made no progress for hang_timeout_s (+ grace): its watchdog fired, or its last beat
        (the stack file's mtime, touched at the call's start and on each beat) is that old, as for a
        stopped process. Where the file is not readable from here (a worker on another node), the call's
        age decides, as the caller checked: True."""
        path = self.stack_files.get(rank, "")
        try:
            age = time.time() - os.stat(path).st_mtime
        except OSError:
            return True
        return self._watchdog_fired(rank) or age > self.hang_timeout_s + HANG_GRACE_S

    def _hung(self, rank: int, method: str) -> WorkerHungError:
        """The WorkerHungError of `rank` in `method`, with the stack its watchdog wrote when readable here."""
        stacks = ""
        path = self.stack_files.get(rank, "")
        try:
            with open(path) as f:
                stacks = f.read().strip()
        except OSError:
            pass
        where = f"\nits Python stacks (faulthandler):\n{stacks}" if stacks else f" (its stacks: {path or 'not written'}, on its node)"
        why = f"no progress in {method}() for {self.hang_timeout_s:g} s (trainer.hang_timeout_s): the worker is hung{where}"
        return WorkerHungError(self.role, rank, why, method)

    def _fail(self, err: WorkerError) -> None:
        self.failure = err
        self.shutdown()
        raise err

    @property
    def closed(self) -> bool:
        """True once the group is shut down (by :meth:`shutdown`, or after a worker failed)."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            why = f" after {self.failure.role} rank {self.failure.rank} failed" if self.failure else ""
            raise RuntimeError(f"worker group {self.role!r} is shut down{why}: build a new group")

    # ---- teardown --------------------------------------------------------------------
    def shutdown(self) -> None:
        """Kill every actor of the group and release its placement group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        import ray

        if ray.is_initialized():
            for actor in self.actors:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # already dead
                    pass
        self.actors = []
        self.placement.release()
        for path in self.stack_files.values():  # the hang watchdog's files (removable here when on this node)
            try:
                os.remove(path)
            except OSError:
                pass

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def role_worker_group(cfg: Any, role: str, worker_cls: type, placement: Placement, **kw: Any) -> WorkerGroup:
    """The worker group of `role` from an AlignerConfig `cfg`.

    Uses ``cfg.<role>.parallel``, the role's share of `placement`, and torch threads per CPU
    worker from ``cfg.trainer.num_threads`` (0 = ``cfg.<role>.resources.cpus_per_worker``), the hang
    watchdog from ``cfg.trainer.hang_timeout_s``. Other keywords go to :class:`WorkerGroup`. Raises as WorkerGroup and ``cfg.role``.
    """
    kw.setdefault("num_threads", cfg.trainer.num_threads)
    kw.setdefault("hang_timeout_s", cfg.trainer.hang_timeout_s)
    return WorkerGroup(role, worker_cls, placement.role(role), cfg.role(role).parallel, **kw)


def start_groups(makers: Mapping[str, Callable[[], WorkerGroup]]) -> dict[str, WorkerGroup]:
    """Build several worker groups at once: role -> maker (a callable returning the started group), each in
    its own thread, so that their processes start and set up side by side instead of one group after the
    other. Returns role -> group in the order of `makers`. When a maker raises, the groups that did start
    are shut down and the exception of the first failing role (in that order) is raised."""
    if len(makers) <= 1:
        return {role: make() for role, make in makers.items()}
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(makers), thread_name_prefix="start_groups") as pool:
        futures = {role: pool.submit(make) for role, make in makers.items()}
    errors = [f.exception() for f in futures.values() if f.exception() is not None]
    if errors:
        for f in futures.values():
            if f.exception() is None:
                f.result().shutdown()
        raise errors[0]
    return {role: f.result() for role, f in futures.items()}


STRAGGLER_MIN_S = 1.0  # a straggler line only for a rank busy at least this long in the step


def rank_busy_metrics(groups: Mapping[str, Any], factor: float, log_fn: Optional[Callable[[str], None]] = None) -> dict[str, float]:
    """Per-rank busy seconds of each WorkerGroup since the last call (:meth:`WorkerGroup.busy_seconds`) as
    metrics ``ranks/<role>/busy_s_min``, ``_median``, ``_max`` and ``ranks/<role>/slowest_rank``; with
    `factor` > 0, `log_fn` gets one straggler line for each group whose slowest rank was busy at least
    ``STRAGGLER_MIN_S`` and more than `factor` times the group's median (role, rank, pid, host, seconds).
    Busy time is wall time inside the workers' methods, so a rank that waits in a collective for a slow
    peer counts as busy too: the line finds ranks that work alone (engine replicas, dp shards without a
    collective in the call) being slow, not the slow peer of a collective. Groups that are shut down
    are skipped."""
    out: dict[str, float] = {}
    for role, g in groups.items():
        if not isinstance(g, WorkerGroup) or g.closed:
            continue
        busy = g.busy_seconds()
        ordered = sorted(busy)
        median = ordered[len(ordered) // 2] if len(ordered) % 2 else 0.5 * (ordered[len(ordered) // 2 - 1] + ordered[len(ordered) // 2])
        slowest = max(range(len(busy)), key=busy.__getitem__)
        out.update(
            {
                f"ranks/{role}/busy_s_min": ordered[0],
                f"ranks/{role}/busy_s_median": median,
                f"ranks/{role}/busy_s_max": ordered[-1],
                f"ranks/{role}/slowest_rank": float(slowest),
            }
        )
        if factor > 0 and log_fn is not None and len(busy) > 1 and busy[slowest] >= STRAGGLER_MIN_S and busy[slowest] > factor * median:
            info = g.worker_info()[slowest]
            log_fn(
                f"straggler: {role} rank {slowest} (pid {info['pid']}, {info['node_ip']}) was busy {busy[slowest]:.2f} s, "
                f"{busy[slowest] / max(median, 1e-9):.1f}x its group's median {median:.2f} s (trainer.straggler_factor={factor:g})"
            )
    return out


def core_shares(info: Mapping[str, list[dict[str, Any]]], busy: Iterable[str]) -> dict[tuple[str, int], int]:
    """Torch threads per busy CPU worker: an equal share of its node's cores.

    info: role -> per-rank :meth:`WorkerGroup.worker_info` dicts (``rank``, ``node_ip``,
        ``node_cores``, ``on_gpu``). busy: the roles of the next phase (unknown roles ignored).
    Returns {(role, rank): max(1, node_cores // busy CPU workers on that node)}; GPU workers
    and idle roles are absent.
    """
    workers = [(role, i) for role in dict.fromkeys(busy) if role in info for i in info[role] if not i["on_gpu"]]
    per_node: dict[str, int] = {}
    for _, i in workers:
        per_node[i["node_ip"]] = per_node.get(i["node_ip"], 0) + 1
    return {(role, i["rank"]): max(1, i["node_cores"] // per_node[i["node_ip"]]) for role, i in workers}


class CoreSharing:
    """Torch threads that follow the work: the CPU workers busy in a phase share their node's cores.

    On a CPU node every worker starts with ``resources.cpus_per_worker`` threads (1 by
    default), so a phase that runs one role alone (generation, a GRPO actor update) would use
    one core of the node and leave the others idle. Before each phase the trainer names the
    groups it is about to call; each of their CPU workers gets ``node_cores // busy_on_node``
    threads (at least 1), where ``busy_on_node`` counts the busy workers on that node. GPU
    workers are left alone. Calls are made only for workers whose share changes.

    groups: role -> WorkerGroup. Queries every worker's node and core count once.
    """

    def __init__(self, groups: Mapping[str, WorkerGroup]) -> None:
        self.groups = dict(groups)
        self.info = {role: g.worker_info() for role, g in self.groups.items()}
        self.current = {(role, i["rank"]): i["num_threads"] for role, infos in self.info.items() for i in infos}

    def shares(self, busy: Iterable[str]) -> dict[tuple[str, int], int]:
        """{(role, rank): threads} for the CPU workers of the `busy` roles (:func:`core_shares`)."""
        return core_shares(self.info, busy)

    def phase(self, busy: Iterable[str]) -> dict[tuple[str, int], int]:
        """Apply :meth:`shares` for the `busy` roles; returns the workers whose threads changed."""
        changed = {k: n for k, n in self.shares(busy).items() if self.current.get(k) != n}
        by_role: dict[str, dict[int, int]] = {}
        for (role, rank), n in changed.items():
            by_role.setdefault(role, {})[rank] = n
        for role, threads in by_role.items():
            self.groups[role].set_threads(threads)
        self.current.update(changed)
        return changed
