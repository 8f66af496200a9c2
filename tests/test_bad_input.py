"""Every user mistake ends before training: one line naming the file, key or line, exit code 2,
no traceback, and nothing on disk changed (an earlier run folder, the data, the recipe).

Each case writes its recipe and files in a folder of its own, snapshots it (contents and mtimes),
runs `python -m toolkit train` for real and compares; the cases run two at a time. DeepSpeed cases set the environment that
`accelerate launch --config_file zeroN.yaml` gives its workers.
"""  # noqa: E501

import hashlib
import json

import pytest

from helpers import ROOT, alpaca_rows, base_recipe, run_toolkit, write_jsonl, write_recipe


@pytest.fixture(scope="module")
def existing_run(tmp_path_factory):
    """A real finished run with checkpoints: the folder users fear losing."""
    d = tmp_path_factory.mktemp("existing")
    train = write_jsonl(d / "train.jsonl", alpaca_rows(16, seed=1))
    evaluation = write_jsonl(d / "eval.jsonl", alpaca_rows(4, seed=2))
    recipe = base_recipe(d, train, evaluation, out="run", train__max_steps=2, train__micro_batch_size=2,
                         checkpoint={"every_steps": 1, "keep_last": 5})
    proc = run_toolkit("train", write_recipe(d / "run.yaml", **recipe))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return d / "run", recipe


def ds_env(tmp, **changes):
    cfg = json.loads((ROOT / "deepspeed_configs" / "zero2.json").read_text())
    for dotted, value in changes.items():
        node = cfg
        *parents, last = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    path = tmp / "ds.json"
    path.write_text(json.dumps(cfg))
    return {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(path),
            "ACCELERATE_DEEPSPEED_ZERO_STAGE": str(cfg["zero_optimization"]["stage"])}


