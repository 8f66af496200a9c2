"""`toolkit plot`: real runs of the tiny preset, plotted through the real CLI, the PNG read back.

The PNG is judged by its pixels: size, how many distinct colors it has (a blank canvas has one,
and `test_the_image_checks_can_fail` shows the checks refuse one), and whether the second run's
color (matplotlib's C1, orange) is there only when two runs are overlaid.
"""

import hashlib
import shutil
from pathlib import Path

import numpy as np
import pytest

from helpers import alpaca_rows, base_recipe, read_metrics, run_toolkit, user_error_line, write_jsonl, write_recipe

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ORANGE = np.array([1.0, 0.498, 0.055])  # C1: the second run's lines


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[Path]:
    """Two 8-step runs (eval every 4 steps) with different learning rates."""
    d = tmp_path_factory.mktemp("plot")
    train = write_jsonl(d / "train.jsonl", alpaca_rows(64, seed=1))
    evaluation = write_jsonl(d / "eval.jsonl", alpaca_rows(12, seed=2))
    out = []
    for name, lr in (("lr-1e-3", 1e-3), ("lr-3e-3", 3e-3)):
        recipe = base_recipe(d, train, evaluation, out=name, train__learning_rate=lr, train__eval_every_steps=4)
        proc = run_toolkit("train", write_recipe(d / f"{name}.yaml", **recipe))
        assert proc.returncode == 0, proc.stderr[-3000:]
        out.append(d / name)
    rows = read_metrics(out[0])
    assert [r["step"] for r in rows] == list(range(9)) and [r["step"] for r in rows if "eval_loss" in r] == [0, 4, 8]
    return out


def pixels(path: Path) -> np.ndarray:
    """The PNG's RGB pixels, floats in [0, 1], after checking the file is a PNG."""
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG_MAGIC, path
    return imread(path)[..., :3]


def check_drawn(path: Path) -> np.ndarray:
    image = pixels(path)
    height, width = image.shape[:2]
    assert 600 <= width <= 3000 and 400 <= height <= 2000, image.shape
    colors = len(np.unique((image * 255).round().astype(np.uint8).reshape(-1, 3), axis=0))
    assert colors >= 50, f"{path}: only {colors} distinct colors: not a drawn plot"
    not_white = (image < 0.95).any(axis=-1).mean()
    assert 0.01 < not_white < 0.5, f"{path}: {not_white:.1%} of the pixels are not white"
    return image


def orange_pixels(image: np.ndarray) -> int:
    return int((np.abs(image - ORANGE).max(axis=-1) < 0.06).sum())


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in root.rglob("*") if p.is_file()}


