"""`toolkit eval`: the loss a run logged at its last step, reproduced from its final/ (a full model
and a LoRA adapter); answers scored by exact match and containment, and references that are not
JSON strings (an integer, any CSV cell) scored as references; user errors as one line; two
gloo processes give what one gives."""

import json
import math
import re
import sys

import pytest
from test_generate import (  # noqa: F401  (fixtures, shared)
    EVAL_FILE,
    QUICKSTART_STEPS,
    alpaca_prompts,
    answers_eval_file,
    answers_model,
    answers_run,
    cli,
    quickstart_run,
    refused,
    trained_run,
)

from toolkit.model.inference import generate_answers, load_for_inference
from toolkit.verbs.evaluate import summary

from helpers import ROOT, read_metrics, run_toolkit, write_jsonl

pytestmark = pytest.mark.launch  # every test here starts processes

MESSAGES_EVAL_FILE = ROOT / "examples" / "data" / "tasks_messages_eval.jsonl"


@pytest.fixture(scope="session")
def lora_run(tmp_path_factory):
    """The LoRA quickstart over the built-in preset (the recipe adapts the SFT quickstart's result) on the
    quickstart's chat files: the adapter's base is the preset's weights saved beside the run."""
    return trained_run(tmp_path_factory, "quickstart-lora", ROOT / "examples/recipes/quickstart_lora.yaml",
                       QUICKSTART_STEPS, "model.path=null", "model.preset=tiny-llama",
                       f"data.train_files=[{ROOT / 'examples/data/tasks_messages_train.jsonl'}]",
                       f"data.eval_files=[{MESSAGES_EVAL_FILE}]")


def evaluate(capsys, tmp_path, *args) -> dict:
    out = tmp_path / "results.json"
    code, stdout, err = cli(capsys, "eval", *args, "--out", out)
    assert code == 0, err
    result = json.loads(out.read_text())
    assert f"wrote {out}" in stdout and "loss" in stdout
    return result


def test_reproduces_the_logged_eval_loss(quickstart_run, tmp_path, capsys):
    """final/ on the run's eval file: the eval_loss training logged at its last step (training
    packs its eval rows; eval pads them), the format read from the rows, max_seq_len from the run."""
    result = evaluate(capsys, tmp_path, quickstart_run / "final", "--data", EVAL_FILE, "--answers", "none")
    logged = read_metrics(quickstart_run)[-1]["eval_loss"]
    assert result["loss"] == pytest.approx(logged, abs=1e-5), (result["loss"], logged)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))
    assert (result["format"], result["max_seq_len"], result["rows"]) == ("alpaca", 128, 200)
    assert result["answers"] is None and result["target_tokens"] > 200
    # Another batch size: the same token-weighted mean.
    again = evaluate(capsys, tmp_path, quickstart_run / "final", "--data", EVAL_FILE, "--answers", "none",
                     "--batch-size", 3)
    assert again["loss"] == pytest.approx(result["loss"], abs=1e-6)
    assert again["target_tokens"] == result["target_tokens"]


def test_lora_adapter_folder(lora_run, tmp_path, capsys):
    """A LoRA run's final/ (an adapter on the preset's saved base): the logged eval loss on the
    messages file, and answers to the last assistant turn prompted with the turns before it."""
    result = evaluate(capsys, tmp_path, lora_run / "final", "--data", MESSAGES_EVAL_FILE, "--max-new-tokens", 6,
                      "--batch-size", 16)
    logged = read_metrics(lora_run)[-1]["eval_loss"]
    assert result["loss"] == pytest.approx(logged, abs=1e-5), (result["loss"], logged)
    assert result["format"] == "messages" and result["answers"]["scored"] == 200
    model, tokenizer = load_for_inference(str(lora_run / "final"))
    assert type(model).__name__.startswith("Peft")
    rows = [json.loads(line) for line in MESSAGES_EVAL_FILE.read_text().splitlines()]
    shown = result["answers"]["examples"]
    assert shown
    expected = generate_answers(model, tokenizer, [rows[r["row"] - 1]["messages"][:-1] for r in shown],
                                max_new_tokens=6)
    assert [r["answer"] for r in shown] == expected
    assert [r["reference"] for r in shown] == [rows[r["row"] - 1]["messages"][-1]["content"] for r in shown]


