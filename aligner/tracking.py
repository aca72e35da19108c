"""What a user sees while a stage runs: progress bar, metrics.jsonl, TensorBoard, W&B, MLflow, PNG curves.

Owns :class:`MetricsLogger`. Every logged step is one JSON line in
``output_dir/metrics.jsonl`` (appended, so a resumed run continues the file; lines
for steps past the resume point are dropped on resume), the progress bar's postfix (loss,
tokens/s, ETA from tqdm), and the same metrics in each logger of ``trainer.loggers``:
TensorBoard (a scalar per metric under ``output_dir/tensorboard``), Weights & Biases (a run under
``output_dir/wandb`` or WANDB_DIR) and MLflow (a run in MLFLOW_TRACKING_URI, else a file store at
``output_dir/mlruns``). The W&B and MLflow runs record the run's config and are continued, not
started again, by a resumed or restarted run: their ids are kept in ``output_dir/loggers.json``.
A last line of metrics.jsonl cut short (an append interrupted by a full disk or a kill) is
dropped with a warning.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

from aligner.config.run import REDACTED, SECRET_FIELDS
from aligner.errors import UserError

log = logging.getLogger("aligner")
_SETTINGS = {  # what to check when a logger cannot start its run
    "wandb": "check W&B's settings (WANDB_API_KEY or `wandb login`, WANDB_MODE=offline for no server, WANDB_ENTITY)",
    "mlflow": "check MLflow's settings (MLFLOW_TRACKING_URI and the server it names)",
}
IDS_FILE = "loggers.json"  # the W&B and MLflow run ids of the run in output_dir (a resumed run continues them)
DEFAULT_PROJECT = "aligner"  # W&B project and MLflow experiment when neither trainer.logger_project nor the environment names one


class MetricsLogger:
    """Write metrics for `stage` under `output_dir`; show a tqdm bar over `total_steps`.

    Args:
        output_dir: run directory (created).
        stage: name shown on the bar (sft, rm, ppo).
        total_steps: steps of the whole run; `start_step` steps already done (resume).
        progress: show the bar (off in tests and non-interactive logs if desired).
        bar_keys: metric names shown on the bar.
        loggers: ``trainer.loggers``: any of jsonl, tensorboard, wandb, mlflow. metrics.jsonl is
            written whether or not "jsonl" is named (resume, the plots and the summary read it).
        config: the run's resolved config (:func:`aligner.config.config_dict`), recorded by W&B
            (its run config) and MLflow (flattened params).
        project: W&B project and MLflow experiment; "" = WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME,
            else "aligner".
        run_name: the W&B and MLflow run name; "" = WANDB_NAME, else "<stage> <output_dir>".
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        stage: str,
        total_steps: int,
        start_step: int = 0,
        progress: bool = True,
        bar_keys: Iterable[str] = ("loss", "tokens_per_s"),
        loggers: Iterable[str] = ("jsonl", "tensorboard"),
        config: Optional[dict] = None,
        project: str = "",
        run_name: str = "",
    ):
        from tqdm.auto import tqdm

        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self.stage = stage
        self.bar_keys = tuple(bar_keys)
        self._truncate_after(start_step)
        loggers = tuple(loggers)
        self._tb = None
        if "tensorboard" in loggers:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(self.dir / "tensorboard"), purge_step=start_step + 1 if start_step else None)
            except Exception as e:  # noqa: BLE001 - TensorBoard is optional at run time
                log.warning("%s: TensorBoard events are not written (%s: %s)", stage, type(e).__name__, e)
        name = run_name or os.environ.get("WANDB_NAME") or f"{stage} {self.dir}"
        self._backends: list = []
        for logger, backend, env in (("wandb", _Wandb, "WANDB_PROJECT"), ("mlflow", _Mlflow, "MLFLOW_EXPERIMENT_NAME")):
            if logger not in loggers:
                continue
            try:
                self._backends.append(backend(self.dir, project or os.environ.get(env) or DEFAULT_PROJECT, name, config))
            except BaseException as e:
                self.close("failed")
                if not isinstance(e, Exception):
                    raise
                first = (str(e).strip().splitlines() or [""])[0][:300]
                raise UserError(
                    f"trainer.loggers: {logger} could not start its run ({type(e).__name__}: {first}): {_SETTINGS[logger]}, "
                    f"or remove {logger} from trainer.loggers"
                ) from e
        self.bar = tqdm(total=total_steps, initial=start_step, desc=stage, disable=not progress, dynamic_ncols=True)

    def _truncate_after(self, step: int) -> None:
        """Keep only lines with step <= `step` (a resumed run rewrites what came after its checkpoint)."""
        if not self.path.exists():
            return
        _rewrite(self.path, [r for r in read_metrics(self.path) if r.get("step", 0) <= step])

    def log(self, step: int, metrics: dict, advance: bool = True) -> None:
        """Record `metrics` (floats) for `step`; advance the bar by one step when `advance`."""
        clean = {k: _num(v) for k, v in metrics.items()}
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")
        if self._tb is not None:
            for k, v in clean.items():
                if isinstance(v, float) and math.isfinite(v):
                    self._tb.add_scalar(f"{self.stage}/{k}", v, step)
        for b in self._backends:
            b.log(step, clean)
        shown = {k: f"{clean[k]:.4g}" for k in self.bar_keys if isinstance(clean.get(k), float)}
        if shown:
            self.bar.set_postfix(shown, refresh=False)
        if advance:
            self.bar.update(1)

    def restarted(self, count: int, what: str, step: int) -> None:
        """Record the run's `count`-th automatic restart (`what`: the dead worker and the error's
        first line), resuming after `step`, in every logger that keeps text: a TensorBoard text entry
        ``{stage}/restarts``, the W&B run summary (``restarts``, ``last_restart``), MLflow tags
        (``restarts``, ``restart_{count}``). The metrics rows of later steps carry ``restarts`` too."""
        if self._tb is not None:
            self._tb.add_text(f"{self.stage}/restarts", f"restart {count}: {what}", step)
        for b in self._backends:
            b.restarted(count, what)

    def close(self, status: str = "finished") -> None:
        """Flush and close every logger. `status`: how the steps ended (finished | failed | killed),
        which W&B (the exit code) and MLflow (the run status) record."""
        if getattr(self, "bar", None) is not None:
            self.bar.close()
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None
        backends, self._backends = self._backends, []
        for b in backends:
            try:
                b.close(status)
            except Exception as e:  # noqa: BLE001 - one logger failing to close must not hide the run's outcome
                log.warning("%s: closing %s failed: %s: %s", self.stage, type(b).__name__.lstrip("_"), type(e).__name__, e)


