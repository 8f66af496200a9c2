"""`toolkit plot RUN_DIR [RUN_DIR ...] [--out FILE.png]`: one PNG of a run's metrics.jsonl, panels
against the optimizer step: loss (train as a line, eval as dots on a dotted line, same axes), learning rate,
grad norm and throughput (tokens/s, and target tokens/s dashed where logged); for online RL (rl.method) also
the reward (train as a line, eval_reward as dots), the completions' length, and the shares of groups without
reward spread (zero_std_groups) and of completions cut at rl.max_new_tokens (clipped_completions), and the
entropy of the policy's distribution at the completion tokens (online RL and distillation). A panel
no run has a value for is left out. Several runs are overlaid, one color each, named by their folder.

Rows are read as they are: an unreadable line (a run killed mid-write) is skipped, and where a
resumed run logged a step twice, the later row wins. Only the PNG is written: into a temporary
file beside it, then renamed. matplotlib is imported inside `run` (`toolkit --help` stays fast)
and drawn on a Figure of its own, never pyplot: nothing opens a window.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import ToolkitError, command
from ..storage.disk import check_writable, write_file

DEFAULT_COMPARE = "runs-compare.png"
# (panel title, [(metrics key, matplotlib line style)]), drawn left to right, top to bottom; a panel
# with no value in any run is left out (the RL panels of a supervised run).
PANELS = [("loss (line: train, dots: eval)", [("loss", "-"), ("eval_loss", "o:")]),
          ("reward (line: train, dots: eval)", [("reward", "-"), ("eval_reward", "o:")]),
          ("completion length, tokens (dotted: min, max)",
           [("completion_length", "-"), ("completion_length_min", ":"), ("completion_length_max", ":")]),
          ("reward margin, chosen minus rejected (line: train, dots: eval)",
           [("reward_margin", "-"), ("eval_reward_margin", "o:")]),
          ("reward accuracy (line: train, dots: eval)", [("reward_accuracy", "-"), ("eval_reward_accuracy", "o:")]),
          ("kl (line: train, dots: eval)", [("kl", "-"), ("eval_kl", "o:")]),
          ("entropy, nats per completion token", [("entropy", "-")]),
          ("zero_std_groups (dashed: clipped_completions)",
           [("zero_std_groups", "-"), ("clipped_completions", "--")]),
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


def shown_panels(runs_rows: list[list[dict]]) -> list[tuple[str, list[tuple[str, str]]]]:
    """The PANELS some run has a value for, in their order."""
    return [(title, keys) for title, keys in PANELS
            if any(series(rows, key)[0] for rows in runs_rows for key, _ in keys)]


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
    check_writable(path, "plot")  # before the figure is drawn
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

    panels = shown_panels([rows for rows, _ in read])
    columns = 2 if len(panels) <= 4 else 3 if len(panels) <= 6 else 4
    rows_of_panels = math.ceil(len(panels) / columns)
    fig = Figure(figsize=(6 * columns, 4 * rows_of_panels), dpi=100, layout="constrained")
    axes = list(fig.subplots(rows_of_panels, columns, sharex=True, squeeze=False).flat)
    for ax in axes[len(panels):]:
        ax.remove()
    for i, (label, (rows, _)) in enumerate(zip(names(runs), read)):
        for ax, (title, keys) in zip(axes, panels):
            for key, style in keys:
                steps, values = series(rows, key)
                if steps:
                    ax.plot(steps, values, style, color=f"C{i}", markersize=4,
                            label=label if key == "loss" else None)
    for j, (ax, (title, keys)) in enumerate(zip(axes, panels)):
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if j + columns >= len(panels):  # the lowest panel of its column
            ax.set_xlabel("step")
            ax.xaxis.set_tick_params(labelbottom=True)
        if keys[0][0] == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    axes[0].legend()

    write_file(out, "plot", lambda f: fig.savefig(f, format="png"))
    steps = [r["step"] for rows, _ in read for r in rows]
    skipped = sum(s for _, s in read)
    note = f", skipped {skipped} unreadable line{'s' * (skipped > 1)}" if skipped else ""
    print(f"wrote {out} ({len(runs)} run{'s' * (len(runs) > 1)}, steps {min(steps)}-{max(steps)}{note})")
    return 0