def test_answers_scored_exact_and_contains(answers_run, answers_model, tmp_path, capsys):
    """Rows whose reference is the model's own greedy answer (padded with spaces: exact after
    strip), a part of it (contains only) and something else (neither)."""
    model, tokenizer = answers_model
    eval_file = answers_eval_file(answers_run)
    rows = [json.loads(line) for line in eval_file.read_text().splitlines()]
    answers = generate_answers(model, tokenizer, alpaca_prompts(eval_file), chat_template=False, max_new_tokens=16)
    long = [i for i, a in enumerate(answers) if len(a.strip()) >= 2]
    assert len(long) >= 2, answers
    first, second = long[:2]
    third = next(i for i in range(len(rows)) if i not in (first, second))
    data = write_jsonl(tmp_path / "scored.jsonl", [
        {**rows[first], "output": f"  {answers[first].strip()} "},
        {**rows[second], "output": answers[second].strip()[1:]},
        {**rows[third], "output": "~never said~"}])
    final = answers_run / "final"
    exact = evaluate(capsys, tmp_path, final, "--data", data, "--max-new-tokens", 16)["answers"]
    assert (exact["mode"], exact["scored"], exact["correct"]) == ("exact", 3, 1)
    assert [r["correct"] for r in exact["examples"]] == [True, False, False]
    assert [r["answer"] for r in exact["examples"]] == [answers[first], answers[second], answers[third]]
    contains = evaluate(capsys, tmp_path, final, "--data", data, "--max-new-tokens", 16,
                        "--answers", "contains")["answers"]
    assert contains["correct"] == 2 and [r["correct"] for r in contains["examples"]] == [True, True, False]
    assert contains["accuracy"] == pytest.approx(2 / 3)
    limited = evaluate(capsys, tmp_path, final, "--data", data, "--max-new-tokens", 16, "--limit", 1)
    assert limited["rows"] == 1 and limited["answers"]["correct"] == 1
    # On the run's own eval file: "Shout." rows answer exactly (measured), the others run on.
    own = evaluate(capsys, tmp_path, final, "--data", eval_file, "--max-new-tokens", 16)["answers"]
    shouts = sum(r["instruction"] == "Shout." for r in rows)
    assert own["scored"] == len(rows) and own["correct"] == shouts > 0


def test_prompt_rows_are_scored_by_reward_functions(answers_run, answers_model, tmp_path, capsys):
    """Online RL's prompt rows (issue 52: refused before): each greedy answer, as a plain greedy generate gives it, is
    scored as training scores a completion (TRL's call: the row's other columns as keywords); the mean total and each
    function's mean are reported. Without a reward function, one line says how to give one."""
    model, tokenizer = answers_model
    eval_file = answers_eval_file(answers_run)
    rows = [json.loads(line) for line in eval_file.read_text().splitlines()][:4]
    prompts = [f"{r['instruction']}" for r in rows]
    answers = generate_answers(model, tokenizer, prompts, chat_template=False, max_new_tokens=16)
    data = write_jsonl(tmp_path / "prompts.jsonl", [
        {"prompt": p, "answer": a.strip() if i % 2 == 0 else "~never said~"}
        for i, (p, a) in enumerate(zip(prompts, answers))])
    judge = tmp_path / "judge.py"
    judge.write_text("def length(completions, **kwargs):\n    return [float(len(c)) for c in completions]\n")
    final = answers_run / "final"
    result = evaluate(capsys, tmp_path, final, "--data", data, "--max-new-tokens", 16, "--reward", "exact_match",
                      "--reward", f"{judge}:length")
    assert result["format"] == "prompt" and result["loss"] is None
    rewards = result["rewards"]
    assert [r["answer"] for r in rewards["records"]] == answers
    exact = [1.0 if i % 2 == 0 else 0.0 for i in range(4)]
    assert rewards["per_function"]["reward_exact_match"] == pytest.approx(sum(exact) / 4)
    assert rewards["per_function"]["reward_length"] == pytest.approx(sum(len(a) for a in answers) / 4)
    assert rewards["mean"] == pytest.approx(sum(e + len(a) for e, a in zip(exact, answers)) / 4)
    assert rewards["scored"] == rewards["answers"] == 4
    line = refused(capsys, "eval", final, "--data", data)
    assert line.startswith(f"error: --data {data}: prompt rows are scored by reward functions; give --reward"), line