def nvme_env(tmp):
    cfg = json.loads((ROOT / "deepspeed_configs" / "zero3_offload_nvme.json").read_text())
    for part in ("offload_optimizer", "offload_param"):
        cfg["zero_optimization"][part]["nvme_path"] = str(tmp / "no-such-nvme")
    path = tmp / "nvme.json"
    path.write_text(json.dumps(cfg))
    return {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(path),
            "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}


def long_prompts(tmp):
    rows = [{"instruction": "x" * 200, "input": "", "output": "y"} for _ in range(8)]
    return write_jsonl(tmp / "long.jsonl", rows)


def malformed(tmp):
    path = tmp / "bad.jsonl"
    good = json.dumps(alpaca_rows(1)[0])
    path.write_text(f"{good}\n{good}\n{{\"instruction\": \"oops\",\n{good}\n")
    return path


def missing_column(tmp):
    return write_jsonl(tmp / "nocol.jsonl", [{"instruction": "a", "input": ""} for _ in range(8)])


def message_without_content(tmp):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    bad = {"messages": [{"role": "user"}, {"role": "assistant", "content": "yo"}]}
    return write_jsonl(tmp / "chat.jsonl", [good, good, bad, good])


def empty_file(tmp):
    (tmp / "empty.jsonl").write_text("")
    return tmp / "empty.jsonl"


def model_folder_without_config(tmp):
    (tmp / "hfmodel").mkdir(exist_ok=True)
    (tmp / "hfmodel" / "weights.bin").write_text("not a model")
    return str(tmp / "hfmodel")


def incomplete_checkpoint(tmp):
    ck = tmp / "half" / "checkpoints" / "step-000004"
    ck.mkdir(parents=True, exist_ok=True)
    (ck / "model.safetensors").write_text("partial")
    return str(ck)


def tiny_model_folder(tmp):
    """A real local Hugging Face folder (config, weights, tokenizer) of the tiny preset."""
    from toolkit.config import ModelConfig
    from toolkit.model.load import build_byte_tokenizer, build_model

    folder = tmp / "tiny-model"
    build_model(ModelConfig(preset="tiny-llama-mini")).save_pretrained(folder)
    build_byte_tokenizer().save_pretrained(folder)
    return str(folder)


# id: (function(tmp, recipe_dict, existing) -> (recipe_dict, overrides, env), expected fragment of the one line)
CASES = {
    "unknown key": (lambda t, r, e: ({**r, "trian": {}}, [], {}), "run.yaml: trian: unknown key"),
    "unknown nested key": (lambda t, r, e: (r, ["train.learning_rat=1"], {}), "train.learning_rat: unknown key"),
    "wrong type": (lambda t, r, e: (r, ["train.micro_batch_size=four"], {}),
                   "train.micro_batch_size: expected an integer, got string 'four'"),
    "negative learning rate": (lambda t, r, e: (r, ["train.learning_rate=-0.001"], {}),
                               "train.learning_rate: must be positive, got -0.001"),
    "zero steps": (lambda t, r, e: (r, ["train.max_steps=0"], {}), "train.max_steps: must be positive, got 0"),
    "bad precision": (lambda t, r, e: (r, ["train.precision=fp8"], {}), "train.precision: must be one of"),
    "bad override form": (lambda t, r, e: (r, ["train.max_steps"], {}), "overrides take the form key=value"),
    # a warmup longer than the run is cut to it (tests/test_optim.py); two warmups are a mistake
    "warmup twice": (lambda t, r, e: (r, ["train.warmup_ratio=0.1"], {}), "train.warmup_ratio: give either"),
    "no model": (lambda t, r, e: ({**r, "model": {}}, [], {}), "model: set exactly one of model.path"),
    "missing model folder": (lambda t, r, e: ({**r, "model": {"path": str(t / "nope")}}, [], {}),
                             "model.path: folder not found"),
    "model folder without config": (lambda t, r, e: ({**r, "model": {"path": model_folder_without_config(t)}}, [], {}),
                                    "has no config.json"),
    "unknown preset": (lambda t, r, e: ({**r, "model": {"preset": "gpt-9"}}, [], {}), "unknown preset 'gpt-9'"),
    "missing dataset file": (lambda t, r, e: (r, [f"data.train_files={t / 'missing.jsonl'}"], {}),
                             "data.train_files: file not found"),
    "malformed JSON line": (lambda t, r, e: (r, [f"data.train_files={malformed(t)}"], {}),
                            "bad.jsonl: line 3: malformed JSON"),
    "message without content": (lambda t, r, e: (r, [f"data.train_files={message_without_content(t)}",
                                                      "data.format=messages", "data.eval_files=[]"], {}),
                                "chat.jsonl: row 3: no target tokens left (messages[0].content is null or missing)"),
    "empty dataset": (lambda t, r, e: (r, [f"data.train_files={empty_file(t)}"], {}), "empty.jsonl: file is empty"),
    "missing column": (lambda t, r, e: (r, [f"data.train_files={missing_column(t)}"], {}), "needs column(s) output"),
    "unsupported file type": (lambda t, r, e: (r, [f"data.train_files={t / 'run.yaml'}"], {}),
                              "unsupported file type '.yaml'"),
    "prompt fills the length": (lambda t, r, e: (r, [f"data.train_files={long_prompts(t)}"], {}),
                                "long.jsonl: row 1: no target tokens left"),
    "too few rows for a batch": (lambda t, r, e: (r, ["train.micro_batch_size=64"], {}),
                                 "do not fill one global batch"),
    "eval files and fraction": (lambda t, r, e: (r, ["data.eval_fraction=0.1"], {}), "give either data.eval_files"),
    "lora target not in model": (lambda t, r, e: (r, ["lora.enabled=true", "lora.target_modules=[c_attn]"], {}),
                                 "c_attn not found in the model (linear modules available: down_proj, gate_proj, "
                                 "k_proj"),
    "lora rank zero": (lambda t, r, e: (r, ["lora.enabled=true", "lora.r=0"], {}), "lora.r: must be positive"),
    "fp16 on a CPU-only host": (lambda t, r, e: (r, ["train.precision=fp16"], {}), "use train.precision=bf16"),
    "half base for full fine-tuning": (lambda t, r, e: (r, ["model.dtype=bf16", "train.precision=bf16"], {}),
                                       "model.dtype: bf16 weights are for a frozen LoRA base"),
    "half base, fp32 compute": (lambda t, r, e: (r, ["model.dtype=bf16", "lora.enabled=true"], {}),
                                "model.dtype: bf16 base weights need train.precision=bf16, got fp32"),
    "DeepSpeed JSON contradicts recipe": (lambda t, r, e: (r, [], ds_env(t, gradient_accumulation_steps=1)),
                                          "ds.json: gradient_accumulation_steps is 1 but the recipe's "
                                          "train.gradient_accumulation_steps gives 2"),
    "DeepSpeed fp16 against bf16 recipe": (lambda t, r, e: (r, ["train.precision=bf16"],
                                                            ds_env(t, **{"fp16.enabled": True})),
                                           "fp16.enabled"),
    "NVMe path does not exist": (lambda t, r, e: (r, [], nvme_env(t)), "nvme_path: folder does not exist"),
    "non-empty output folder": (lambda t, r, e: ({**r, "output_dir": str(e[0])}, [], {}), "is not empty"),
    "resume path without complete checkpoint": (lambda t, r, e: (r, [f"resume={incomplete_checkpoint(t)}"], {}),
                                                "has no complete checkpoint"),
    "resume path missing": (lambda t, r, e: (r, [f"resume={t / 'gone'}"], {}), "gone: folder not found"),
    "resume with a changed recipe": (lambda t, r, e: ({**e[1], "resume": "auto", "train": {**e[1]["train"],
                                                       "learning_rate": 0.5}}, [], {}),
                                     "resume: train.learning_rate was 0.001 when"),
    "resume with overwrite": (lambda t, r, e: (r, ["resume=auto", "overwrite=true"], {}), "resume and overwrite=true"),
    "QLoRA without LoRA": (lambda t, r, e: (r, ["model.load_in_4bit=true", "train.precision=bf16"], {}),
                           "model.load_in_4bit: a 4-bit base cannot be trained itself: QLoRA needs lora.enabled=true"),
    "QLoRA over a preset": (lambda t, r, e: (r, ["model.load_in_4bit=true", "lora.enabled=true"], {}),
                            "model.load_in_4bit: QLoRA quantizes a model.path base while loading it"),
    "accelerate compiles the model": (lambda t, r, e: (r, [], {"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"}),
                                      "dynamo_config.dynamo_backend is 'INDUCTOR': compile in the recipe instead "
                                      "(train.compile: true"),
    "keep_last zero": (lambda t, r, e: (r, ["checkpoint.keep_last=0"], {}), "checkpoint.keep_last: must be positive"),
}


def snapshot(root):
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


# These two write into the existing run's folder if they fail to refuse (and take its lock), so they
# run one at a time after the others; every other case runs in a folder of its own, two at a time.
ON_EXISTING = ("non-empty output folder", "resume with a changed recipe")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, existing_run):
    """{case: (process, files changed?, existing run changed?)}: each case as the user would run it,
    `python -m toolkit train`, its folder snapshot before and after."""
    import re
    from concurrent.futures import ThreadPoolExecutor

    def run_case(case):
        make, _ = CASES[case]
        tmp = tmp_path_factory.mktemp(re.sub(r"\W+", "_", case))
        train = write_jsonl(tmp / "train.jsonl", alpaca_rows(32, seed=1))
        evaluation = write_jsonl(tmp / "eval.jsonl", alpaca_rows(4, seed=2))
        recipe, overrides, env = make(tmp, base_recipe(tmp, train, evaluation, out="new_run"), existing_run)
        path = write_recipe(tmp / "run.yaml", **recipe)
        before, before_existing = snapshot(tmp), snapshot(existing_run[0])
        proc = run_toolkit("train", path, *overrides, env=env, timeout=300)
        return (proc, snapshot(tmp) != before or (tmp / "new_run").exists(),
                snapshot(existing_run[0]) != before_existing)

    apart = [case for case in CASES if case not in ON_EXISTING]
    before_existing = snapshot(existing_run[0])
    with ThreadPoolExecutor(2) as pool:
        found = dict(zip(apart, pool.map(run_case, apart)))
    changed = snapshot(existing_run[0]) != before_existing
    found = {case: (proc, files, changed) for case, (proc, files, _) in found.items()}
    found.update({case: run_case(case) for case in ON_EXISTING})
    return found


