"""Online RL in the loop (rl.method=grpo, data.format=prompt), launched for real: one process
samples, scores and learns; 2 processes under DDP, FSDP and ZeRO-3 sample the same completions
(the same rewards and lengths per step) and end with the same weights as one process; a run killed
by SIGKILL resumes bitwise, and within float tolerance on another backend; LoRA with a KL term to
the disabled adapter trains and merges; a bad reward function, bad prompt rows and contradicting
settings each end in one line, with the last checkpoint intact."""

import json

import pytest
import torch
from objective_runs import assert_runs_close, sectioned_recipe

from helpers import (
    ROOT,
    finish,
    kill_after_step,
    layout_command,
    load_weights,
    read_metrics,
    run_toolkit,
    start,
    user_error_line,
    write_jsonl,
)

pytestmark = pytest.mark.launch  # every test here starts processes

STEPS = 3
TASKS = ROOT / "examples" / "data" / "tasks_messages_train.jsonl"
# A reward with spread among a random model's completions (their lengths differ), so every step learns.
REWARDS = '''
def shorter(completions, trainer_state, log_metric, log_extra, **kwargs):
    log_metric("seen_step", trainer_state.global_step)
    log_metric("seen_max_steps", trainer_state.max_steps)
    log_extra("characters", [len(c[0]["content"]) for c in completions])
    return [-len(c[0]["content"]) / 10 for c in completions]


def fails_at_step_2(completions, trainer_state, **kwargs):
    if trainer_state.global_step == 1:  # TRL's: the optimizer steps done
        raise ValueError("the grader is down")
    return [0.0 for _ in completions]
'''


def prompts(n: int, skip: int = 0) -> list[dict]:
    with open(TASKS) as f:
        rows = [json.loads(line) for line in f][skip:skip + n]
    return [{"prompt": r["messages"][:-1], "answer": r["messages"][-1]["content"]} for r in rows]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    write_jsonl(root / "train.jsonl", prompts(16))
    write_jsonl(root / "eval.jsonl", prompts(4, skip=100))
    (root / "grader.py").write_text(REWARDS)
    return root


def recipe(workdir, name, layout="single", lora=False, **extra):
    sections = {
        "output_dir": str(workdir / name), "seed": 5, "model": {"preset": "tiny-llama-mini"},
        "lora": {"enabled": True, "r": 4, "alpha": 8} if lora else {"enabled": False},
        "data": {"train_files": [str(workdir / "train.jsonl")], "eval_files": [str(workdir / "eval.jsonl")],
                 "format": "prompt", "max_seq_len": 64},
        "rl": {"method": "grpo", "num_generations": 4, "max_new_tokens": 6, "top_entropy_quantile": 0.5,
               "num_generations_eval": 2, "log_completions": True, "num_completions_to_print": 2,
               "rewards": [f"{workdir / 'grader.py'}:shorter", {"function": "exact_match", "weight": 0.5}]},
        "train": {"micro_batch_size": 2 if layout == "single" else 1, "gradient_accumulation_steps": 2,
                  "max_steps": STEPS, "learning_rate": 1e-2, "eval_every_steps": STEPS, "log_every_steps": 1},
        "checkpoint": {"every_steps": 1, "keep_last": 10},
    }
    return sectioned_recipe(workdir / f"{name}.yaml", sections, **extra)


def command(workdir, layout, path, *overrides):
    return layout_command(workdir, layout, path, *overrides)


def train(workdir, name, layout="single", *overrides, **extra):
    path = recipe(workdir, name, layout, **extra)
    rc, out, err = finish(start(command(workdir, layout, path, *overrides)))
    assert rc == 0, err[-3000:]
    return workdir / name, out + err


# What the completions decide (rewards, lengths) and what is learned from them (loss, clip ratio).
KEYS = ("loss", "reward", "reward_std", "completion_length", "completion_length_max", "zero_std_groups", "clip_ratio",
        "eval_reward")


