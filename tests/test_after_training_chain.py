"""Issue 54's chain on SmolLM2-135M-Instruct (slow): the quickstart's LoRA recipe trains over the real
model reporting to W&B (offline), MLflow (its file store) and trackio (a local store); its final/ is
merged, exported to GGUF in f16 and q8_0 (each read back within its stated logit bound by the verb
itself), scored on the shipped lm-eval task, and checked pushable (`push --dry-run`). Each
tracker holds the losses of metrics.jsonl. Each step's seconds are printed (`-s`) for the notes."""

import json
import re
import sqlite3
import time

import pytest
from test_observe import wandb_history

from helpers import ROOT, read_metrics, run_toolkit

pytestmark = [pytest.mark.slow, pytest.mark.real_model, pytest.mark.launch]


def timed(name, *args, env=None, timeout=1800):
    started = time.perf_counter()
    proc = run_toolkit(*args, env=env, timeout=timeout)
    print(f"{name}: {time.perf_counter() - started:.1f} s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_a_smollm2_lora_run_is_merged_exported_evaluated_and_tracked(real_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    from toolkit.verbs.export import TOLERANCE

    run = tmp_path / "lora"
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "TRACKIO_DIR": str(tmp_path / "trackio")}
    timed("train (LoRA, 12 steps)", "train", ROOT / "examples/recipes/quickstart_lora.yaml",
          f"model.path={real_model_dir}", f"output_dir={run}", "train.max_steps=12", "train.eval_every_steps=6",
          "train.log_every_steps=4", "train.report_to=[wandb,mlflow,trackio]", env=env)
    losses = {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r}
    assert sorted(losses) == list(range(1, 13)), losses

    history = wandb_history(next(run.glob("wandb/offline-run-*/run-*.wandb")))
    assert {h["_step"]: h["loss"] for h in history if "loss" in h} == pytest.approx(losses, rel=1e-6)
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient((run / "mlruns").as_uri())
    (mlflow_run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    got = {m.step: m.value for m in client.get_metric_history(mlflow_run.info.run_id, "loss")}
    assert got == pytest.approx(losses, rel=1e-6)
    db = sqlite3.connect(tmp_path / "trackio" / f"{run.name}.db")
    logged = {step: json.loads(m) for step, m in db.execute("select step, metrics from metrics order by id")}
    assert {s: m["loss"] for s, m in logged.items() if "loss" in m} == pytest.approx(losses, rel=1e-6)

    merged = run / "merged"
    timed("merge", "merge", run / "final", "--out", merged)
    for kind in ("f16", "q8_0"):
        out = timed(f"export {kind}", "export", merged, "--gguf", tmp_path / f"m-{kind}.gguf", "--type", kind).stdout
        found = re.search(r"max logit difference (\S+) of the logits' scale \(bound for \w+: (\S+)\); greedy next "
                          r"tokens (the same|differ)", out)
        assert found and float(found[1]) <= float(found[2]) == TOLERANCE[kind], out
        assert kind != "f16" or found[3] == "the same", out  # q8_0 may flip a near tie among the prompts' positions
        print(f"export {kind}: max logit difference {found[1]}, greedy next tokens {found[3]}")
    proc = timed("eval --tasks letters (50 rows)", "eval", merged, "--tasks", "examples/lm_eval/letters.yaml",
                 "--limit", 50, "--json")
    result = json.loads(proc.stdout)
    assert result["n-samples"]["letters"]["effective"] == 50
    print(f"letters exact_match: {result['results']['letters']['exact_match,none']:.3f}")
    dry = timed("push --dry-run", "push", merged, "someone/smollm2-lora", "--dry-run")
    assert "README.md" in dry.stdout and "model.safetensors" in dry.stdout
