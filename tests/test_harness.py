"""`toolkit eval MODEL_DIR --tasks ...` (toolkit/verbs/harness.py): lm-evaluation-harness tasks from
local YAML files over local JSON lines, on a model folder and on a LoRA adapter over its base, give
exactly what the harness's own `hf` model gives when it loads the same folder (with `peft=` for the
adapter): a multiple-choice accuracy and a rolling log-likelihood's bits per byte, which the adapter
changes. Results land in the run folder, a new file each time. Mistakes (an unknown task, a file
that is not a task, a task whose data cannot be read, options of the other mode) are one line
before the model loads. Starts no process."""

import json
import shutil

import pytest

pytest.importorskip("lm_eval")  # in the test extra (pyproject.toml)

MC = """task: sums
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
"""
ROLLING = """task: prose_bpb
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny model as a run's final/, a LoRA adapter over it whose B is not zero, and two tasks in a
    folder: a multiple-choice one (named by its file in the tests) and a rolling one (by name)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from toolkit.config import ModelConfig
    from toolkit.model.load import build_byte_tokenizer, build_model

    root = tmp_path_factory.mktemp("harness")
    final = root / "run" / "final"
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="tiny-llama"))
    model.save_pretrained(final)
    build_byte_tokenizer().save_pretrained(final)
    (root / "run" / "config.yaml").write_text("{}\n")
    (root / "run" / "manifest.json").write_text("{}\n")
    from transformers import AutoModelForCausalLM

    adapter = root / "adapter"
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(final), config)
    lora.save_pretrained(adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(final)

    rows = [{"question": f"{a} plus {b} is", "choices": [str(a + b), str(a + b + 1), str(a * b + 7)], "label": 0}
            for a in range(6) for b in range(3)]
    (root / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prose = ["The cat sat on the mat.", "Numbers add up: two and two make four.", "A short line of text."]
    (root / "prose.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in prose))
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "sums.yaml").write_text(MC.format(data=root / "sums.jsonl"))
    (tasks / "prose.yaml").write_text(ROLLING.format(data=root / "prose.jsonl"))
    return {"final": final, "adapter": adapter, "tasks": tasks, "run": root / "run"}


def evaluate(capsys, *args) -> dict:
    from toolkit.cli import main

    code = main(["eval", *map(str, args), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def reference(setup, peft=None) -> dict:
    """The harness's own run: its `hf` model loads the folder (and the adapter) itself."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    args = {"pretrained": str(setup["final"]), "dtype": "float32", **({"peft": str(peft)} if peft else {})}
    return simple_evaluate(model="hf", model_args=args, tasks=["sums", "prose_bpb"], device="cpu", batch_size=4,
                           task_manager=TaskManager(include_path=str(setup["tasks"])), log_samples=False)["results"]


def test_tasks_give_what_the_harness_own_model_gives_on_a_folder_and_an_adapter(setup, capsys):
    ours = {}
    for name, model in (("base", setup["final"]), ("adapter", setup["adapter"])):
        ours[name] = evaluate(capsys, model, "--tasks", setup["tasks"] / "sums.yaml", "--tasks", "prose_bpb",
                              "--include", setup["tasks"], "--batch-size", 4)["results"]
    theirs = {"base": reference(setup), "adapter": reference(setup, peft=setup["adapter"])}
    for name in ours:
        assert ours[name]["sums"]["acc,none"] == theirs[name]["sums"]["acc,none"], name
        assert ours[name]["prose_bpb"]["bits_per_byte,none"] == pytest.approx(
            theirs[name]["prose_bpb"]["bits_per_byte,none"], rel=1e-6), name
    assert ours["base"]["prose_bpb"]["bits_per_byte,none"] != pytest.approx(
        ours["adapter"]["prose_bpb"]["bits_per_byte,none"], rel=1e-3)  # the adapter is what was measured
    assert 0.0 <= ours["base"]["sums"]["acc,none"] <= 1.0