def assert_close(a, b, tol=1e-4, first=0):
    assert_runs_close(a, b, KEYS, STEPS, tol, first)
    assert table(a, first) == table(b, first)  # every rank's completions gathered, in some order


def table(run, first=0) -> list[tuple]:
    """completions.jsonl's rows from step `first` on, as (step, completion, rewards, characters), sorted."""
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    return sorted((r["step"], r["completion"], r["reward"], r["reward_shorter"], r["reward_exact_match"],
                   r["characters"]) for r in rows if r["step"] >= first)


@pytest.fixture(scope="module")
def single(workdir):
    """One process, full fine-tuning: the reference of the backend cases and of the resume."""
    return train(workdir, "single")


def test_one_process_samples_scores_and_learns(single, workdir):
    run, log = single
    assert "rl: DAPO, 4 completions per prompt" in log and "rl: rewards" in log, log[-3000:]
    assert "the policy term on the top 0.5 of the global batch's completion tokens by entropy" in log
    metrics = read_metrics(run)
    assert "eval_reward" in metrics[0] and "eval_loss" not in metrics[0]
    for row in metrics[1:]:  # trainer_state as TRL's: the optimizer steps done, of the run's; log_metric's means
        assert row["seen_step"] == row["step"] - 1 and row["seen_max_steps"] == STEPS
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [s for s in range(1, STEPS + 1) for _ in range(4 * 4)]  # 4 prompts x 4
    for r in rows:
        assert r["characters"] == len(r["completion"])
        assert r["reward_shorter"] == pytest.approx(-len(r["completion"]) / 10)
        assert r["reward"] == pytest.approx(r["reward_shorter"] + 0.5 * r["reward_exact_match"])
        assert r["prompt"][-1]["role"] == "user" and isinstance(r["advantage"], float)
    for group in range(0, len(rows), 4):  # advantages are centred within each prompt's group
        assert sum(r["advantage"] for r in rows[group:group + 4]) == pytest.approx(0, abs=1e-5)
    for row in metrics[1:]:
        assert 1 <= row["completion_length_min"] <= row["completion_length"] <= row["completion_length_max"] <= 6
        assert 0 <= row["zero_std_groups"] < 1 and row["reward_std"] > 0  # the length reward has spread
        for key in ("reward_shorter", "reward_exact_match", "clip_ratio", "entropy", "generation_seconds",
                    "unscored_completions"):
            assert key in row, key
    base = load_weights(run / "checkpoints" / "step-000001")  # the weights moved, step after step
    assert not all(torch.equal(base[k], v) for k, v in load_weights(run / "final").items() if k in base)
    assert "sample " in log and "(reward " in log  # completions with their rewards at evaluation
    shown = [line for line in log.splitlines()
             if line.startswith("step ") and "' -> " in line and "| sample" not in line]
    assert [line.split(":")[0] for line in shown] == [f"step {s}" for s in range(1, STEPS + 1) for _ in range(2)]
    first = rows[0]  # rl.num_completions_to_print 2: the first two rows of each step's table, with their scores
    assert shown[0].endswith(f"-> {first['completion']!r}, reward {first['reward']:.4g}, advantage "
                             f"{first['advantage']:.4g}"), shown[0]


# FSDP's case runs by hand (`-m slow`) within CI's budget; in CI, FSDP samples and trains in the resume test's move.
@pytest.mark.parametrize("layout", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow), "zero3"])
def test_two_processes_equal_one(layout, workdir, single):
    """Each rank samples its prompts' groups with the same seeds as one process: the same rewards,
    completion lengths, losses and weights within 1e-4."""
    run, log = train(workdir, f"full_{layout}", layout)
    assert_close(single[0], run)
    held, whole = held_while_sampling(log)  # rl.gather_for_sampling (the default): whole weights on every rank
    assert held >= whole if layout != "ddp" else held == pytest.approx(whole, rel=1e-6), (held, whole)


