"""DeepSpeed JSONs as users bring them: every shipped config resolves; Trainer-style "auto" files
train; contradictions stop before training with one line naming the file, key and both values."""

import json
import sys

import pytest
import yaml

from conftest import ROOT, alpaca_rows, base_recipe, read_metrics, run_toolkit, write_jsonl, write_recipe
from toolkit.config import Recipe, ToolkitError, load_recipe
from toolkit.deepspeed_config import load_json, resolve

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


def test_trainer_style_json_with_optimizer_and_scheduler_trains(tmp_path, data_files):
    train_f, eval_f = data_files
    proc = launch(tmp_path, TRAINER_STYLE, base_recipe(tmp_path, train_f, eval_f))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(rows) == 8 and rows[-1]["loss"] < rows[0]["loss"]
    lrs = [r["lr"] for r in rows]
    assert max(lrs) == pytest.approx(1e-3, rel=1e-6)  # DeepSpeed's WarmupDecayLR, peaking at the recipe's lr


def test_contradicting_json_stops_before_training_with_one_line(tmp_path, data_files):
    train_f, eval_f = data_files
    ds = dict(TRAINER_STYLE, gradient_accumulation_steps=1)
    proc = launch(tmp_path, ds, base_recipe(tmp_path, train_f, eval_f))
    assert proc.returncode != 0
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert str(tmp_path / "ds.json") in errors[0] and "gradient_accumulation_steps is 1" in errors[0] and "gives 2" in errors[0]
    assert "Traceback" not in "\n".join(l for l in proc.stderr.splitlines() if "[rank" in l)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_config_show_prints_resolved_json(tmp_path):
    path = write_recipe(tmp_path / "r.yaml", output_dir=str(tmp_path / "o"), model={"preset": "tiny-llama"},
                        data={"train_files": ["a.jsonl"]},
                        train={"micro_batch_size": 2, "gradient_accumulation_steps": 3, "max_steps": 10})
    proc = run_toolkit("config", "show", path, "--accelerate-config", ROOT / "accelerate_configs" / "zero3.yaml",
                       "--num-processes", "4")
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout.split("resolved for 4 process(es)\n", 1)[1])
    assert shown["train_batch_size"] == 24 and shown["zero_optimization"]["reduce_bucket_size"] == 128 * 128