# ---- W&B and MLflow ----------------------------------------------------------------------------
def _read_ids(out: Path) -> dict:
    try:
        ids = json.loads((out / IDS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return ids if isinstance(ids, dict) else {}


def _write_id(out: Path, key: str, value: str) -> None:
    ids = {**_read_ids(out), key: value}
    tmp = out / (IDS_FILE + ".tmp")
    tmp.write_text(json.dumps(ids, indent=1) + "\n")
    os.replace(tmp, out / IDS_FILE)


SECRET_ARG_KEYS = (*SECRET_FIELDS, "token")  # key=value arguments (serve_rm: token=) whose value a logger never records
SECRET_ENV = ("ALIGNER_RM_TOKEN",)  # variables whose value is scrubbed wherever it appears in the arguments


def scrub_argv(argv: Sequence[str], secrets: Iterable[str] = ()) -> list[str]:
    """`argv` with the value of every ``key=value`` argument whose key is a secret
    (:data:`SECRET_ARG_KEYS`, with Hydra's ``+``/``++``/``~`` prefixes) and every occurrence of each
    non-empty string of `secrets` replaced by ``<redacted>``."""
    out = []
    for a in argv:
        key, eq, _ = str(a).partition("=")
        if eq and key.lstrip("+~").strip() in SECRET_ARG_KEYS:
            a = f"{key}={REDACTED}"
        for secret in secrets:
            if secret:
                a = a.replace(secret, REDACTED)
        out.append(a)
    return out


@contextmanager
def scrubbed_argv() -> Iterator[None]:
    """``sys.argv`` scrubbed (:func:`scrub_argv`, the values of :data:`SECRET_ENV` included) while a
    logger starts: W&B records the command line in its run's metadata."""
    saved = sys.argv
    sys.argv = scrub_argv(saved, [os.environ.get(name, "") for name in SECRET_ENV])
    try:
        yield
    finally:
        sys.argv = saved


class _Wandb:
    """A W&B run: ``wandb.init(project, name, dir, config, id, resume="allow")``. The id is kept in
    loggers.json, so a resumed or restarted run continues the same W&B run. WANDB_MODE, WANDB_ENTITY,
    WANDB_API_KEY and the like apply as wandb reads them; WANDB_DIR, when set, replaces output_dir."""

    def __init__(self, out: Path, project: str, name: str, config: Optional[dict]):
        import wandb

        with scrubbed_argv():  # W&B stores sys.argv (its run's "args"): no secret goes with it
            self.run = self._init(wandb, out, project, name, config)
        _write_id(out, "wandb", self.run.id)

    @staticmethod
    def _init(wandb, out: Path, project: str, name: str, config: Optional[dict]):
        return wandb.init(
            project=project,
            name=name,
            dir=None if os.environ.get("WANDB_DIR") else str(out),
            config=config or {},
            id=_read_ids(out).get("wandb"),  # None: WANDB_RUN_ID, else a new id
            resume="allow",
            allow_val_change=True,  # a resumed run may change a field (trainer.max_steps, resume itself)
        )

    def log(self, step: int, metrics: dict) -> None:
        self.run.log(metrics, step=step)

    def restarted(self, count: int, what: str) -> None:
        self.run.summary["restarts"] = count
        self.run.summary["last_restart"] = what

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "finished" else 1)


class _Mlflow:
    """An MLflow run through ``mlflow.tracking.MlflowClient`` (no process-global active run): in
    MLFLOW_TRACKING_URI, else a local file store at ``output_dir/mlruns`` (MLflow 3.7+ refuses a file
    store unless MLFLOW_ALLOW_FILE_STORE=true: it is set while the client builds its store). The config is logged as
    flattened params (values cut to MLflow's length limit; a resumed run adds only new keys: MLflow
    params cannot change), metrics with names MLflow accepts (other characters become ``_``). The
    run id is kept in loggers.json, so a resumed or restarted run continues the same MLflow run."""

    STATUS = {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}

    def __init__(self, out: Path, experiment: str, name: str, config: Optional[dict]):
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (out / "mlruns").absolute().as_uri()
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        allow = "MLFLOW_ALLOW_FILE_STORE"
        if uri.startswith("file:") and allow not in os.environ:  # for the store MLflow builds (and caches) here, not for the process
            os.environ[allow] = "true"
            try:
                self.client = MlflowClient(tracking_uri=uri)
            finally:
                del os.environ[allow]
        else:
            self.client = MlflowClient(tracking_uri=uri)
        run = None
        stored = _read_ids(out).get("mlflow")
        if stored:
            try:
                run = self.client.get_run(stored)
                self.client.update_run(stored, status="RUNNING")
            except MlflowException as e:
                log.warning("MLflow run %s of %s not found in %s (%s): starting a new run", stored, out, uri, str(e).splitlines()[0])
                run = None
        if run is None:
            exp = self.client.get_experiment_by_name(experiment)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(experiment)
            run = self.client.create_run(exp_id, run_name=name)
        self.run_id = run.info.run_id
        _write_id(out, "mlflow", self.run_id)
        if config:
            have = dict(run.data.params)
            params = {k: v for k, v in mlflow_params(config).items() if k not in have}
            if params:
                from mlflow.entities import Param

                self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in params.items()])

    def log(self, step: int, metrics: dict) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        rows = [Metric(mlflow_key(k), v, ts, step) for k, v in metrics.items() if isinstance(v, float)]
        if rows:
            self.client.log_batch(self.run_id, metrics=rows)

    def restarted(self, count: int, what: str) -> None:
        self.client.set_tag(self.run_id, "restarts", str(count))
        self.client.set_tag(self.run_id, f"restart_{count}", what[:5000])

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=self.STATUS.get(status, "FAILED"))


