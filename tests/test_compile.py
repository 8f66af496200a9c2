"""train.compile: each decoder layer compiled with dynamic shapes learns what the eager model learns,
and a batch of a new length (packed, padding-free: every step) does not compile again."""

import re

import pytest
import torch
from test_padding_free import messages_recipe

from helpers import base_recipe, read_metrics, run_toolkit, user_error_line, write_recipe

pytestmark = pytest.mark.launch  # every test here starts processes


def graphs(proc) -> int:
    found = re.findall(r"compile: (\d+) graphs built", proc.stdout + proc.stderr)
    assert len(found) == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    return int(found[0])


def test_compiled_layers_train_as_eager_without_recompiling(tmp_path):
    """One compiled run of 6 steps (each batch a new length): the losses of the eager run, and the
    graph count logged at step 2 (after the first recompile for dynamic shapes) unchanged at step 6."""
    runs = {}
    for name, compiled in (("eager", False), ("long", True)):
        recipe = messages_recipe(tmp_path, name, packing=True)
        recipe["data"]["padding_free"] = True
        recipe["train"].update(max_steps=6, eval_every_steps=0, compile=compiled)
        proc = run_toolkit("train", write_recipe(tmp_path / f"{name}.yaml", **recipe))
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = proc
    eager = [r["loss"] for r in read_metrics(tmp_path / "eager") if "loss" in r]
    rows = [r for r in read_metrics(tmp_path / "long") if "loss" in r]
    compiled = [r["loss"] for r in rows]
    assert len(eager) == len(compiled) == 6
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-4, atol=0)
    tokens = [r["tokens"] for r in rows]
    lengths = {b - a for a, b in zip(tokens, tokens[1:])}
    assert len(lengths) > 1  # the steps' batches did differ in length
    assert "compile: 2 decoder layers" in runs["long"].stdout + runs["long"].stderr
    counts = [r["compiled_graphs"] for r in rows]
    assert counts[1] == counts[-1] == graphs(runs["long"]) > 0, counts  # 4 more steps, no new graph
    assert "compiled_graphs" not in read_metrics(tmp_path / "eager")[-1]


def test_compile_is_refused_under_zero3(tmp_path, data_files):
    from helpers import ROOT, accelerate_launch

    train_f, eval_f = data_files
    recipe = base_recipe(tmp_path, train_f, eval_f, train__compile=True)
    proc = run_toolkit("train", write_recipe(tmp_path / "r.yaml", **recipe),
                       launcher=accelerate_launch(ROOT / "accelerate_configs" / "zero3.yaml"))
    line = user_error_line(proc, launched=True)
    assert "train.compile" in line and "ZeRO-3" in line, line
