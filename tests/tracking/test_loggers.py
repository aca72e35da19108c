"""trainer.loggers: W&B and MLflow beside metrics.jsonl and TensorBoard, offline.

Checked, with WANDB_MODE=offline and MLflow's local file store (both under tmp_path): the values of
three steps read back from each logger (W&B from its own offline run file, MLflow through
``MlflowClient.get_metric_history``), the run's config in both (the secret redacted, long values
cut, metric names MLflow refuses made valid), a resumed logger continuing the same W&B and MLflow
runs, the environment's project / store winning over the defaults, an automatic restart of the
loop recorded in every logger, an SFT run through Ray with ``trainer.loggers=[jsonl,wandb,mlflow]``,
and a missing package stopping the command line with one line and exit 2. Nothing reaches a
server: WANDB_BASE_URL points at a local socket that must see no connection, and no Python socket
may connect beyond this machine.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aligner.cli import load_config
from aligner.config import config_dict
from aligner.errors import UserError, WorkerDiedError
from aligner.run_ops.run_dir import previous_run_entries
from aligner.tracking import IDS_FILE, MetricsLogger, mlflow_key, mlflow_params, read_metrics
from aligner.trainers.loop import Trainer
from tests.toolkit.overrides import SMALL
from tests.toolkit.paths import REPO

NEEDS_BOTH = pytest.mark.skipif(
    importlib.util.find_spec("wandb") is None or importlib.util.find_spec("mlflow") is None,
    reason="needs wandb and mlflow (pip install 'aligner[loggers]' or aligner[test])",
)
ALL = ["jsonl", "tensorboard", "wandb", "mlflow"]


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """WANDB_MODE=offline, wandb's own dirs in tmp_path, no MLflow server configured; asserts afterwards
    that no connection reached the local "server" (WANDB_BASE_URL) and no Python socket left this machine."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    for name in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_NAME", "WANDB_RUN_ID", "WANDB_API_KEY", "WANDB_ENTITY"):
        monkeypatch.delenv(name, raising=False)
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_ALLOW_FILE_STORE", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "wandb_home"
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(home / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
    outside: list = []
    connect = socket.socket.connect
    try:  # this machine's own addresses (the session's Ray instance listens on one) are not the network
        here = {"127.0.0.1", "::1", "localhost", *(a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None))}
    except OSError:
        here = {"127.0.0.1", "::1", "localhost"}

    def guarded(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in here:
            outside.append(address)
        return connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    yield
    try:
        conn, peer = server.accept()
        conn.close()
        pytest.fail(f"a logger connected to the server at WANDB_BASE_URL (from {peer})")
    except BlockingIOError:
        pass
    finally:
        server.close()
    assert not outside, f"connections beyond loopback: {outside}"


# ---- reading the loggers back ------------------------------------------------------------------
def wandb_records(run_dir: Path) -> list:
    """The protobuf records of an offline W&B run (``run-<id>.wandb``: a 7-byte header, then 32 KiB
    blocks of LevelDB-log chunks, each a CRC-32, a length and a type: full, first, middle, last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = next(run_dir.glob("run-*.wandb")).read_bytes()
    assert data[:4] == b":W&B", data[:7]
    out, pos, part = [], 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (n == 0 and kind == 0):
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
        part = chunk if kind in (1, 2) else part + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(part)
            out.append(rec)
    return out


def wandb_finished_records(run_dir: Path, timeout_s: float = 60.0) -> list:
    """:func:`wandb_records` once the run's exit record is in the file: ``finish()`` returns before
    wandb's service process has written everything (seen once on a loaded 2-core machine)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = wandb_records(run_dir) if list(run_dir.glob("run-*.wandb")) else []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def wandb_runs(out: Path) -> list[dict]:
    """Each offline W&B run under out/wandb, oldest first: id, project, config, history {step: {key: value}}, summary."""
    runs = []
    for d in (out / "wandb").glob("offline-run-*"):
        run = {"history": {}, "summary": {}}
        for rec in wandb_finished_records(d):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                run.update(
                    id=rec.run.run_id, project=rec.run.project, name=rec.run.display_name, started=rec.run.start_time.ToNanoseconds()
                )
                run["config"] = {i.key: json.loads(i.value_json) for i in rec.run.config.update}
            elif kind == "history":
                items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item}
                run["history"][rec.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
            elif kind == "summary":
                run["summary"].update({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.summary.update})
        runs.append(run)
    return sorted(runs, key=lambda r: r["started"])  # not by dir name: runs started in the same second get -1, -2, ...


def mlflow_run(out: Path, uri: str = ""):
    """(client, run) of the MLflow run whose id out/loggers.json keeps, in `uri` (default: out/mlruns)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri or (out / "mlruns").absolute().as_uri())
    return client, client.get_run(json.loads((out / IDS_FILE).read_text())["mlflow"])


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))]


@pytest.fixture
def file_store_allowed(monkeypatch):
    """Reading the file store back: MLflow 3.7+ opens one only with MLFLOW_ALLOW_FILE_STORE=true (the
    logger sets it only while it builds its own client)."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


def _steps(n: int, start: int = 1) -> dict[int, dict]:
    return {s: {"loss": 1.0 / s, "time/step": 0.25 * s, "grad@norm": float(s)} for s in range(start, start + n)}


# ---- MetricsLogger -----------------------------------------------------------------------------
@NEEDS_BOTH
def test_four_loggers_record_the_steps_and_the_config_and_a_resume_continues_the_runs(offline, tmp_path, monkeypatch):
    out = tmp_path / "run"
    cfg = load_config("sft", [f"output_dir={out}", f"trainer.loggers=[{','.join(ALL)}]"])
    cfg.reward.token = "s3cret"  # as a config file gives it (the command line refuses a token: docs/security.md)
    conf = config_dict(cfg)
    conf["data"]["train_path"] = "x" * 7000  # longer than any MLflow param value
    logger = MetricsLogger(out, "sft", 5, progress=False, loggers=cfg.trainer.loggers, config=conf)
    for step, row in _steps(3).items():
        logger.log(step, row)
    logger.close()

    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    (wb,) = wandb_runs(out)
    assert wb["project"] == "aligner" and wb["name"] == f"sft {out}"
    assert wb["history"] == _steps(3)
    assert wb["config"]["trainer"]["loggers"] == ALL and wb["config"]["reward"]["token"] == "<redacted>"

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client, run = mlflow_run(out)
    assert run.info.status == "FINISHED" and run.info.run_name == f"sft {out}"
    assert client.get_experiment(run.info.experiment_id).name == "aligner"
    assert history(client, run.info.run_id, "loss") == [(s, r["loss"]) for s, r in _steps(3).items()]
    assert history(client, run.info.run_id, "time/step") == [(s, r["time/step"]) for s, r in _steps(3).items()]
    assert history(client, run.info.run_id, "grad_norm") == [(s, r["grad@norm"]) for s, r in _steps(3).items()], "@ is not an MLflow name"
    params = run.data.params
    assert params["trainer.max_steps"] == str(cfg.trainer.max_steps) and params["reward.token"] == "<redacted>"
    assert params["data.train_path"] == "x" * 6000, "cut to MLflow's limit"
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")

    ids = json.loads((out / IDS_FILE).read_text())
    conf["trainer"]["max_steps"] = 6  # a resumed run may change a field: W&B takes it, MLflow keeps its first params
    logger = MetricsLogger(out, "sft", 6, start_step=2, progress=False, loggers=cfg.trainer.loggers, config=conf)
    for step, row in _steps(2, start=3).items():
        logger.log(step, row)
    logger.close()
    assert json.loads((out / IDS_FILE).read_text()) == ids, "the same W&B and MLflow runs"
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]
    first, resumed = wandb_runs(out)
    assert resumed["id"] == first["id"] == ids["wandb"] and resumed["history"] == _steps(2, start=3)
    assert resumed["config"]["trainer"]["max_steps"] == 6
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client, run = mlflow_run(out)
    assert run.info.run_id == ids["mlflow"] and len(client.search_runs([run.info.experiment_id])) == 1
    assert history(client, run.info.run_id, "loss") == [(1, 1.0), (2, 0.5), (3, 1 / 3), (3, 1 / 3), (4, 0.25)], (
        "MLflow keeps both values of a step that was run again"
    )
    assert run.data.params["trainer.max_steps"] == str(cfg.trainer.max_steps)
    assert {IDS_FILE, "wandb", "mlruns"} <= set(previous_run_entries(out)), "a previous run's outputs: overwrite=true deletes them"


