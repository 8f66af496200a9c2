"""train.sample_prompts: answers generated at every evaluation, printed and kept in metrics.jsonl.
They must be what the model of that step says (the last ones equal `toolkit generate`'s answers
from final/), and a backend that shards the weights must not hang in them (every rank generates)."""

import sys

import pytest

from helpers import ROOT, read_metrics, require_op, run_toolkit, write_recipe

pytestmark = pytest.mark.launch  # every test here starts processes

PROMPTS = ["Last letter. plum", "Count the letters. abcde", "Even or odd? 12"]


def recipe(tmp_path, out="run", **train):
    return {
        "output_dir": str(tmp_path / out), "seed": 3, "model": {"preset": "tiny-llama-mini"},
        "data": {"train_files": [str(ROOT / "examples/data/tasks_messages_train.jsonl")],
                 "eval_files": [str(ROOT / "examples/data/tasks_messages_eval.jsonl")], "format": "messages",
                 "max_seq_len": 64},
        "train": {"micro_batch_size": 4, "max_steps": 6, "eval_every_steps": 3, "learning_rate": 3e-3,
                  "warmup_steps": 1, "sample_prompts": PROMPTS, "sample_max_new_tokens": 6, **train},
    }


def final_answers(run):
    from toolkit.model.inference import generate_answers, load_for_inference

    model, tokenizer = load_for_inference(str(run / "final"), "fp32")
    return generate_answers(model, tokenizer, PROMPTS, max_new_tokens=6)


def check_samples(run, stdout_and_err: str):
    rows = [r for r in read_metrics(run) if "samples" in r]
    assert [r["step"] for r in rows] == [0, 3, 6]
    for r in rows:
        assert [s["prompt"] for s in r["samples"]] == PROMPTS
    last = rows[-1]["samples"]
    assert [s["answer"] for s in last] == final_answers(run)
    assert f"step 6/6 | sample {PROMPTS[0]!r} -> {last[0]['answer']!r}" in stdout_and_err


def test_samples_are_logged_at_each_eval_and_match_the_final_model(tmp_path):
    path = write_recipe(tmp_path / "r.yaml", **recipe(tmp_path))
    proc = run_toolkit("train", path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_samples(tmp_path / "run", proc.stdout + proc.stderr)


@pytest.mark.parametrize("backend", ["fsdp", "zero3"])
def test_samples_under_sharded_weights_on_two_ranks(tmp_path, backend, request):
    if backend == "zero3":
        require_op(request.getfixturevalue("deepspeed_ops"), "cpu_adam")
    path = write_recipe(tmp_path / "r.yaml", **recipe(tmp_path, micro_batch_size=2))
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                str(ROOT / "accelerate_configs" / f"{backend}.yaml"), "--num_processes", "2",
                "--main_process_port", "0", "-m"]
    proc = run_toolkit("train", path, launcher=launcher, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_samples(tmp_path / "run", proc.stdout + proc.stderr)


def test_a_bad_sample_setting_is_one_line(tmp_path):
    path = write_recipe(tmp_path / "r.yaml", **recipe(tmp_path, sample_max_new_tokens=0))
    proc = run_toolkit("train", path)
    assert proc.returncode == 2
    assert "train.sample_max_new_tokens: must be positive, got 0" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()
