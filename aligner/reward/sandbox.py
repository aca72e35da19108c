"""Sandboxed execution of candidate programs, and the code reward ``reward.rule=code_tests``.

Owns: :func:`run_program` (one Python program, one stdin, under :class:`SandboxLimits`, giving a
:class:`SandboxResult`), :func:`isolation` (what this host enforces), and the rule
:func:`code_tests_reward` with its row check :func:`check_rows`, registered in
:mod:`aligner.reward.rules`. Only the standard library is imported: this file is also the
launcher that the sandbox executes (``python -I -S sandbox.py CONFIG``).

The code reward of verl (``prime_code``, ``sandbox_fusion``), TRL/open-r1, AReaL and slime runs the
response's program on test inputs and compares what it prints with the expected output; here the
program runs on this host, as a child process:

    parent (the reward scorer)
      -> launcher, a new session (setsid): namespaces, mounts, rlimits, then drops to ``uid``
         -> init, pid 1 of the new pid namespace (reaps; its exit kills every process left in it)
            -> the program: ``python -I main.py`` with stdin, stdout and stderr on files

What is enforced, and where (:func:`isolation` reports it for this host, ``SandboxResult.enforced``
for one run):

- Always (any Linux): RLIMIT_CPU (``cpu_s`` seconds of CPU per process: SIGXCPU, then SIGKILL a
  second later), RLIMIT_AS (``memory_bytes`` of address space per process: an allocation past it
  fails, Python raises MemoryError), RLIMIT_FSIZE (``file_bytes``: no file, stdout and stderr
  included, grows past it; Python gets EFBIG), RLIMIT_NOFILE, RLIMIT_CORE 0, a wall-clock timeout
  (``wall_s``: the program's process group is killed with SIGKILL and reaped by the launcher), an
  environment of PATH, HOME, TMPDIR, LANG and one-thread settings only (the parent's variables,
  secrets included, are not passed), Python's isolated mode (``-I``: no PYTHON* variables, no
  user site, no script directory on sys.path).
- When the scorer runs as root (CAP_SYS_ADMIN): new network, mount, pid, IPC and UTS namespaces.
  Network: the new namespace has only a loopback device, down, so every connect (127.0.0.1
  included) fails with ENETUNREACH, and the host's abstract Unix sockets are out of reach. Files:
  every mount is remounted read-only in the sandbox's mount namespace (the host's mounts are
  untouched) and a fresh tmpfs of ``tmpfs_bytes`` is mounted on /tmp, holding the working
  directory (``/tmp/sandbox``, also HOME and TMPDIR): the only writable place, bounded in total,
  and the host's /tmp (Ray's sockets, other runs' files) is hidden. Processes: init mounts a new
  /proc for the pid namespace, so the host's processes, their command lines and environments are
  out of sight; the program is not pid 1 of its pid namespace, so all its descendants die with
  the namespace's init, those that left the process group (setsid) too. The program then runs as
  ``uid``/``gid`` (default 65534, ``nobody``) with no supplementary groups, which puts
  RLIMIT_NPROC (``max_processes``) in force (the kernel does not apply it to root): a fork bomb
  gets EAGAIN once the uid has that many processes and threads. It counts every process of
  ``uid`` on the host: concurrent sandboxes with the same ``uid`` share the budget (give each
  concurrent scorer its own ``uid``).
- Without root, where unprivileged user namespaces are allowed: new user, mount, network, pid and
  IPC namespaces, and the same files and processes as root: the host read-only (the kernel locks
  the read-only flag of mounts handed to a less privileged user namespace, so the program cannot
  undo it), a private /tmp holding the working directory, a new /proc (or, where the kernel
  refuses a proc mount in a user namespace, an empty read-only /proc), no network, descendants
  dying with init; the program keeps the scorer's uid, and RLIMIT_NPROC counts the processes of the
  new user namespace only. Where the user namespace's mounts fail, there is no filesystem isolation.
- Without root and without user namespaces: only the "Always" list, and RLIMIT_NPROC set to
  ``max_processes`` above the user's process count at launch. The network is open, the host is
  writable as the scorer's user, and a descendant that calls setsid() outlives the timeout.

Without filesystem isolation a run is refused (RuntimeError naming the cause and the fix) unless
``SandboxLimits.allow_unisolated`` is set (the code reward: ``ALIGNER_SANDBOX_UNISOLATED=1``); run
the scorer in a container there. The program's interpreter must be one its uid can execute inside
the sandbox (:func:`program_python`), else the run is refused the same way.

Not enforced anywhere: reading world-readable host files (the repository, the interpreter's
site-packages) and connecting to Unix sockets bound on the host filesystem outside /tmp whose
mode lets the program's user write them; system calls are not filtered (no seccomp filter).
Measured on the development machine (Linux 6.18, Python 3.11): as root, every item of the root
list; as an unprivileged user, every item of the user-namespace list (tests/reward/test_sandbox.py).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import re
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional, Sequence

# unshare(2) and mount(2) flags (linux/sched.h, linux/mount.h)
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
_KEEP_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
               "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}  # fmt: skip
SANDBOX_DIR = "/tmp/sandbox"  # the program's working directory inside the mount namespace


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run.

    cpu_s: CPU seconds per process (RLIMIT_CPU, whole seconds, >= 1): SIGXCPU at cpu_s, SIGKILL at
        cpu_s + 1. wall_s: wall-clock seconds for the whole run (launch included), then SIGKILL to
        the process group. memory_bytes: address space per process (RLIMIT_AS); the interpreter
        alone maps about 30 MB. file_bytes: largest file the program may write (RLIMIT_FSIZE),
        stdout and stderr included, so also the most output kept. max_processes: processes and
        threads of ``uid`` (RLIMIT_NPROC; the launcher and init count too). max_open_files:
        RLIMIT_NOFILE. tmpfs_bytes: size of the private /tmp holding the working directory (mount
        namespace only). uid / gid: the unprivileged ids the program runs as when the scorer is
        root. python: the interpreter that runs the program; None: the first of this process's
        interpreter, its resolved path, /usr/bin/python3 and /usr/local/bin/python3 that the program's
        uid can execute inside the sandbox (:func:`program_python`, :func:`reach_problem`).
        allow_unisolated: run even where the host gives no filesystem isolation (no root and no user
        namespace, or the user namespace's mounts fail): the program can then write wherever the
        scorer's user can; False (the default): such a run is refused with RuntimeError.
        response_s: wall-clock seconds for all the tests of one response (:func:`pass_fraction`):
        each test gets ``min(wall_s, what is left)``, and a response that runs out scores 0.0.
    """

    cpu_s: int = 4
    wall_s: float = 10.0
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20
    max_processes: int = 32
    max_open_files: int = 128
    tmpfs_bytes: int = 64 << 20
    uid: int = 65534
    gid: int = 65534
    python: Optional[str] = None
    allow_unisolated: bool = False
    response_s: float = 30.0

    def __post_init__(self):
        for name in ("cpu_s", "memory_bytes", "file_bytes", "max_processes", "max_open_files", "tmpfs_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"SandboxLimits.{name}={v!r}: give a positive integer")
        if not self.response_s > 0:
            raise ValueError(f"SandboxLimits.response_s={self.response_s!r}: give a positive number of seconds")
        if not self.wall_s > 0:
            raise ValueError(f"SandboxLimits.wall_s={self.wall_s!r}: give a positive number of seconds")
        if self.max_processes < 3:
            raise ValueError(f"SandboxLimits.max_processes={self.max_processes}: the launcher and init count too, give at least 3")


@dataclasses.dataclass
class SandboxResult:
    """What one run did.

    stdout / stderr: the program's output, decoded as UTF-8 (bad bytes replaced), at most
    ``file_bytes`` each. returncode: the program's exit status, or -N when signal N ended it, None
    when it did not end by itself (wall timeout). killed_by: the limit the run hit, one of "cpu"
    (SIGXCPU/SIGKILL at the CPU limit), "wall" (the timeout), "memory" (MemoryError), "fsize"
    (EFBIG), "nproc" (fork/thread creation refused: EAGAIN), or None; the last three are read from
    the interpreter's final error line, so a program that catches them is judged on its output.
    wall_s: seconds from launch to the end of the run. cpu_s: CPU seconds of the program process
    (user + system, its children excluded; None when unknown). enforced: the isolation applied
    ("network", "pid", "filesystem", "uid", "nproc"; see :func:`isolation`).
    """

    stdout: str
    stderr: str
    returncode: Optional[int]
    killed_by: Optional[str]
    wall_s: float
    cpu_s: Optional[float]
    enforced: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """True when the program exited with status 0 and hit no limit."""
        return self.returncode == 0 and self.killed_by is None


HIDDEN_DIRS = ("/tmp",)  # replaced by the sandbox's private tmpfs: an interpreter under them is out of the program's reach


def _allows(st: os.stat_result, uid: int, gid: int, bit: int) -> bool:
    """Whether `uid` / `gid` (no supplementary groups, as the program runs) has permission `bit`
    (4 read, 2 write, 1 execute or search) on a file of status `st` (mode bits; ACLs are not read)."""
    if uid == 0:
        return bit != 1 or bool(st.st_mode & 0o111) or (st.st_mode & 0o170000) == 0o040000
    if st.st_uid == uid:
        return bool(st.st_mode & (bit << 6))
    if st.st_gid == gid:
        return bool(st.st_mode & (bit << 3))
    return bool(st.st_mode & bit)


def reach_problem(path: str, uid: int, gid: int, hidden: Sequence[str] = HIDDEN_DIRS, read_dirs: Sequence[str] = ()) -> str:
    """What stops `uid` / `gid` from executing `path` inside the sandbox ("" when nothing): a directory on
    its path or on its resolved path (symlinks followed) that the uid cannot enter, a file it cannot
    execute, a path under one of `hidden` (the sandbox mounts its own /tmp there), or one of `read_dirs`
    (the interpreter's standard library) it cannot list and enter. A static check of mode bits; the
    launcher checks again as the program's uid before it executes the interpreter."""
    for p in dict.fromkeys([os.path.abspath(path), os.path.realpath(path), *read_dirs, *map(os.path.realpath, read_dirs)]):
        for h in hidden:
            if p == h or p.startswith(h.rstrip("/") + "/"):
                return f"{p} is under {h}, which the sandbox replaces by its own empty {h}"
        d = "/"
        for comp in [c for c in p.split("/") if c][:-1]:
            d = os.path.join(d, comp)
            try:
                st = os.stat(d)
            except OSError as e:
                return f"{d}: {e.strerror}"
            if not _allows(st, uid, gid, 1):
                return f"uid {uid} cannot enter {d} (mode {st.st_mode & 0o777:o}, owner uid {st.st_uid})"
    for d in read_dirs:
        st = os.stat(d)
        if not (_allows(st, uid, gid, 1) and _allows(st, uid, gid, 4)):
            return f"uid {uid} cannot read {d} (mode {st.st_mode & 0o777:o}, owner uid {st.st_uid})"
    try:
        st = os.stat(path)
    except OSError as e:
        return f"{path}: {e.strerror}"
    if (st.st_mode & 0o170000) != 0o100000 or not _allows(st, uid, gid, 1):
        return f"uid {uid} cannot execute {os.path.realpath(path)} (mode {st.st_mode & 0o777:o})"
    return ""


def program_ids(limits: SandboxLimits) -> tuple[int, int]:
    """(uid, gid) the program runs as: ``limits.uid`` / ``limits.gid`` when the scorer is root, else the scorer's own."""
    return (limits.uid, limits.gid) if os.geteuid() == 0 else (os.getuid(), os.getgid())


def program_python(limits: SandboxLimits) -> str:
    """The interpreter the program runs with, one the program's uid (:func:`program_ids`) can execute
    inside the sandbox (:func:`reach_problem`): ``limits.python`` when set; else the first that passes
    of this process's interpreter (with its standard library readable), its resolved path, and
    /usr/bin/python3, /usr/local/bin/python3 (the standard library only then: the scorer's
    site-packages are not on the program's path). RuntimeError, one line naming the path, what
    blocks it and the fix, when none passes."""
    uid, gid = program_ids(limits)
    if limits.python:
        problem = reach_problem(limits.python, uid, gid, hidden=())
        if problem:
            raise RuntimeError(
                f"sandbox: the interpreter SandboxLimits.python={limits.python} cannot run as the program's uid {uid}: {problem}: "
                "give an interpreter outside private directories (e.g. /usr/bin/python3) or make its directories searchable (chmod o+x)"
            )
        return limits.python
    stdlib = os.path.dirname(os.__file__)
    tried = []
    for cand, reads in (
        (sys.executable, (stdlib,)),
        (os.path.realpath(sys.executable), (stdlib,)),
        ("/usr/bin/python3", ()),
        ("/usr/local/bin/python3", ()),
    ):
        if not cand or not os.path.exists(cand) or any(cand == t for t, _ in tried):
            continue
        problem = reach_problem(cand, uid, gid, read_dirs=reads)
        if not problem:
            return cand
        tried.append((cand, problem))
    raise RuntimeError(
        f"sandbox: no Python interpreter that the program's uid {uid} can execute inside the sandbox ("
        + "; ".join(f"{c}: {p}" for c, p in tried)
        + "): install a system python3 (/usr/bin/python3), or set SandboxLimits.python to one outside private and /tmp directories"
    )


_ERROR_LABELS = (
    (re.compile(r"^MemoryError\b"), "memory"),
    (re.compile(r"\[Errno 27\]"), "fsize"),  # EFBIG: File too large
    (re.compile(r"\[Errno 11\]|can't start new thread"), "nproc"),  # EAGAIN from fork/clone
)


def _label(status: Optional[int], cpu_s: Optional[float], limits: SandboxLimits, stderr: str) -> Optional[str]:
    if status is None:
        return None
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s is not None and cpu_s >= limits.cpu_s):
            return "cpu"
        if sig == signal.SIGXFSZ:
            return "fsize"
        return None
    if os.WEXITSTATUS(status) == 0:
        return None
    last = next((ln for ln in reversed(stderr.splitlines()) if ln.strip()), "")
    return next((name for pat, name in _ERROR_LABELS if pat.search(last)), None)


