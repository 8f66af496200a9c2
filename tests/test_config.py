"""Recipes (toolkit/config/): typed loading, overrides, unknown keys (with the near miss suggested),
values that would fail late refused at load, and one-line errors that name the file and the key,
through the CLI too (a recipe that is not YAML or not UTF-8; `config show --num-processes -2`)."""

from pathlib import Path

import pytest

from toolkit.config import ConfigError, Recipe, load_recipe

from helpers import (
    ROOT,
    alpaca_folder,
    run_toolkit,
    short_recipe,
    user_error_line,
    write_recipe,
)

SHIPPED = sorted((ROOT / "examples" / "recipes").glob("*.yaml"))

REQUIRED_NAMES = [
    "output_dir", "seed", "model.path", "model.preset", "lora.enabled", "lora.r", "lora.alpha",
    "lora.target_modules", "data.train_files", "data.eval_files", "data.format", "data.max_seq_len",
    "data.packing", "train.micro_batch_size", "train.gradient_accumulation_steps", "train.max_steps",
    "train.epochs", "train.learning_rate", "train.warmup_steps", "train.precision", "train.max_grad_norm",
    "train.eval_every_steps",
]


def test_documented_names_exist():
    recipe = Recipe()
    for name in REQUIRED_NAMES:
        node = recipe
        for part in name.split("."):
            assert hasattr(node, part), name
            node = getattr(node, part)


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_recipe_loads(path):
    recipe = load_recipe(path)
    for f in recipe.data.train_files + recipe.data.eval_files:
        assert (ROOT / f).is_file(), f


def test_shipped_recipes_exist():
    assert len(SHIPPED) >= 2


def write(tmp_path, text: str) -> Path:
    p = tmp_path / "recipe.yaml"
    p.write_text(text)
    return p


GOOD = """
output_dir: out
model: {preset: tiny-llama}
data: {train_files: [a.jsonl]}
"""


def test_overrides_are_typed(tmp_path):
    r = load_recipe(write(tmp_path, GOOD), ["train.max_steps=20", "train.learning_rate=3e-4", "lora.enabled=true",
                                             "lora.target_modules=[q_proj,v_proj]", "data.packing=true"])
    assert r.train.max_steps == 20 and r.train.learning_rate == 3e-4 and r.lora.enabled
    assert r.lora.target_modules == ["q_proj", "v_proj"] and r.data.packing


@pytest.mark.parametrize("extra, key, words", [
    ("trian: {max_steps: 3}", "trian", "unknown key"),
    ("train: {max_step: 3}", "train.max_step", "unknown key"),
    ("train: {max_steps: many}", "train.max_steps", "expected an integer"),
    ("train: {max_steps: 2.5}", "train.max_steps", "expected an integer"),
    ("train: {learning_rate: -1.0}", "train.learning_rate", "must be positive"),
    ("train: {precision: fp8}", "train.precision", "one of fp32, bf16, fp16"),
    ("train: {initial_loss_scale: 1000}", "train.initial_loss_scale", "must be a power of two"),
    ("train: {initial_loss_scale: 0.5}", "train.initial_loss_scale", "must be a power of two"),
    ("lora: {enabled: yes please}", "lora.enabled", "expected true/false"),
    ("train: {max_steps: 0}", "train.max_steps", "must be positive"),
    ("train: {warmup_steps: 10, warmup_ratio: 0.1}", "train.warmup_ratio", "not both"),
    ("train: {warmup_ratio: 1.5}", "train.warmup_ratio", "must be in [0, 1)"),
    ("data: {train_files: [a.jsonl], eval_files: [b.jsonl], eval_fraction: 0.1}", "data.eval_fraction", "not both"),
    ("data: {train_files: [a.jsonl], format: csv}", "data.format", "one of alpaca"),
    ("train: 3", "train", "expected a section"),
])
def test_bad_values_name_file_and_key(tmp_path, extra, key, words):
    text = (GOOD + extra + "\n" if not extra.startswith("data:")
            else GOOD.replace("data: {train_files: [a.jsonl]}", extra))
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_recipe(path)
    assert e.value.key == key and str(path) in str(e.value) and words in str(e.value)


def test_model_path_and_preset_contradict(tmp_path):
    with pytest.raises(ConfigError, match="model: set exactly one"):
        load_recipe(write(tmp_path, GOOD.replace("{preset: tiny-llama}", "{preset: tiny-llama, path: x}")))