@NEEDS_BOTH
def test_the_environment_and_logger_project_name_the_project_and_the_store(offline, tmp_path, monkeypatch):
    store = (tmp_path / "elsewhere").absolute().as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the user's own file store: MLflow's opt-in is theirs
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "exp-from-env")
    for out, project, want_wb, want_ml in (
        (tmp_path / "a", "", "from-env", "exp-from-env"),
        (tmp_path / "b", "mine", "mine", "mine"),
    ):
        logger = MetricsLogger(out, "rm", 1, progress=False, loggers=["wandb", "mlflow"], project=project, run_name="named")
        logger.log(1, {"loss": 0.5})
        logger.close()
        (wb,) = wandb_runs(out)
        assert (wb["project"], wb["name"]) == (want_wb, "named")
        client, run = mlflow_run(out, store)
        assert client.get_experiment(run.info.experiment_id).name == want_ml and run.info.run_name == "named"
        assert not (out / "mlruns").exists() and not (out / "tensorboard").exists()
        assert read_metrics(out / "metrics.jsonl") == [{"step": 1, "loss": 0.5}], "metrics.jsonl whatever the list says"


@NEEDS_BOTH
def test_a_logger_that_cannot_start_its_run_is_one_line_naming_it(offline, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://host/path")
    with pytest.raises(UserError) as e:
        MetricsLogger(tmp_path / "run", "sft", 1, progress=False, loggers=ALL)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("trainer.loggers: mlflow could not start its run (") and "nosuchscheme" in msg, msg
    assert "MLFLOW_TRACKING_URI" in msg and msg.endswith("or remove mlflow from trainer.loggers"), msg


def test_mlflow_names_and_params():
    assert mlflow_key("time/generate") == "time/generate" and mlflow_key("a b:c-d.e_f") == "a b:c-d.e_f"
    assert mlflow_key("pass@1") == "pass_1" and mlflow_key("reward/é") == "reward/_"
    assert mlflow_key("/x//y/./z/../") == "x/y/z" and mlflow_key("//") == "_" and len(mlflow_key("k" * 300)) == 250
    params = mlflow_params({"a": {"b": 1, "c": [1, 2], "d": {}}, "e": None, "f": "v" * 10000})
    assert params["a.b"] == "1" and params["a.c"] == "[1, 2]" and params["a.d"] == "{}" and params["e"] == "None"
    assert 500 <= len(params["f"]) <= 6000


# ---- the loop: restarts ------------------------------------------------------------------------
class Toy(Trainer):
    """A one-float trainer with no Ray and no workers (the pattern of tests/trainers/test_loop.py):
    each step's loss is its step number; a step in `die_at` raises a worker death once."""

    name = "sft"
    bar_keys = ("loss",)

    def __init__(self, cfg, die_at: tuple[int, ...] = ()):
        super().__init__(cfg)
        self.die_at = list(die_at)

    def check(self):
        return None

    def load_inputs(self):
        pass

    def init_ray(self):
        pass

    def shutdown_ray(self):
        pass

    def start(self):
        pass

    def stop(self):
        pass

    def finish(self):
        pass

    def run_step(self):
        step = self.step + 1
        if step in self.die_at:
            self.die_at.remove(step)
            raise WorkerDiedError("actor", 1, "the worker process died or became unreachable: pid 4242 killed", "train_step")
        return {"loss": float(step)}

    def evaluate(self):
        return {"eval_loss": 2.0 * self.step}

    def save_roles(self, tmp):
        (tmp / "toy.json").write_text("{}")

    def load_roles(self, ckpt):
        pass

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = int(state["step"])


@NEEDS_BOTH
def test_a_restart_and_the_steps_reach_every_logger_through_the_loop(offline, tmp_path, monkeypatch):
    out = tmp_path / "healed"
    cfg = load_config("sft", [f"output_dir={out}", "trainer.progress=false", "trainer.max_steps=4", "trainer.save_every=2", f"trainer.loggers=[{','.join(ALL)}]"])  # fmt: skip
    assert Toy(cfg, die_at=(3,)).run() == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [(r["step"], r["loss"], r.get("restarts")) for r in rows] == [(1, 1.0, None), (2, 2.0, None), (3, 3.0, 1.0), (4, 4.0, 1.0)]
    before, after = wandb_runs(out)  # the restart continues the W&B run
    assert before["id"] == after["id"] and sorted(before["history"]) == [1, 2] and sorted(after["history"]) == [3, 4]
    assert after["history"][3]["restarts"] == 1.0 and after["summary"]["restarts"] == 1
    assert (
        after["summary"]["last_restart"].startswith("actor rank 1 died during step 3 (") and "pid 4242" in after["summary"]["last_restart"]
    )
    assert after["config"]["trainer"]["max_steps"] == 4
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client, run = mlflow_run(out)
    assert run.info.status == "FINISHED" and len(client.search_runs([run.info.experiment_id])) == 1
    assert history(client, run.info.run_id, "loss") == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]
    assert history(client, run.info.run_id, "restarts") == [(3, 1.0), (4, 1.0)]
    assert run.data.tags["restarts"] == "1" and run.data.tags["restart_1"] == after["summary"]["last_restart"]
    assert run.data.params["trainer.loggers"] == str(ALL)
    tb = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert tb and any(b"restart 1: actor rank 1 died during step 3" in p.read_bytes() for p in tb)


