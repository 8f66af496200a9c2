"""Recipe fuzzing: every numeric key of the recipe with 0, -1, inf, nan and huge values, and the
path keys with `~`, spaces, a missing path and a file where a folder belongs. Each must end in one
line naming its key with exit code 2, or in a correct run (exit 0, or a documented stop).

Every numeric key x value is loaded in-process (fast, all of them in CI); the values that load
are launched for real: a representative few in CI, all of them under `-m slow`.
"""

import dataclasses
import math
import typing
from pathlib import Path

import pytest

from toolkit.config import ConfigError, Recipe, load_recipe

from helpers import alpaca_rows, base_recipe, run_toolkit, write_jsonl, write_recipe

VALUES = ["0", "-1", "inf", "-inf", ".nan", "1e30", "1000000000000"]


def numeric_keys(cls=Recipe, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            yield from numeric_keys(hint, prefix + f.name + ".")
            continue
        args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        if args[0] in (int, float):
            yield prefix + f.name


NUMERIC = list(numeric_keys())


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    write_jsonl(d / "train.jsonl", alpaca_rows(32, seed=31))
    write_jsonl(d / "eval.jsonl", alpaca_rows(4, seed=32))
    recipe = base_recipe(d, d / "train.jsonl", d / "eval.jsonl", out="run", train__max_steps=3, train__warmup_steps=1)
    return d, write_recipe(d / "recipe.yaml", **recipe)


def test_every_numeric_key_is_found():
    assert len(NUMERIC) >= 30 and "train.learning_rate" in NUMERIC and "lora.r" in NUMERIC, NUMERIC


@pytest.mark.parametrize("key", NUMERIC)
def test_odd_numbers_are_refused_naming_their_key_or_loaded(work, key):
    _, path = work
    for value in VALUES:
        try:
            recipe = load_recipe(path, [f"{key}={value}"])
        except ConfigError as e:
            assert f": {key}: " in str(e), (key, value, str(e))
            continue
        loaded = recipe
        for part in key.split("."):
            loaded = getattr(loaded, part)
        assert isinstance(loaded, (int, float)) and math.isfinite(loaded), (key, value, loaded)


def accepted_odd_values(path) -> list[str]:
    accepted = []
    for key in NUMERIC:
        for value in VALUES:
            try:
                load_recipe(path, [f"{key}={value}"])
            except ConfigError:
                continue
            accepted.append(f"{key}={value}")
    return accepted


# What a launch of each accepted odd value did, measured on this host (the fuzz below re-checks it):
# exit 0 (trained), 2 (one line) or 3 (stopped: loss not finite). None ended otherwise.
CI_LAUNCHES = ["lora.r=1000000000000", "train.learning_rate=1e30"]


def launch_args(override: str) -> list[str]:
    key = override.split("=")[0]
    extra = [] if key in ("train.max_steps", "train.epochs") else ["train.max_steps=3"]
    if key.startswith("lora."):
        extra.append("lora.enabled=true")
    return [override, *extra]


def check_launch(work, override: str, tmp_path: Path, timeout: int = 300):
    d, path = work
    args = launch_args(override)
    key = override.split("=")[0]
    if key in ("train.max_steps", "train.epochs", "train.eval_every_steps", "train.log_every_steps",
               "checkpoint.every_steps", "train.sample_max_new_tokens"):
        pytest.skip(f"{override}: a run that long is its own test (it trains, it does not fail)")
    proc = run_toolkit("train", path, f"output_dir={tmp_path / 'run'}", *args, timeout=timeout)
    assert "Traceback" not in proc.stderr, (override, proc.stderr[-3000:])
    assert proc.returncode in (0, 2, 3), (override, proc.returncode, proc.stderr[-3000:])
    lines = [line for line in proc.stderr.splitlines() if line.startswith(("error: ", "stopped: "))]
    if proc.returncode == 0:
        assert lines == [] and (tmp_path / "run" / "final").is_dir(), (override, proc.stderr[-2000:])
    else:
        assert len(lines) == 1, (override, proc.stderr[-2000:])
        if proc.returncode == 2:
            assert key.split(".")[-1] in lines[0] and not (tmp_path / "run").exists(), (override, lines[0])


@pytest.mark.launch
@pytest.mark.parametrize("override", CI_LAUNCHES)
def test_odd_values_that_load_train_or_stop_in_one_line(work, override, tmp_path):
    check_launch(work, override, tmp_path)


@pytest.mark.launch
@pytest.mark.slow
def test_every_odd_value_that_loads_trains_or_stops_in_one_line(work, tmp_path_factory):
    for override in accepted_odd_values(work[1]) + ["train.max_grad_norm=0", "data.max_seq_len=1000000000000"]:
        try:
            check_launch(work, override, tmp_path_factory.mktemp("launch"))
        except pytest.skip.Exception:
            continue


def path_cases(d: Path) -> dict:
    """key=value -> what must happen: "ok" or a fragment of the one error line."""
    (d / "a file").write_text("x")
    spaced = d / "with space"
    spaced.mkdir(exist_ok=True)
    write_jsonl(spaced / "train set.jsonl", alpaca_rows(32, seed=31))
    return {
        f"output_dir={spaced / 'run dir'}": "ok",
        f"output_dir={d / 'a file'}": "exists and is not a folder",
        f"output_dir={d / 'a file' / 'run'}": "output_dir: cannot create",
        f"data.train_files={spaced / 'train set.jsonl'}": "ok",
        f"data.train_files={d / 'missing.jsonl'}": "data.train_files: file not found",
        f"data.train_files={d}/nothing*.jsonl": "data.train_files: no files match",
        f"data.eval_files={d / 'missing.jsonl'}": "data.eval_files: file not found",
        f"model.path={d / 'a file'}": "model.path",
        f"model.path={d / 'no model'}": "model.path: folder not found",
        f"resume={d / 'no checkpoint'}": "folder not found",
        f"resume={d / 'a file'}": "resume",
    }


CI_PATH_CASES = {0, 2, 4, 8}  # spaces, a file where a folder belongs, a missing file, a file as model.path


@pytest.mark.launch
@pytest.mark.parametrize("case", [pytest.param(i, marks=() if i in CI_PATH_CASES else pytest.mark.slow)
                                  for i in range(11)])
def test_path_keys_are_one_line_or_a_run(work, case, tmp_path):
    d, path = work
    override, want = list(path_cases(d).items())[case]
    extra = ["model.preset=null"] if override.startswith("model.path") else []
    proc = run_toolkit("train", path, f"output_dir={tmp_path / 'run'}", *extra, override, timeout=300)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if want == "ok":
        assert proc.returncode == 0, proc.stderr[-3000:]
        return
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and want in errors[0], (override, proc.stderr[-2000:])
    assert (d / "a file").read_text() == "x"


@pytest.mark.launch
def test_tilde_in_output_dir_is_the_home_folder(work, tmp_path, monkeypatch):
    _, path = work
    monkeypatch.setenv("HOME", str(tmp_path))
    proc = run_toolkit("train", path, "output_dir=~/runs/x", env={"HOME": str(tmp_path)}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "runs" / "x" / "final").is_dir()
    assert not Path("~").exists()
