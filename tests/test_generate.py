"""`toolkit generate` on a briefly trained quickstart model: the same answers as a hand-written
greedy `model.generate`, stopping at eos; prompts from flags, files, a pipe and a terminal; user
errors as one line."""

import io
import json
import os
import pty
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from toolkit.cli import main
from toolkit.data.formats import ALPACA_PROMPT_WITH_INPUT
from toolkit.model.inference import (
    end_of_turn_id,
    generate_answers,
    generate_with_counts,
    load_for_inference,
    stop_token_ids,
)

from helpers import ROOT, read_metrics, run_toolkit, user_error_line, write_jsonl, write_recipe

pytestmark = pytest.mark.launch  # every test here starts processes

EVAL_FILE = ROOT / "examples" / "data" / "tasks_eval.jsonl"
QUICKSTART_STEPS = 4  # the eval-loss checks need a trained model, not a good one
# A model that answers in a few dozen steps: the answer depends on the instruction only. Rows are
# cut at max_seq_len 64, which keeps the eos of short "Shout." rows and cuts it off every other
# row; so after 50 steps (measured) "Shout." gives "HEY YOU" and stops at eos, while the other two
# start right and run on until --max-new-tokens.
ANSWERS = {"Greet.": "hello there", "Part.": "goodbye moon", "Shout.": "HEY YOU"}
ANSWER_STEPS = 50


def trained_run(tmp_path_factory, name: str, recipe: Path, steps: int, *overrides: str) -> Path:
    """A short run trained once per session through the CLI (test_eval.py shares it: a complete
    run folder under the session's base temp is reused). The last logged eval_loss is that of
    the final weights: a run evaluates at its last step."""
    run = tmp_path_factory.getbasetemp() / name
    if not (run / "final").is_dir():
        proc = run_toolkit("train", recipe, f"output_dir={run}", "overwrite=true", f"train.max_steps={steps}",
                           f"train.warmup_steps={min(4, steps)}", "train.eval_every_steps=0",
                           f"train.log_every_steps={steps}", *overrides)
        assert proc.returncode == 0, proc.stderr[-3000:]
        last = read_metrics(run)[-1]
        assert last["step"] == steps and last["eval_loss"] is not None, last
    return run


@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory) -> Path:
    """The quickstart recipe on the alpaca copy of its data (the recipe itself trains on `messages`;
    the LoRA fixture covers that format)."""
    return trained_run(tmp_path_factory, "quickstart-full", ROOT / "examples/recipes/quickstart_full.yaml",
                       QUICKSTART_STEPS, "data.format=alpaca",
                       f"data.train_files=[{ROOT / 'examples/data/tasks_train.jsonl'}]",
                       f"data.eval_files=[{EVAL_FILE}]")


def answer_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        instruction = rng.choice(sorted(ANSWERS))
        word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 6)))
        rows.append({"instruction": instruction, "input": word, "output": ANSWERS[instruction]})
    return rows


@pytest.fixture(scope="session")
def answers_run(tmp_path_factory) -> Path:
    """The tiny preset fine-tuned (alpaca format) to answer; its eval rows are `answers_eval_file(run)`."""
    base = tmp_path_factory.getbasetemp()
    train_file = write_jsonl(base / "answers-data" / "train.jsonl", answer_rows(400, seed=0))
    eval_file = write_jsonl(base / "answers-data" / "eval.jsonl", answer_rows(12, seed=1))
    recipe = write_recipe(base / "answers-data" / "recipe.yaml", output_dir="unset",
                          model={"preset": "tiny-llama-mini"},
                          data={"train_files": [str(train_file)], "eval_files": [str(eval_file)], "format": "alpaca",
                                "max_seq_len": 64},
                          train={"micro_batch_size": 16, "learning_rate": 5e-3})
    return trained_run(tmp_path_factory, "answers", recipe, ANSWER_STEPS)


