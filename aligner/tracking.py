"""What a user sees while a stage runs: progress bar, metrics.jsonl, TensorBoard events, PNG curves.

Owns :class:`MetricsLogger`. Every logged step is one JSON line in
``output_dir/metrics.jsonl`` (appended, so a resumed run continues the file; lines
for steps past the resume point are dropped on resume), a TensorBoard scalar per
metric, and the progress bar's postfix (loss, tokens/s, ETA from tqdm). A last line cut
short (an append interrupted by a full disk or a kill) is dropped with a warning.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Iterable, Optional

log = logging.getLogger("aligner")


class MetricsLogger:
    """Write metrics for `stage` under `output_dir`; show a tqdm bar over `total_steps`.

    Args:
        output_dir: run directory (created).
        stage: name shown on the bar (sft, rm, ppo).
        total_steps: steps of the whole run; `start_step` steps already done (resume).
        progress: show the bar (off in tests and non-interactive logs if desired).
        bar_keys: metric names shown on the bar.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        stage: str,
        total_steps: int,
        start_step: int = 0,
        progress: bool = True,
        bar_keys: Iterable[str] = ("loss", "tokens_per_s"),
    ):
        from tqdm.auto import tqdm

        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self.stage = stage
        self.bar_keys = tuple(bar_keys)
        self._truncate_after(start_step)
        self._tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.dir / "tensorboard"), purge_step=start_step + 1 if start_step else None)
        except Exception:  # noqa: BLE001 - TensorBoard is optional at run time
            self._tb = None
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
        shown = {k: f"{clean[k]:.4g}" for k in self.bar_keys if isinstance(clean.get(k), float)}
        if shown:
            self.bar.set_postfix(shown, refresh=False)
        if advance:
            self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()


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
