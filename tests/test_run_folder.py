"""Issue 27's first hour of a new user, one test per class that failed on the old main: each runs
the real CLI on real files and checks that nothing is lost, nothing is silently changed, and every
refusal is one line (signals and file systems are in test_faults.py, data values in
test_data_fidelity.py, odd recipe values in test_recipe_fuzz.py)."""

import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

import pytest

from helpers import (ROOT, alpaca_rows, base_recipe, finish, run_toolkit, start, user_error_line, write_jsonl,
                      write_recipe)

pytestmark = pytest.mark.launch  # every test here starts processes


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("first_hour")
    write_jsonl(d / "train.jsonl", alpaca_rows(32, seed=41))
    write_jsonl(d / "eval.jsonl", alpaca_rows(4, seed=42))
    return d


def recipe(work: Path, name: str, **overrides) -> Path:
    r = base_recipe(work, work / "train.jsonl", work / "eval.jsonl", out=name, train__max_steps=3,
                    train__warmup_steps=1, **overrides)
    return write_recipe(work / f"{name}.yaml", **r)


@pytest.fixture(scope="module")
def finished(work):
    """A finished run with a checkpoint: the folder users fear losing."""
    proc = run_toolkit("train", recipe(work, "old"), "checkpoint.every_steps=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return work / "old"


# ----------------------------------------------------------------------------- overwrite, lock


def test_overwrite_with_a_bad_data_file_keeps_the_earlier_run(work, finished):
    before = snapshot(finished)
    proc = run_toolkit("train", recipe(work, "old"), "overwrite=true", f"data.train_files=[{work / 'typo.jsonl'}]")
    assert "data.train_files: file not found" in user_error_line(proc)
    assert snapshot(finished) == before


def test_overwrite_never_clears_a_folder_that_is_not_a_run(work):
    proj = work / "proj"
    proj.mkdir()
    shutil.copy(work / "train.jsonl", proj / "train.jsonl")
    (proj / "notes.txt").write_text("mine")
    before = snapshot(proj)
    proc = run_toolkit("train", recipe(work, "p"), f"output_dir={proj}", "overwrite=true",
                       f"data.train_files=[{proj / 'train.jsonl'}]")
    assert "is not a toolkit run folder (it holds notes.txt, train.jsonl)" in user_error_line(proc)
    assert snapshot(proj) == before


def test_overwrite_replaces_a_run_only_once_the_new_one_starts(work, finished, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    proc = run_toolkit("train", recipe(work, "again"), f"output_dir={run}", "overwrite=true", "train.max_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "overwrite: removed the earlier run's checkpoints, config.yaml, final" in proc.stdout
    assert not (run / "checkpoints").exists()  # the new run took none
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]


def test_a_second_run_into_a_folder_in_use_is_refused_and_a_dead_ones_lock_is_taken_over(work, tmp_path):
    out = tmp_path / "busy"
    first = start([sys.executable, "-m", "toolkit", "train", recipe(work, "busy"), f"output_dir={out}",
                   "train.max_steps=100000", "train.log_every_steps=100000"])
    lock = out / ".toolkit.lock"
    deadline = time.time() + 120
    while not (out / "metrics.jsonl").exists() and time.time() < deadline:
        time.sleep(0.2)
    assert json.loads(lock.read_text())["pid"] == first.pid
    second = run_toolkit("train", recipe(work, "busy"), f"output_dir={out}", "resume=auto")
    assert f"is in use by process {first.pid}" in user_error_line(second)
    first.kill()  # SIGKILL: its lock stays behind
    finish(first)
    assert lock.exists()
    again = run_toolkit("train", recipe(work, "busy"), f"output_dir={out}", "overwrite=true")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"took over the lock of process {first.pid}" in again.stdout
    assert not lock.exists()


def test_a_refused_run_leaves_no_folder_behind(work, tmp_path):
    proc = run_toolkit("train", recipe(work, "x"), f"output_dir={tmp_path / 'new'}", "train.warmup_steps=50",
                       "train.max_steps=null", "train.epochs=1")
    assert "train.warmup_steps: 50 warmup steps exceed the 4 optimizer steps that train.epochs=1 gives" \
        in user_error_line(proc)
    assert not (tmp_path / "new").exists()


# ----------------------------------------------------------------------------- resume


def test_resume_after_a_kill_that_cut_metrics_mid_line(work, tmp_path):
    out = tmp_path / "cut"
    proc = run_toolkit("train", recipe(work, "cut"), f"output_dir={out}", "checkpoint.every_steps=1")
    assert proc.returncode == 0
    shutil.rmtree(out / "final")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 1.2')  # the kill landed mid-write
    proc = run_toolkit("train", recipe(work, "cut"), f"output_dir={out}", "checkpoint.every_steps=1", "resume=auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3]


@pytest.mark.parametrize("change", [["data.eval_files=[]"], pytest.param(["data.num_proc=1"], marks=pytest.mark.slow),
                                    pytest.param(["train.eval_every_steps=2"], marks=pytest.mark.slow)])
def test_resume_allows_changes_that_learn_nothing_else(work, tmp_path, change):
    out = tmp_path / "r"
    first = run_toolkit("train", recipe(work, "r"), f"output_dir={out}", "checkpoint.every_steps=1", "train.max_steps=2")
    assert first.returncode == 0
    shutil.rmtree(out / "final")
    proc = run_toolkit("train", recipe(work, "r"), f"output_dir={out}", "checkpoint.every_steps=1",
                       "train.max_steps=2", "resume=auto", *change)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout


# ----------------------------------------------------------------------------- after training


@pytest.fixture(scope="module")
def lora_on_a_folder(work):
    """A LoRA run over a local base folder named by a relative model.path."""
    from toolkit.config import ModelConfig
    from toolkit.model.load import build_byte_tokenizer, build_model

    base = work / "base"
    build_model(ModelConfig(preset="tiny-llama-mini")).save_pretrained(base)
    build_byte_tokenizer().save_pretrained(base)
    r = recipe(work, "lora", model={"path": "base"}, lora={"enabled": True})
    proc = run_toolkit("train", r, cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return work / "lora" / "final", base


def test_adapter_records_its_base_by_absolute_path(lora_on_a_folder, tmp_path):
    final, base = lora_on_a_folder
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base.resolve())
    proc = run_toolkit("generate", final, "--prompt", "hi", "--max-new-tokens", "2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_replaced_base_is_refused_by_merge_generate_and_eval(lora_on_a_folder, work, tmp_path):
    from toolkit.config import ModelConfig
    from toolkit.model.load import build_model

    final, base = lora_on_a_folder
    kept = tmp_path / "original"
    shutil.copytree(base, kept)
    try:
        import torch

        torch.manual_seed(123)
        build_model(ModelConfig(preset="tiny-llama-mini")).save_pretrained(base)  # another model, same shapes
        for args in (["merge", final, "--out", tmp_path / "merged"], ["generate", final, "--prompt", "hi"],
                     ["eval", final, "--data", work / "eval.jsonl"]):
            line = user_error_line(run_toolkit(*args))
            assert f"the base model {base}" in line and "is not the one" in line, line
        assert not (tmp_path / "merged").exists()
        proc = run_toolkit("merge", final, "--out", tmp_path / "merged", "--base", kept)
        assert proc.returncode == 0, proc.stderr[-2000:]
    finally:
        shutil.rmtree(base)
        shutil.copytree(kept, base)


def test_config_show_refuses_a_negative_process_count(work):
    proc = run_toolkit("config", "show", recipe(work, "c"), "--accelerate-config",
                       ROOT / "accelerate_configs" / "ddp.yaml", "--num-processes", "-2")
    assert "--num-processes: must be positive, got -2" in user_error_line(proc)


# ----------------------------------------------------------------------------- data shapes


def chat(user="hi", answer="hello") -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def trained_first_example(work: Path, rows: list[dict], tmp_path: Path, name: str = "run") -> str:
    data = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    proc = run_toolkit("train", recipe(work, "chat"), f"output_dir={tmp_path / name}", f"data.train_files=[{data}]",
                       "data.format=messages", "data.eval_files=[]", "data.max_seq_len=512")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_a_conversation_with_no_messages_is_dropped_by_row(work, tmp_path):
    proc = trained_first_example(work, [{"messages": []}] + [chat()] * 120, tmp_path)
    assert "row 1: no target tokens left (messages is null or missing); dropped 1 such row(s) of 121" in proc.stdout


def test_an_opening_assistant_turn_is_context_and_tool_calls_are_rendered(work, tmp_path):
    opening = {"messages": [{"role": "assistant", "content": "Welcome!"}, {"role": "user", "content": "hi"},
                            {"role": "assistant", "content": "hello"}]}
    tool = {"messages": [{"role": "user", "content": "weather?"},
                         {"role": "assistant", "content": None,
                          "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                           "arguments": {"city": "Paris"}}}]},
                         {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}]}
    proc = trained_first_example(work, [opening] * 20, tmp_path)
    assert "<s><|assistant|>\\nWelcome!</s>\\n<|user|>\\nhi</s>\\n<|assistant|>\\n[[hello</s>\\n]]" in proc.stdout
    proc = trained_first_example(work, [tool] * 20, tmp_path, "tools")
    assert ('[[<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call></s>\\n]]'
            '<|tool|>\\nsunny</s>\\n<|assistant|>\\n[[It is sunny.</s>\\n]]') in proc.stdout


def test_save_to_disk_folders_and_sharegpt_rows_train(work, tmp_path):
    import datasets

    sharegpt = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}] * 20
    datasets.DatasetDict({"train": datasets.Dataset.from_list(sharegpt),
                          "test": datasets.Dataset.from_list(sharegpt[:4])}).save_to_disk(str(tmp_path / "saved"))
    proc = run_toolkit("train", recipe(work, "saved"), f"output_dir={tmp_path / 'run'}",
                       f"data.train_files=[{tmp_path / 'saved'}]", "data.format=messages", "data.eval_files=[]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "<s><|user|>\\nhi</s>\\n<|assistant|>\\n[[hello</s>\\n]]" in proc.stdout
    line = user_error_line(run_toolkit("train", recipe(work, "saved"), f"output_dir={tmp_path / 'run2'}",
                                       f"data.train_files=[{{path: {tmp_path / 'saved'}, split: validation}}]",
                                       "data.format=messages", "data.eval_files=[]"))
    assert "has splits train, test; no split 'validation'" in line


# ----------------------------------------------------------------------------- recipe values


@pytest.mark.parametrize("override,fragment", [
    ("seed=-1", "seed: must be in [0, 2**32), got -1"),
    ("train.learning_rate=.nan", "train.learning_rate: must be a finite number"),
    ("train.adam_epsilon=inf", "train.adam_epsilon: must be a finite number"),
    ("model.attn_implementation=flash_attention_2", "flash_attention_2 needs the flash-attn package"),
])
def test_recipe_values_that_would_fail_late_are_refused_at_load(work, override, fragment, tmp_path):
    if "flash" in override:
        pytest.importorskip("torch")
        import importlib.util

        if importlib.util.find_spec("flash_attn") is not None:
            pytest.skip("flash-attn is installed here")
    line = user_error_line(run_toolkit("train", recipe(work, "v"), f"output_dir={tmp_path / 'run'}", override))
    assert fragment in line
    assert not (tmp_path / "run").exists()


def test_a_recipe_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("output_dir: café\n".encode("latin-1"))
    assert "not UTF-8 text (byte 0xe9 at offset 15)" in user_error_line(run_toolkit("train", path))


def test_eval_scores_integer_and_csv_references(work, finished, tmp_path):
    """References that are not JSON strings (an integer; any CSV cell) are references: before, eval
    skipped them all and reported that no row had one."""
    write_jsonl(tmp_path / "numbers.jsonl", [{"instruction": f"{i} plus one", "output": i + 1} for i in range(4)])
    (tmp_path / "numbers.csv").write_text("instruction,output\n" + "".join(f"{i} plus one,0{i + 1}\n" for i in range(4)))
    for data in ("numbers.jsonl", "numbers.csv"):
        proc = run_toolkit("eval", finished / "final", "--data", tmp_path / data, "--max-new-tokens", "3")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "of 4 correct" in proc.stdout + proc.stderr, (data, proc.stdout[-2000:])