def test_results_land_in_the_run_folder_a_new_file_each_time_with_the_table_printed(setup, capsys):
    from toolkit.cli import main

    before = set((setup["run"] / "eval").glob("lm-eval-*.json"))
    for _ in range(2):
        assert main(["eval", str(setup["final"]), "--tasks", str(setup["tasks"] / "sums.yaml"), "--limit", "4"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0].split() == ["task", "metric", "value", "stderr", "rows"]
    assert out.splitlines()[1].split()[:2] == ["sums", "acc"] and out.splitlines()[1].split()[-1] == "4"
    files = sorted(set((setup["run"] / "eval").glob("lm-eval-*.json")) - before)
    assert len(files) == 2, files
    for f in files:
        record = json.loads(f.read_text())
        assert record["tasks"] == ["sums"] and record["n-samples"]["sums"]["effective"] == 4
        assert f"wrote {f}" in out


def test_mistakes_are_one_line_before_the_model_loads(setup, tmp_path, capsys):
    from toolkit.cli import main

    broken = tmp_path / "broken"  # the model's weights are garbage: any error below comes before they load
    shutil.copytree(setup["final"], broken)
    (broken / "model.safetensors").write_bytes(b"not weights")
    (tmp_path / "notask.yaml").write_text("dataset_path: json\n")
    (tmp_path / "notyaml.yaml").write_text("task: [unclosed\n")
    (tmp_path / "nodata.yaml").write_text(MC.format(data=tmp_path / "missing.jsonl").replace("sums", "nodata"))
    cases = [
        (["--tasks", "sumz", "--include", setup["tasks"]], "'sumz' is not a task, group or tag of lm-eval's or in"),
        (["--tasks", "sumz", "--include", setup["tasks"]], ", sums, "),
        (["--tasks", tmp_path / "notask.yaml"], "is not an lm-eval task file (it has no `task:` name)"),
        (["--tasks", tmp_path / "notyaml.yaml"], "is not YAML"),
        (["--tasks", tmp_path / "absent.yaml"], "absent.yaml: no such file"),
        (["--tasks", tmp_path / "nodata.yaml"], "task 'nodata' could not be built"),
        (["--tasks", "sums", "--include", tmp_path / "nowhere"], "--include: " + str(tmp_path / "nowhere")),
        (["--tasks", "sums", "--data", tmp_path / "x.jsonl"], "not both"),
        ([], "give --data FILE or --tasks NAME"),
        (["--tasks", "sums", "--format", "alpaca"], "--format: reads --data rows"),
        (["--data", tmp_path / "x.jsonl", "--include", setup["tasks"]], "--include: only with --tasks"),
        (["--tasks", "sums", "--num-fewshot", "-1"], "--num-fewshot: must be 0 or more"),
        (["--tasks", "sums", "--limit", "-1"], "--limit: must be positive, got -1"),
        (["--tasks", "sums", "--max-new-tokens", "16"], "--max-new-tokens: reads --data rows"),
    ]
    for args, expected in cases:
        code = main(["eval", str(broken), *map(str, args)])
        out, err = capsys.readouterr()
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2 and len(lines) == 1 and expected in lines[0], (args, err)
        assert "Traceback" not in err


GEN = """dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[0]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 4
metric_list:
{metrics}
"""


def test_a_metric_lm_eval_cannot_compute_is_one_line_before_the_model_loads(setup, tmp_path, capsys):
    """Issue 69: a metric name lm-eval does not know (neither its own nor Hugging Face evaluate's) passed the task
    check, and lm-eval raised once every answer was generated (a TypeError from its metric, or its aggregation).
    Named by the task, before the model loads: in a task file, in the base file it includes, an aggregation that is
    not lm-eval's, and a metric lm-eval does not compute for the task's output type."""
    from toolkit.cli import main

    broken = tmp_path / "broken"  # garbage weights: the refusal comes before they load
    shutil.copytree(setup["final"], broken)
    (broken / "model.safetensors").write_bytes(b"not weights")
    data = setup["tasks"].parent / "sums.jsonl"
    files = {
        "bare": "  - metric: accuracy",
        "averaged": "  - metric: exact_match\n    aggregation: average\n    higher_is_better: true",
    }
    for name, metrics in files.items():
        (tmp_path / f"{name}.yaml").write_text(f"task: {name}\n" + GEN.format(data=data, metrics=metrics))
    base = tmp_path / "base"  # a task whose metrics come from the file it includes
    base.mkdir()
    named = "  - metric: accuracy\n    aggregation: mean\n    higher_is_better: true"  # builds; fails once run
    (base / "common.yaml").write_text(GEN.format(data=data, metrics=named))
    (base / "derived.yaml").write_text("include: common.yaml\ntask: derived\n")
    cases = [(["--tasks", tmp_path / "bare.yaml"], "task 'bare': metric 'accuracy' is not one lm-eval knows"),
             (["--tasks", tmp_path / "averaged.yaml"],
              "task 'averaged': metric 'exact_match': aggregation 'average' is not one lm-eval knows (bits_per_byte, "),
             (["--tasks", "derived", "--include", base], "task 'derived': metric 'accuracy' is not one lm-eval knows")]
    for args, expected in cases:
        code = main(["eval", str(broken), *map(str, args)])
        out, err = capsys.readouterr()
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2 and len(lines) == 1 and expected in lines[0], (args, err)
        assert "Traceback" not in err and "not found in the evaluate library" not in err, err

    # metrics lm-eval knows but does not compute for the task's output type: a traceback once every answer is
    # generated (an average of [target, answer] pairs), or a result without the metric
    from toolkit.errors import ToolkitError
    from toolkit.verbs.harness import check_metrics

    wrong = [({"metric": "acc"}, "generate_until", "computes it from log-likelihoods"),
             ({"metric": "bleu"}, "multiple_choice", "gives a multiple_choice task no such score"),
             ({"metric": "acc", "aggregation": "mean"}, "loglikelihood_rolling", "no such score")]
    for entry, output_type, expected in wrong:
        with pytest.raises(ToolkitError, match=f"eval --tasks: task 't': metric '{entry['metric']}': .*{expected}"):
            check_metrics("t", [entry], output_type=output_type)
    check_metrics("t", [{"metric": "f1", "aggregation": "f1"}], output_type="generate_until")  # f1 takes the pairs
    check_metrics("t", [{"metric": "acc", "aggregation": "mean"}], own_results=True, output_type="generate_until")


def test_the_shipped_task_runs_as_the_docs_show_it_from_the_repository_root(setup, capsys, monkeypatch):
    from helpers import ROOT

    monkeypatch.chdir(ROOT)  # its data_files path is relative, as lm-eval reads it
    result = evaluate(capsys, setup["adapter"], "--tasks", "examples/lm_eval/letters.yaml", "--limit", 2)
    assert result["n-samples"]["letters"] == {"original": 200, "effective": 2}
    assert "exact_match,none" in result["results"]["letters"]


def test_without_the_harness_installed_it_is_one_line(setup, capsys, monkeypatch):
    import sys

    from toolkit.cli import main

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # how Python marks a module that cannot be imported
    code = main(["eval", str(setup["final"]), "--tasks", "sums"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == ("error: eval --tasks: needs EleutherAI's lm-evaluation-harness: "
                                         "pip install 'lm-eval>=0.4.13,<0.5' (the toolkit's `eval` extra)"), err


def test_a_group_file_runs_its_tasks(setup, tmp_path, capsys):
    """A group YAML (`group:` and a list under `task:`) named by its file runs the tasks it lists."""
    (tmp_path / "both.yaml").write_text("group: both\ntask: [sums, prose_bpb]\n")
    result = evaluate(capsys, setup["adapter"], "--tasks", tmp_path / "both.yaml", "--include", setup["tasks"],
                      "--limit", 2)
    assert result["tasks"] == ["both"] and {"sums", "prose_bpb"} <= set(result["results"])
