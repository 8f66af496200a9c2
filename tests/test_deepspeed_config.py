"""DeepSpeed JSONs as users bring them: every shipped config resolves; Trainer-style "auto" files
train; contradictions stop before training with one line naming the file, key and both values; a
run says which of its schedule and optimizer came from the JSON, and resumes under another ZeRO
stage (refused in one line under another global batch)."""

import json
import math
import sys

import pytest
import yaml
from test_bad_input import snapshot

from toolkit.backends.deepspeed_config import load_json, resolve
from toolkit.config import Recipe
from toolkit.errors import ToolkitError

from helpers import (
    ROOT,
    alpaca_rows,
    base_recipe,
    read_metrics,
    run_toolkit,
    user_error_line,
    write_jsonl,
    write_recipe,
)

DS_JSONS = sorted((ROOT / "deepspeed_configs").glob("*.json"))
ACCEL_YAMLS = sorted((ROOT / "accelerate_configs").glob("*.yaml"))


def recipe(**train) -> Recipe:
    r = Recipe(output_dir="x")
    r.model.preset = "tiny-llama"
    r.data.train_files = ["a.jsonl"]
    for k, v in train.items():
        setattr(r.train, k, v)
    return r


@pytest.mark.parametrize("path", DS_JSONS, ids=[p.name for p in DS_JSONS])
def test_every_shipped_json_resolves(path, tmp_path):
    raw = load_json(str(path))
    for part in ("offload_optimizer", "offload_param"):  # the NVMe path must exist to resolve
        if raw["zero_optimization"].get(part, {}).get("device") == "nvme":
            raw["zero_optimization"][part]["nvme_path"] = str(tmp_path)
    cfg = resolve(raw, recipe(micro_batch_size=3, gradient_accumulation_steps=5, precision="bf16",
                              max_grad_norm=0.7), 4, str(path), total_steps=100, hidden_size=64)
    assert cfg["train_micro_batch_size_per_gpu"] == 3 and cfg["gradient_accumulation_steps"] == 5
    assert cfg["train_batch_size"] == 60 and cfg["gradient_clipping"] == 0.7
    assert cfg["bf16"]["enabled"] is True and cfg["fp16"]["enabled"] is False
    assert "auto" not in json.dumps(cfg), json.dumps(cfg)


@pytest.mark.parametrize("path", ACCEL_YAMLS, ids=[p.name for p in ACCEL_YAMLS])
def test_every_shipped_accelerate_yaml_loads(path):
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(path))
    assert cfg.distributed_type.value in ("NO", "MULTI_GPU", "FSDP", "DEEPSPEED")
    if cfg.distributed_type.value == "DEEPSPEED":
        assert (ROOT / cfg.deepspeed_config["deepspeed_config_file"]).is_file()
    if cfg.distributed_type.value == "FSDP":
        assert cfg.fsdp_config["fsdp_version"] == 2


TRAINER_STYLE = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto",
                                                "torch_adam": True, "adam_w_mode": True}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                        "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": "auto",
                          "stage3_gather_fp16_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def test_trainer_style_auto_resolution():
    cfg = resolve(TRAINER_STYLE, recipe(learning_rate=5e-4, adam_beta2=0.95, weight_decay=0.1, warmup_steps=3),
                  2, "ds.json", total_steps=40, hidden_size=64)
    assert cfg["optimizer"]["params"] | {} == {"lr": 5e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                                              "torch_adam": True, "adam_w_mode": True}
    assert cfg["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 5e-4, "warmup_num_steps": 3,
                                          "total_num_steps": 40}
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 64 * 64
    assert cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True  # legacy key understood