def _wait(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait until `proc` exits, without reaping it (so its process-group id stays ours); False on timeout."""
    deadline = time.monotonic() + timeout
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        fd = None
    try:
        while True:
            left = deadline - time.monotonic()
            if fd is not None:
                select.select([fd], [], [], max(left, 0))
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
            if left <= 0:
                return False
            if fd is None:
                time.sleep(min(0.005, max(left, 0)))
    finally:
        if fd is not None:
            os.close(fd)


def _drain(fd: int) -> bytes:
    """Everything buffered in the non-blocking pipe `fd` (its writers have exited), then close it."""
    out = b""
    try:
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            out += chunk
    except BlockingIOError:
        pass
    finally:
        os.close(fd)
    return out


def _read(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


_NO_MOUNT = False  # set once the mounts of a user namespace failed here (then only allow_unisolated runs go on)


def run_program(source: str, stdin: str = "", limits: Optional[SandboxLimits] = None) -> SandboxResult:
    """Run the Python program `source` on `stdin` in the sandbox (module docstring) and return what it did.

    A program that loops, forks or allocates without bound is stopped by its limit and reported in
    ``killed_by``; nothing the program does raises here. Raises RuntimeError (one line) when the
    sandbox itself cannot be set up: no interpreter the program's uid can run
    (:func:`program_python`), no filesystem isolation on this host and ``limits.allow_unisolated``
    false, or the mounts fail: an error of the host, not of the program.
    """
    global _NO_MOUNT
    limits = limits or SandboxLimits()
    res = _run_once(source, stdin, limits)
    if res is None:  # a user namespace's mounts failed and the caller allows a run without them
        _NO_MOUNT = True
        res = _run_once(source, stdin, limits)
    assert res is not None
    return res


def _run_once(source: str, stdin: str, limits: SandboxLimits) -> Optional[SandboxResult]:
    host = tempfile.mkdtemp(prefix="aligner-sandbox-")
    try:
        work = os.path.join(host, "work")
        os.mkdir(work, 0o700)
        with open(os.path.join(host, "main.py"), "w", encoding="utf-8") as f:
            f.write(source)
        with open(os.path.join(host, "stdin"), "w", encoding="utf-8") as f:
            f.write(stdin)
        cfg = dataclasses.asdict(limits)
        cfg.update(host=host, work=work, python=program_python(limits), no_mount=_NO_MOUNT, require_fs=not limits.allow_unisolated)
        r, w = os.pipe()  # the launcher's and init's reports: "enforced ...", "exit STATUS CPU_S", "error ..."
        os.set_blocking(r, False)
        t0 = time.monotonic()
        with (
            open(os.path.join(host, "stdin"), "rb") as fin,
            open(os.path.join(host, "stdout"), "wb") as fout,
            open(os.path.join(host, "stderr"), "wb") as ferr,
        ):
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", os.path.abspath(__file__), json.dumps(cfg), str(w)],
                    stdin=fin,
                    stdout=fout,
                    stderr=ferr,
                    pass_fds=(w,),
                    start_new_session=True,
                    cwd=host,
                    env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                )
            except BaseException:
                os.close(r)
                raise
            finally:
                os.close(w)
            timed_out = not _wait(proc, limits.wall_s)
            if timed_out:  # the launcher kills the program's process group and reaps it
                try:
                    os.kill(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                _wait(proc, 2.0)
            try:  # the launcher's group, if it did not end; before reaping it, so the group id is still ours
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        wall = time.monotonic() - t0
        lines = _drain(r)
        report = [ln.split(" ", 1) for ln in lines.decode().splitlines() if ln]
        info = {k: v for k, v in (x if len(x) == 2 else (x[0], "") for x in report)}
        stderr = _read(os.path.join(host, "stderr"), limits.file_bytes)
        if "error" in info:
            raise RuntimeError(f"sandbox: the launcher could not set up the run: {info['error']}")
        if "retry" in info and not _NO_MOUNT:
            return None
        if "enforced" not in info and not timed_out:
            raise RuntimeError(f"sandbox: the launcher ended (status {proc.returncode}) before the program started: {stderr[-2000:]}")
        status = cpu = None
        if "exit" in info:
            st, c = info["exit"].split()
            status, cpu = int(st), float(c)
        killed = "wall" if timed_out else _label(status, cpu, limits, stderr)
        if status is None:
            code = None
        else:
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        return SandboxResult(
            stdout=_read(os.path.join(host, "stdout"), limits.file_bytes),
            stderr=stderr,
            returncode=code,
            killed_by=killed,
            wall_s=wall,
            cpu_s=cpu,
            enforced=tuple(info.get("enforced", "").split()),
        )
    finally:
        shutil.rmtree(host, ignore_errors=True)


_ISOLATION: Optional[tuple[str, ...]] = None


def isolation() -> tuple[str, ...]:
    """The isolation this host applies beyond rlimits and the timeout (cached): a subset of "network"
    (own network namespace), "pid" (own pid namespace), "filesystem" (read-only host, private
    /tmp), "uid" (runs as SandboxLimits.uid), "nproc" (RLIMIT_NPROC in force). Runs one program.
    RuntimeError as :func:`run_program` when the sandbox cannot run a program at all."""
    global _ISOLATION
    if _ISOLATION is None:
        res = run_program("print('ok')", "", SandboxLimits(cpu_s=5, wall_s=30.0, allow_unisolated=True))
        if res.stdout.strip() != "ok":
            raise RuntimeError(
                f"sandbox: a trivial program failed (status {res.returncode}, {res.killed_by or 'no limit hit'}): "
                f"{res.stderr.strip()[-2000:]}: set SandboxLimits.python to an interpreter that uid {SandboxLimits.uid} can run"
            )
        _ISOLATION = res.enforced
    return _ISOLATION


# --- the launcher: runs as `python -I -S sandbox.py CONFIG STATUS_FD`, standard library only ---


def _remount_read_only() -> None:
    """Every mount of this (new, private) mount namespace read-only, keeping its other per-mount flags."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open("/proc/self/mountinfo") as f:
        entries = [ln.split() for ln in f]
    for e in entries:
        target = e[4].encode().decode("unicode_escape").encode("latin-1")  # \040 etc. as in mountinfo
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for opt in e[5].split(","):
            flags |= _KEEP_FLAGS.get(opt, 0)
        if libc.mount(None, target, None, flags, None) != 0:
            err = ctypes.get_errno()
            if target == b"/" or not os.path.exists(target):  # the root must be; a hidden stacked mount may fail
                raise OSError(err, f"remount {target.decode()} read-only: {os.strerror(err)}")


def _owner(pid: str) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1


def _mount(libc, source: bytes, target: bytes, fstype: Optional[bytes], flags: int, data: Optional[bytes]) -> None:
    if libc.mount(source, target, fstype, flags, data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target.decode()}: {os.strerror(err)}")


def _isolate_files(libc, cfg: dict, root: bool) -> str:
    """In the launcher's new mount namespace: every mount read-only, a private tmpfs on /tmp holding the
    working directory (returned). As root, or as the owner of a new user namespace (the kernel keeps
    the read-only flag locked for the program there)."""
    _mount(libc, None, b"/", None, MS_REC | MS_PRIVATE, None)
    _remount_read_only()
    opts = f"size={cfg['tmpfs_bytes']},mode=1777".encode()
    _mount(libc, b"tmpfs", b"/tmp", b"tmpfs", MS_NOSUID | MS_NODEV, opts)
    os.mkdir(SANDBOX_DIR, 0o700)
    if root:
        os.chown(SANDBOX_DIR, cfg["uid"], cfg["gid"])
    return SANDBOX_DIR


def _fresh_proc(libc) -> None:
    """In init, pid 1 of the new pid namespace: a new /proc showing only the namespace's processes (the
    host's command lines and environments out of sight); where the kernel refuses a proc mount (a user
    namespace under a /proc with masked paths), an empty read-only tmpfs over /proc instead."""
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    if libc.mount(b"proc", b"/proc", b"proc", flags, None) != 0:
        _mount(libc, b"tmpfs", b"/proc", b"tmpfs", flags | MS_RDONLY, b"size=4k,mode=555")


def _launch(cfg: dict, status_fd: int) -> None:
    def say(key: str, value: str = "") -> None:
        os.write(status_fd, f"{key} {value}\n".encode())

    libc = ctypes.CDLL(None, use_errno=True)
    root = os.geteuid() == 0
    enforced: list[str] = []
    work = cfg["work"]
    no_fs = ""  # why there is no filesystem isolation, when there is none
    try:
        with open(os.path.join(cfg["host"], "main.py"), "rb") as f:
            source = f.read()
        if root:
            if libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS) == 0:
                enforced += ["network", "pid"]
                work = _isolate_files(libc, cfg, root)
                enforced.append("filesystem")
            else:
                no_fs = f"unshare: {os.strerror(ctypes.get_errno())}"
        else:
            uid, gid = os.getuid(), os.getgid()
            mount_ns = 0 if cfg["no_mount"] else CLONE_NEWNS
            if libc.unshare(CLONE_NEWUSER | mount_ns | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC) == 0:
                for name, text in (("uid_map", f"{uid} {uid} 1"), ("setgroups", "deny"), ("gid_map", f"{gid} {gid} 1")):
                    with open(f"/proc/self/{name}", "w") as f:
                        f.write(text)
                enforced += ["network", "pid"]  # RLIMIT_NPROC then counts the processes of this user namespace
                if mount_ns:
                    try:
                        work = _isolate_files(libc, cfg, root)
                        enforced.append("filesystem")
                    except OSError as e:
                        if not cfg["require_fs"]:  # half-made mounts: the parent launches again without a mount namespace
                            say("retry", "no_mount")
                            os._exit(5)
                        no_fs = f"the mounts of a user namespace failed: {e}"
                else:
                    no_fs = "the mounts of a user namespace failed on an earlier run"
            else:  # RLIMIT_NPROC counts all the user's processes: leave room for those running now
                no_fs = f"no root, and no user namespace ({os.strerror(ctypes.get_errno())})"
                cfg["max_processes"] += sum(1 for p in os.listdir("/proc") if p.isdigit() and _owner(p) == uid)
        if cfg["require_fs"] and "filesystem" not in enforced:
            raise OSError(
                f"no filesystem isolation for the program on this host ({no_fs}): run the scorer as root, or where unprivileged "
                "user namespaces are allowed (sysctl kernel.unprivileged_userns_clone=1, a container), or opt in to running "
                "without it (SandboxLimits.allow_unisolated=True; ALIGNER_SANDBOX_UNISOLATED=1 for reward.rule=code_tests)"
            )
        main = os.path.join(work, "main.py")
        with open(main, "wb") as f:
            f.write(source)
        if root:
            os.chown(main, cfg["uid"], cfg["gid"])
        os.chdir(work)
        mem, fsize = cfg["memory_bytes"], cfg["file_bytes"]
        for lim, value in (
            (resource.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1)),
            (resource.RLIMIT_AS, (mem, mem)),
            (resource.RLIMIT_FSIZE, (fsize, fsize)),
            (resource.RLIMIT_NOFILE, (cfg["max_open_files"], cfg["max_open_files"])),
            (resource.RLIMIT_NPROC, (cfg["max_processes"], cfg["max_processes"])),
            (resource.RLIMIT_CORE, (0, 0)),
        ):
            hard = resource.getrlimit(lim)[1]  # an unprivileged launcher cannot raise a hard limit
            if hard != resource.RLIM_INFINITY and not root:
                value = (min(value[0], hard), min(value[1], hard))
            resource.setrlimit(lim, value)
    except (OSError, ValueError) as e:
        say("error", f"{e} (as uid {os.geteuid()})".replace("\n", " "))
        os._exit(3)
    env = {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # fmt: skip
    # the launcher reaps what its program leaves (a subreaper), so no zombie is left to the host's pid 1
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1)
    state = {"init": None, "reaped": False, "stop": False}

    def stop(signum, frame):  # the parent's wall timeout: kill the program's group (its namespace with init)
        state["stop"] = True
        if state["init"] is not None and not state["reaped"]:  # the group id is init's until init is reaped
            os.killpg(state["init"], signal.SIGKILL)

    signal.signal(signal.SIGTERM, stop)
    init = os.fork()
    if init == 0:  # pid 1 of the new pid namespace where there is one; leader of the program's group
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.setpgid(0, 0)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        try:  # inside the pid namespace: its own /proc; then the program's uid (which cannot mount)
            if "filesystem" in enforced and "pid" in enforced:
                _fresh_proc(libc)
                enforced.append("proc")
            if root:
                os.setgroups([])
                os.setgid(cfg["gid"])
                os.setuid(cfg["uid"])
                enforced.append("uid")
            if os.geteuid() != 0:
                enforced.append("nproc")
        except OSError as e:
            say("error", f"{e} (as uid {os.geteuid()})".replace("\n", " "))
            os._exit(3)
        say("enforced", " ".join(enforced))
        prog = os.fork()
        if prog == 0:
            if not os.access(cfg["python"], os.X_OK):  # as the program's uid, in the sandbox's view of the files
                say("error", f"uid {os.getuid()} cannot execute {cfg['python']} inside the sandbox: set SandboxLimits.python "
                             "to an interpreter outside private and /tmp directories (e.g. /usr/bin/python3)")  # fmt: skip
                os._exit(127)
            os.close(status_fd)
            for sig in (signal.SIGPIPE, signal.SIGXFSZ):
                signal.signal(sig, signal.SIG_DFL)
            try:
                os.execve(cfg["python"], [cfg["python"], "-I", "main.py"], env)
            except OSError as e:
                os.write(2, f"sandbox: cannot execute {cfg['python']}: {e}\n".encode())
                os._exit(127)
        while True:  # reap every orphan; report the program's status
            try:
                pid, status, ru = os.wait4(-1, 0)
            except ChildProcessError:
                os._exit(0)
            if pid == prog:
                say("exit", f"{status} {ru.ru_utime + ru.ru_stime:.3f}")
                os._exit(0)
    try:
        os.setpgid(init, init)  # also here: the group must exist before a SIGTERM can name it
    except OSError:
        pass  # init already did it, or already exited (then waitid below returns at once)
    state["init"] = init
    if state["stop"]:
        stop(signal.SIGTERM, None)
    os.waitid(os.P_PID, init, os.WEXITED | os.WNOWAIT)
    os.killpg(init, signal.SIGKILL)  # what is left in the program's group (without a pid namespace)
    os.waitpid(init, 0)
    state["reaped"] = True
    deadline = time.monotonic() + 0.5  # reap the killed orphans handed to this subreaper
    while time.monotonic() < deadline:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.01)
        except ChildProcessError:
            break
    os._exit(0)


