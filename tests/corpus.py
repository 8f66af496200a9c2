"""The config corpus (tests/config_corpus): real public DeepSpeed JSONs and accelerate YAMLs,
copied verbatim, and how a test launches each one the way a user would: 2 processes on this
host, a recipe that agrees with the file's fixed values, a multi-node file rehearsed as one
machine, a YAML's deepspeed_config_file pointed at the corpus copy of that JSON."""

import json
from pathlib import Path

import yaml

from helpers import ROOT, alpaca_rows, write_jsonl

CORPUS = ROOT / "tests" / "config_corpus"
NPROC = 2
STEPS = 3


def entries() -> list[dict]:
    return yaml.safe_load((CORPUS / "INDEX.yaml").read_text())


def launch_args(entry: dict) -> list[str]:
    """accelerate launch arguments beside --config_file: what a user rehearsing on one host types."""
    args = ["--num_processes", str(NPROC), "--num_machines", "1", "--machine_rank", "0"]
    if entry.get("references"):  # the YAML names the JSON by its path in the author's repository
        args += ["--deepspeed_config_file", str(CORPUS / entry["references"])]
    return args


def launch_yaml(entry: dict, tmp: Path) -> Path:
    """A DeepSpeed JSON is launched the way users pass one: an accelerate YAML naming it."""
    if entry["file"].endswith(".yaml"):
        return CORPUS / entry["file"]
    cfg = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED", "num_machines": 1,
           "num_processes": NPROC, "machine_rank": 0,
           "deepspeed_config": {"deepspeed_config_file": str(CORPUS / entry["file"]), "zero3_init_flag": False}}
    out = tmp / "launch.yaml"
    out.write_text(yaml.safe_dump(cfg))
    return out


def ds_json_of(entry: dict) -> dict | None:
    name = entry["file"] if entry["file"].endswith(".json") else entry.get("references")
    if not name:
        return None
    try:
        return json.loads((CORPUS / name).read_text())
    except ValueError:
        return None


def fixed(node, *keys):
    for k in keys:
        if not isinstance(node, dict) or k not in node:
            return None
        node = node[k]
    return None if node == "auto" else node


def agreeing_recipe(entry: dict, tmp: Path) -> dict:
    """A small recipe whose batch sizes, precision, clipping and optimizer values agree with what
    the file fixes (what a user adapting their recipe to their config would write)."""
    ds = ds_json_of(entry) or {}
    launch = yaml.safe_load((CORPUS / entry["file"]).read_text()) if entry["file"].endswith(".yaml") else {}
    inline = (launch or {}).get("deepspeed_config") or {}
    micro = fixed(ds, "train_micro_batch_size_per_gpu")
    accum = fixed(ds, "gradient_accumulation_steps") or (inline.get("gradient_accumulation_steps")
                                                          if not entry.get("references") else None)
    total = fixed(ds, "train_batch_size")
    if total:
        if micro and not accum:
            accum = max(1, total // (micro * NPROC))
        elif accum and not micro:
            micro = max(1, total // (accum * NPROC))
        elif not micro:
            micro, accum = max(1, total // NPROC), 1
    micro, accum = micro or 2, accum or 1
    precision = "fp32"
    if fixed(ds, "fp16", "enabled") is True:
        precision = "fp16"
    if fixed(ds, "bf16", "enabled") is True or fixed(ds, "bfloat16", "enabled") is True:
        precision = "bf16"
    mixed = str((launch or {}).get("mixed_precision", "no")).lower()
    if mixed in ("bf16", "fp16", "fp8"):
        precision = {"fp8": "bf16"}.get(mixed, mixed)
    train = {"micro_batch_size": int(micro), "gradient_accumulation_steps": int(accum), "max_steps": STEPS,
             "learning_rate": 1e-3, "warmup_steps": 1, "precision": precision, "log_every_steps": 1}
    clip = fixed(ds, "gradient_clipping") if "gradient_clipping" in ds else inline.get("gradient_clipping")
    if clip is not None and clip != "auto":
        train["max_grad_norm"] = float(clip)
    params = fixed(ds, "optimizer", "params") or {}
    for key, name in (("lr", "learning_rate"), ("eps", "adam_epsilon"), ("weight_decay", "weight_decay")):
        if fixed(params, key) is not None:
            train[name] = float(params[key])
    if fixed(params, "betas") is not None:
        train["adam_beta1"], train["adam_beta2"] = map(float, params["betas"])
    global_batch = train["micro_batch_size"] * train["gradient_accumulation_steps"] * NPROC
    rows = write_jsonl(tmp / "train.jsonl", alpaca_rows(max(48, global_batch * STEPS), seed=1))
    evaluation = write_jsonl(tmp / "eval.jsonl", alpaca_rows(8, seed=2))
    recipe = {"output_dir": str(tmp / "run"), "seed": 5, "model": {"preset": "tiny-llama-mini"},
              "data": {"train_files": [str(rows)], "eval_files": [str(evaluation)], "format": "alpaca",
                       "max_seq_len": 96},
              "train": train}
    return recipe


def resolve_outcome(entry: dict, tmp: Path) -> str:
    """"trains" or "refused: <the error line>", from the same code a launch and `config show` run."""
    import torch

    from toolkit.backends.launch_config import plan, worker_env
    from toolkit.config import load_recipe
    from toolkit.errors import ToolkitError

    from helpers import write_recipe

    recipe = load_recipe(write_recipe(tmp / "recipe.yaml", **agreeing_recipe(entry, tmp)))
    try:
        env = worker_env(str(launch_yaml(entry, tmp)), extra_args=launch_args(entry))
        plan(recipe, env, torch.cuda.is_available(), source=entry["file"])
    except ToolkitError as e:
        return f"refused: {e}"
    return "trains"
