"""What a user sees while a stage runs: progress bar, metrics.jsonl, TensorBoard events, PNG curves.

Owns :class:`MetricsLogger`. Every logged step is one JSON line in
``output_dir/metrics.jsonl`` (appended, so a resumed run continues the file; lines
for steps past the resume point are dropped on resume), a TensorBoard scalar per
metric, and the progress bar's postfix (loss, tokens/s, ETA from tqdm).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterable, Optional


class MetricsLogger:
    """Write metrics for `stage` under `output_dir`; show a tqdm bar over `total_steps`.

    Args:
        output_dir: run directory (created).
        stage: name shown on the bar (sft, rm, ppo).
        total_steps: steps of the whole run; `start_step` steps already done (resume).
        progress: show the bar (off in tests and non-interactive logs if desired).
        bar_keys: metric names shown on the bar.
    """

    def __init__(self, output_dir: str | os.PathLike, stage: str, total_steps: int, start_step: int = 0,
                 progress: bool = True, bar_keys: Iterable[str] = ("loss", "tokens_per_s")):
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
        keep = [ln for ln in self.path.read_text().splitlines() if ln.strip() and json.loads(ln).get("step", 0) <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(ln + "\n" for ln in keep))
        os.replace(tmp, self.path)

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
    """All records of a metrics.jsonl file."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(ln) for ln in p.read_text().splitlines() if ln.strip()]


def plot_curves(metrics_path: str | os.PathLike, out_png: str | os.PathLike, keys: Iterable[str],
                title: Optional[str] = None) -> Optional[Path]:
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
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out_png)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
