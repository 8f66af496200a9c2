"""Runs that survive anything: SIGKILL at a random step, SIGKILL during a checkpoint write and
SIGTERM all resume to bitwise the weights and metrics of an uninterrupted run.

Every case launches for real (`python -m toolkit` or `accelerate launch` with 2 gloo processes),
kills the whole process group, launches again with resume=auto and compares with a run that was
never interrupted.
"""

import json
import os
import pickle
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from toolkit.storage import checkpoint

from helpers import (
    RESUME_STEPS,
    descendants,
    finish,
    layout_command,
    layout_recipe,
    load_weights,
    read_metrics,
    read_output,
    start,
    write_recipe,
)

pytestmark = pytest.mark.launch  # every test here starts processes

STEPS = RESUME_STEPS
CASES = {  # name: (accelerate config or None for one plain process, lora dropout or None for full)
    "single": (None, None),
    "single_lora_dropout": (None, 0.1),  # dropout draws random numbers: RNG restore matters
    "ddp": ("ddp", None),
    "fsdp": ("fsdp", None),
    "zero2": ("zero2", None),
    "zero3": ("zero3", None),
    "ddp_packed": ("ddp", None),  # rows of documents read from Arrow bins
    "sp": ("sp", None),  # each sequence split across the 2 processes (DeepSpeed Ulysses)
}
PACKED = {"ddp_packed"}
KILL_SEED = int(os.environ.get("TOOLKIT_KILL_SEED", time.time_ns() % 10_000))


@pytest.fixture
def workdir(layout_dir):
    return layout_dir


def recipe(workdir, name, dropout, backend=None, **extra):
    """helpers.layout_recipe (the recipe test_portable_resume.py moves between layouts), LoRA when
    `dropout` is not None."""
    return layout_recipe(workdir, name, backend or "single", lora=dropout is not None, dropout=dropout or 0.0,
                         **extra)


def command(workdir, backend, path, *overrides):
    return layout_command(workdir, backend or "single", path, *overrides)


