"""Resume anywhere: a checkpoint written under one backend and process count continues under
another, through its portable state (`checkpoint/portable/`).

Each case trains 8 steps under layout A with checkpoints every 2 steps, then starts a new run
under layout B from A's step-4 checkpoint (same global batch: 8 sequences, split as micro 2 x
accumulation 2 x 2 processes or micro 4 x 2 x 1). Right after the load, the test seam writes
what B now holds, gathered again: weights and AdamW moments must be bitwise what A saved, and the
AdamW step, learning rates and scheduler equal. Then B's losses from step 5 on must be those of an
uninterrupted run under B within 1e-5 relative (the two differ only in the order of float sums).
"""

import json
import sys

import pytest
import torch
from safetensors.torch import load_file
from test_bad_input import snapshot

from helpers import RESUME_STEPS, finish, layout_command, layout_recipe, load_weights, read_metrics, run_command, start

STEPS, RESUME_AT = RESUME_STEPS, 4
MOVES = [("ddp", "single", False), ("single", "ddp", False), ("single", "ddp", True), ("zero2", "zero3", False),
         ("zero3", "fsdp", False), ("zero3", "fsdp", True), ("fsdp", "single", False),
         ("single", "zero2", False),  # ZeRO-2 holds no optimizer state before its first step: the load makes it
         ("sp", "single", False), ("single", "sp", True)]  # to and from each sequence split across 2 processes


@pytest.fixture
def workdir(layout_dir):
    return layout_dir


@pytest.fixture
def uninterrupted(layout_runs):
    return layout_runs


def recipe(workdir, name, layout, lora, **train):
    return layout_recipe(workdir, name, layout, lora, **{f"train__{k}": v for k, v in train.items()})


def command(workdir, layout, path, *overrides):
    return layout_command(workdir, layout, path, *overrides)


def losses(run):
    return {r["step"]: (r.get("loss"), r.get("eval_loss")) for r in read_metrics(run)}


@pytest.mark.launch
@pytest.mark.parametrize("source,target,lora",
                         # By hand: ZeRO-2 -> ZeRO-3 (test_deepspeed_config.py moves a ZeRO-2 run to ZeRO-3 in
                         # CI) and ZeRO-3 -> FSDP full (its LoRA twin makes the same move in CI)
                         [pytest.param(*m, marks=pytest.mark.slow)
                          if m in (("zero2", "zero3", False), ("zero3", "fsdp", False)) else m for m in MOVES],
                         ids=[f"{a}-to-{b}-{'lora' if lora else 'full'}" for a, b, lora in MOVES])
def test_resume_under_another_layout(source, target, lora, workdir, uninterrupted):
    written = uninterrupted(source, lora)
    saved = written / "checkpoints" / f"step-{RESUME_AT:06d}" / "portable"
    name = f"{source}_to_{target}_{'lora' if lora else 'full'}"
    seen = workdir / f"{name}_after_load"
    rc, out, err = finish(start(command(workdir, target, recipe(workdir, name, target, lora), f"resume={saved.parent}"),
                                env={"TOOLKIT_FAULT_PORTABLE_AFTER_LOAD": str(seen)}))
    assert rc == 0, err[-3000:]
    assert f"resumed from {saved.parent} at step {RESUME_AT} (written by" in out + err, (out + err)[-3000:]

    # Right after the load: bitwise what was saved.
    for part in ("weights", "moments"):
        want, have = load_file(saved / f"{part}.safetensors"), load_file(seen / "portable" / f"{part}.safetensors")
        assert want.keys() == have.keys() and want, part
        assert all(torch.equal(want[k], have[k]) for k in want), [k for k in want if not torch.equal(want[k], have[k])]
        assert any(v.abs().sum() > 0 for v in have.values())  # not a state that is zero everywhere
    want, have = (json.loads((d / "state.json").read_text()) for d in (saved, seen / "portable"))
    assert want["adam_step"] == have["adam_step"] == RESUME_AT
    assert want["scheduler"]["state"] == have["scheduler"]["state"]
    lrs = [{n: g["lr"] for g in s["param_groups"] for n in g["names"]} for s in (want, have)]
    assert lrs[0] == lrs[1] and lrs[0]

    # Then the run continues as one that was never moved.
    reference = losses(uninterrupted(target, lora))
    resumed = losses(workdir / name)
    assert sorted(resumed) == list(range(RESUME_AT + 1, STEPS + 1))
    for step, (loss, eval_loss) in resumed.items():
        assert loss == pytest.approx(reference[step][0], rel=1e-5), (step, loss, reference[step])
        if eval_loss is not None:
            assert eval_loss == pytest.approx(reference[step][1], rel=1e-5), (step, eval_loss, reference[step])
    a, b = load_weights(workdir / name / "final"), load_weights(uninterrupted(target, lora) / "final")
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-4, msg=k)  # as the backend matrix