@pytest.mark.launch
def test_one_run(runs):
    run = runs[0]
    before = snapshot(run)
    proc = run_toolkit("plot", run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == f"wrote {run / 'plot.png'} (1 run, steps 0-8)"
    image = check_drawn(run / "plot.png")
    assert orange_pixels(image) == 0  # one run: one color
    after = snapshot(run)
    assert after.pop("plot.png") and after == before  # the PNG is all it wrote, no temporary file left


@pytest.mark.launch
def test_two_runs_overlaid(runs, tmp_path):
    out = tmp_path / "compare.png"
    proc = run_toolkit("plot", *runs, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == f"wrote {out} (2 runs, steps 0-8)"
    assert orange_pixels(check_drawn(out)) > 200  # the second run is drawn too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["compare.png"]


@pytest.mark.launch
def test_a_line_cut_short_is_skipped(runs, tmp_path):
    """A run killed mid-write leaves half a line at the end; the rest is plotted."""
    run = shutil.copytree(runs[0], tmp_path / "killed")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "epoch": 1.1, "lo')
    proc = run_toolkit("plot", run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == f"wrote {run / 'plot.png'} (1 run, steps 0-8, skipped 1 unreadable line)"
    check_drawn(run / "plot.png")


def test_equal_folder_names_are_told_apart(tmp_path):
    from toolkit.verbs.plot import names

    assert names([tmp_path / "a" / "run", tmp_path / "b" / "run"]) == ["a/run", "b/run"]
    assert names([tmp_path / "x", tmp_path / "y"]) == ["x", "y"]
    assert names([tmp_path / "x", tmp_path / "x"]) == [f"{tmp_path.name}/x (1)", f"{tmp_path.name}/x (2)"]


def test_the_image_checks_can_fail(tmp_path):
    """A blank canvas of the same size fails `check_drawn`; so does a file that is not a PNG."""
    from matplotlib.figure import Figure

    Figure(figsize=(12, 8), dpi=100).savefig(tmp_path / "blank.png")
    with pytest.raises(AssertionError, match="distinct colors"):
        check_drawn(tmp_path / "blank.png")
    (tmp_path / "fake.png").write_bytes(b"GIF89a" + bytes(100))
    with pytest.raises(AssertionError):
        check_drawn(tmp_path / "fake.png")


@pytest.mark.launch
def test_refusals(runs, tmp_path):
    """Each user mistake: exit 2, one `error:` line naming the path, no traceback, nothing written."""
    empty = tmp_path / "empty"
    empty.mkdir()
    only_eval = tmp_path / "only-eval"
    write_jsonl(only_eval / "metrics.jsonl", [{"step": 0, "epoch": 0.0, "eval_loss": 3.2}])
    cases = [((tmp_path / "missing",), "no such folder"),
             ((empty,), "no metrics.jsonl"),
             ((runs[0], empty), "no metrics.jsonl"),
             ((only_eval,), "no training rows"),
             ((runs[0], "--out", tmp_path / "nowhere" / "x.png"), "does not exist")]
    for args, reason in cases:
        named = args[-1] if reason != "no metrics.jsonl" else empty
        line = user_error_line(run_toolkit("plot", *args))
        assert str(named) in line and reason in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "only-eval"]
    assert [p.name for p in empty.iterdir()] == [] and [p.name for p in only_eval.iterdir()] == ["metrics.jsonl"]


def rl_rows(steps: int = 6) -> list[dict]:
    """metrics.jsonl of an online-RL run as the loop writes it (rl.method=grpo): eval_reward, no eval_loss."""
    rows = [{"step": 0, "epoch": 0.0, "eval_reward": 0.1}]
    for s in range(1, steps + 1):
        rows.append({"step": s, "epoch": s / steps, "loss": 0.01 * (-1) ** s, "reward": 0.1 * s, "reward_std": 0.3,
                     "reward_exact_match": 0.1 * s, "completion_length": 20.0 - s, "completion_length_min": 2.0,
                     "completion_length_max": 32.0, "clipped_completions": 0.3 / s, "zero_std_groups": 0.05 * s,
                     "clip_ratio": 0.0, "entropy": 1.5, "generation_seconds": 0.4, "lr": 1e-5, "grad_norm": 0.5,
                     "tokens": 900 * s, "tokens_per_second": 450.0, "target_tokens_per_second": 120.0,
                     **({"eval_reward": 0.08 * s} if s % 3 == 0 else {})})
    return rows


def test_an_rl_run_gets_its_reward_panels(tmp_path, capsys):
    """An online-RL run (metrics written by hand, no training): reward (train line, eval dots), completion
    length, entropy and zero_std_groups panels beside the four of every run; a supervised run keeps its 2 x 2 of
    those four, the RL panels left out; overlaid, the panels of either are drawn."""
    from toolkit.cli import main
    from toolkit.verbs.plot import shown_panels

    rl, sft = tmp_path / "grpo", tmp_path / "sft"
    write_jsonl(rl / "metrics.jsonl", rl_rows())
    write_jsonl(sft / "metrics.jsonl", [{"step": 0, "epoch": 0.0, "eval_loss": 3.0}]
                + [{"step": s, "epoch": s / 6, "loss": 3.0 - 0.2 * s, "lr": 1e-4, "grad_norm": 1.0 + s,
                    "tokens_per_second": 100.0 + s} for s in range(1, 7)])
    everyday = ["loss", "learning rate", "grad norm", "tokens/s"]
    rl_titles = [title.split(" (")[0].split(",")[0] for title, _ in shown_panels([rl_rows()])]
    assert rl_titles == ["loss", "reward", "completion length", "entropy", "zero_std_groups", *everyday[1:]]
    reward_keys = dict(shown_panels([rl_rows()]))["reward (line: train, dots: eval)"]
    assert reward_keys == [("reward", "-"), ("eval_reward", "o:")]

    assert main(["plot", str(rl)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {rl / 'plot.png'} (1 run, steps 0-6)"
    assert check_drawn(rl / "plot.png").shape[:2] == (800, 2400)  # 8 panels: 4 columns x 2 rows
    assert main(["plot", str(sft)]) == 0
    assert check_drawn(sft / "plot.png").shape[:2] == (800, 1200)  # 4 panels: 2 x 2, as before
    out = tmp_path / "both.png"
    assert main(["plot", str(rl), str(sft), "--out", str(out)]) == 0
    assert orange_pixels(check_drawn(out)) > 200 and check_drawn(out).shape[:2] == (800, 2400)
