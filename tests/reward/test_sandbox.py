"""Sandboxed code execution and the code reward (aligner.reward.sandbox, reward.rule=code_tests).

Hostile programs, each under tight limits (1 s of CPU, 2 s of wall clock, 8 processes): an
infinite loop, a sleeping loop, a fork bomb (also one whose children leave the process group), a
memory bomb, an oversized file, writes outside the working directory (the test's tmp_path, the
repository, /dev/shm), a socket to a listener the test opens on 127.0.0.1, the parent's secret
environment variable. Each is stopped by its limit or refused, scored 0, and the scorer returns.
The isolation tests skip, naming the reason, where the host does not provide it (no root and no
user namespaces); the limits that need nothing of the host are tested everywhere.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

if not sys.platform.startswith("linux"):
    pytest.skip("the sandbox uses Linux namespaces and rlimits", allow_module_level=True)

from aligner.reward import sandbox as S  # noqa: E402
from aligner.reward.rules import RULES, check_rule_rows, score  # noqa: E402
from tests.toolkit.paths import REPO  # noqa: E402

TIGHT = S.SandboxLimits(cpu_s=1, wall_s=2.0, memory_bytes=256 << 20, file_bytes=1 << 20, max_processes=8)
MARGIN_S = 2.5  # launch, kill and reap on a loaded 2-core machine
ROOMY = dataclasses.replace(TIGHT, wall_s=30.0)  # where the wall limit is not the point: a busy machine starts slowly

ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
TESTS = {"inputs": ["1 2\n", "10 20\n", "-5 5\n"], "outputs": ["3\n", "30", "0\n\n"]}


def need(feature: str) -> None:
    got = S.isolation()
    if feature not in got:
        pytest.skip(f"this host does not enforce {feature!r} (enforced: {', '.join(got) or 'rlimits only'}): needs root or user namespaces")


def procs_of(uid: int) -> int:
    n = 0
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                n += os.stat(f"/proc/{p}").st_uid == uid
            except OSError:
                pass
    return n


def sandbox_uid() -> int:
    return TIGHT.uid if os.geteuid() == 0 else os.geteuid()


# --- correct and wrong programs ---


def test_correct_program_passes_every_test():
    res = S.run_program(ADD, "2 40\n", ROOMY)
    assert res.ok and res.stdout == "42\n" and res.killed_by is None
    assert S.pass_fraction(ADD, TESTS["inputs"], TESTS["outputs"], ROOMY) == 1.0


def test_wrong_program_scores_the_fraction_it_passes():
    wrong = "a, b = map(int, input().split())\nprint(a + b if a > 0 else 99)\n"  # fails only the -5 5 test
    assert S.pass_fraction(wrong, TESTS["inputs"], TESTS["outputs"], ROOMY) == pytest.approx(2 / 3)
    assert S.pass_fraction("print(7)", TESTS["inputs"], TESTS["outputs"], ROOMY) == 0.0
    crash = S.run_program("raise SystemExit(3)", "", ROOMY)
    assert crash.returncode == 3 and not crash.ok and crash.killed_by is None


def test_rule_extracts_the_last_python_block_and_scores_the_row():
    resp = f"First try:\n```python\nprint(0)\n```\nFixed:\n```python\n{ADD}```\nDone."
    assert S.extract_code(resp) == ADD
    assert S.extract_code("print(1)") == "print(1)"  # no fence: the whole response
    assert "code_tests" in RULES
    scores = score("code_tests", ["p", "p"], [resp, "```python\nprint(3)\n```"], [{"tests": TESTS}, {"tests": TESTS}])
    assert scores.tolist() == pytest.approx([1.0, 1 / 3])


def test_output_comparison_ignores_trailing_whitespace_only():
    assert S.same_output("3 \n\n", "3") and S.same_output("a\r\nb\n", "a\nb")
    assert not S.same_output("3", "03") and not S.same_output("1 2", "1  2") and not S.same_output("", "0")


# --- hostile programs: stopped by their limit, scored 0, and the scorer goes on ---


def test_infinite_loop_is_killed_at_the_cpu_limit():
    # the wall limit far above the CPU limit: on a busy machine the loop gets less than one core
    res = S.run_program("while True:\n    pass\n", "", ROOMY)
    assert res.killed_by == "cpu" and res.returncode in (-signal.SIGXCPU, -signal.SIGKILL)
    assert 0.9 * TIGHT.cpu_s <= res.cpu_s <= TIGHT.cpu_s + 1.5 and res.wall_s < ROOMY.wall_s  # CPU time is counted in ticks
    assert S.pass_fraction("while True:\n    pass\n", TESTS["inputs"], TESTS["outputs"], TIGHT) == 0.0


def test_sleeping_program_is_killed_at_the_wall_limit_and_stops_the_remaining_tests():
    t0 = time.monotonic()
    assert S.pass_fraction("import time\ntime.sleep(60)\n", TESTS["inputs"], TESTS["outputs"], TIGHT) == 0.0
    assert time.monotonic() - t0 < TIGHT.wall_s + MARGIN_S  # one timeout, not one per test
    res = S.run_program("import time\nprint('started', flush=True)\ntime.sleep(60)\n", "", TIGHT)
    assert res.killed_by == "wall" and res.returncode is None and res.stdout == "started\n"
    assert TIGHT.wall_s <= res.wall_s < TIGHT.wall_s + MARGIN_S


def test_memory_bomb_is_refused_at_the_memory_limit():
    res = S.run_program("chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n", "", ROOMY)
    assert res.killed_by == "memory" and res.returncode != 0, res.stderr[-300:]
    res = S.run_program("x = bytearray(1 << 30)\n", "", ROOMY)  # 1 GiB at once, over 256 MiB
    assert res.killed_by == "memory"


def test_oversized_file_and_output_are_cut_at_the_file_size_limit():
    res = S.run_program("open('big', 'wb').write(b'0' * (4 << 20))\n", "", ROOMY)
    assert res.killed_by == "fsize" and "File too large" in res.stderr
    res = S.run_program("import sys\nwhile True:\n    sys.stdout.write('y' * 65536)\n", "", ROOMY)
    assert res.killed_by == "fsize" and len(res.stdout) <= TIGHT.file_bytes


def test_fork_bomb_is_contained_and_leaves_no_process():
    need("nproc")
    uid = sandbox_uid()
    before = procs_of(uid)
    bomb = "import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.05)\n"
    res = S.run_program(bomb, "", TIGHT)
    assert res.killed_by == "wall"
    assert procs_of(uid) <= before  # every process of the bomb is gone (and reaped: no zombie)
    # a bomb whose children leave the process group (setsid), outliving the program
    escape = "import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n        os.setsid()\n        time.sleep(30)\n"
    res = S.run_program(escape, "", TIGHT)
    assert res.returncode == 0
    time.sleep(0.2)
    if "pid" in S.isolation():
        assert procs_of(uid) <= before
    # an uncaught fork failure is labelled
    res = S.run_program("import os\nwhile True:\n    if os.fork() == 0:\n        import time; time.sleep(5)\n", "", TIGHT)
    assert res.killed_by in ("nproc", "wall")


def test_writes_outside_the_working_directory_fail(tmp_path):
    need("filesystem")
    outside = tmp_path / "outside.txt"
    in_repo = REPO / "sandbox_escape.txt"
    prog = (
        "import os\n"
        "print(sorted(os.listdir('/tmp')))\n"
        "ok = []\n"
        f"for p in [{str(outside)!r}, {str(in_repo)!r}, '/dev/shm/sandbox_escape', '/var/tmp/sandbox_escape']:\n"
        "    try:\n"
        "        os.makedirs(os.path.dirname(p), exist_ok=True)\n"
        "        open(p, 'w').write('x')\n"
        "        ok.append(p)\n"
        "    except OSError as e:\n"
        "        print(p, 'refused', e.errno)\n"
        "open('inside.txt', 'w').write('fine')\n"
        "print(open('inside.txt').read(), os.getcwd())\n"
    )
    res = S.run_program(prog, "", ROOMY)
    assert res.ok, res.stderr
    listing, *refused, last = res.stdout.splitlines()
    assert "/var/tmp/sandbox_escape refused 30" in refused  # EROFS: the host's mounts are read-only in the sandbox
    assert "/dev/shm/sandbox_escape refused 30" in refused
    if not str(REPO).startswith("/tmp/"):  # a clone under /tmp is hidden by the private /tmp, not refused
        assert f"{in_repo} refused 30" in refused
    assert listing == "['sandbox']"  # the host's /tmp (this test's tmp_path included) is hidden
    assert last.split() == ["fine", S.SANDBOX_DIR]  # its own directory is writable
    # written nowhere on the host: tmp_path's file went to the private /tmp, the rest was refused
    assert not outside.exists() and not in_repo.exists()
    assert not Path("/dev/shm/sandbox_escape").exists() and not Path("/var/tmp/sandbox_escape").exists()


def test_socket_to_a_local_listener_fails():
    need("network")
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.5)
    port = srv.getsockname()[1]
    try:
        prog = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\ns.sendall(b'leak')\nprint('connected')\n"
        res = S.run_program(prog, "", TIGHT)
        assert res.returncode != 0 and "connected" not in res.stdout
        assert "Network is unreachable" in res.stderr, res.stderr[-300:]
        with pytest.raises(socket.timeout):
            srv.accept()
    finally:
        srv.close()


def test_parent_secret_is_not_visible(monkeypatch):
    monkeypatch.setenv("ALIGNER_TEST_SECRET", "hunter2")
    prog = (
        "import os\n"
        "print(sorted(os.environ))\n"
        "try:\n"
        f"    print(open('/proc/{os.getpid()}/environ', 'rb').read())\n"
        "except OSError as e:\n"
        "    print('denied', e.errno)\n"
    )
    res = S.run_program(prog, "", ROOMY)
    assert res.ok, res.stderr
    assert "hunter2" not in res.stdout and "ALIGNER_TEST_SECRET" not in res.stdout
    assert "PYTHONPATH" not in res.stdout


def test_rule_goes_on_after_every_kind_of_kill(monkeypatch):
    hostile = [
        "while True: pass",
        "import time; time.sleep(60)",
        "a = []\nwhile True: a.append(bytearray(16 << 20))",
        "import os, time\nwhile True:\n    try: os.fork()\n    except OSError: time.sleep(0.05)",
    ]
    monkeypatch.setattr(S, "CODE_LIMITS", TIGHT)
    resp = [f"```python\n{src}\n```" for src in hostile] + [f"```python\n{ADD}```"]
    scores = score("code_tests", ["p"] * len(resp), resp, [{"tests": TESTS}] * len(resp))
    assert scores.tolist() == [0.0, 0.0, 0.0, 0.0, 1.0]


# --- rows and limits refused before anything runs ---


@pytest.mark.parametrize(
    "meta, fragment",
    [
        ({}, "needs a 'tests' field"),
        ({"tests": "{not json"}, "not JSON"),
        ({"tests": {"inputs": ["1"]}}, "lists 'inputs' and 'outputs'"),
        ({"tests": {"inputs": ["1", "2"], "outputs": ["1"]}}, "2 inputs and 1 outputs"),
        ({"tests": {"inputs": [], "outputs": []}}, "at least one"),
        ({"tests": {"inputs": [1], "outputs": ["1"]}}, "holds a int"),
    ],
)
def test_bad_rows_are_refused_with_their_source(meta, fragment):
    with pytest.raises(ValueError, match="data.jsonl:7: .*" + fragment.replace("(", r"\(")):
        check_rule_rows(
            "code_tests", [{"metadata": {"tests": TESTS}, "source": "data.jsonl:6"}, {"metadata": meta, "source": "data.jsonl:7"}]
        )


def test_tests_as_a_json_string_are_accepted():
    import json

    check_rule_rows("code_tests", [{"metadata": {"tests": json.dumps(TESTS)}, "source": "a:1"}])
    assert S.code_tests_reward("p", f"```python\n{ADD}```", {"tests": json.dumps(TESTS)}) == 1.0


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="cpu_s=0"):
        S.SandboxLimits(cpu_s=0)
    with pytest.raises(ValueError, match="wall_s"):
        S.SandboxLimits(wall_s=0)
    with pytest.raises(ValueError, match="max_processes=2"):
        S.SandboxLimits(max_processes=2)


def public_copy_of_the_sandbox() -> str:
    """A directory every uid can enter holding a copy of sandbox.py: the clone's own directory may be
    private (a checkout under ``mktemp -d`` or a 0700 home), which another uid cannot read."""
    d = tempfile.mkdtemp(prefix="aligner-sandbox-src-", dir="/tmp")
    os.chmod(d, 0o755)
    shutil.copy(S.__file__, os.path.join(d, "sandbox.py"))
    os.chmod(os.path.join(d, "sandbox.py"), 0o644)
    return d


# --- the interpreter: one the program's uid can run, or a one-line refusal ---


def private_python(tmp_path: Path, kind: str) -> Path:
    """An interpreter inside a directory only its owner (root) can enter, as a venv in a 0700 home or a
    clone under ``mktemp -d`` is: a symlink to /usr/bin/python3 (a venv's bin/python) or a copy."""
    home = tmp_path / "private-home"
    home.mkdir(mode=0o700)
    os.chmod(home, 0o700)
    py = home / "python3"
    if kind == "symlink":
        py.symlink_to(os.path.realpath("/usr/bin/python3"))
    else:
        shutil.copy2(os.path.realpath("/usr/bin/python3"), py)
    return py


@pytest.mark.parametrize("kind", ["symlink", "copy"])
def test_interpreter_in_a_private_directory_is_replaced_by_one_the_program_can_run(tmp_path, monkeypatch, kind):
    if os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("needs root (the program then runs as another uid) and /usr/bin/python3")
    py = private_python(tmp_path, kind)
    monkeypatch.setattr(sys, "executable", str(py))  # as if the scorer ran from a venv in a private directory
    chosen = S.program_python(TIGHT)
    assert chosen != str(py) and S.reach_problem(chosen, TIGHT.uid, TIGHT.gid) == ""
    assert "cannot enter" in S.reach_problem(str(py), TIGHT.uid, TIGHT.gid, hidden=())
    res = S.run_program(ADD, "2 40\n", ROOMY)
    assert res.ok and res.stdout == "42\n", res.stderr


def test_interpreter_the_program_cannot_run_is_refused_in_one_line(tmp_path):
    if os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("needs root (the program then runs as another uid) and /usr/bin/python3")
    py = private_python(tmp_path, "symlink")
    with pytest.raises(RuntimeError) as e:
        S.run_program(ADD, "1 1\n", dataclasses.replace(TIGHT, python=str(py)))
    msg = str(e.value)
    assert "\n" not in msg and str(py) in msg and "cannot enter" in msg and "chmod o+x" in msg
    # a path the static check cannot see through (hidden by the private /tmp): the launcher refuses it as the program's uid
    if "filesystem" in S.isolation():
        public = tempfile.mkdtemp(prefix="aligner-sandbox-py-", dir="/tmp")
        try:
            os.chmod(public, 0o755)
            hidden = os.path.join(public, "python3")
            os.symlink(os.path.realpath("/usr/bin/python3"), hidden)
            assert S.reach_problem(hidden, TIGHT.uid, TIGHT.gid, hidden=()) == ""  # reachable on the host, not in the sandbox
            with pytest.raises(RuntimeError, match=f"cannot execute {hidden} inside the sandbox"):
                S.run_program(ADD, "1 1\n", dataclasses.replace(ROOMY, python=hidden))
        finally:
            shutil.rmtree(public, ignore_errors=True)


def test_no_reachable_interpreter_is_refused_naming_each_candidate(tmp_path, monkeypatch):
    py = private_python(tmp_path, "copy")
    monkeypatch.setattr(sys, "executable", str(py))
    monkeypatch.setattr(S, "reach_problem", lambda path, uid, gid, hidden=S.HIDDEN_DIRS, read_dirs=(): f"blocked {path}")
    with pytest.raises(RuntimeError) as e:
        S.program_python(TIGHT)
    msg = str(e.value)
    assert "\n" not in msg and f"{py}: blocked {py}" in msg and "/usr/bin/python3" in msg and "SandboxLimits.python" in msg


UNPRIVILEGED_SCORER = """
import json, sys
sys.path.insert(0, sys.argv[1])
import sandbox as S
port, writable, secret_pid = int(sys.argv[2]), sys.argv[3], sys.argv[4]
tag = writable.rstrip("/").rsplit("/", 1)[1] + "-x"  # a fresh name: nothing of an earlier run is mistaken for an escape
L = S.SandboxLimits(cpu_s=1, wall_s=5.0, memory_bytes=256 << 20, max_processes=8)
sock = S.run_program("import socket; socket.create_connection(('127.0.0.1', %d), timeout=1)" % port, "", L)
escape = S.run_program("import os, time\\nif os.fork() == 0:\\n    os.setsid()\\n    time.sleep(30)\\n", "", L)
bomb = S.run_program("import os, time\\nwhile True:\\n    try: os.fork()\\n    except OSError: time.sleep(0.05)\\n", "", L)
probe = (
    "import os\\n"
    "for p in [%r, '/var/tmp/%s', '/dev/shm/%s']:\\n"
    "    try:\\n"
    "        open(p, 'w').write('x'); print(p, 'written')\\n"
    "    except OSError as e:\\n"
    "        print(p, 'refused', e.errno)\\n"
    "print('host-proc', os.path.exists('/proc/%s'))\\n"
    "print('tmp', sorted(os.listdir('/tmp')))\\n"
) % (writable + "/escape", tag, tag, secret_pid)
files = S.run_program(probe, "", L)
S._NO_MOUNT = True  # as after a failed mount in a user namespace: no filesystem isolation
try:
    S.run_program("print(1)", "", L)
    refused = ""
except RuntimeError as e:
    refused = str(e)
opted = S.run_program("print(1)", "", S.SandboxLimits(allow_unisolated=True, wall_s=5.0))
print(json.dumps({"enforced": sock.enforced, "sock": sock.stderr[-200:], "escape": escape.returncode, "bomb": bomb.killed_by,
                  "files": files.stdout, "files_err": files.stderr[-300:], "refused": refused,
                  "opted": [opted.stdout, opted.enforced]}))
"""


def test_unprivileged_scorer_gets_network_pid_files_proc_and_nproc_isolation():
    """The scorer's user-namespace path (no root), run from this root test as an unused uid: no network,
    its own pid namespace and /proc, a read-only host (a directory the uid may write on the host
    included) with a private /tmp, RLIMIT_NPROC; without filesystem isolation a run is refused
    unless allowed."""
    import json

    if os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("needs root (to start the scorer as another uid) and /usr/bin/python3")
    uid = 43210  # no account, no process
    if procs_of(uid):
        pytest.skip(f"uid {uid} has processes on this host")
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.2)
    public = public_copy_of_the_sandbox()
    writable = tempfile.mkdtemp(prefix="aligner-sandbox-home-", dir="/var/tmp")  # as the scorer's home: its own, writable
    os.chown(writable, uid, uid)
    secret = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--token=hunter2"])
    try:
        r = subprocess.run(
            ["/usr/bin/python3", "-I", "-c", UNPRIVILEGED_SCORER, public, str(srv.getsockname()[1]), writable, str(secret.pid)],
            user=uid,
            group=uid,
            extra_groups=[],
            env={"PATH": "/usr/bin:/bin"},
            cwd="/",
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr[-2000:]
        out = json.loads(r.stdout)
        if "network" not in out["enforced"]:
            pytest.skip(f"unprivileged user namespaces are off here (enforced: {out['enforced']})")
        assert set(out["enforced"]) == {"network", "pid", "filesystem", "proc", "nproc"}, out
        assert "Network is unreachable" in out["sock"]
        with pytest.raises(socket.timeout):
            srv.accept()
        assert out["escape"] == 0 and out["bomb"] == "wall"
        lines = out["files"].splitlines()
        assert f"{writable}/escape refused 30" in lines, out  # EROFS, though the uid owns it on the host
        tag = os.path.basename(writable) + "-x"
        assert f"/var/tmp/{tag} refused 30" in lines and f"/dev/shm/{tag} refused 30" in lines
        assert "host-proc False" in lines  # another process of the host is not in the sandbox's /proc
        assert "tmp ['sandbox']" in lines
        assert os.listdir(writable) == [] and not os.path.exists(f"/dev/shm/{tag}")
        assert "no filesystem isolation" in out["refused"] and "allow_unisolated" in out["refused"] and "\n" not in out["refused"]
        assert out["opted"][0] == "1\n" and "filesystem" not in out["opted"][1]
        time.sleep(0.2)
        assert procs_of(uid) == 0  # the child that left the group and the bomb are gone
    finally:
        srv.close()
        secret.kill()
        secret.wait()
        shutil.rmtree(public, ignore_errors=True)
        shutil.rmtree(writable, ignore_errors=True)


def test_host_processes_and_their_command_lines_are_out_of_sight():
    need("pid")  # a pid namespace: its own /proc goes with it
    secret = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--token=hunter2"])
    try:
        prog = (
            "import os\n"
            "pids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
            "seen = []\n"
            "for p in pids:\n"
            "    try:\n"
            "        seen.append(open(f'/proc/{p}/cmdline', 'rb').read())\n"
            "    except OSError:\n"
            "        pass\n"
            f"print(len(pids), any(b'hunter2' in c for c in seen), os.path.exists('/proc/{secret.pid}'))\n"
        )
        res = S.run_program(prog, "", ROOMY)
        assert res.ok, res.stderr
        n, leaked, visible = res.stdout.split()
        assert leaked == "False" and visible == "False" and int(n) <= 3  # init and the program (and a fork)
    finally:
        secret.kill()
        secret.wait()


def test_all_tests_of_a_response_share_one_time_budget():
    slow = "import time\ntime.sleep(1.5)\nprint(0)\n"
    limits = dataclasses.replace(TIGHT, wall_s=4.0, response_s=2.5)
    t0 = time.monotonic()
    assert S.pass_fraction(slow, ["", "", ""], ["0", "0", "0"], limits) == 0.0  # the budget ends within the second test
    assert time.monotonic() - t0 < limits.response_s + MARGIN_S  # not 3 x 1.5 s
    assert S.pass_fraction(slow, [""], ["0"], dataclasses.replace(limits, response_s=20.0)) == 1.0
    with pytest.raises(ValueError, match="response_s"):
        S.SandboxLimits(response_s=0)


def test_code_reward_refuses_a_host_without_filesystem_isolation_unless_opted_in(monkeypatch):
    monkeypatch.setattr(S, "isolation", lambda: ("network", "pid", "nproc"))
    monkeypatch.delenv(S.UNISOLATED_ENV, raising=False)
    with pytest.raises(ValueError) as e:
        check_rule_rows("code_tests", [{"metadata": {"tests": TESTS}, "source": "a:1"}])
    assert "no filesystem isolation" in str(e.value) and f"{S.UNISOLATED_ENV}=1" in str(e.value) and "\n" not in str(e.value)
    monkeypatch.setenv(S.UNISOLATED_ENV, "1")
    check_rule_rows("code_tests", [{"metadata": {"tests": TESTS}, "source": "a:1"}])
    assert S.code_limits().allow_unisolated