@pytest.mark.parametrize("key, value, words", [
    ("gradient_accumulation_steps", 1, "gradient_accumulation_steps is 1 but the recipe's "
                                       "train.gradient_accumulation_steps gives 4"),
    ("fp16", {"enabled": True}, "fp16.enabled is True but the recipe's train.precision is 'bf16'"),
    ("train_micro_batch_size_per_gpu", 16, "train_micro_batch_size_per_gpu is 16"),
])
def test_contradictions_name_file_key_and_both_values(key, value, words):
    cfg = dict(TRAINER_STYLE, **{key: value})
    with pytest.raises(ToolkitError) as e:
        resolve(cfg, recipe(gradient_accumulation_steps=4, precision="bf16"), 2, "my_ds.json")
    assert str(e.value).startswith("my_ds.json: ") and words in str(e.value)


def test_fp16_initial_loss_scale_comes_from_the_recipe():
    shipped = load_json(str(ROOT / "deepspeed_configs" / "zero2.json"))
    cfg = resolve(shipped, recipe(precision="fp16", initial_loss_scale=2.0**24), 1, "zero2.json")
    assert cfg["fp16"]["enabled"] is True and cfg["fp16"]["initial_scale_power"] == 24
    assert resolve(shipped, recipe(precision="bf16"), 1, "zero2.json")["fp16"]["initial_scale_power"] == 16
    # A fixed power that agrees is kept; one that disagrees names both values (fp16 only).
    assert resolve(TRAINER_STYLE, recipe(precision="fp16"), 1, "ds.json")["fp16"]["initial_scale_power"] == 16
    with pytest.raises(ToolkitError) as e:
        resolve(TRAINER_STYLE, recipe(precision="fp16", initial_loss_scale=2.0**20), 1, "ds.json")
    assert str(e.value).startswith("ds.json: fp16.initial_scale_power is 16 but the recipe's "
                                   "train.initial_loss_scale (1.04858e+06 = 2^20) gives 20")
    resolve(TRAINER_STYLE, recipe(precision="bf16", initial_loss_scale=2.0**20), 1, "ds.json")  # unused: no clash


def test_nvme_path_must_exist():
    cfg = load_json(str(ROOT / "deepspeed_configs" / "zero3_offload_nvme.json"))
    cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = "/definitely/not/here"
    with pytest.raises(ToolkitError, match="offload_optimizer.nvme_path: folder does not exist: /definitely/not/here"):
        resolve(cfg, recipe(), 1, "nvme.json")


def launch(tmp_path, ds: dict, recipe_dict: dict, nproc=2):
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    launch_cfg = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED", "num_machines": 1,
                  "num_processes": nproc, "machine_rank": 0,
                  "deepspeed_config": {"deepspeed_config_file": str(tmp_path / "ds.json"), "zero3_init_flag": False}}
    (tmp_path / "launch.yaml").write_text(yaml.safe_dump(launch_cfg))
    path = write_recipe(tmp_path / "r.yaml", **recipe_dict)
    return run_toolkit("train", path, launcher=[sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                                                str(tmp_path / "launch.yaml"), "--main_process_port", "0", "-m"])


@pytest.mark.launch
def test_trainer_style_json_with_optimizer_and_scheduler_trains(tmp_path, data_files):
    train_f, eval_f = data_files
    proc = launch(tmp_path, TRAINER_STYLE, base_recipe(tmp_path, train_f, eval_f))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(rows) == 8 and rows[-1]["loss"] < rows[0]["loss"]
    lrs = [r["lr"] for r in rows]
    assert max(lrs) == pytest.approx(1e-3, rel=1e-6)  # DeepSpeed's WarmupDecayLR, peaking at the recipe's lr