# ---- a real stage and the command line ---------------------------------------------------------
@NEEDS_BOTH
@pytest.mark.e2e
def test_sft_through_ray_logs_to_wandb_and_mlflow(offline, ray_cluster, tmp_path, monkeypatch):
    from aligner.trainers.sft import SFTTrainer

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "sft"
    cfg = load_config("sft", SMALL + [f"output_dir={out}", "trainer.max_steps=2", "trainer.loggers=[jsonl,wandb,mlflow]"])
    assert SFTTrainer(cfg).run() == 0
    rows = {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}
    assert sorted(rows) == [1, 2] and not (out / "tensorboard").exists()
    (wb,) = wandb_runs(out)
    assert sorted(wb["history"]) == [1, 2] and [wb["history"][s]["loss"] for s in (1, 2)] == [rows[s]["loss"] for s in (1, 2)]
    assert wb["config"]["stage"] == "sft" and wb["config"]["output_dir"] == str(out)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client, run = mlflow_run(out)
    assert history(client, run.info.run_id, "loss") == [(s, rows[s]["loss"]) for s in (1, 2)]
    assert history(client, run.info.run_id, "tokens_per_s") == [(s, rows[s]["tokens_per_s"]) for s in (1, 2)]
    assert run.info.status == "FINISHED" and run.data.params["stage"] == "sft"