def held_while_sampling(log: str) -> tuple[float, float]:
    """(MiB of the policy's weights a rank held between sampling's forwards, the whole model's MiB), as the run said."""
    said = log.split("rl: between sampling's forwards the policy's weights took ")[1].split("\n")[0]
    return float(said.split(" MiB")[0].replace(",", "")), float(said.split("whole model: ")[1].split(" MiB")[0])


@pytest.mark.parametrize("layout", ["fsdp", "zero3"])
def test_sampling_from_sharded_weights_equals_one_process_and_holds_no_whole_copy(layout, workdir, single):
    """rl.gather_for_sampling false (TRL's ds3_gather_for_generation=False): each forward of sampling gathers a
    layer at a time and frees it, every rank stepping until all are done; the completions, rewards, losses and
    weights equal one process's, and between forwards a rank holds about its half of the weights (gathered: the
    whole model, and more: its shard beside it)."""
    run, log = train(workdir, f"sharded_sampling_{layout}", layout, rl__gather_for_sampling=False)
    assert "each layer gathered in each token's forward" in log and "rl.gather_for_sampling false" in log, log[-3000:]
    held, whole = held_while_sampling(log)
    assert held < 0.6 * whole, (held, whole)
    assert_close(single[0], run)
    _, single_log = single
    assert held_while_sampling(single_log)[0] == pytest.approx(whole, rel=1e-6)  # one process: whole weights


def rloo_rl(workdir) -> dict:
    return {"method": "rloo", "num_generations": 4, "max_new_tokens": 6, "normalize_advantages": True,
            "reward_clip_range": [-0.5, 0.0], "num_generations_eval": 2, "log_completions": True,
            "rewards": [f"{workdir / 'grader.py'}:shorter", {"function": "exact_match", "weight": 0.5}]}


@pytest.fixture(scope="module")
def rloo_single(workdir):
    """One process of rl.method=rloo: the reference of its backend cases and of its resume."""
    return train(workdir, "rloo", rl=rloo_rl(workdir))


def test_rloo_learns(rloo_single):
    """rl.method=rloo (TRL's RLOOTrainer, equal to it in test_grpo_trl.py) in the loop: one process learns, the
    advantages standardised over the global batch (mean 0, not all 0)."""
    run, log = rloo_single
    assert "rl: RLOO (leave-one-out baselines, one ratio per completion)" in log, log[-3000:]
    assert "rewards clipped to [-0.5, 0]; advantages standardised over the global batch" in log
    rows = read_metrics(run)
    assert all(row["reward_std"] > 0 for row in rows[1:])
    table = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    first = [r["advantage"] for r in table if r["step"] == 1]
    assert abs(sum(first) / 16) < 1e-5 and max(map(abs, first)) > 0.5  # standardised: mean 0, std 1 (not all 0)


@pytest.mark.parametrize("layout", ["ddp", "fsdp", "zero3"])
def test_rloo_two_processes_equal_one(layout, workdir, rloo_single):
    """2 processes sample the same completions and end with the same losses and weights within 1e-4 (the
    advantages' moments reduced over the ranks)."""
    run, _ = train(workdir, f"rloo_{layout}", layout, rl=rloo_rl(workdir))
    assert_close(rloo_single[0], run)


def test_rloo_sigkill_resumes_bitwise(workdir, rloo_single):
    """Killed by SIGKILL while step 2 samples (the fault seam: after step 1's checkpoint), resumed: the metrics,
    the completions table and the weights of the run never killed, bit for bit."""
    from objective_runs import assert_sigkill_resumes_bitwise

    path = recipe(workdir, "rloo_killed", rl=rloo_rl(workdir))
    run = assert_sigkill_resumes_bitwise(workdir, path, rloo_single[0], fault="generate:KILL")
    assert table(run) == table(rloo_single[0])