def kill_tree(pid, sig=signal.SIGKILL):
    """Signal a launcher and every process below it (torchrun starts its workers in sessions of
    their own, so a process-group kill would leave them training)."""
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def wait_for(predicate, proc, timeout=600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended before the kill point: {read_output(proc)[1][-3000:]}")
        time.sleep(0.05)
    raise AssertionError("kill point never reached")


def logged_steps(run_dir):
    try:
        return max((r["step"] for r in read_metrics(run_dir)), default=-1)
    except (FileNotFoundError, json.JSONDecodeError):
        return -1


def comparable(rows, from_step):
    from toolkit.observe.measure import MEASURED

    return [{k: v for k, v in r.items() if k not in MEASURED} for r in rows if r["step"] > from_step]


def assert_identical(reference, resumed, from_step):
    assert comparable(read_metrics(resumed), from_step) == comparable(read_metrics(reference), from_step)
    want, have = load_weights(reference / "final"), load_weights(resumed / "final")
    assert want.keys() == have.keys() and want
    for k in want:
        assert torch.equal(want[k], have[k]), f"{k} differs"
    last = f"step-{STEPS:06d}"
    world = checkpoint.read_state(reference / "checkpoints" / last).world_size
    names = [sorted(p.name for p in (run / "checkpoints" / last).glob("rng_rank*.pkl")) for run in (reference, resumed)]
    assert names[0] == names[1] == [f"rng_rank{r}.pkl" for r in range(world)], names  # one per rank, none missing
    for name in names[0]:
        a = pickle.loads((reference / "checkpoints" / last / name).read_bytes())
        b = pickle.loads((resumed / "checkpoints" / last / name).read_bytes())
        assert torch.equal(a["torch"], b["torch"]) and a["python"] == b["python"], f"RNG differs ({name})"
        assert all(np.array_equal(x, y) for x, y in zip(a["numpy"], b["numpy"])), f"numpy RNG differs ({name})"


@pytest.fixture
def uninterrupted(workdir, layout_runs):
    """The run never interrupted: shared with test_portable_resume.py (conftest's layout_runs) for
    the full-fine-tuning cases on plain data; trained here for LoRA with dropout and packed rows."""
    done = {}

    def get(name):
        backend, dropout = CASES[name]
        if dropout is None and name not in PACKED:
            return layout_runs(backend or "single")
        if name not in done:
            path = recipe(workdir, f"ref_{name}", dropout, backend, data__packing=name in PACKED)
            rc, _, err = finish(start(command(workdir, backend, path)))
            assert rc == 0, err[-3000:]
            done[name] = workdir / f"ref_{name}"
        return done[name]

    return get


# CI kills and resumes one process (LoRA with dropout), DDP on packed rows, FSDP, ZeRO-3 and sequence parallel; the
# plain single, DDP and ZeRO-2 cases run by hand (`-m slow`), within CI's 60 minutes (2026-11-28).
BY_HAND = {"single", "ddp", "zero2"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in BY_HAND else n for n in CASES])
def test_sigkill_at_a_random_step_resumes_identically(name, workdir, uninterrupted):
    """Killed between the first complete checkpoint (step 2, written before step 3 is logged) and
    the end, so there is always a checkpoint to resume from. A fast run may get past the last
    checkpoint (step 8) before the kill lands and die while writing final/: that is a moment too,
    and its resume must write the same final/ without training a step.
    (A kill before the first checkpoint is test_killed_before_the_first_checkpoint_starts_again.)"""
    backend, dropout = CASES[name]
    reference = uninterrupted(name)
    kill_at = random.Random(f"{KILL_SEED}-{name}").randint(3, STEPS - 2)
    print(f"\n{name}: SIGKILL once step {kill_at} is logged (TOOLKIT_KILL_SEED={KILL_SEED})")
    path = recipe(workdir, f"killed_{name}", dropout, backend, data__packing=name in PACKED)
    run = workdir / f"killed_{name}"
    proc = start(command(workdir, backend, path))
    wait_for(lambda: logged_steps(run) >= kill_at, proc)
    kill_tree(proc.pid)
    finish(proc)
    saved = checkpoint_names(run)
    assert saved and not (run / "final").exists(), (saved, "the kill came after the run finished")
    resume_step = int(saved[-1].removeprefix("step-"))
    assert 2 <= resume_step <= STEPS, saved
    rc, out, err = finish(start(command(workdir, backend, path, "resume=auto")))
    assert rc == 0, err[-3000:]
    resumed_at = [line for line in out.splitlines() if line.startswith("resumed from")]
    assert resumed_at == [f"resumed from {run / 'checkpoints' / saved[-1]} at step {resume_step}"], (saved, out[-2000:])
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(STEPS + 1)), "a step was repeated or lost in metrics.jsonl"
    assert_identical(reference, workdir / f"killed_{name}", from_step=0)
    with open(workdir / "kills.jsonl", "a") as f:
        f.write(json.dumps({"case": name, "kill_at": kill_at, "identical": True, "resumed": resumed_at[0]}) + "\n")


def test_sigkill_during_a_checkpoint_write_keeps_the_previous_one(workdir, uninterrupted):
    reference = uninterrupted("single")
    path = recipe(workdir, "killed_in_write", None)
    run = workdir / "killed_in_write"
    proc = start(command(workdir, None, path), env={"TOOLKIT_FAULT_CHECKPOINT_PAUSE": "3"})
    wait_for(lambda: (run / "checkpoints" / ".tmp-step-000004").is_dir(), proc)
    time.sleep(0.5)  # inside the write: state files being written, no marker yet
    kill_tree(proc.pid)
    finish(proc)
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == [".tmp-step-000004", "step-000002"], names
    rc, out, err = finish(start(command(workdir, None, path, "resume=auto")))
    assert rc == 0, err[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'step-000002'} at step 2" in out
    assert_identical(reference, run, from_step=0)


def test_killed_before_the_first_checkpoint_starts_again(workdir, uninterrupted):
    """resume=auto on a run folder with no complete checkpoint (killed while writing step 2):
    the same recipe starts again from step 0 and ends identical; another recipe is refused."""
    reference = uninterrupted("single")
    path = recipe(workdir, "killed_first", None)
    run = workdir / "killed_first"
    proc = start(command(workdir, None, path), env={"TOOLKIT_FAULT_CHECKPOINT_PAUSE": "3"})
    wait_for(lambda: (run / "checkpoints" / ".tmp-step-000002").is_dir(), proc)
    kill_tree(proc.pid)
    finish(proc)
    assert not checkpoint_names(run)
    rc, _, err = finish(start(command(workdir, None, path, "resume=auto", "train.learning_rate=0.001")))
    assert rc == 2 and err.strip().splitlines()[-1].startswith("error: output_dir:"), err[-2000:]
    rc, out, err = finish(start(command(workdir, None, path, "resume=auto")))
    assert rc == 0, err[-3000:]
    assert "resumed from" not in out
    assert_identical(reference, run, from_step=0)