def test_bad_override_names_command_line(tmp_path):
    with pytest.raises(ConfigError, match="train.nope: unknown key"):
        load_recipe(write(tmp_path, GOOD), ["train.nope=1"])
    with pytest.raises(ConfigError, match="command line: train.max_steps: overrides take the form"):
        load_recipe(write(tmp_path, GOOD), ["train.max_steps"])


@pytest.mark.launch
def test_cli_config_error_is_one_line_exit_2(tmp_path):
    path = write(tmp_path, GOOD + "train: {micro_batch_size: -4}\n")
    proc = run_toolkit("train", path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert str(path) in lines[0] and "train.micro_batch_size" in lines[0]


@pytest.mark.launch
def test_cli_invalid_yaml_gives_line(tmp_path):
    proc = run_toolkit("train", write(tmp_path, "output_dir: out\nmodel: [unclosed\n"))
    assert proc.returncode == 2 and "line" in proc.stderr and "Traceback" not in proc.stderr


def test_the_key_reference_is_generated_from_the_docstrings_and_in_sync():
    """docs/recipe-keys.md is `key_reference()` (run `make docs` after changing a key), and every key
    in it says what it does."""
    from toolkit.config import key_reference

    text = key_reference()
    assert (ROOT / "docs" / "recipe-keys.md").read_text() == text, "run `make docs`"
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) > 60
    assert [r for r in rows if r.rstrip().endswith("|  |")] == [], "a key without a docstring"
    for key in ("train.max_steps", "data.padding_free", "checkpoint.portable", "lora.use_dora", "resume"):
        assert f"| `{key}` |" in text


@pytest.mark.parametrize("override, hint", [
    ("lora.rank=8", "lora.rank: unknown key; did you mean r?"),
    ("lora.lora_alpha=16", "lora.lora_alpha: unknown key; did you mean alpha?"),
    ("train.lr=1e-4", "train.lr: unknown key; did you mean learning_rate?"),
    ("train.num_train_epochs=2", "train.num_train_epochs: unknown key; did you mean epochs?"),
    ("data.max_length=64", "data.max_length: unknown key; did you mean max_seq_len?"),
])
def test_a_peers_name_for_a_key_is_pointed_at_ours(override, hint):
    """peft's `lora_alpha`, the Trainer's `num_train_epochs`: keys users carry over from the peers
    get the name here in the one-line refusal (a near-miss check alone does not find `r` for `rank`)."""
    with pytest.raises(ConfigError, match=hint.replace("?", r"\?")):
        load_recipe(ROOT / "examples" / "recipes" / "quickstart_lora.yaml", [override])


# --------------------------------------------------------- unknown keys, values that fail late, the CLI


@pytest.mark.parametrize("override, words", [
    ("train.max_step=3", "train.max_step: unknown key; did you mean max_steps?"),
    ("max_steps=3", "max_steps: unknown key; did you mean train.max_steps?"),
    ("lora.size=3", "lora.size: unknown key (known here"),  # nothing close: no guess (lora.rank now points at r)
])
def test_unknown_keys_suggest_the_near_miss(tmp_path, override, words):
    path = write_recipe(tmp_path / "r.yaml", output_dir="o", model={"preset": "tiny-llama"},
                        data={"train_files": ["a.jsonl"]})
    with pytest.raises(ConfigError) as e:
        load_recipe(path, [override])
    assert words in str(e.value)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return alpaca_folder(tmp_path_factory.mktemp("config"))


recipe = short_recipe


@pytest.mark.launch
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


@pytest.mark.launch
def test_a_recipe_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("output_dir: café\n".encode("latin-1"))
    assert "not UTF-8 text (byte 0xe9 at offset 15)" in user_error_line(run_toolkit("train", path))


@pytest.mark.launch
def test_config_show_refuses_a_negative_process_count(work):
    proc = run_toolkit("config", "show", recipe(work, "c"), "--accelerate-config",
                       ROOT / "accelerate_configs" / "ddp.yaml", "--num-processes", "-2")
    assert "--num-processes: must be positive, got -2" in user_error_line(proc)