def test_sigkill_resumes_bitwise_and_on_another_backend(workdir, single):
    """Killed after step 1 is logged: resumed on one process it ends bitwise like the run never
    killed; its step-1 checkpoint resumed under FSDP on 2 processes ends within 1e-4."""
    path = recipe(workdir, "killed")
    run = workdir / "killed"
    kill_after_step(start(command(workdir, "single", path)), run, 1)
    assert not (run / "final").exists(), "the kill came after the run finished"
    rc, out, err = finish(start(command(workdir, "single", path, "resume=auto")))
    assert rc == 0, err[-3000:]
    from toolkit.observe.measure import MEASURED

    def comparable(folder):
        return [{k: v for k, v in r.items() if k not in MEASURED} for r in read_metrics(folder)]

    assert comparable(run) == comparable(single[0])
    assert table(run) == table(single[0])  # the rows a killed step wrote are dropped, as metrics.jsonl's
    want, have = load_weights(single[0] / "final"), load_weights(run / "final")
    assert all(torch.equal(want[k], have[k]) for k in want)

    moved = recipe(workdir, "moved", "fsdp", resume=str(run / "checkpoints" / "step-000001"))
    rc, out, err = finish(start(command(workdir, "fsdp", moved)))
    assert rc == 0, err[-3000:]
    assert_close(single[0], workdir / "moved", first=2)


def test_sigterm_while_sampling_finishes_the_step_saves_and_resumes_to_the_same_result(workdir, single):
    """SIGTERM lands while step 2's completions are sampled: the step finishes, its checkpoint is
    saved (exit 75), and resume=auto ends bitwise like the run never stopped."""
    path = recipe(workdir, "sigterm", checkpoint={"every_steps": 0})
    rc, out, err = finish(start(command(workdir, "single", path), env={"TOOLKIT_FAULT_SIGNAL": "generate:TERM"}))
    assert rc == 75, err[-3000:]
    assert "preempted: checkpoint" in err + out and "step-000002" in err + out, err[-2000:]
    rc, out, err = finish(start(command(workdir, "single", path, "resume=auto")))
    assert rc == 0, err[-3000:]
    want, have = load_weights(single[0] / "final"), load_weights(workdir / "sigterm" / "final")
    assert all(torch.equal(want[k], have[k]) for k in want)


def test_lora_with_kl_to_the_disabled_adapter_trains_and_merges(workdir):
    """rl.beta > 0 with LoRA: the reference is the base with the adapter disabled; two steps on each
    generated batch (rl.num_iterations=2, the old policy's log-probabilities kept); the adapter merges."""
    run, log = train(workdir, "lora_kl", lora=True, rl={**yaml_rl(workdir), "beta": 0.04, "num_iterations": 2},
                     train__max_steps=4, checkpoint__every_steps=2)
    assert "KL to the base (adapter disabled) x 0.04" in log and "2 optimizer steps per generated batch" in log
    metrics = read_metrics(run)
    assert metrics[1]["kl"] == pytest.approx(0, abs=1e-9)  # the adapter starts at zero: policy = reference
    assert metrics[2]["kl"] > 0  # after one update on the same batch
    assert metrics[1]["reward"] == metrics[2]["reward"]  # the same generated batch, trained twice
    merged = run_toolkit("merge", str(run / "final"), "--out", str(workdir / "lora_merged"))
    assert merged.returncode == 0 and (workdir / "lora_merged" / "model.safetensors").is_file(), merged.stderr[-2000:]