def mlflow_key(name: str) -> str:
    """`name` as an MLflow metric or param name: characters other than alphanumerics and ``_ - . space
    / :`` become ``_``; empty, ``.`` and ``..`` path parts are dropped (MLflow refuses names that
    are not normalized paths); at most 250 characters."""
    name = re.sub(r"[^\w\-. :/]", "_", str(name), flags=re.ASCII)
    name = "/".join(p for p in name.split("/") if p not in ("", ".", ".."))
    return (name or "_")[:250]


def mlflow_params(config: dict, prefix: str = "") -> dict[str, str]:
    """The nested config as MLflow params: dotted keys (``trainer.max_steps``), values as text cut
    to the installed MLflow's limit (6000 characters in MLflow 3, 500 in MLflow 1)."""
    try:
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH as limit
    except ImportError:
        limit = 500
    out: dict[str, str] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(mlflow_params(v, key + "."))
        else:
            out[mlflow_key(key)] = str(v)[:limit]
    return out


def _num(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return v


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """All records of a metrics.jsonl file ([] when missing).

    A last line that is not JSON (cut short) is dropped with a warning. Raises ValueError naming
    file:line for any other line that is not a JSON object.
    """
    return _parse(Path(path))[0]


def repair_metrics(path: str | os.PathLike) -> None:
    """Rewrite a metrics.jsonl whose last line was cut short without that line (warns); no-op otherwise.

    Raises ValueError naming file:line for an earlier line that is not a JSON object.
    """
    p = Path(path)
    rows, dropped = _parse(p)
    if dropped:
        _rewrite(p, rows)


def _parse(p: Path) -> tuple[list[dict], bool]:
    """(records, whether a cut last line was dropped)."""
    if not p.exists():
        return [], False
    lines = [(i, ln) for i, ln in enumerate(p.read_text(errors="replace").splitlines(), 1) if ln.strip()]
    rows = []
    for i, ln in lines:
        try:
            row = json.loads(ln)
        except ValueError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        elif i == lines[-1][0]:
            log.warning("%s:%d: dropped the last line, cut short (%d bytes: an interrupted append)", p, i, len(ln))
            return rows, True
        else:
            raise ValueError(f"{p}:{i}: not a JSON object: fix or delete that line")
    return rows, False


def _rewrite(p: Path, rows: list[dict]) -> None:
    tmp = p.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, p)


def plot_curves(
    metrics_path: str | os.PathLike, out_png: str | os.PathLike, keys: Iterable[str], title: Optional[str] = None
) -> Optional[Path]:
    """PNG with one panel per metric in `keys` (those present) against step. Returns the path, or None."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    keys = [k for k in keys if any(isinstance(r.get(k), (int, float)) for r in rows)]
    if not keys:
        return None
    cols = min(3, len(keys))
    nrows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.0 * nrows), squeeze=False)
    for ax, k in zip(axes.flat, keys):
        pts = [(r["step"], r[k]) for r in rows if isinstance(r.get(k), (int, float)) and math.isfinite(r[k])]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 60 else None)
        ax.set_title(k, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out_png)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