def test_model_chat_template_is_a_builtin_a_template_or_a_file_checked_at_load(tmp_path, monkeypatch):
    """model.chat_template: `chatml`, the template itself, or a readable Jinja file (kept as its
    path, `~` expanded); anything else is refused at load, one line naming the key, not after the
    tokenizer and model have loaded."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "turns.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (tmp_path / "latin1.jinja").write_bytes("{{ 'café' }}".encode("latin-1"))
    (tmp_path / "empty.jinja").write_text(" \n")

    def load(value):
        return load_recipe(write_recipe(tmp_path / "r.yaml", output_dir="o", data={"train_files": ["a.jsonl"]},
                                        model={"preset": "tiny-llama", "chat_template": value}))

    inline = "{{ messages[0]['content'] }}"
    for value, kept in (("chatml", "chatml"), (inline, inline), (str(tmp_path / "turns.jinja"), None),
                        ("~/turns.jinja", str(tmp_path / "turns.jinja"))):
        assert load(value).model.chat_template == (kept or value)
    for value, words in ((str(tmp_path / "nope.jinja"), f"file not found: {tmp_path / 'nope.jinja'} (give a Jinja "
                                                         "file, the template itself, or chatml)"),
                         (str(tmp_path), f"is a folder: {tmp_path}"),
                         (str(tmp_path / "empty.jinja"), "empty.jinja: the file is empty"),
                         (str(tmp_path / "latin1.jinja"), "latin1.jinja: not UTF-8 text (byte 0xe9 at offset 7)"),
                         ("", "empty: give a Jinja file")):
        with pytest.raises(ConfigError) as e:
            load(value)
        assert e.value.key == "model.chat_template" and words in str(e.value), str(e.value)
        assert str(e.value).startswith(f"{tmp_path / 'r.yaml'}: model.chat_template: ")


@pytest.mark.launch
def test_config_show_puts_the_plan_first_and_its_steps_are_the_runs(work, tmp_path):
    """Issue 53: the plan (model, objective, data, launch, global batch, steps, results) before the
    resolved keys; the steps it gives from the files' rows are the steps the run takes."""
    from helpers import base_recipe, read_metrics

    r = base_recipe(work, work / "train.jsonl", work / "eval.jsonl", out="plan", train__max_steps=None,
                    train__epochs=2, train__micro_batch_size=2, train__gradient_accumulation_steps=3,
                    train__warmup_steps=1, train__log_every_steps=1)
    path = write_recipe(work / "plan.yaml", **r)
    shown = run_toolkit("config", "show", path, "--accelerate-config", ROOT / "accelerate_configs" / "ddp.yaml",
                        "--num-processes", "2")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0] == f"# plan for {path}:" and lines[1].startswith("#   model:       the built-in preset tiny-llama")
    assert "#   batch:       2 x 3 accumulation x 2 data-parallel rank(s) = 12 examples per optimizer step" in lines
    assert any(x.startswith("#   launch:      ") and "ddp, 2 process(es)" in x for x in lines), lines
    assert lines.index("# the resolved recipe, every key (docs/recipe-keys.md):") < lines.index("seed: 7")
    one = run_toolkit("config", "show", path).stdout.splitlines()
    assert "#   steps:       10 = 2 epoch(s) x 5 (32 training rows in the files // 6), warmup 1" in one, one[:10]
    proc = run_toolkit("train", path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["step"] for r in read_metrics(work / "plan") if "loss" in r][-1] == 10


@pytest.mark.parametrize("tracker,package", [("wandb", "wandb"), ("mlflow", "mlflow-skinny"), ("trackio", "trackio"),
                                             ("tensorboard", "tensorboard")])
def test_a_tracker_without_its_package_is_refused_at_load(tracker, package, tmp_path, monkeypatch):
    """Issue 54: the package missing (sys.modules[name] = None is how Python marks a module that cannot
    be imported; find_spec then finds nothing) is one line naming the key and the install, at load."""
    import sys

    monkeypatch.setitem(sys.modules, tracker, None)
    path = write_recipe(tmp_path / "r.yaml", output_dir="o", model={"preset": "tiny-llama"},
                        data={"train_files": ["a.jsonl"]}, train={"report_to": [tracker]})
    with pytest.raises(ConfigError) as e:
        load_recipe(path)
    assert str(e.value).startswith(f"{path}: train.report_to: {tracker} is not installed: ")
    assert f"pip install {package}" in str(e.value)