@pytest.mark.launch
def test_another_global_batch_is_refused_in_one_line(workdir, uninterrupted):
    written = uninterrupted("ddp", False) / "checkpoints" / f"step-{RESUME_AT:06d}"
    before = snapshot(written.parent.parent)
    path = recipe(workdir, "other_batch", "single", False, micro_batch_size=2)
    rc, _, err = finish(start(command(workdir, "single", path, f"resume={written}")))
    assert rc == 2, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: resume:") and "global batch of 8" in line and " 4 " in line, line
    assert "Traceback" not in err and not (workdir / "other_batch").exists()
    assert snapshot(written.parent.parent) == before


# ----------------------------------------------------------------------------- toolkit checkpoint convert


def convert(*args):
    return run_command([sys.executable, "-m", "toolkit", "checkpoint", "convert", *map(str, args)])


@pytest.mark.launch
def test_convert_a_zero3_checkpoint_to_a_plain_folder(workdir, uninterrupted):
    """The last checkpoint of a 2-process ZeRO-3 run, converted by one process: the weights of its
    final/ bit for bit, in a folder transformers loads alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = uninterrupted("zero3", False)
    out = workdir / "zero3_converted"
    proc = convert(run / "checkpoints" / f"step-{STEPS:06d}", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want, have = load_weights(run / "final"), load_weights(out)
    assert want.keys() == have.keys() and want
    assert all(torch.equal(want[k], have[k]) for k in want), [k for k in want if not torch.equal(want[k], have[k])]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert (AutoTokenizer.from_pretrained(out).chat_template
            == AutoTokenizer.from_pretrained(run / "final").chat_template)
    assert torch.equal(model.state_dict()["model.norm.weight"], want["model.norm.weight"])

    again = convert(run / "checkpoints" / f"step-{STEPS:06d}", "--out", out)  # never over earlier results
    assert (again.returncode == 2
            and again.stderr.strip().splitlines()[-1].startswith("error: checkpoint convert: --out"))
    assert load_weights(out).keys() == want.keys()


@pytest.mark.launch
def test_convert_a_lora_checkpoint_to_its_adapter_and_to_a_merged_model(workdir, uninterrupted):
    run = uninterrupted("fsdp", True)
    step = run / "checkpoints" / f"step-{STEPS:06d}"
    proc = convert(step, "--out", workdir / "fsdp_adapter", "--adapter")
    assert proc.returncode == 0, proc.stderr[-3000:]
    want, have = load_weights(run / "final"), load_weights(workdir / "fsdp_adapter")
    assert want.keys() == have.keys() and want and all(torch.equal(want[k], have[k]) for k in want)
    proc = convert(step, "--out", workdir / "fsdp_merged")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "max |logit difference|" in proc.stdout and (workdir / "fsdp_merged" / "config.json").is_file(), proc.stdout
    assert not (workdir / "fsdp_merged.tmp").exists()
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(workdir / "fsdp_merged")


@pytest.mark.launch
def test_a_checkpoint_without_its_portable_state_is_refused_in_one_line(workdir):
    path = recipe(workdir, "not_portable", "single", False, max_steps=2)
    rc, _, err = finish(start(command(workdir, "single", path, "checkpoint.portable=false")))
    assert rc == 0, err[-3000:]
    step = workdir / "not_portable" / "checkpoints" / "step-000002"
    assert not (step / "portable").exists()
    proc = convert(step, "--out", workdir / "not_portable_out")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: checkpoint convert:") and "portable" in proc.stderr
    assert not (workdir / "not_portable_out").exists()
    # ... and so is a resume of it under another layout.
    moved = recipe(workdir, "not_portable_moved", "ddp", False, max_steps=2)
    rc, _, err = finish(start(command(workdir, "ddp", moved, f"resume={step}")))
    assert rc != 0 and "without its portable state" in err, err[-3000:]



@pytest.mark.launch
def test_a_portable_weights_file_cut_short_is_refused_in_one_line(workdir, uninterrupted):
    """A checkpoint whose portable weights were cut short after the save (a copy interrupted, a full
    disk elsewhere): convert ends in one line naming the file, exit 2, no traceback, no folder."""
    import shutil

    source = uninterrupted("single", False) / "checkpoints" / f"step-{STEPS:06d}"
    run = workdir / "cut_short_run"
    shutil.copytree(source.parent.parent, run, ignore=shutil.ignore_patterns("final"))
    weights = run / "checkpoints" / source.name / "portable" / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    proc = convert(weights.parent.parent, "--out", workdir / "cut_short_out")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: checkpoint convert: {weights} cannot be read") and "cut short" in line, line
    assert not (workdir / "cut_short_out").exists()

# ----------------------------------------------------------------------------- resume_new_global_batch


def test_a_new_global_batch_continues_at_the_samples_seen():
    """The sampler of a launch with another global batch, resumed at a checkpoint's data position,
    yields exactly the samples the old one had not yet given, in the same order."""
    from toolkit.data.batching import EpochSampler

    old = EpochSampler(48, 8, seed=3)
    order = []
    for epoch in range(2):
        old.set_epoch(epoch)
        order += list(old)
    for global_batch, offset, first_epoch in ((4, 32, order[32:48]), (5, 32, order[32:42]), (16, 40, [])):
        new = EpochSampler(48, global_batch, seed=3)
        new.resume_at(0, offset)  # 4 steps of 8 seen (5 of 8 for the last case)
        new.set_epoch(0)
        assert list(new) == first_epoch and new.steps_in(0) * global_batch == len(first_epoch)
        new.set_epoch(1)
        assert list(new) == order[48:48 + 48 // global_batch * global_batch]


@pytest.mark.launch
def test_resume_new_global_batch_continues_by_samples_and_optimizer_steps(workdir, uninterrupted):
    written = uninterrupted("single", False) / "checkpoints" / f"step-{RESUME_AT:06d}"
    path = recipe(workdir, "new_batch", "single", False, micro_batch_size=2)  # global batch 4 instead of 8
    rc, out, err = finish(start(command(workdir, "single", path, f"resume={written}", "resume_new_global_batch=true")))
    assert rc == 0, err[-3000:]
    assert "resume: global batch 8 -> 4 (resume_new_global_batch): the data continues at sample 32 of epoch 0, " \
           "the schedule at optimizer step 4" in out + err, (out + err)[-3000:]
    rows = {r["step"]: r for r in read_metrics(workdir / "new_batch")}
    assert sorted(rows) == [5, 6, 7, 8]  # the schedule's length is this recipe's: max_steps 8
    assert [rows[s]["epoch"] for s in (5, 6, 7, 8)] == [0.75, 0.8333, 0.9167, 1.0]  # 4 samples a step from 32 of 48
    reference = {r["step"]: r for r in read_metrics(uninterrupted("single", False))}
    assert [rows[s]["lr"] for s in (5, 6, 7, 8)] == [reference[s]["lr"] for s in (5, 6, 7, 8)]
    state = json.loads((workdir / "new_batch" / "checkpoints" / "step-000006" / "trainer_state.json").read_text())
    assert state["data_position"] == [0, 40] and state["global_batch"] == 4


@pytest.mark.launch
def test_a_portable_state_that_does_not_read_back_stops_the_run(workdir):
    path = recipe(workdir, "bad_portable", "single", False, max_steps=2)
    rc, out, err = finish(start(command(workdir, "single", path), env={"TOOLKIT_FAULT_CORRUPT_PORTABLE": "1"}))
    assert rc == 4, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("stopped: checkpoint step-000002 did not read back as saved (rank 0: ") and \
        "portable: tensor" in line and "differs" in line, line
    assert "Traceback" not in err and not (workdir / "bad_portable" / "checkpoints" / "step-000002").exists()


@pytest.mark.launch
def test_each_checkpoint_says_what_it_cost(workdir, uninterrupted):
    lines = [line for line in (uninterrupted("ddp", False) / "train.log").read_text().splitlines()
             if line.startswith("checkpoint step-")]
    assert len(lines) == STEPS // 2, lines
    assert all(" s (backend state " in line and ", portable " in line and ", read-back " in line for line in lines)


@pytest.mark.launch
def test_checkpoint_cost_benchmark_runs():
    """benchmarks/checkpoint_cost.py at its smallest, so the script cannot rot."""
    proc = run_command([sys.executable, "benchmarks/checkpoint_cost.py", "--preset", "tiny-llama-mini", "--steps", "3",
                        "--seq", "32"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["checkpoints_timed"] == 2 and result["mib_portable"] > 0 and result["seconds_portable"] >= 0