def checkpoint_names(run):
    """The complete checkpoints a resume finds: those in place, and a `.tmp-` write killed after
    its marker but before its rename into place, which the resume completes (checkpoint.tidy; a
    fresh-clone CI once killed a run in that moment)."""
    from toolkit.storage.checkpoint import is_complete

    if not (run / "checkpoints").is_dir():
        return []
    return sorted(p.name.removeprefix(".tmp-") for p in (run / "checkpoints").iterdir()
                  if not p.name.startswith(".") or (p.name.startswith(".tmp-step-") and is_complete(p)))


def test_sigterm_checkpoints_and_exits_75(workdir, uninterrupted):
    reference = uninterrupted("single")
    path = recipe(workdir, "terminated", None)
    run = workdir / "terminated"
    proc = start(command(workdir, None, path))
    wait_for(lambda: logged_steps(run) >= 3, proc)
    os.killpg(proc.pid, signal.SIGTERM)
    rc, _, err = finish(proc)
    assert rc == 75, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("stopped: preempted: checkpoint") and "resume=auto" in last, last
    assert "Traceback" not in err
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert saved and all(n.startswith("step-") for n in saved), saved
    assert not (run / "final").exists()
    rc, _, err = finish(start(command(workdir, None, path, "resume=auto")))
    assert rc == 0, err[-3000:]
    assert_identical(reference, run, from_step=0)


@pytest.mark.parametrize("target", ["launcher", "every_process"])
def test_sigterm_under_accelerate_launch_checkpoints_and_resumes(target, workdir, uninterrupted):
    """DDP, 2 processes. `launcher`: SIGTERM to `accelerate launch` alone, as a container runtime
    does to its main process; torchrun forwards it to the workers and waits up to 30 s before
    SIGKILL. `every_process`: SIGTERM to every process of the tree at once, as Slurm does.

    The signal lands while step 6's checkpoint is being written (slowed by the test seam), so the
    run stops after step 7: with 6 steps per epoch (48 rows, global batch 8), the resumed run
    starts in the middle of the second epoch, where the sampler must skip its first batch again."""
    reference = uninterrupted("ddp")
    name = f"terminated_ddp_{target}"
    path = recipe(workdir, name, None, "ddp")
    run = workdir / name
    proc = start(command(workdir, "ddp", path), env={"TOOLKIT_FAULT_CHECKPOINT_PAUSE": "2"})
    wait_for(lambda: logged_steps(run) >= 6, proc)
    if target == "launcher":
        os.kill(proc.pid, signal.SIGTERM)
    else:
        kill_tree(proc.pid, signal.SIGTERM)
    rc, _, err = finish(proc)
    assert rc != 0, err[-3000:]  # torchrun reports the signal, not the workers' exit code 75
    assert "stopped: preempted: checkpoint" in err and "resume=auto" in err, err[-3000:]
    saved = checkpoint.complete_checkpoints(run)
    assert saved and saved[-1].name == "step-000007" and not (run / "final").exists(), saved
    epoch = {r["step"]: r["epoch"] for r in read_metrics(run)}[7]
    assert 1 < epoch < 2, epoch  # 1 + 1/6: one step into the second epoch
    rc, out, err = finish(start(command(workdir, "ddp", path, "resume=auto")))
    assert rc == 0, err[-3000:]
    assert f"resumed from {saved[-1]} at step 7" in out + err, out[-3000:]
    assert_identical(reference, run, from_step=0)


def checkpoint_tensors(folder: Path) -> dict:
    """Every tensor a checkpoint holds (model, optimizer, scheduler; any backend's files), by
    file and key path. RNG states and counters are left out."""
    from safetensors.torch import load_file

    found = {}

    def walk(prefix, value):
        if isinstance(value, torch.Tensor):
            found[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}/{i}", v)

    for f in sorted(folder.rglob("*")):
        if f.suffix == ".safetensors":
            walk(f.relative_to(folder).as_posix(), load_file(f))
        elif f.suffix in (".bin", ".pt") and not f.name.startswith(("random_states", "rng_rank")):
            walk(f.relative_to(folder).as_posix(), torch.load(f, weights_only=False, map_location="cpu"))
    return found