@pytest.mark.launch
@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_fails_in_one_line(case, outcomes):
    proc, files_changed, existing_changed = outcomes[case]
    expected = CASES[case][1]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and lines[-1] == errors[0], lines
    assert expected in errors[0], errors[0]
    assert not files_changed, "files changed (or new_run was made)"
    assert not existing_changed, "the existing run folder changed"


def test_a_mistake_only_another_rank_sees_is_still_one_line(monkeypatch, capsys):
    """A rank other than 0 waits for rank 0's line (the launcher stops the job once rank 0 exits);
    when rank 0 never ends the job, that rank prints the one line itself, naming its rank."""
    import signal

    from toolkit.cli import report_user_error
    from toolkit.errors import ToolkitError

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    monkeypatch.setenv("RANK", "1")
    try:
        report_user_error(ToolkitError("data.train_files: file not found"), wait_for_main_s=0.05)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert capsys.readouterr().err.splitlines() == ["error: (rank 1) data.train_files: file not found"]


def model_without_weights(tmp):
    """A model folder whose config and tokenizer load and whose weights are missing: a run that
    got as far as building the model would stop there."""
    from pathlib import Path

    folder = Path(tiny_model_folder(tmp))
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    return str(folder)


def chat_file(tmp):
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}] * 8
    return write_jsonl(tmp / "chat.jsonl", rows)