# --- the rule: reward.rule=code_tests ---

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)
CODE_LIMITS = SandboxLimits()  # the limits the rule runs each test under


def extract_code(response: str) -> str:
    """The program in `response`: the last fenced block tagged python/py/python3 or untagged
    (verl's prime_code and open-r1 take the last block too), else the whole response."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def _tests(metadata: dict, where: str = "metadata") -> tuple[list[str], list[str]]:
    """(inputs, outputs) of a row's ``tests`` field; ValueError naming the problem and the fix."""
    if "tests" not in metadata:
        raise ValueError(
            f"{where}: reward.rule=code_tests needs a 'tests' field: "
            '{"inputs": ["stdin of test 1", ...], "outputs": ["expected stdout of test 1", ...]}'
        )
    tests = metadata["tests"]
    if isinstance(tests, str):  # APPS / TACO store it as a JSON string
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: field 'tests' is a string but not JSON ({e}): give an object with 'inputs' and 'outputs'") from None
    if not isinstance(tests, dict) or not isinstance(tests.get("inputs"), list) or not isinstance(tests.get("outputs"), list):
        raise ValueError(f"{where}: field 'tests' must be an object with lists 'inputs' and 'outputs', got {str(tests)[:80]!r}")
    ins, outs = tests["inputs"], tests["outputs"]
    if not ins or len(ins) != len(outs):
        raise ValueError(
            f"{where}: field 'tests' has {len(ins)} inputs and {len(outs)} outputs: give one expected output per input (at least one)"
        )
    bad = next((x for x in ins + outs if not isinstance(x, str)), None)
    if bad is not None:
        raise ValueError(
            f"{where}: field 'tests' holds a {type(bad).__name__} ({str(bad)[:40]!r}): inputs and outputs are strings (stdin, stdout)"
        )
    return ins, outs