def test_an_lm_eval_task_scores_the_answers_this_eval_scores(answers_run, tmp_path, capsys):
    """The shipped lm-eval task (examples/lm_eval/letters.yaml: training's alpaca prompt, a greedy
    answer, exact after strip) over the run's eval rows, through the harness, gives the accuracy
    `--data` gives: the harness is handed the model this verb loads, and sees it as this verb does."""
    pytest.importorskip("lm_eval")
    eval_file = answers_eval_file(answers_run)
    task = (ROOT / "examples/lm_eval/letters.yaml").read_text()
    assert "test: examples/data/tasks_eval.jsonl" in task
    (tmp_path / "letters.yaml").write_text(task.replace("examples/data/tasks_eval.jsonl", str(eval_file)))
    final = answers_run / "final"
    ours = evaluate(capsys, tmp_path, final, "--data", eval_file, "--max-new-tokens", 16)["answers"]
    code, out, err = cli(capsys, "eval", final, "--tasks", tmp_path / "letters.yaml", "--json")
    assert code == 0, err
    harness = json.loads(out)["results"]["letters"]["exact_match,none"]
    assert harness == ours["accuracy"] > 0, (harness, ours)


def test_json_output_and_text_format(answers_run, tmp_path, capsys):
    """--json prints the results (summary on stderr); text rows are scored for loss only."""
    data = write_jsonl(tmp_path / "text.jsonl", [{"text": "Sort the letters. abc"}, {"text": "hello world"}])
    code, out, err = cli(capsys, "eval", answers_run / "final", "--data", data, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["format"] == "text" and result["loss"] > 0 and result["answers"]["scored"] == 0
    assert "loss" in err and "no row has a reference answer" in err


def test_errors_are_one_line(answers_run, tmp_path, capsys):
    """A missing model folder or data file, a malformed JSON line and a row that does not fit its
    format, each named by file and line: exit 2, one `error:` line."""
    final = answers_run / "final"
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"instruction": "a", "output": "b"}\n\n{"instruction": "c", "output": \n')
    bad_row = write_jsonl(tmp_path / "rows.jsonl", [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"messages": [{"role": "user"}, {"role": "assistant", "content": "yo"}]}])
    cases = [((tmp_path / "nowhere", "--data", EVAL_FILE), "nowhere: model folder not found"),
             ((final, "--data", tmp_path / "missing.jsonl"), "--data: file not found"),
             ((final, "--data", bad_json), f"{bad_json}: line 3: malformed JSON"),
             ((final, "--data", bad_row), f"{bad_row}: line 2: messages[0].content is null or missing"),
             ((final, "--data", bad_row, "--format", "alpaca"), "needs column(s) instruction, output"),
             ((final, "--data", EVAL_FILE, "--limit", 0), "--limit: must be positive")]
    for args, expected in cases:
        assert expected in refused(capsys, "eval", *args)