@pytest.mark.launch
@pytest.mark.parametrize("mistake, overrides, expected", [
    ("data.format left at alpaca on a chat file", lambda t: [f"data.train_files=[{chat_file(t)}]"],
     "chat.jsonl: data.format=alpaca needs column(s) instruction, output; found messages, which "
     "data.format=messages reads"),
    ("a missing eval file", lambda t: [f"data.eval_files=[{t / 'gone.jsonl'}]"], "data.eval_files: file not found"),
])
def test_data_mistakes_are_refused_before_the_model_loads(tmp_path, mistake, overrides, expected):
    """The data files and their first rows are checked right after the run folder is opened: with a
    model whose weights are missing, the data's mistake is the one line, and no model start line
    (`parameters:`) came before it."""
    train = write_jsonl(tmp_path / "train.jsonl", alpaca_rows(32, seed=1))
    recipe = base_recipe(tmp_path, train, write_jsonl(tmp_path / "eval.jsonl", alpaca_rows(4, seed=2)), out="new_run")
    path = write_recipe(tmp_path / "run.yaml", **{**recipe, "model": {"path": model_without_weights(tmp_path)}})
    args = overrides(tmp_path)
    before = snapshot(tmp_path)
    proc = run_toolkit("train", path, *args, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[-1].startswith("error: ") and expected in lines[-1], lines[-1]
    assert "parameters:" not in proc.stdout + proc.stderr
    assert snapshot(tmp_path) == before and not (tmp_path / "new_run").exists()


def test_a_model_folder_whose_weights_do_not_fit_its_config_is_one_line(tmp_path):
    """Issue 69: a folder whose config.json no longer fits its weights (here its vocab_size edited) ended
    in transformers' RuntimeError for training (model.path, rl.teacher) and a line of transformers' own words
    for generate and eval; each says what is wrong with the folder."""
    import torch

    from toolkit.config import ModelConfig, RLConfig
    from toolkit.errors import ToolkitError
    from toolkit.model.inference import load_for_inference
    from toolkit.model.load import build_model
    from toolkit.training.distill import load_teacher

    from families import build_family

    folder = build_family("llama3", tmp_path / "edited")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 10}))
    said = r"its weights do not fit its config.json \(a tensor of another shape than the config gives"
    with pytest.raises(ToolkitError, match=rf"model.path: cannot load a causal LM from {folder}: {said}"):
        build_model(ModelConfig(path=str(folder)))
    with pytest.raises(ToolkitError, match=rf"{folder}: cannot load a causal LM: {said}"):
        load_for_inference(str(folder), "fp32")
    with pytest.raises(ToolkitError, match=rf"rl.teacher: {folder} cannot be loaded as a causal LM: {said}"):
        load_teacher(RLConfig(method="distill", teacher=str(folder)), ModelConfig(path=str(folder)), torch.float32)