def same_output(got: str, expected: str) -> bool:
    """Output comparison as in the APPS checker's first test: lines equal after stripping trailing
    whitespace of each line and trailing blank lines."""

    def norm(s: str) -> list[str]:
        lines = [ln.rstrip() for ln in s.replace("\r\n", "\n").split("\n")]
        while lines and not lines[-1]:
            lines.pop()
        return lines

    return norm(got) == norm(expected)


def pass_fraction(source: str, inputs: Sequence[str], outputs: Sequence[str], limits: Optional[SandboxLimits] = None) -> float:
    """The fraction of tests (stdin -> expected stdout) that `source` passes, run one at a time in
    :func:`run_program`; a test passes when the program exits 0, hits no limit and prints the
    expected output (:func:`same_output`). A run that hits a limit scores the whole program 0.0 and
    stops the remaining tests (a looping program costs one ``wall_s``, not one per test), and all
    the tests together get ``limits.response_s`` seconds of wall clock (a program slow on every test
    costs one budget, not one ``wall_s`` per test)."""
    limits = limits or CODE_LIMITS
    passed, deadline = 0, time.monotonic() + limits.response_s
    for stdin, expected in zip(inputs, outputs):
        left = deadline - time.monotonic()
        if left <= 0:
            return 0.0
        res = run_program(source, stdin, limits if left >= limits.wall_s else dataclasses.replace(limits, wall_s=left))
        if res.killed_by is not None:
            return 0.0
        passed += res.ok and same_output(res.stdout, expected)
    return passed / len(inputs)