def test_two_processes_give_what_one_gives(answers_run, tmp_path, capsys):
    """`accelerate launch` with 2 gloo processes: rows split over the ranks, sums and answers
    gathered, one summary and one results file from the main process, equal to one process's."""
    args = (answers_run / "final", "--data", answers_eval_file(answers_run), "--max-new-tokens", 16)
    one = evaluate(capsys, tmp_path, *args)
    out = tmp_path / "two.json"
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                str(ROOT / "accelerate_configs" / "ddp.yaml"), "--num_processes", "2", "--main_process_port", "0", "-m"]
    proc = run_toolkit("eval", *args, "--out", out, launcher=launcher, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("wrote ") == 1 and "2 processes" in proc.stdout
    two = json.loads(out.read_text())
    assert two["processes"] == 2 and two["rows"] == one["rows"] == 12
    assert two["loss"] == pytest.approx(one["loss"], abs=1e-6)
    assert two["target_tokens"] == one["target_tokens"]
    assert two["answers"] == one["answers"] and one["answers"]["correct"] > 0


def test_eval_scores_integer_and_csv_references(quickstart_run, tmp_path):
    """References that are not JSON strings (an integer; any CSV cell) are references: before, eval
    skipped them all and reported that no row had one."""
    write_jsonl(tmp_path / "numbers.jsonl", [{"instruction": f"{i} plus one", "output": i + 1} for i in range(4)])
    (tmp_path / "numbers.csv").write_text("instruction,output\n"
                                          + "".join(f"{i} plus one,0{i + 1}\n" for i in range(4)))
    for data in ("numbers.jsonl", "numbers.csv"):
        proc = run_toolkit("eval", quickstart_run / "final", "--data", tmp_path / data, "--max-new-tokens", "3")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "of 4 correct" in proc.stdout + proc.stderr, (data, proc.stdout[-2000:])


def test_progress_on_stderr_results_alone_on_stdout(answers_run):
    """The real CLI, stderr a pipe (a log): progress bars over the rows measured and the answers
    generated on stderr, as training has (a 60-prompt eval used to be silent for minutes); stdout
    holds the JSON alone with --json, and the summary alone without."""
    args = (answers_run / "final", "--data", answers_eval_file(answers_run), "--max-new-tokens", 4, "--batch-size", 5)
    proc = run_toolkit("eval", *args, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for bar in ("eval loss", "eval answers"):
        assert re.search(rf"{bar}: 100%\|.*\| 12/12 \[", proc.stderr), (bar, proc.stderr[-3000:])
    result = json.loads(proc.stdout)
    assert result["rows"] == 12 and result["answers"]["scored"] == 12
    text = run_toolkit("eval", *args)
    assert text.returncode == 0, text.stderr[-3000:]
    assert text.stdout == summary(result, str(answers_run.resolve() / "config.yaml")) + "\n"
    assert "eval answers: 100%" in text.stderr


def test_final_holds_a_model_card_of_what_the_run_did(quickstart_run, lora_run):
    """final/README.md (training/card.py): Hub model-card metadata (library, tags), what was trained and
    how long, the data entries, the last logged metrics as metrics.jsonl has them, and the recipe."""
    import yaml

    for run, library, how in ((quickstart_run, "transformers", "of all weights"),
                              (lora_run, "peft", "with LoRA (r=")):
        text = (run / "final" / "README.md").read_text()
        _, front, body = text.split("---\n", 2)
        meta = yaml.safe_load(front)
        assert meta["library_name"] == library and meta["tags"][:2] == ["toolkit", "sft"], meta
        assert f"supervised fine-tuning {how}" in body and f"{QUICKSTART_STEPS} optimizer steps" in body, body
        evals = [r for r in read_metrics(run) if r.get("eval_loss") is not None]
        assert f"| eval_loss | {evals[-1]['eval_loss']:.4g} | {evals[-1]['step']} |" in body
        assert re.search(r"Training data content fingerprint: `[0-9a-f]{16}`", body)
        assert f"```yaml\noutput_dir: {run}\n" in body