@pytest.mark.launch
def test_contradicting_json_stops_before_training_with_one_line(tmp_path, data_files):
    """The workers of a 2-process launch exit 2 without a traceback, after one line from rank 0.
    torchrun itself then exits 1 and prints its own traceback (ChildFailedError) with each worker's
    exit code; that one traceback is the launcher's, and no frame of the toolkit appears anywhere.
    `toolkit config show` gives the same line, exit code 2, and nothing else."""
    import re

    train_f, eval_f = data_files
    ds = dict(TRAINER_STYLE, gradient_accumulation_steps=1)
    proc = launch(tmp_path, ds, base_recipe(tmp_path, train_f, eval_f))
    assert proc.returncode == 1, proc.stderr[-3000:]  # torchrun's code for any failed worker
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert (str(tmp_path / "ds.json") in errors[0] and "gradient_accumulation_steps is 1" in errors[0]
            and "gives 2" in errors[0])
    # The first worker to exit is the root cause; torchrun may SIGTERM (-15) the other before it exits 2 too.
    codes = re.findall(r"exitcode\s*: (-?\d+)", proc.stderr)
    root_cause = re.search(r"Root Cause.*?exitcode\s*: (-?\d+)", proc.stderr, re.S)
    assert root_cause and root_cause[1] == "2" and set(codes) <= {"2", "-15"}, proc.stderr[-3000:]
    tracebacks = proc.stderr.split("Traceback (most recent call last):")[1:]
    assert len(tracebacks) == 1 and "ChildFailedError" in tracebacks[0], proc.stderr[-3000:]
    assert not re.search(r'File "[^"]*/toolkit/', proc.stderr), proc.stderr[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    shown = run_toolkit("config", "show", tmp_path / "r.yaml", "--accelerate-config", tmp_path / "launch.yaml",
                        "--num-processes", "2")
    assert shown.returncode == 2 and "Traceback" not in shown.stderr
    assert shown.stderr.strip().splitlines() == errors, shown.stderr[-2000:]


@pytest.mark.launch
def test_config_show_prints_resolved_json(tmp_path):
    path = write_recipe(tmp_path / "r.yaml", output_dir=str(tmp_path / "o"), model={"preset": "tiny-llama"},
                        data={"train_files": ["a.jsonl"]},
                        train={"micro_batch_size": 2, "gradient_accumulation_steps": 3, "max_steps": 10})
    proc = run_toolkit("config", "show", path, "--accelerate-config", ROOT / "accelerate_configs" / "zero3.yaml",
                       "--num-processes", "4")
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout.split("resolved for 4 process(es)\n", 1)[1])
    assert shown["train_batch_size"] == 24 and shown["zero_optimization"]["reduce_bucket_size"] == 128 * 128


# The classes of failure seen with public configs (each once crashed every rank with a traceback).

def zero(stage=2, **extra):
    return {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "zero_optimization": {"stage": stage, **extra}}