def answers_eval_file(run: Path) -> Path:
    return run.parent / "answers-data" / "eval.jsonl"


@pytest.fixture(scope="session")
def answers_model(answers_run):
    return load_for_inference(str(answers_run / "final"))


def alpaca_prompts(data: Path, n: int | None = None) -> list[str]:
    """Alpaca rows' questions as raw text, rendered as training renders them (the tokenizer puts
    BOS before raw text)."""
    rows = [json.loads(line) for line in data.read_text().splitlines()[:n]]
    return [ALPACA_PROMPT_WITH_INPUT.format(**row) for row in rows]


def cli(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def refused(capsys, *args) -> str:
    """The one `error: ...` line of a command refused in this process: exit 2, nothing on stdout,
    no traceback, the error the last line of stderr (the same checks as helpers.user_error_line)."""
    code, out, err = cli(capsys, *args)
    assert code == 2 and out == "" and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], err
    return lines[-1]


def test_answers_equal_a_plain_greedy_generate_and_stop_at_eos(answers_run, answers_model, capsys):
    """Prompts of unequal lengths, batched with left padding: each answer is what a hand-written
    greedy `model.generate` of that prompt alone gives, cut at eos (`tokens` counts the eos);
    an answer without eos runs to --max-new-tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = alpaca_prompts(answers_eval_file(answers_run))
    assert len({len(p) for p in prompts}) > 1
    limit = 16
    code, out, err = cli(capsys, "generate", answers_run / "final", "--no-chat-template", "--json",
                         "--max-new-tokens", limit, "--batch-size", 5, *[x for p in prompts for x in ("--prompt", p)])
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in lines] == prompts

    tokenizer = AutoTokenizer.from_pretrained(answers_run / "final")
    model = AutoModelForCausalLM.from_pretrained(answers_run / "final").eval()
    stopped = []
    for prompt, got in zip(prompts, lines):
        ids = tokenizer(prompt, return_tensors="pt").input_ids  # BOS + text, as training's rows start
        assert ids[0, 0].item() == tokenizer.bos_token_id
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=limit, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
        if tokenizer.eos_token_id in gen:
            gen = gen[:gen.index(tokenizer.eos_token_id) + 1]
            stopped.append(got["answer"])
            assert got["tokens"] == len(gen) < limit
        else:
            assert got["tokens"] == len(gen) == limit
        assert got["answer"] == tokenizer.decode(gen, skip_special_tokens=True), prompt
    assert "HEY YOU" in stopped and len(stopped) < len(prompts), lines  # measured: "Shout." rows stop, others run on

    # The same answers from Python, and printed plainly without --json.
    model, tokenizer = answers_model
    assert generate_answers(model, tokenizer, prompts, chat_template=False, max_new_tokens=limit) == \
        [r["answer"] for r in lines]
    code, out, _ = cli(capsys, "generate", answers_run / "final", "--no-chat-template", "--max-new-tokens", limit,
                       "--prompt", prompts[0], "--prompt", prompts[1])
    assert code == 0 and out == f"{lines[0]['answer']}\n\n{lines[1]['answer']}\n"


def test_prompts_file_text_and_jsonl(answers_run, answers_model, tmp_path, capsys):
    """--prompts: a text file is one prompt per line (blank lines skipped); a .jsonl file holds a
    `prompt` string or a `messages` list per line, rendered through the chat template (with
    --system put first)."""
    model, tokenizer = answers_model
    prompts = alpaca_prompts(answers_eval_file(answers_run), 3)
    text_file = tmp_path / "prompts.txt"
    text_file.write_text("\n".join(p.replace("\n", " ") for p in prompts) + "\n\n")
    flat = [p.replace("\n", " ") for p in prompts]
    code, out, err = cli(capsys, "generate", answers_run / "final", "--prompts", text_file, "--no-chat-template",
                         "--json", "--max-new-tokens", 12)
    assert code == 0, err
    assert [json.loads(line)["answer"] for line in out.splitlines()] == \
        generate_answers(model, tokenizer, flat, chat_template=False, max_new_tokens=12)

    chat = [{"role": "user", "content": "Sort the letters. pbg"}, {"role": "assistant", "content": "bgp"},
            {"role": "user", "content": "Reverse the letters. abc"}]
    jsonl = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "Add the numbers. 1+2"}, {"messages": chat}])
    code, out, err = cli(capsys, "generate", answers_run / "final", "--prompts", jsonl, "--system", "Be brief.",
                         "--json", "--max-new-tokens", 12)
    assert code == 0, err
    got = [json.loads(line) for line in out.splitlines()]
    assert [g["prompt"] for g in got] == ["Add the numbers. 1+2", chat]
    assert [g["answer"] for g in got] == generate_answers(
        model, tokenizer, ["Add the numbers. 1+2", chat], system="Be brief.", max_new_tokens=12)
    # What the template rendered: the system turn first, then the conversation, then the assistant's cue.
    from toolkit.model.inference import prompt_text

    text, add_bos = prompt_text(tokenizer, chat, "Be brief.")
    assert not add_bos and text.startswith("<s><|system|>\nBe brief.</s>\n<|user|>\nSort")
    assert text.endswith("<|user|>\nReverse the letters. abc</s>\n<|assistant|>\n")


def test_stdin_lines_until_the_end_blank_lines_skipped(answers_run, answers_model, monkeypatch, capsys):
    """Without --prompt/--prompts, each non-blank line of a piped stdin is a prompt, answered at once,
    until its end (a pipe that starts with a blank line answered nothing before, exit 0)."""
    model, tokenizer = answers_model
    monkeypatch.setattr(sys, "stdin", io.StringIO("\nSort the letters. cba\n\nAdd the numbers. 2+2\n  \n"))
    code, out, err = cli(capsys, "generate", answers_run / "final", "--json", "--max-new-tokens", 10)
    assert code == 0, err
    got = [json.loads(line) for line in out.splitlines()]
    assert [g["prompt"] for g in got] == ["Sort the letters. cba", "Add the numbers. 2+2"]
    assert [g["answer"] for g in got] == generate_answers(model, tokenizer, [g["prompt"] for g in got],
                                                          max_new_tokens=10)


def test_interactive_terminal(answers_run, answers_model):
    """stdin a terminal: a `> ` prompt on stderr, an answer per line, an empty line ends the loop."""
    model, tokenizer = answers_model
    primary, secondary = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "toolkit", "generate", str(answers_run / "final"),
                             "--max-new-tokens", "10"], cwd=ROOT, stdin=secondary, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    os.close(secondary)
    try:
        os.write(primary, b"Sort the letters. cba\n\n")
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
        os.close(primary)
    assert proc.returncode == 0, err[-3000:]
    assert "> " in err and "Traceback" not in err
    expected = generate_answers(model, tokenizer, ["Sort the letters. cba"], max_new_tokens=10)[0]
    assert out == expected + "\n"


def test_end_of_turn_token_stops_generation_too(answers_model):
    """The template's end-of-turn token is a stop token beside eos: the byte tokenizer's template
    ends turns with eos itself; one that ends them with `<|end|>` adds that token."""
    model, tokenizer = answers_model
    assert end_of_turn_id(tokenizer) == tokenizer.eos_token_id
    assert stop_token_ids(model, tokenizer) == [tokenizer.eos_token_id]
    from toolkit.model.load import build_byte_tokenizer

    other = build_byte_tokenizer()
    other.add_special_tokens({"additional_special_tokens": ["<|end|>"]})
    other.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                           "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    end = other.convert_tokens_to_ids("<|end|>")
    assert end != other.eos_token_id and end_of_turn_id(other) == end
    assert stop_token_ids(model, other) == [other.eos_token_id, end]
    plain = build_byte_tokenizer()
    plain.chat_template = None
    assert end_of_turn_id(plain) is None


def test_errors_are_one_line(answers_run, tmp_path, capsys):
    """A missing model folder, a missing prompts file, a malformed JSON line (named by file and
    line) and a row without a prompt: exit 2, one `error:` line, no traceback."""
    proc = run_toolkit("generate", tmp_path / "no-such-model", "--prompt", "hi")
    assert "no-such-model: model folder not found" in user_error_line(proc)

    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n\n{"prompt": "broken"\n')
    no_prompt = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "ok"}, {"question": "?"}])
    cases = [((not_a_model, "--prompt", "hi"), "neither a Hugging Face model folder"),
             ((answers_run / "final", "--prompts", tmp_path / "missing.txt"), "--prompts: file not found"),
             ((answers_run / "final", "--prompts", bad), f"{bad}: line 3: malformed JSON"),
             ((answers_run / "final", "--prompts", no_prompt),
              f"{no_prompt}: line 2: expected an object with a `prompt`"),
             ((answers_run / "final", "--prompt", "hi", "--max-new-tokens", 0), "--max-new-tokens: must be positive")]
    for args, expected in cases:
        assert expected in refused(capsys, "generate", *args)


def test_real_chat_model_stops_at_its_end_of_turn(real_model_dir, tmp_path, capsys):
    """SmolLM2-135M-Instruct (ChatML) with eos set to <|endoftext|> in its tokenizer, config and
    generation_config, as base-model tokenizers of ChatML families ship it: answers still end at the
    template's <|im_end|>, as a hand-written greedy generate told to stop there ends them; told
    only eos, that generate runs past <|im_end|>."""
    import os

    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path / "smollm2-eos-endoftext"
    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    tokenizer.eos_token = "<|endoftext|>"
    tokenizer.save_pretrained(folder)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((real_model_dir / name).read_text())
        config["eos_token_id"] = tokenizer.eos_token_id
        (folder / name).write_text(json.dumps(config))
    os.symlink(real_model_dir / "model.safetensors", folder / "model.safetensors")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end != tokenizer.eos_token_id

    limit, prompt = 48, "What is the capital of France?"
    code, out, err = cli(capsys, "generate", folder, "--prompt", prompt, "--json", "--max-new-tokens", limit)
    assert code == 0, err
    got = json.loads(out)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=limit, do_sample=False, eos_token_id=[tokenizer.eos_token_id, end],
                             pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
        eos_only = model.generate(ids, max_new_tokens=len(gen) + 4, do_sample=False,
                                  eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
    assert gen[-1] == end and got["tokens"] == len(gen) < limit, (gen, got)
    assert got["answer"] == tokenizer.decode(gen[:-1], skip_special_tokens=True) and "Paris" in got["answer"]
    assert eos_only[:len(gen)] == gen and len(eos_only) > len(gen)  # eos alone would not have stopped it


def test_progress_on_stderr_answers_alone_on_stdout(answers_run, answers_model):
    """The real CLI, stderr a pipe (a log): a progress bar over the prompts on stderr, as training
    has (a 60-prompt eval used to be silent for minutes); stdout holds the JSON lines of the answers
    alone, what the Python API gives."""
    prompts = alpaca_prompts(answers_eval_file(answers_run))
    n = len(prompts)
    proc = run_toolkit("generate", answers_run / "final", "--no-chat-template", "--json", "--max-new-tokens", 4,
                       "--batch-size", 5, *[x for p in prompts for x in ("--prompt", p)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(rf"generate: 100%\|.*\| {n}/{n} \[", proc.stderr), proc.stderr[-3000:]
    model, tokenizer = answers_model
    expected = generate_with_counts(model, tokenizer, prompts, chat_template=False, max_new_tokens=4)
    assert proc.stdout == "".join(json.dumps({"prompt": p, "answer": a, "tokens": t}, ensure_ascii=False) + "\n"
                                  for p, (a, t) in zip(prompts, expected))