@pytest.mark.parametrize("backend", [None, "ddp", "zero2"], ids=lambda b: b or "single")
def test_nonfinite_steps_are_skipped_then_stop_the_run(backend, workdir):
    """NaN losses at steps 5, 6 and 7 (through the test seam, on every rank): each step is
    skipped, not applied; the third in a row stops the run with one line and exit code 3;
    checkpoints stay intact and hold exactly the state of step 4."""
    name = f"nonfinite_{backend or 'single'}"
    path = recipe(workdir, name, None, backend, checkpoint__every_steps=1, checkpoint__keep_last=10)
    run = workdir / name
    rc, out, err = finish(start(command(workdir, backend, path), env={"TOOLKIT_FAULT_NONFINITE_STEPS": "5,6,7"}))
    # torchrun exits 1 whatever its workers' codes were; each worker's 3 is in its report.
    assert rc == (3 if backend is None else 1), err[-3000:]
    if backend is not None:
        assert "exitcode  : 3 " in err, err[-3000:]  # the rank that exits second may be SIGTERMed first
    stopped = [line for line in err.splitlines() if line.startswith("stopped: ")]
    assert stopped and stopped[0].startswith(
        "stopped: train: loss or gradient not finite for 3 optimizer steps in a row (steps 5-7"), stopped
    if backend is None:
        assert err.strip().splitlines()[-1] == stopped[0] and "Traceback" not in err
    rows = {r["step"]: r for r in read_metrics(run)}
    assert [rows[s]["skipped_steps"] for s in (4, 5, 6, 7)] == [0, 1, 2, 3]
    assert all("loss_scale" in rows[s] for s in (4, 5, 6, 7))  # None: nothing scales the loss in fp32
    assert rows[5]["lr"] == rows[6]["lr"] == rows[7]["lr"]  # the schedule did not advance
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == [f"step-{s:06d}" for s in range(1, 7)], ckpts  # the stopping step saves nothing
    # A skipped step leaves weights, optimizer and scheduler exactly as they were ...
    at = {s: checkpoint_tensors(run / "checkpoints" / f"step-{s:06d}") for s in (3, 4, 6)}
    assert at[4] and at[4].keys() == at[6].keys()
    for key in at[4]:
        assert torch.equal(at[4][key], at[6][key]), key
    # ... while an applied step changes them (so the comparison above can fail).
    assert any(not torch.equal(at[3][k], at[4][k]) for k in at[4])
    # The scheduler's state (scheduler.bin on every backend here, DeepSpeed too: accelerate saves the
    # recipe's LambdaLR itself) holds no tensors, so it is compared on its own: held on skipped steps,
    # advanced by an applied one.
    files = {s: run / "checkpoints" / f"step-{s:06d}" / "scheduler.bin" for s in (3, 4, 6)}
    assert all(f.is_file() for f in files.values()), sorted(p.name for p in files[4].parent.iterdir())
    sch = {s: torch.load(f, weights_only=False) for s, f in files.items()}
    assert sch[4]["last_epoch"] == sch[6]["last_epoch"] and sch[4]["_last_lr"] == sch[6]["_last_lr"]
    assert sch[3]["last_epoch"] + 1 == sch[4]["last_epoch"], (sch[3], sch[4])


def test_a_key_added_since_a_checkpoint_resumes_at_its_default_and_is_refused_otherwise(tmp_path):
    """A checkpoint written before a recipe key existed (rl.top_k, rl.min_p, rl.mask_truncated_completions came
    on 2026-11-27) resumes when the key is at its default, which is what the older toolkit did; at any other
    value it is a changed recipe, refused in one line. (Found when a run's reference checkpoints were written
    before the keys and resumed after them.)"""
    from toolkit.config import Recipe
    from toolkit.errors import ToolkitError
    from toolkit.storage.checkpoint import TrainerState
    from toolkit.storage.run_folder import check_resumable, learning_relevant

    now = learning_relevant(Recipe())
    older = {k: v for k, v in now.items() if k not in ("rl.top_k", "rl.min_p", "rl.mask_truncated_completions")}
    assert len(older) == len(now) - 3
    saved = TrainerState(recipe=older, global_batch=8)
    assert check_resumable(saved, TrainerState(recipe=now, global_batch=8), tmp_path) is False
    with pytest.raises(ToolkitError, match=r"resume: rl.top_k was None when .* written, now 5; a resumed run must"):
        check_resumable(saved, TrainerState(recipe={**now, "rl.top_k": 5}, global_batch=8), tmp_path)
    with pytest.raises(ToolkitError, match=r"resume: train.learning_rate was"):  # a key both know still counts
        check_resumable(saved, TrainerState(recipe={**now, "train.learning_rate": 1.0}, global_batch=8), tmp_path)