def test_warmup_lr_gets_only_the_parameters_it_takes():
    ds = dict(zero(), scheduler={"type": "WarmupLR",
                                 "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                            "warmup_num_steps": "auto", "total_num_steps": "auto"}})
    notes = []
    cfg = resolve(ds, recipe(learning_rate=3e-4, warmup_steps=5), 2, "ds.json", total_steps=50, notes=notes)
    assert cfg["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4, "warmup_num_steps": 5}
    assert any("total_num_steps" in n and "dropped" in n for n in notes), notes
    from deepspeed.runtime.lr_schedules import WarmupLR

    WarmupLR(torch_optimizer(), **cfg["scheduler"]["params"])  # what DeepSpeed will call


def test_decay_scheduler_without_warmup_in_the_recipe():
    ds = dict(zero(), scheduler={"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto",
                                                                      "total_num_steps": "auto"}})
    notes = []
    cfg = resolve(ds, recipe(warmup_steps=0), 2, "ds.json", total_steps=50, notes=notes)
    assert cfg["scheduler"]["params"]["warmup_num_steps"] == 1 and cfg["scheduler"]["params"]["total_num_steps"] == 50
    from deepspeed.runtime.lr_schedules import WarmupDecayLR

    WarmupDecayLR(torch_optimizer(), **cfg["scheduler"]["params"])
    assert any("warmup_num_steps" in n for n in notes) and any("WarmupDecayLR from this file" in n for n in notes)


def test_fixed_schedule_values_are_kept_and_noted():
    ds = dict(zero(), scheduler={"type": "WarmupDecayLR", "params": {"warmup_num_steps": 100, "total_num_steps": 1000,
                                                                      "warmup_max_lr": 2e-5}})
    notes = []
    cfg = resolve(ds, recipe(warmup_steps=2), 1, "ds.json", total_steps=10, notes=notes)
    assert cfg["scheduler"]["params"] == {"warmup_num_steps": 100, "total_num_steps": 1000, "warmup_max_lr": 2e-5}
    assert sum("kept from this file" in n for n in notes) == 3, notes


@pytest.mark.parametrize("params, words", [
    ({"foo": 3}, "scheduler.params.foo: WarmupLR takes no such parameter"),
    ({"warmup_type": "auto"}, "scheduler.params.warmup_type is \"auto\" but the recipe has no value for it"),
])
def test_scheduler_params_deepspeed_would_reject(params, words):
    with pytest.raises(ToolkitError, match=words):
        resolve(dict(zero(), scheduler={"type": "WarmupLR", "params": params}), recipe(), 1, "ds.json")


def test_unknown_scheduler_and_optimizer_types_are_one_line():
    with pytest.raises(ToolkitError, match="ds.json: scheduler.type 'Cosine' is not a DeepSpeed scheduler"):
        resolve(dict(zero(), scheduler={"type": "Cosine"}), recipe(), 1, "ds.json")
    with pytest.raises(ToolkitError, match="ds.json: optimizer.type 'Adamz' is neither"):
        resolve(dict(zero(), optimizer={"type": "Adamz", "params": {}}), recipe(), 1, "ds.json")


def test_both_spellings_of_one_zero_key():
    """gather_16bit_weights_on_model_save is the field's name and stage3_gather_16bit_... its alias:
    DeepSpeed accepts either, and fails when both appear (the toolkit used to add the second)."""
    for spelling in ("gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"):
        cfg = resolve(zero(3, **{spelling: True}), recipe(), 2, "ds.json", total_steps=5, hidden_size=64)
        assert spelling not in cfg["zero_optimization"]
        assert cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    cfg = resolve(zero(3, max_live_parameters=100, param_persistence_threshold="auto"), recipe(), 2, "ds.json",
                  hidden_size=64)
    assert cfg["zero_optimization"]["stage3_max_live_parameters"] == 100
    assert cfg["zero_optimization"]["stage3_param_persistence_threshold"] == 640
    with pytest.raises(ToolkitError, match="zero_optimization.max_live_parameters is 100 but zero_optimization."
                                           "stage3_max_live_parameters \\(the same setting\\) is 7; keep one"):
        resolve(zero(3, max_live_parameters=100, stage3_max_live_parameters=7), recipe(), 1, "ds.json")


def test_legacy_switches_and_sections_are_mapped():
    notes = []
    cfg = resolve(dict(zero(2, cpu_offload=True), bfloat16={"enabled": True, "loss_scale": 0},
                       compile={"disable": False, "backend": "inductor"}),
                  recipe(precision="bf16"), 1, "ds.json", notes=notes)
    assert (cfg["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
            and "cpu_offload" not in cfg["zero_optimization"])
    assert cfg["bf16"] == {"enabled": True} and "bfloat16" not in cfg and "compile" not in cfg
    assert len(notes) == 4, notes


@pytest.mark.parametrize("extra, words", [
    (zero(2, foo=1), "ds.json: zero_optimization.foo: not a key DeepSpeed accepts here"),
    (dict(zero(3), zero_optimization={"stage": 3, "offload_param": {"device": "cpu", "bogus": 1}}),
     "ds.json: zero_optimization.offload_param.bogus: not a key DeepSpeed accepts here"),
    (dict(zero(), comms_logger={"enabled": False, "verbose_x": 1}), "ds.json: comms_logger.verbose_x: not a key"),
    (dict(zero(), amp={"enabled": True}), "ds.json: DeepSpeed .* rejects this config: NVIDIA Apex AMP"),
    (dict(zero(), tensor_parallel={"autotp_size": 4}), "ds.json: tensor_parallel.autotp_size is 4: tensor parallelism"),
    (dict(zero(), compile={"enabled": True}), "ds.json: compile.enabled is true"),
])
def test_what_deepspeed_rejects_is_one_line_naming_the_key(extra, words):
    with pytest.raises(ToolkitError, match=words) as e:
        resolve(extra, recipe(), 1, "ds.json")
    assert "\n" not in str(e.value)


def torch_optimizer():
    import torch

    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)


def test_an_applied_step_never_counts_toward_the_stop():
    from toolkit.training.loop import counts_toward_stop

    nan = float("nan")
    assert counts_toward_stop(2.0, nan, None) and not counts_toward_stop(2.0, nan, None, applied=True)
    assert not counts_toward_stop(nan, nan, None, applied=True)


ZERO0 = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
         "gradient_clipping": "auto", "zero_optimization": {"stage": 0}}


@pytest.mark.launch
def test_zero0_trains_with_finite_grad_norms_and_skips_what_is_not_finite(tmp_path, data_files):
    """ZeRO-0 in fp32 steps a plain torch optimizer and recorded no gradient norm: every step was
    logged as not finite and a healthy run stopped with exit 3. Now: finite norms, equal to what
    DDP logs, and a step made non-finite on purpose is skipped (not applied), and the stop fires
    only on skipped steps."""
    train_f, eval_f = data_files
    proc = launch(tmp_path, ZERO0, base_recipe(tmp_path, train_f, eval_f, train__max_steps=6))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(rows) == 6 and all(r["grad_norm"] > 0 and r["grad_norm"] < float("inf") for r in rows), rows
    assert rows[-1]["loss"] < rows[0]["loss"] and rows[-1]["skipped_steps"] == 0
    ddp = run_toolkit("train", write_recipe(tmp_path / "ddp.yaml", **base_recipe(tmp_path, train_f, eval_f, out="ddp",
                                                                                  train__max_steps=6)),
                      launcher=[sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                                str(ROOT / "accelerate_configs" / "ddp.yaml"), "--num_processes", "2",
                                "--main_process_port", "0", "-m"])
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    ref = [r for r in read_metrics(tmp_path / "ddp") if "loss" in r]
    for a, b in zip(ref, rows):
        assert (a["loss"] == pytest.approx(b["loss"], rel=1e-4)
                and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4))

    (tmp_path / "nan").mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOOLKIT_FAULT_NONFINITE_STEPS", "3")
        proc = launch(tmp_path / "nan", ZERO0, base_recipe(tmp_path / "nan", train_f, eval_f, train__max_steps=5))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in read_metrics(tmp_path / "nan" / "run") if "loss" in r]
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 1, 1], rows
    assert all(math.isfinite(r["loss"]) for r in rows if r["step"] != 3)