def test_full_fine_tuning_with_kl_to_a_frozen_reference_and_zero3_equal_one_process(workdir):
    """rl.beta > 0 without LoRA: the reference is the base loaded once more and frozen (TRL's ref_model; equal to it
    in test_grpo_trl.py), held as the backend holds a frozen model; the KL to it grows from 0 as the policy moves
    away over generated batches; ZeRO-3 on 2 processes (the reference sharded too) equals one process."""
    import json as json_module

    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.model.load import PRESETS, build_byte_tokenizer

    base = workdir / "base"
    if not (base / "config.json").is_file():
        torch.manual_seed(5)
        LlamaForCausalLM(LlamaConfig(**json_module.loads((PRESETS / "tiny-llama-mini.json").read_text()))
                         ).save_pretrained(base)
        build_byte_tokenizer().save_pretrained(base)
    run, log = train(workdir, "full_kl", model={"path": str(base)}, rl__beta=0.04)
    assert "KL to the base (a frozen copy of it, a whole copy on every rank) x 0.04" in log, log[-3000:]
    kl = [r["kl"] for r in read_metrics(run)[1:]]
    assert kl[0] == pytest.approx(0, abs=1e-9) and kl[-1] > 0, kl  # step 1: the policy is the base
    zero3, log = train(workdir, "full_kl_zero3", "zero3", model={"path": str(base)}, rl__beta=0.04)
    assert "a frozen copy of it, sharded across the ranks (a ZeRO-3 engine of its own)" in log
    assert_close(run, zero3)


def test_the_kl_at_step_one_is_exactly_zero_in_bf16_full_fine_tuning(workdir):
    """Issue 67.5: the frozen reference was built in train.precision's dtype (bf16) while the policy keeps fp32
    weights under autocast, so their log-probabilities differed at step 1 (TRL gives the reference the policy's
    dtype). The near-uniform preset hides it (7e-7): this base's output layer is scaled so its logits spread."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.model.load import PRESETS, build_byte_tokenizer

    base = workdir / "spread_base"
    torch.manual_seed(6)
    model = LlamaForCausalLM(LlamaConfig(**{**json.loads((PRESETS / "tiny-llama-mini.json").read_text()),
                                            "tie_word_embeddings": False}))
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # logits of a few units: bf16 weights move each log-probability visibly
    model.save_pretrained(base)
    build_byte_tokenizer().save_pretrained(base)
    run, log = train(workdir, "full_kl_bf16", model={"path": str(base)}, rl__beta=0.04, train__precision="bf16",
                     train__max_steps=1, train__eval_every_steps=0, rl__num_generations_eval=None)
    row = [r for r in read_metrics(run) if "kl" in r][0]
    assert row["step"] == 1 and row["kl"] == 0.0, row


def yaml_rl(workdir) -> dict:
    return {"method": "grpo", "num_generations": 4, "max_new_tokens": 6,
            "rewards": [f"{workdir / 'grader.py'}:shorter"]}


def test_a_reward_function_that_raises_stops_in_one_line_with_the_checkpoint_intact(workdir):
    path = recipe(workdir, "raises", rl={**yaml_rl(workdir), "rewards": [f"{workdir / 'grader.py'}:fails_at_step_2"]})
    result = run_toolkit("train", str(path))
    line = user_error_line(result)
    assert "fails_at_step_2" in line and "step 2" in line and "train.jsonl row" in line, line
    assert "ValueError: the grader is down" in line, line
    assert (workdir / "raises" / "checkpoints" / "step-000001" / "COMPLETE").is_file()  # step 1 kept whole


def test_bad_prompt_rows_and_contradicting_settings_are_refused_in_one_line(workdir):
    write_jsonl(workdir / "no_prompt.jsonl", [{"question": "2+2?", "answer": "4"}] * 8)
    path = recipe(workdir, "no_prompt", data__train_files=[str(workdir / "no_prompt.jsonl")])
    line = user_error_line(run_toolkit("train", str(path)))
    assert "no_prompt.jsonl" in line and "prompt" in line, line
    path = recipe(workdir, "missing_grader", rl={**yaml_rl(workdir), "rewards": ["nowhere.py:f"]})
    line = user_error_line(run_toolkit("train", str(path)))
    assert "rl.rewards[0].function" in line and "nowhere.py" in line, line
    path = recipe(workdir, "no_answer", rl={**yaml_rl(workdir), "rewards": [{"function": "exact_match",
                                                                             "column": "gold"}]})
    line = user_error_line(run_toolkit("train", str(path)))
    assert "exact_match" in line and "gold" in line and "row 1" in line, line