def test_a_resume_with_another_length_says_what_to_do_instead(tmp_path):
    """Issue 68: a resume that changes train.max_steps is refused, and the line says how to finish the run and how to
    train further; another optimizer is refused as a changed recipe."""
    from toolkit.config import Recipe
    from toolkit.errors import ToolkitError
    from toolkit.storage.checkpoint import TrainerState
    from toolkit.storage.run_folder import check_resumable, learning_relevant

    now = {**learning_relevant(Recipe()), "train.max_steps": 100}
    saved = TrainerState(recipe=now, global_batch=8)
    with pytest.raises(ToolkitError, match=r"train.max_steps was 100 when .* now 200; a resumed run must keep its "
                                           r"recipe \(its learning-rate schedule runs over that length\): resume with "
                                           r"train.max_steps=100 to finish it, then train further in a new run"):
        check_resumable(saved, TrainerState(recipe={**now, "train.max_steps": 200}, global_batch=8), tmp_path)
    with pytest.raises(ToolkitError, match=r"resume: train.optim was 'adamw_torch' when .* now 'adamw_8bit'"):
        check_resumable(saved, TrainerState(recipe={**now, "train.optim": "adamw_8bit"}, global_batch=8), tmp_path)


def test_the_reward_code_is_an_input_by_content_and_a_moved_base_is_not_a_change(tmp_path, monkeypatch):
    """storage/inputs.py (issue 52): an edited reward file changes the run's `rewards` identity and a resume is
    refused naming it, unless resume_accept_changed lists it; the same file elsewhere is the same identity. A
    model.path that differs while the base's content identity is the same is no change."""
    import textwrap

    from toolkit.config import Recipe, RewardConfig
    from toolkit.errors import ToolkitError
    from toolkit.model.base_identity import identities
    from toolkit.storage.checkpoint import TrainerState
    from toolkit.storage.run_folder import check_resumable, learning_relevant
    from toolkit.training.rewards import load_rewards

    def rewards_in(folder, body="return [1.0] * len(completions)"):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "judge.py").write_text(textwrap.dedent(f"""
            def correct(completions, **kwargs):
                {body}
            """))
        return identities(Recipe(), load_rewards([RewardConfig(function=f"{folder / 'judge.py'}:correct"),
                                                  RewardConfig(function="exact_match")]))

    first = rewards_in(tmp_path / "a")
    assert set(first) == {"rewards"}
    assert rewards_in(tmp_path / "b") == first  # the same code at another path
    edited = rewards_in(tmp_path / "c", "return [0.0] * len(completions)")
    assert edited != first
    assert identities(Recipe(), load_rewards([RewardConfig(function="exact_match")])) == {}  # the toolkit's own

    recipe = learning_relevant(Recipe())
    saved = TrainerState(recipe=recipe, global_batch=8, inputs={**first, "model": "m1"})
    with pytest.raises(ToolkitError, match=r"^resume: the reward functions' code \(rl.rewards\) changed since .* "
                                           r"set resume_accept_changed=\[rewards\] to continue with this one$"):
        check_resumable(saved, TrainerState(recipe=recipe, global_batch=8, inputs={**edited, "model": "m1"}), tmp_path)
    check_resumable(saved, TrainerState(recipe=recipe, global_batch=8, inputs={**edited, "model": "m1"}), tmp_path,
                    accept=["rewards"])
    moved = {**recipe, "model.path": "/models/elsewhere"}
    check_resumable(saved, TrainerState(recipe=moved, global_batch=8, inputs={**first, "model": "m1"}), tmp_path)
    with pytest.raises(ToolkitError, match=r"^resume: the base model .* changed since"):
        check_resumable(saved, TrainerState(recipe=moved, global_batch=8, inputs={**first, "model": "m2"}), tmp_path)
    older = TrainerState(recipe=recipe, global_batch=8)  # a checkpoint that recorded no inputs: the path decides
    with pytest.raises(ToolkitError, match=r"^resume: model.path was None when"):
        check_resumable(older, TrainerState(recipe=moved, global_batch=8, inputs={"model": "m1"}), tmp_path)


