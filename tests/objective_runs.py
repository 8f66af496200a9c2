"""What the launched tests of the dataset objectives (DPO, KTO, reward models) share: their recipes
written from sections with `section__key` overrides, a run trained under a layout, two runs compared
step by step and weight by weight, and a run killed by SIGKILL resumed to the uninterrupted one."""

import math
from pathlib import Path

import torch

from helpers import (
    finish,
    kill_after_step,
    layout_command,
    load_weights,
    read_metrics,
    start,
    with_overrides,
    write_recipe,
)


def sectioned_recipe(path: Path, sections: dict, **extra) -> Path:
    """`sections` written to `path`, with `extra` overrides: section__key=value, or section=value."""
    return write_recipe(path, **with_overrides(sections, extra))


def trained(workdir: Path, layout: str, path: Path, *overrides) -> tuple[Path, str]:
    """The run of the recipe at `path` under `layout` (single, ddp, fsdp, zero3): its folder and log."""
    rc, out, err = finish(start(layout_command(workdir, layout, path, *overrides)))
    assert rc == 0, err[-3000:]
    import yaml

    return Path(yaml.safe_load(path.read_text())["output_dir"]), out + err


def assert_runs_close(a: Path, b: Path, keys: tuple[str, ...], steps: int, tol: float = 1e-4, first: int = 0) -> None:
    """Each logged step from `first` and each `keys` metric, and every final weight, within `tol`."""
    ra, rb = [r for r in read_metrics(a) if r["step"] >= first], [r for r in read_metrics(b) if r["step"] >= first]
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == list(range(first, steps + 1))
    for x, y in zip(ra, rb):
        for k in keys:
            if x.get(k) is not None or y.get(k) is not None:
                assert math.isclose(x[k], y[k], rel_tol=tol, abs_tol=tol * 1e-2), (x["step"], k, x[k], y[k])
    wa, wb = load_weights(a / "final"), load_weights(b / "final")
    assert wa.keys() == wb.keys() and wa
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=tol, atol=tol, msg=k)


def assert_sigkill_resumes_bitwise(workdir: Path, path: Path, reference: Path, step: int = 2,
                                   fault: str | None = None) -> Path:
    """The recipe at `path` killed by SIGKILL once step `step` is logged (or, with `fault`, by the
    toolkit's own fault seam, TOOLKIT_FAULT_SIGNAL=`fault`: where a run is too fast to catch between
    steps), then resumed on one process, ends with the metrics (but the measured ones) and the weights
    of `reference`, bit for bit."""
    import yaml

    from toolkit.observe.measure import MEASURED

    run = Path(yaml.safe_load(path.read_text())["output_dir"])
    if fault is None:
        kill_after_step(start(layout_command(workdir, "single", path)), run, step)
    else:
        rc, _, err = finish(start(layout_command(workdir, "single", path), env={"TOOLKIT_FAULT_SIGNAL": fault}))
        assert rc == -9, (rc, err[-2000:])
    assert not (run / "final").exists(), "the kill came after the run finished"
    rc, out, err = finish(start(layout_command(workdir, "single", path, "resume=auto")))
    assert rc == 0, err[-3000:]
    assert "resumed from" in out

    def comparable(folder):
        return [{k: v for k, v in r.items() if k not in MEASURED} for r in read_metrics(folder)]

    assert comparable(run) == comparable(reference)
    want, have = load_weights(reference / "final"), load_weights(run / "final")
    assert all(torch.equal(want[k], have[k]) for k in want)
    return run