UNISOLATED_ENV = "ALIGNER_SANDBOX_UNISOLATED"  # "1": the code reward runs where the host gives no filesystem isolation


def code_limits() -> SandboxLimits:
    """The limits the rule runs each test under: :data:`CODE_LIMITS`, with ``allow_unisolated`` set when
    the environment variable ``ALIGNER_SANDBOX_UNISOLATED`` is "1" (the user's explicit opt-in; Ray's
    workers and ``serve_rm`` inherit it from the shell that starts them)."""
    if os.environ.get(UNISOLATED_ENV, "") == "1":
        return dataclasses.replace(CODE_LIMITS, allow_unisolated=True)
    return CODE_LIMITS


_checked = False


def preflight() -> tuple[str, ...]:
    """Check once per process, before any response is scored, that the code reward can run here: an
    interpreter the program's uid can execute (:func:`program_python`) and filesystem isolation, unless
    opted out (:func:`code_limits`). Returns :func:`isolation`; ValueError, one line naming the cause
    and the fix, otherwise. Warns once on the "aligner.reward" logger about any isolation missing."""
    global _checked
    limits = code_limits()
    try:
        program_python(limits)
        got = isolation()
    except RuntimeError as e:
        raise ValueError(f"reward.rule=code_tests: {e}") from None
    if "filesystem" not in got and not limits.allow_unisolated:
        raise ValueError(
            "reward.rule=code_tests: this host gives the candidate programs no filesystem isolation (enforced: "
            f"{', '.join(got) or 'rlimits only'}): run the scorer as root or where unprivileged user namespaces are allowed "
            f"(a container), or opt in to writable-host runs with {UNISOLATED_ENV}=1"
        )
    if not _checked:
        _checked = True
        missing = [x for x in ("network", "pid", "filesystem", "proc", "uid", "nproc") if x not in got]
        if missing:
            import logging

            logging.getLogger("aligner.reward").warning(
                "reward.rule=code_tests: this host does not enforce %s for the candidate programs "
                "(needs root or user namespaces; see aligner/reward/sandbox.py): run the scorer in a container",
                ", ".join(missing),
            )
    return got