def test_the_same_training_data_in_another_folder_resumes(tmp_path):
    """Issue 52, class 2 for the data: the prepared data's fingerprint names the files' paths (the cache key);
    a resume compares the one without them, so data copied to another folder resumes and data.train_files may
    name it; changed content is refused as before."""
    import shutil

    from toolkit.config import DataConfig, Recipe
    from toolkit.data.prepare import fingerprint
    from toolkit.data.sources import resolve_sources
    from toolkit.errors import ToolkitError
    from toolkit.model.load import build_byte_tokenizer
    from toolkit.storage.checkpoint import TrainerState
    from toolkit.storage.run_folder import check_resumable, learning_relevant

    from helpers import alpaca_rows, write_jsonl

    tokenizer, cfg = build_byte_tokenizer(), DataConfig(format="alpaca")
    first = write_jsonl(tmp_path / "a" / "train.jsonl", alpaca_rows(8, seed=1))
    (tmp_path / "b").mkdir()
    moved = Path(shutil.copy(first, tmp_path / "b" / "train.jsonl"))
    changed = write_jsonl(tmp_path / "c" / "train.jsonl", alpaca_rows(8, seed=2))

    def prints(path, by_content):
        return fingerprint(resolve_sources([str(path)], cfg, "data.train_files"), cfg, tokenizer, by_content=by_content)

    assert prints(first, False) != prints(moved, False) and prints(first, True) == prints(moved, True)
    assert prints(changed, True) != prints(first, True)

    def state(path):
        recipe = learning_relevant(Recipe(data=DataConfig(train_files=[str(path)])))
        return TrainerState(recipe=recipe, global_batch=8, data_fingerprint=prints(path, False),
                            data_content=prints(path, True))

    check_resumable(state(first), state(moved), tmp_path)
    with pytest.raises(ToolkitError, match="^resume: the training data changed since"):
        check_resumable(state(first), state(changed), tmp_path)


def test_every_value_a_resume_refusal_suggests_is_one_the_recipe_accepts(tmp_path):
    """Issue 69: a changed teacher was refused naming `resume_accept_changed=[teacher]`, which the recipe itself
    refused. Every input a checkpoint records (storage/inputs.py), found changed, is refused naming the value
    that lets the resume go on; that value, fed back through the recipe loader, is accepted and does let it go
    on. So do the other refusals of a resume that suggest a value: another global batch, another run length."""
    import re

    from toolkit.config import Recipe, load_recipe
    from toolkit.errors import ToolkitError
    from toolkit.storage import inputs
    from toolkit.storage.checkpoint import TrainerState
    from toolkit.storage.run_folder import check_resumable, learning_relevant

    path = write_recipe(tmp_path / "r.yaml", output_dir=str(tmp_path / "run"), model={"preset": "tiny-llama-mini"},
                        data={"train_files": ["t.jsonl"]})

    def suggested(refusal) -> tuple[str, Recipe]:
        """The `key=value` the refusal suggests, and the recipe loaded with it (a refused value raises here)."""
        found = re.search(r"(?:set|resume with) (\S+=\S+?)[;,]? (?:to continue|to finish)", str(refusal.value))
        assert found, str(refusal.value)
        return found.group(1), load_recipe(path, [found.group(1)])

    recipe = learning_relevant(Recipe())
    assert {"model", "rewards", "reward_models", "teacher"} <= set(inputs.WHAT)
    for name in inputs.WHAT:
        saved = TrainerState(recipe=recipe, global_batch=8, inputs={name: "before"})
        now = TrainerState(recipe=recipe, global_batch=8, inputs={name: "after"})
        with pytest.raises(ToolkitError, match=f"^resume: {re.escape(inputs.WHAT[name])} changed since") as refusal:
            check_resumable(saved, now, tmp_path)
        value, loaded = suggested(refusal)
        assert value == f"resume_accept_changed=[{name}]" and loaded.resume_accept_changed == [name]
        check_resumable(saved, now, tmp_path, accept=loaded.resume_accept_changed)

    saved, now = TrainerState(recipe=recipe, global_batch=8), TrainerState(recipe=recipe, global_batch=16)
    with pytest.raises(ToolkitError, match="global batch of 8") as refusal:
        check_resumable(saved, now, tmp_path)
    check_resumable(saved, now, tmp_path, suggested(refusal)[1].resume_new_global_batch)

    for key, before, after in (("train.max_steps", 100, 200), ("train.max_steps", None, 200), ("train.epochs", 2, 3)):
        saved = TrainerState(recipe={**recipe, key: before}, global_batch=8)
        with pytest.raises(ToolkitError, match=f"resume: {key} was") as refusal:
            check_resumable(saved, TrainerState(recipe={**recipe, key: after}, global_batch=8), tmp_path)
        _, loaded = suggested(refusal)
        resumed = {**recipe, key: learning_relevant(loaded)[key]}
        check_resumable(saved, TrainerState(recipe=resumed, global_batch=8), tmp_path)
