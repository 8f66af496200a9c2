"""Seeing a run while it trains: throughput, MFU and peak memory per rank in metrics.jsonl, the step
profile, profiler traces, TensorBoard, the hang watchdog and the label audit. Real runs."""

import json
import sys
import time

import pytest
import torch

from toolkit.observe import measure as observe
from toolkit.observe.watchdog import who_is_behind

from helpers import ROOT, base_recipe, read_metrics, run_toolkit, write_recipe

DDP = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
       str(ROOT / "accelerate_configs" / "ddp.yaml"), "--num_processes", "2", "--main_process_port", "0", "-m"]


def train(tmp_path, data_files, *overrides, launcher=None, env=None, out="run", **sections):
    recipe = base_recipe(tmp_path, *data_files, out=out, **sections)
    path = write_recipe(tmp_path / f"{out}.yaml", **recipe)
    proc = run_toolkit("train", path, *overrides, launcher=launcher, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp_path / out, proc


# ----------------------------------------------------------------------------- arithmetic


def test_flops_follow_the_matmul_weights_and_each_documents_length():
    """Llama-2-7B shape: 6 x matmul weights per token (full), 4 x (LoRA, plus 6 x adapters), and
    causal attention 6 x layers x query width per squared document length."""
    from types import SimpleNamespace

    counts = SimpleNamespace(matmul=6_607_343_616, trainable=4_000_000, layers=32, query=4096)
    full, lora = observe.Flops.of(counts, lora=False), observe.Flops.of(counts, lora=True)
    assert full.dense == 6 * 6_607_343_616 and lora.dense == 4 * 6_607_343_616 + 6 * 4_000_000
    assert full.attention == lora.attention == 6 * 32 * 4096
    # Two documents of 3 and 5 tokens packed into a row of 10 (2 padding), and a padded batch.
    packed = {"position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1]])}
    assert observe.document_lengths(packed).tolist() == [3, 5, 2]
    padded = {"attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])}
    assert observe.document_lengths(padded).tolist() == [3, 4]
    assert full.of_batch(10, 9 + 25 + 4) == full.dense * 10 + full.attention * 38


def test_the_watchdog_names_the_rank_behind_the_others():
    def at(phase, step, micro=0, frame="train.py:1 in fit", collective=False):
        return ((phase, step, "", micro), frame, collective)

    line = who_is_behind({0: at("backward", 3), 1: at("forward", 3), 2: at("backward", 3)}, 3)
    assert line.startswith("rank 1 is still in the forward of micro-batch 1 of step 3 while 0, 2 are in the backward")
    # Data before counts before the micro-batches, an earlier micro-batch before a later one, step before step.
    assert who_is_behind({0: at("counts", 3), 1: at("data", 3)}, 2).startswith("rank 1 is still in waiting")
    assert who_is_behind({0: at("backward", 3), 1: at("forward", 3, 1)}, 2).startswith("rank 0 is still")
    assert who_is_behind({0: at("data", 4), 1: at("sync", 3)}, 2).startswith("rank 1 is still")
    # Same position: the rank not inside a collective is the one the others wait for.
    line = who_is_behind({0: at("forward", 3, frame="parallel/distributed.py:9 in _sync_buffers", collective=True),
                          1: at("forward", 3, frame="toolkit/data/prepare.py:5 in read")}, 2)
    assert line.startswith("rank 1 is in the forward of micro-batch 1 of step 3 at toolkit/data/prepare.py:5 in read "
                           "while 0 is waiting in a collective (parallel/distributed.py:9 in _sync_buffers)")
    same = who_is_behind({0: at("backward", 3), 1: at("backward", 3)}, 2)
    assert same.startswith("all 2 ranks are in the backward")
    assert "rank(s) 1 did not report" in who_is_behind({0: at("backward", 3)}, 2)


# ----------------------------------------------------------------------------- runs


@pytest.mark.launch
def test_metrics_carry_throughput_mfu_and_peak_memory(tmp_path, data_files):
    """With a stated peak (a CPU has none), MFU = achieved TFLOP/s / peak; the achieved figure is
    the dense term for the tokens counted plus an attention term no longer than max_seq_len allows."""
    from toolkit.backends.model_counts import count_model
    from toolkit.config import LoraConfig, ModelConfig
    from toolkit.model.load import build_model

    run, proc = train(tmp_path, data_files, "train.peak_tflops=0.5", "train.profile_steps=[3,4]")
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert len(rows) == 8
    counts = count_model(build_model(ModelConfig(preset="tiny-llama-mini")).config, "m", LoraConfig())
    previous = 0
    for r in rows:
        step_tokens, previous = r["tokens"] - previous, r["tokens"]
        assert r["mfu"] == pytest.approx(r["tflops_per_device"] / 0.5, rel=1e-12)
        per_token = r["tflops_per_device"] * 1e12 / r["tokens_per_second"]
        attention = per_token - 6 * counts.matmul
        assert 0 < attention <= 6 * counts.layers * counts.query * 96, (per_token, counts)
        assert r["target_tokens_per_second"] < r["tokens_per_second"]
        # 8 sequences per step (4 x 2 accumulation) in the time the step's tokens took.
        assert r["samples_per_second"] == pytest.approx(8 * r["tokens_per_second"] / step_tokens, rel=1e-9)
        assert len(r["peak_memory_gib"]) == 1 and 0.2 < r["peak_memory_gib"][0] < 8
        assert r["eta_seconds"] >= 0
    assert rows[-1]["eta_seconds"] == 0
    # Peaks only grow.
    assert [r["peak_memory_gib"][0] for r in rows] == sorted(r["peak_memory_gib"][0] for r in rows)
    assert "MFU " in proc.stdout and "peak " in proc.stdout

    # The step profile: every phase of the loop, shares of the steps' time, the largest named.
    profile = json.loads((run / "profile.json").read_text())
    assert profile["timed_steps"] == 7  # the first step of a launch is left out
    assert {"data", "sync", "forward", "backward", "optimizer"} <= set(profile["shares"])
    assert sum(profile["shares"].values()) == pytest.approx(1.0, abs=1e-6)
    assert profile["largest"] == max(profile["shares"], key=profile["shares"].get)
    assert profile["outside_steps"]["eval"] > 0
    line = next((x for x in proc.stdout.splitlines() if x.startswith("step profile over 7 timed step(s)")), proc.stdout)
    assert f"Largest: {profile['largest']}: " in line
    # train.profile_steps: a torch profiler trace of steps 3-4.
    trace = json.loads((run / "profile" / "trace-rank0.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("aten::mm" in n or "aten::addmm" in n for n in names)
    assert "profile: steps 3-4 traced into" in proc.stdout

    # The label audit: the first example with its trained span marked.
    audit = next(x for x in proc.stdout.splitlines() if x.startswith("data: first training example"))
    prompt, _, answer = audit.split(" tokens): ", 1)[1].partition("[[")
    word = prompt.split("### Input:\\n")[1].split("\\n")[0]
    assert prompt.endswith("### Response:\\n") and answer == f"{word[::-1]}</s>]]", audit


@pytest.mark.launch
def test_two_ranks_report_their_own_peak_memory(tmp_path, data_files):
    run, _ = train(tmp_path, data_files, "train.max_steps=3", "train.warmup_steps=1", launcher=DDP)
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert all(len(r["peak_memory_gib"]) == 2 and min(r["peak_memory_gib"]) > 0.2 for r in rows)
    assert rows[0]["mfu"] is None  # no known peak on a CPU host


@pytest.mark.launch
def test_tensorboard_gets_the_metrics_and_the_recipe(tmp_path, data_files):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = train(tmp_path, data_files, "train.report_to=[tensorboard]")
    events = list((run / "tensorboard").rglob("events.out.tfevents.*"))
    assert events, list(run.rglob("*"))
    scalars = {}
    for path in events:
        acc = EventAccumulator(str(path))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars[tag] = [(e.step, e.value) for e in acc.Scalars(tag)]
    losses = [(r["step"], r["loss"]) for r in read_metrics(run) if "loss" in r]
    assert [s for s, _ in scalars["loss"]] == [s for s, _ in losses]
    assert [v for _, v in scalars["loss"]] == pytest.approx([v for _, v in losses], rel=1e-6)
    assert "eval_loss" in scalars and "tokens_per_second" in scalars and "peak_memory_gib/rank0" in scalars
    hparams = list((run / "tensorboard").rglob("hparams.yml"))
    assert hparams and "train.learning_rate: 0.001" in hparams[0].read_text()


def wandb_records(run_file):
    """The records of a W&B offline run file (LevelDB-style log: 32 KiB blocks of 7-byte-headed chunks)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, parts = run_file.read_bytes(), 7, b""  # the file's own 7-byte header first
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # padding to the end of the block
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record


def wandb_history(run_file) -> list[dict]:
    """The logged rows of a W&B offline run file."""
    return [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in wandb_records(run_file) if r.WhichOneof("record_type") == "history"]


def wandb_run(run_file) -> tuple[str, str]:
    """(project, run name) of a W&B offline run file."""
    run = next(r.run for r in wandb_records(run_file) if r.WhichOneof("record_type") == "run")
    return run.project, run.display_name


@pytest.mark.launch
def test_wandb_mlflow_and_trackio_get_the_rows_of_metrics_jsonl(tmp_path, data_files, monkeypatch):
    """Issue 54: one run reporting to W&B (offline), MLflow (its file store in the run folder) and
    trackio (a local store): each holds every step's loss and the evals at the steps metrics.jsonl
    has them, and the recipe as parameters; an MLflow server out of reach is one line before step 1."""
    import sqlite3

    from mlflow.tracking import MlflowClient

    from helpers import user_error_line

    env = {"WANDB_MODE": "offline", "TRACKIO_DIR": str(tmp_path / "trackio"), "WANDB_SILENT": "true",
           "WANDB_PROJECT": "my-team"}  # the team's project wins over the run folder's name; the run is named
    run, proc = train(tmp_path, data_files, "train.report_to=[wandb,mlflow,trackio]", "train.eval_every_steps=4",
                      "train.run_name=trial-1", env=env)
    assert "trackers: wandb, mlflow, trackio, project my-team, run trial-1" in proc.stdout + proc.stderr
    rows = read_metrics(run)
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    evals = {r["step"]: r["eval_loss"] for r in rows if r.get("eval_loss") is not None}
    assert len(losses) == 8 and sorted(evals) == [0, 4, 8], rows

    wandb_file = next(run.glob("wandb/offline-run-*/run-*.wandb"))
    assert wandb_run(wandb_file) == ("my-team", "trial-1")
    history = wandb_history(wandb_file)
    assert {h["_step"]: h["loss"] for h in history if "loss" in h} == pytest.approx(losses, rel=1e-6)
    assert {h["_step"]: h["eval_loss"] for h in history if "eval_loss" in h} == pytest.approx(evals, rel=1e-6)

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # as the run set it for its own file store
    client = MlflowClient((run / "mlruns").as_uri())
    (mlflow_run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert mlflow_run.info.run_name == "trial-1"
    for name, expected in (("loss", losses), ("eval_loss", evals)):
        got = {m.step: m.value for m in client.get_metric_history(mlflow_run.info.run_id, name)}
        assert got == pytest.approx(expected, rel=1e-6), name
    assert float(mlflow_run.data.params["train.learning_rate"]) == 0.001

    db = sqlite3.connect(tmp_path / "trackio" / "my-team.db")
    logged = [(step, json.loads(m)) for step, m in db.execute("select step, metrics from metrics order by id")]
    assert {step: m["loss"] for step, m in logged if "loss" in m} == pytest.approx(losses, rel=1e-6)
    assert {step: m["eval_loss"] for step, m in logged if "eval_loss" in m} == pytest.approx(evals, rel=1e-6)

    recipe = write_recipe(tmp_path / "away.yaml", **base_recipe(tmp_path, *data_files, out="away"))
    proc = run_toolkit("train", recipe, "train.report_to=[mlflow]", timeout=300,
                       env={"MLFLOW_TRACKING_URI": "http://127.0.0.1:9", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"})
    assert user_error_line(proc).startswith("error: train.report_to: mlflow did not start: "), proc.stderr[-2000:]
    assert not (tmp_path / "away" / "metrics.jsonl").exists()


@pytest.mark.launch
def test_the_watchdog_names_the_rank_that_sleeps_inside_a_step(tmp_path, data_files):
    """Rank 1 sleeps 10 s before its forward at step 3; the limit is 3 s. Every rank writes its
    stacks, the main process names rank 1, and the run then finishes normally."""
    started = time.time()
    run, proc = train(tmp_path, data_files, "train.max_steps=4", "train.warmup_steps=1", "train.watchdog_seconds=3",
                      launcher=DDP, env={"TOOLKIT_FAULT_HANG": "1:3:10"})
    lines = [x for x in proc.stderr.splitlines() if x.startswith("watchdog: ")]
    assert len(lines) == 2, proc.stderr[-3000:]
    assert lines[0].startswith("watchdog: step 3 has run ")
    # Under DDP the forward itself broadcasts buffers: rank 0 waits there, in the same phase.
    # The seam sleeps in toolkit/faults.py (read once there, called from the step).
    assert "rank 1 is in the forward of micro-batch 1 of step 3 at toolkit/faults.py:" in lines[0], lines[0]
    assert "in injected_hang while 0 is waiting in a collective (parallel/distributed.py:" in lines[0], lines[0]
    assert lines[1].startswith("watchdog: step 3 finished after 1")
    stacks = {r: (run / "hang" / f"step-3-rank{r}.txt").read_text() for r in (0, 1)}
    assert "injected_hang" in stacks[1] and "injected_hang" not in stacks[0]
    assert 'File "' in stacks[0] and "training/loop.py" in stacks[0]
    assert time.time() - started < 300
    assert (run / "final").is_dir()


@pytest.mark.launch
def test_a_chat_template_that_renders_no_prompt_is_refused(tmp_path):
    """A template that renders no prompt: refused in one line naming the file, row and field it leaves out."""
    from test_bad_input import tiny_model_folder
    from transformers import AutoTokenizer

    from helpers import user_error_line, write_jsonl

    folder = tiny_model_folder(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] + eos_token }}"
                               "{% endif %}{% endfor %}")
    tokenizer.save_pretrained(folder)
    rows = [{"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": f"{i}"}]}
            for i in range(40)]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    recipe = base_recipe(tmp_path, data, data, model={"path": folder})
    recipe["data"]["format"] = "messages"
    proc = run_toolkit("train", write_recipe(tmp_path / "run.yaml", **recipe), timeout=300)
    line = user_error_line(proc)
    # The rendering check (data/tokenize.py check_rendered) names the field the template leaves out, before the
    # every-token-a-target audit would see the rows.
    assert "chat.jsonl: row 1: messages[0].content" in line and "would not train as written" in line, line
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- each objective's preparation


def objectives_by_name():
    """One of each objective, built as the run builds it (no model needed for what is asked here)."""
    from types import SimpleNamespace

    from toolkit.config import Recipe
    from toolkit.training import distill, kto, objectives, online, reward_training

    r = Recipe()
    r.preference.method = "dpo"
    dpo = objectives.Preference(r.preference)
    r.preference.method, r.preference.loss_type = "kto", "kto"
    unpaired = kto.Unpaired(r.preference)
    r.preference.loss_type = "apo_zero_unpaired"
    unpaired_no_kl = kto.Unpaired(r.preference)
    backend = SimpleNamespace(accelerator=None)
    r.rl.method = "grpo"
    grpo = online.GroupRL(r.rl, [], None, backend, 0, [], [])
    r.rl.method = "distill"
    distilled = distill.Distill(r.rl, torch.nn.Linear(2, 2), None, backend, 0, [], [])
    return {"sft": objectives.Supervised(), "dpo": dpo, "reward": reward_training.PairScores(r.preference),
            "kto": unpaired, "kto_apo_zero": unpaired_no_kl, "grpo": grpo, "distill": distilled}


def test_each_objective_names_its_own_preparation_and_advice_in_the_step_profile():
    """What an objective does to a step's batch before the loss (`step_batches`) is named by the objective, with
    its own advice: online RL samples and scores (`generate`, rl.* advice), distillation samples the student's
    completions (no rewards), KTO takes its KL estimate; SFT, DPO and reward modelling do nothing there (their
    time stays in `data`). No objective's profile gives another's advice (a KTO run said `generate 35%` with
    online RL's advice)."""
    found = {name: o.preparation() for name, o in objectives_by_name().items()}
    assert found["sft"] is None and found["dpo"] is None and found["reward"] is None
    assert found["kto_apo_zero"] is None  # no KL estimate: its step_batches returns the loader's batches
    assert found["grpo"].phase == "generate" and "rl.max_new_tokens" in found["grpo"].hint
    assert "reward" in found["grpo"].hint and "scoring" in found["grpo"].doing
    assert found["distill"].phase == "generate" and "rl.max_new_tokens" in found["distill"].hint
    assert "reward" not in found["distill"].hint + found["distill"].doing
    assert found["kto"].phase == "kl_estimate" and "mismatched" in found["kto"].hint
    assert "rl." not in found["kto"].hint + found["kto"].doing and "KL" in found["kto"].doing

    clock = observe.StepClock(torch.device("cpu"))
    clock.steps, clock.step_seconds = 5, 10.0
    for name in ("grpo", "distill", "kto"):
        prep = found[name]
        clock.totals = {"data": 0.05, prep.phase: 3.5, "forward": 2.0, "backward": 3.0, "optimizer": 0.5,
                        "sync": 0.7, "other": 0.25}
        line, profile = observe.profile_report(clock, {"eval": 1.0}, gradient_checkpointing=False, preparation=prep)
        assert profile["largest"] == prep.phase and profile["shares"][prep.phase] == pytest.approx(0.35)
        assert line.startswith(f"step profile over 5 timed step(s), 2.000 s each: {prep.phase} 35%, backward 30%")
        assert line.endswith(f"Largest: {prep.phase}: {prep.hint}") and profile["hint"] == prep.hint
        if name == "kto":
            assert "generate" not in line and "rl." not in line, line

    # A preparation that took under half a percent stays out of the line (profile.json keeps it).
    clock.totals = {"data": 4.0, "generate": 0.0004, "forward": 2.0, "backward": 3.9996, "sync": 0.0}
    line, profile = observe.profile_report(clock, {}, gradient_checkpointing=False, preparation=found["grpo"])
    assert "generate" in profile["shares"] and "generate" not in line
    assert "data 40%" in line and "sync 0%" in line  # the phases every run has stay, even at 0%
    assert line.endswith(f"Largest: data: {observe.HINTS['data']}")
    assert not any("rl." in hint or "online RL" in hint for hint in observe.HINTS.values())  # no objective's own


def test_the_loop_laps_the_objectives_preparation_under_its_name():
    """train_step times `objective.step_batches` (and only it) under the name the objective gives; an objective
    that prepares nothing has it timed with the data. The watchdog says what the objective is doing there and
    places it between the data and the counts."""
    from toolkit.observe.monitor import Monitor
    from toolkit.observe.watchdog import Watchdog, describe
    from toolkit.training import loop

    class Clocked:
        def __init__(self):
            self.laps = []

        def lap(self, phase):
            self.laps.append(phase)

    for name, objective in objectives_by_name().items():
        monitor = Monitor.__new__(Monitor)
        monitor.watchdog = Watchdog(ROOT, 0, 1, True, None, enabled=False)
        monitor.clock = Clocked()
        seen = []
        objective.step_batches = lambda model, batches, step, o=objective: seen.append(monitor.watchdog.where)
        loop.prepare_batches(monitor, objective, None, [], 3)
        prep = objective.preparation()
        assert monitor.clock.laps == [prep.phase if prep else "data"], name
        if prep:
            assert describe(seen[0]) == f"{prep.doing} of step 3", name

    def at(phase, step, micro=0, detail=""):
        return ((phase, step, detail, micro), "train.py:1 in fit", False)

    doing = objectives_by_name()["kto"].preparation().doing
    line = who_is_behind({0: at("counts", 3), 1: at("prepare", 3, detail=doing)}, 2)
    assert line.startswith(f"rank 1 is still in {doing} of step 3 while 0 is in the reduction of token counts"), line
    assert who_is_behind({0: at("prepare", 3), 1: at("data", 3)}, 2).startswith("rank 1 is still in waiting")
    assert who_is_behind({0: at("backward", 3), 1: at("forward", 3, 1)}, 2).startswith("rank 0 is still")
    assert who_is_behind({0: at("prepare", 4), 1: at("sync", 3)}, 2).startswith("rank 1 is still")