@pytest.mark.parametrize("args,missing,words", [
    (["trainer.loggers=[jsonl,neptune]"], "", "unknown loggers ['neptune']: valid loggers are jsonl, tensorboard, wandb, mlflow"),
    (["trainer.loggers=[jsonl,wandb]"], "wandb", "wandb needs the wandb package, which is not importable by"),
])  # fmt: skip
def test_the_command_line_stops_with_one_line_and_exit_2(tmp_path, args, missing, words):
    """Before any worker: a bad name, or a logger whose package find_spec does not see (hidden in the child)."""
    hide = f"import importlib.util as u; f = u.find_spec; u.find_spec = lambda n, *a, **k: None if n == {missing!r} else f(n, *a, **k)"
    code = f"{hide}; import sys; from aligner.sft import main; sys.exit(main(sys.argv[1:]))"
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-c", code, *args, f"output_dir={out}"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(tmp_path)},
    )  # fmt: skip
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("aligner sft: error: trainer.loggers=") and words in lines[0], lines[0]
    assert not out.exists(), "nothing is written before the configuration is accepted"


# ---- secrets never reach a logger ----------------------------------------------------------------
def test_scrub_argv_redacts_secret_keys_and_known_values():
    from aligner.tracking import scrub_argv

    argv = ["-m", "aligner.ppo", "reward.token=abc123", "++reward.token=def", "token=ghi", "note=xx-abc123-yy", "lr=1"]
    assert scrub_argv(argv, ["abc123", ""]) == [
        "-m",
        "aligner.ppo",
        "reward.token=<redacted>",
        "++reward.token=<redacted>",
        "token=<redacted>",
        "note=xx-<redacted>-yy",
        "lr=1",
    ]


@NEEDS_BOTH
def test_wandb_records_no_secret_of_the_command_line(offline, tmp_path, monkeypatch):
    """W&B stores sys.argv in its run's metadata: a token there (a key of the command line, or the
    environment's token pasted into another argument) is redacted while W&B starts, and sys.argv is
    restored afterwards."""
    argv = ["aligner/ppo.py", "reward.token=hunter2-argv", "output_dir=/x/hunter2-env/y"]
    monkeypatch.setattr(sys, "argv", list(argv))
    monkeypatch.setenv("ALIGNER_RM_TOKEN", "hunter2-env")
    out = tmp_path / "run"
    logger = MetricsLogger(out, "ppo", 1, progress=False, loggers=["wandb", "mlflow"], config={"reward": {"token": "<redacted>"}})
    logger.log(1, {"loss": 0.5})
    logger.close()
    assert sys.argv == argv
    (wb,) = wandb_runs(out)  # waits until W&B wrote everything
    seen = [p for p in out.rglob("*") if p.is_file() and b"hunter2" in p.read_bytes()]
    assert seen == [], seen
    meta = list(out.rglob("wandb-metadata.json"))
    if meta:  # where this wandb writes it: the args are there, redacted
        assert "reward.token=<redacted>" in meta[0].read_text()