def code_tests_reward(prompt: str, response: str, metadata: dict) -> float:
    """Rule "code_tests": the fraction of the row's tests the response's program passes, in [0, 1].

    metadata["tests"]: {"inputs": [str], "outputs": [str]} (stdin and expected stdout per test,
    the APPS / TACO / verl prime_code layout; a JSON string of it is accepted). The program is
    :func:`extract_code` of the response, run under :func:`code_limits` (all its tests within
    ``response_s``); 0.0 when any test hits a limit. ValueError for a row without valid tests
    (:func:`check_rows` finds these first) and, on the first call, when :func:`preflight` fails.
    """
    ins, outs = _tests(metadata)
    if not _checked:
        preflight()
    return pass_fraction(extract_code(response), ins, outs, code_limits())


def check_rows(examples: Sequence[dict]) -> None:
    """Each example's ({"metadata", "source"}) tests are valid; ValueError "file:line: ..." at the first
    bad one; then :func:`preflight` (ValueError when the code reward cannot run on this host)."""
    for e in examples:
        _tests(dict(e.get("metadata") or {}), str(e.get("source", "?")))
    preflight()


RULES: dict[str, Any] = {"code_tests": code_tests_reward}

if __name__ == "__main__":
    _launch(json.loads(sys.argv[1]), int(sys.argv[2]))