# ------------------------------------------------------------- the run's summary; resume under another stage


def ds_launch(tmp_path, name: str, ds: dict, recipe: dict):
    (tmp_path / f"{name}.json").write_text(json.dumps(ds))
    launch = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED", "num_machines": 1,
              "num_processes": 2, "machine_rank": 0,
              "deepspeed_config": {"deepspeed_config_file": str(tmp_path / f"{name}.json"), "zero3_init_flag": False}}
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(launch))
    path = write_recipe(tmp_path / f"{name}_recipe.yaml", **recipe)
    return run_toolkit("train", path, launcher=[sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                                                str(tmp_path / f"{name}.yaml"), "--main_process_port", "0", "-m"])


@pytest.mark.launch
def test_zero2_run_says_its_schedule_came_from_the_json_and_resumes_under_zero3(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", alpaca_rows(32, seed=1))
    evaluation = write_jsonl(tmp_path / "eval.jsonl", alpaca_rows(9, seed=2))  # rank 1's last eval batch: padding only
    recipe = base_recipe(tmp_path, train, evaluation, train__max_steps=2, train__micro_batch_size=2,
                         train__eval_batch_size=2, train__warmup_steps=1, checkpoint={"every_steps": 2})
    proc = ds_launch(tmp_path, "zero2", TRAINER_STYLE, recipe)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_lines = [line[len("run: "):] for line in proc.stderr.splitlines() if line.startswith("run: ")]
    schedule = [line for line in run_lines if line.startswith("schedule ")]
    assert schedule and schedule[0].startswith(f"schedule WarmupDecayLR from {tmp_path / 'zero2.json'}: "), run_lines
    assert ("total_num_steps 2" in schedule[0]
            and "the recipe's train.lr_scheduler_type and min_lr_ratio are not used" in schedule[0])
    assert any(line.startswith("optimizer AdamW from ") for line in run_lines), run_lines
    assert any(line.startswith("backend DeepSpeed ZeRO-2, 2 processes") for line in run_lines), run_lines
    assert any("batch 8 sequences per optimizer step = micro_batch_size 2 x gradient_accumulation_steps 2 x 2 "
               "processes" in line for line in run_lines), run_lines
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["launches"][0]["summary"] == run_lines and manifest["launches"][0]["layout"] == "DeepSpeed ZeRO-2"
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "eval_loss" in r] == [0, 2]

    # Under ZeRO-3 with another split of the global batch: refused in one line naming both, nothing touched.
    zero3 = dict(TRAINER_STYLE, zero_optimization={"stage": 3})
    before = snapshot(tmp_path / "run")
    smaller = {**recipe, "resume": "auto", "train": {**recipe["train"], "micro_batch_size": 1}}
    error = user_error_line(ds_launch(tmp_path, "zero3", zero3, smaller), launched=True)
    assert "global batch of 8 sequences and this launch makes 4" in error, error
    assert snapshot(tmp_path / "run") == before
    # The same global batch continues under ZeRO-3 from the portable state, DeepSpeed's own optimizer
    # and WarmupDecayLR included (the run had finished: it loads, checks and saves final/ again).
    proc = ds_launch(tmp_path, "zero3", zero3, {**recipe, "resume": "auto"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(written by 2 process(es) under DeepSpeed ZeRO-2: its portable state)" in proc.stdout + proc.stderr
    assert "loaded and read back as saved" in proc.stderr


# ------------------------------------------------------------- top-level keys: used, passed through or refused


@pytest.mark.parametrize("key, meant", [("zero_optimisation", "zero_optimization"),
                                        ("gradient_clippin", "gradient_clipping"),
                                        ("bf_16", "bf16"), ("train_micro_batch_size_per_gpus",
                                                            "train_micro_batch_size_per_gpu")])
def test_a_near_miss_of_a_key_that_changes_what_is_learned_is_refused_with_a_suggestion(key, meant):
    with pytest.raises(ToolkitError) as e:
        resolve(dict(zero(), **{key: {}}), recipe(), 1, "ds.json")
    assert str(e.value) == f"ds.json: {key}: not a key DeepSpeed reads (it would ignore it); did you mean {meant}?"


@pytest.mark.parametrize("key, note", [
    ("cuda_visible_devices", "ds.json: cuda_visible_devices: not a key DeepSpeed reads; ignored, as DeepSpeed ignores "
                             "it"),  # DeepSpeedExamples' imagenet ds_config.json
    ("comms_config", "ds.json: comms_config: not a key DeepSpeed reads; ignored, as DeepSpeed ignores it (did you "
                     "mean comms_logger?)"),  # LLaMA-Factory's ds_z3_fp8_config.json
    ("comms_loger", "ds.json: comms_loger: not a key DeepSpeed reads; ignored, as DeepSpeed ignores it (did you mean "
                    "comms_logger?)")])
def test_a_key_deepspeed_ignores_is_ignored_with_a_note_as_deepspeed_does(key, note):
    """Issue 52: DeepSpeed trains with these, so a user swapping in a public JSON does too, told what is ignored."""
    notes = []
    out = resolve(dict(zero(), **{key: {"x": 1}}), recipe(), 1, "ds.json", notes=notes)
    assert note in notes and out[key] == {"x": 1}, notes
    assert "_comment" in resolve(dict(zero(), _comment="supported models: ..."), recipe(), 1, "ds.json")


# For each key DeepSpeed reads: a value that asks for something and, for a refused key, one that does not.
RECIPE_KEYS = {  # resolved against recipe(micro_batch_size=3, gradient_accumulation_steps=5, ...) on 2 processes
    "train_batch_size": ("auto", lambda out: out["train_batch_size"] == 30),
    "train_micro_batch_size_per_gpu": ("auto", lambda out: out["train_micro_batch_size_per_gpu"] == 3),
    "gradient_accumulation_steps": ("auto", lambda out: out["gradient_accumulation_steps"] == 5),
    "gradient_clipping": ("auto", lambda out: out["gradient_clipping"] == 0.7),
    "fp16": ({"enabled": "auto"}, lambda out: out["fp16"] == {"enabled": False}),
    "bf16": ({"enabled": "auto"}, lambda out: out["bf16"] == {"enabled": True}),
    "bfloat16": ({"enabled": "auto"}, lambda out: out["bf16"] == {"enabled": True} and "bfloat16" not in out),
    "optimizer": ({"type": "AdamW", "params": {"lr": "auto"}}, lambda out: out["optimizer"]["params"]["lr"] == 2e-4),
    "scheduler": ({"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}},
                  lambda out: out["scheduler"]["params"]["warmup_max_lr"] == 2e-4),
    "zero_optimization": ({"stage": 3, "reduce_bucket_size": "auto"},
                          lambda out: out["zero_optimization"]["reduce_bucket_size"] == 64 * 64
                          and out["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True),
    "steps_per_print": (10, lambda out: out["steps_per_print"] == 10**9),  # accelerate turns DeepSpeed's print off
}
PASSED_KEYS = {
    "communication_data_type": "bf16", "seq_parallel_communication_data_type": "bf16", "prescale_gradients": True,
    "gradient_predivide_factor": 2.0, "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
    "wall_clock_breakdown": True, "memory_breakdown": True, "flops_profiler": {"enabled": True, "profile_step": 3},
    "tensorboard": {"enabled": True, "output_path": "tb/", "job_name": "run"}, "wandb": {"enabled": True,
                                                                                          "project": "p"},
    "csv_monitor": {"enabled": True, "output_path": "csv/"}, "comet": {"enabled": True},
    "timers": {"throughput": {"enabled": False}}, "log_level": "info", "dump_state": True, "disable_python_gc": 10,
    "disable_allgather": True, "vocabulary_size": 32000, "aio": {"queue_depth": 16},
    "data_types": {"grad_accum_dtype": "fp32"},
}
REFUSED_KEYS = {  # key: (asks for what the toolkit cannot honour, the same key off)
    "tensor_parallel": ({"autotp_size": 2}, {"autotp_size": 1}),
    "sequence_parallel_size": (2, 1),
    "pipeline": ({"activation_checkpoint_interval": 1}, {"stages": 1}),
    "expert_parallel": ({"enabled": True}, {"enabled": False}),
    "use_data_before_expert_parallelism": (True, False),
    "hybrid_engine": ({"enabled": True}, {"enabled": False}),
    "autotuning": ({"enabled": True}, {"enabled": False}),
    "data_efficiency": ({"enabled": True}, {"enabled": False}),
    "dataloader_drop_last": (True, False),
    "activation_checkpointing": ({"partition_activations": True}, {"partition_activations": False}),
    "torch_autocast": ({"enabled": True, "dtype": "bfloat16"}, {"enabled": False}),
    "managed_gradient_accumulation": (False, True),
    "gradient_allreduce_op": ("sum", "mean"),
    "weight_quantization": ({"quantized_initialization": {"num_bits": 8}}, {}),
    "datastates_ckpt": ({}, False),  # DeepSpeed turns it on for any value but false
    "checkpoint": ({"load_universal": True}, {"tag_validation": "Warn"}),
    "compile": ({"deepcompile": True}, {"deepcompile": False}),
    "comms_logger": ({"enabled": True}, {"enabled": True, "verbose": True}),
}


def walk(key, value, notes=None):
    return resolve(dict(zero(), **{key: value}), recipe(micro_batch_size=3, gradient_accumulation_steps=5,
                                                        max_grad_norm=0.7, precision="bf16", learning_rate=2e-4),
                   2, "ds.json", total_steps=10, hidden_size=64, notes=notes)


@pytest.mark.parametrize("key", sorted(REFUSED_KEYS))
def test_what_deepspeed_accepts_and_the_toolkit_cannot_honour_is_refused_in_one_line(key):
    asks, off = REFUSED_KEYS[key]
    with pytest.raises(ToolkitError) as e:
        walk(key, asks)
    assert str(e.value).startswith(f"ds.json: {key}") and "\n" not in str(e.value), str(e.value)
    assert walk(key, off)[key] == off  # off, DeepSpeed gets it as written and does nothing with it


def test_no_key_deepspeed_reads_is_silently_ignored():
    """Every key of the table is used (settled from the recipe), passed to DeepSpeed as written (and
    DeepSpeed acts on it under this loop), refused where it asks for what the loop cannot honour, or
    refused by DeepSpeed itself (removed in 0.19)."""
    from toolkit.backends.deepspeed_config import TOP_LEVEL_KEYS

    by_kind = {kind: {k for k, v in TOP_LEVEL_KEYS.items() if v == kind} for kind in set(TOP_LEVEL_KEYS.values())}
    assert by_kind == {"recipe": set(RECIPE_KEYS), "deepspeed": set(PASSED_KEYS), "refused": set(REFUSED_KEYS),
                       "removed": by_kind["removed"]}
    for key, (value, settled) in RECIPE_KEYS.items():
        notes = []
        assert settled(walk(key, value, notes)), key
    assert any(n.startswith("ds.json: steps_per_print 10 not used") for n in notes), notes
    for key, value in PASSED_KEYS.items():
        assert walk(key, value)[key] == value, key
    for key in by_kind["removed"]:
        with pytest.raises(ToolkitError, match="ds.json: DeepSpeed .* rejects this config") as e:
            walk(key, {"enabled": False})
        assert key in str(e.value).lower(), str(e.value)


def test_the_table_holds_every_key_deepspeed_reads():
    """Ask DeepSpeed's own parser which top-level keys it looks up (a dict that records them), so a
    DeepSpeed that reads a new key fails here until the table says what the toolkit does with it."""
    from deepspeed.runtime import config as ds_config

    from toolkit.backends.deepspeed_config import TOP_LEVEL_KEYS

    asked = set()

    class Keys:
        def __init__(self, keys):
            self.keys = keys

        def __contains__(self, key):
            asked.add(key)
            return key in self.keys

        def __iter__(self):
            return iter(self.keys)

    class Recording(dict):
        def __getitem__(self, key):
            asked.add(key)
            return super().__getitem__(key)

        def get(self, key, *default):
            asked.add(key)
            return super().get(key, *default)

        def __contains__(self, key):
            asked.add(key)
            return super().__contains__(key)

        def keys(self):
            return Keys(list(super().keys()))

    ds_config.DeepSpeedConfig(Recording(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1))
    # sequence_parallel_size is read in DeepSpeedConfig.__init__ only once torch.distributed is up.
    assert asked | {"sequence_parallel_size"} == set(TOP_LEVEL_KEYS)
    removed = {k for k, v in TOP_LEVEL_KEYS.items() if v == "removed"}
    assert removed == set(ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS)
