"""`toolkit plot RUN_DIR [RUN_DIR ...] [--out FILE.png]`: one PNG of a run's metrics.jsonl, four panels
against the optimizer step: loss (train as a line, eval as dots on a dotted line, same axes), learning rate,
grad norm and throughput (tokens/s, and target tokens/s dashed where logged). Several runs are
overlaid, one color each, named by their folder.

Rows are read as they are: an unreadable line (a run killed mid-write) is skipped, and where a
resumed run logged a step twice, the later row wins. Only the PNG is written: into a temporary
file beside it, then renamed. matplotlib is imported inside `run` (`toolkit --help` stays fast)
and drawn on a Figure of its own, never pyplot: nothing opens a window.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from ..errors import ToolkitError, command

DEFAULT_COMPARE = "runs-compare.png"
# (panel title, [(metrics key, matplotlib line style)]), drawn left to right, top to bottom.
PANELS = [("loss (line: train, dots: eval)", [("loss", "-"), ("eval_loss", "o:")]),
          ("learning rate", [("lr", "-")]),
          ("grad norm", [("grad_norm", "-")]),
          ("tokens/s (dashed: target tokens/s)", [("tokens_per_second", "-"), ("target_tokens_per_second", "--")])]


def add_arguments(p) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="a run's output_dir (holding metrics.jsonl)")
    p.add_argument("--out", default=None, metavar="FILE.png",
                   help=f"the PNG to write (replaced if it exists; its folder must exist). Default: RUN_DIR/plot.png "
                        f"for one run, ./{DEFAULT_COMPARE} for several")


def read_rows(run: Path) -> tuple[list[dict], int]:
    """The run's rows by step (later rows win), and how many lines could not be read."""
    if not run.exists():
        raise ToolkitError(f"plot: {run}: no such folder")
    if not run.is_dir():
        raise ToolkitError(f"plot: {run} is not a folder; give the run's output_dir")
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise ToolkitError(f"plot: {run} has no metrics.jsonl (not a run folder, or nothing logged yet)")
    by_step, skipped = {}, 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            by_step[row["step"]] = row
        else:
            skipped += bool(line.strip())
    rows = [by_step[s] for s in sorted(by_step)]
    if not any(number(r.get("loss")) is not None for r in rows):
        raise ToolkitError(f"plot: {path} has no training rows (no step with a loss)")
    return rows, skipped


def number(value) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], number(r.get(key))) for r in rows]
    return [s for s, v in points if v is not None], [v for s, v in points if v is not None]


def names(runs: list[Path]) -> list[str]:
    """Folder names; where two are equal, their parent's name too, then a number."""
    labels = [r.resolve().name for r in runs]
    if len(set(labels)) < len(labels):
        labels = ["/".join(r.resolve().parts[-2:]) for r in runs]
    if len(set(labels)) < len(labels):
        labels = [f"{label} ({i + 1})" for i, label in enumerate(labels)]
    return labels


def output_path(runs: list[Path], out: str | None) -> Path:
    path = Path(out) if out else runs[0] / "plot.png" if len(runs) == 1 else Path(DEFAULT_COMPARE)
    if path.is_dir():
        raise ToolkitError(f"plot: --out {path} is a folder; give a file such as {path / 'plot.png'}")
    if not path.parent.is_dir():
        raise ToolkitError(f"plot: cannot write {path}: the folder {path.parent} does not exist")
    return path


def run(args) -> int:
    runs = [Path(r) for r in args.runs]
    read = [read_rows(r) for r in runs]
    out = output_path(runs, args.out)
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ToolkitError("toolkit plot needs matplotlib: "
                           + command("python -m pip install 'toolkit[plot]'")) from None

    fig = Figure(figsize=(12, 8), dpi=100, layout="constrained")
    axes = list(fig.subplots(2, 2, sharex=True).flat)
    for i, (label, (rows, _)) in enumerate(zip(names(runs), read)):
        for ax, (title, keys) in zip(axes, PANELS):
            for key, style in keys:
                steps, values = series(rows, key)
                if steps:
                    ax.plot(steps, values, style, color=f"C{i}", markersize=4,
                            label=label if key == "loss" else None)
    for ax, (title, _) in zip(axes, PANELS):
        ax.set_title(title)
        ax.grid(alpha=0.3)
    for ax in axes[2:]:
        ax.set_xlabel("step")
    axes[1].ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    axes[0].legend()

    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")  # beside the PNG: the rename stays on one disk
    try:
        with open(tmp, "xb") as f:
            fig.savefig(f, format="png")
        os.replace(tmp, out)
    except OSError as e:
        raise ToolkitError(f"plot: cannot write {out}: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)
    steps = [r["step"] for rows, _ in read for r in rows]
    skipped = sum(s for _, s in read)
    note = f", skipped {skipped} unreadable line{'s' * (skipped > 1)}" if skipped else ""
    print(f"wrote {out} ({len(runs)} run{'s' * (len(runs) > 1)}, steps {min(steps)}-{max(steps)}{note})")
    return 0
