"""Every backend from one loop: 2 gloo processes learn exactly what one process learns.

Each case launches `accelerate launch --config_file accelerate_configs/X.yaml --num_processes 2
-m toolkit train` with the same seed and global batch (2 processes x micro 2 x accumulation 2 = 8)
and compares every loss, grad norm and the saved final weights with a single process (micro 4 x 2).
The matrix's recipe is the resume tests' (helpers.layout_recipe), so its runs under ddp, fsdp, zero2
and zero3 are shared with them (conftest's `layout_runs`).
"""

import json
import shutil
import sys

import pytest
import torch

from helpers import (
    LAYOUTS,
    MODES,
    RESUME_STEPS,
    ROOT,
    STEPS,
    accelerate_launch,
    finish,
    launch_config_for,
    layout_recipe,
    load_weights,
    read_metrics,
    recipe_for,
    require_op,
    run_command,
    run_toolkit,
    start,
    train_losses,
    write_recipe,
)

pytestmark = pytest.mark.launch  # every test here starts processes

BACKENDS = ["ddp", "fsdp", "fsdp_shard_grad_op", "fsdp_offload", "zero1", "zero2", "zero3", "zero2_offload",
            "zero3_offload", "zero3_nvme"]


@pytest.fixture
def workdir(matrix_dir):
    return matrix_dir


@pytest.fixture
def reference(references):
    return references


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_single_process(backend, mode, layout_dir, layout_runs, request):
    """helpers.layout_recipe on 2 processes against one process. The runs under ddp, fsdp, zero2 and
    zero3 are conftest's `layout_runs`, which the resume tests also kill, resume and move between
    layouts (one launch proves both). The other backends train the same recipe here without
    checkpoints and with train.loss_chunk_tokens=5 (the reference: 1,024, one chunk per micro-batch):
    each rank's micro-batch then has its own number of target tokens, so its own number of chunks,
    and ZeRO-3 (its offload variants) gathers the output layer at every call and FSDP (its variants)
    unshards it, collectives, so the ranks must agree on one count or wait on each other forever.
    They learn what one process learns all the same. (This replaces
    test_chunked_loss_with_unequal_chunk_counts_across_ranks, which ran four launches of its own.)"""
    if backend.startswith("zero") and ("offload" in backend or "nvme" in backend):  # DeepSpeed's CPU Adam
        require_op(request.getfixturevalue("deepspeed_ops"), "cpu_adam")
    if "nvme" in backend:
        require_op(request.getfixturevalue("deepspeed_ops"), "async_io")
    lora = mode == "lora"
    if backend in LAYOUTS:
        run = layout_runs(backend, lora)
        stderr = (run / "train.log").read_text()
    else:
        run = layout_dir / f"{backend}_{mode}"
        shutil.rmtree(run, ignore_errors=True)
        path = layout_recipe(layout_dir, run.name, backend, lora, train__loss_chunk_tokens=5,
                             checkpoint__every_steps=0)
        proc = run_toolkit("train", path, timeout=600,
                           launcher=accelerate_launch(launch_config_for(backend, layout_dir)))
        assert proc.returncode == 0, proc.stderr[-4000:]
        stderr = proc.stderr
    if backend == "fsdp_offload" and not torch.cuda.is_available():  # said, not silently dropped
        assert "fsdp_offload_params has no effect on a CPU-only host" in stderr
    # The layout a checkpoint of this run records; resume refuses any other (tests/test_deepspeed_config.py).
    layout = json.loads((run / "manifest.json").read_text())["launches"][-1]["layout"]
    stage = {"zero1": 1, "zero2": 2, "zero3": 3}.get(backend[:5])
    assert layout == {"ddp": "DDP",
                      "fsdp": "FSDP2 SHARDED_STATE_DICT"}.get(backend[:4], f"DeepSpeed ZeRO-{stage}"), layout
    reference = layout_runs("single", lora)
    ref, got = train_losses(reference), train_losses(run)
    assert len(got) == len(ref) == RESUME_STEPS
    rel = max(abs(a - b) / abs(a) for a, b in zip(ref, got))
    print(f"\n{backend} {mode}: max relative loss difference {rel:.2e}")
    (layout_dir / "diffs.jsonl").open("a").write(json.dumps({"backend": backend, "mode": mode, "rel": rel}) + "\n")
    assert rel <= 1e-4, (ref, got)
    assert ref[-1] < ref[0]
    # The logged grad_norm is the global gradient's norm before clipping, the same on every
    # backend, also where DeepSpeed clips internally (full fine-tuning: norms above
    # max_grad_norm 1.0, so clipping is active).
    ref_norms, norms = grad_norms(reference), grad_norms(run)
    assert len(norms) == RESUME_STEPS and (mode != "full" or min(ref_norms) > 1.0), ref_norms
    norm_rel = max(abs(a - b) / a for a, b in zip(ref_norms, norms))
    print(f"{backend} {mode}: max relative grad_norm difference {norm_rel:.2e}")
    assert norm_rel <= 1e-4, (ref_norms, norms)
    want, have = load_weights(reference / "final"), load_weights(run / "final")
    assert want.keys() == have.keys() and want
    for k in want:
        assert have[k].shape == want[k].shape and have[k].numel() > 0, k
        torch.testing.assert_close(have[k], want[k], rtol=1e-4, atol=1e-4, msg=k)


def grad_norms(run_dir) -> list[float]:
    return [r["grad_norm"] for r in read_metrics(run_dir) if "grad_norm" in r]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_multi_node_rehearsal_on_loopback(workdir, reference):
    """The shipped multi-node template, two 'machines' on 127.0.0.1 (ranks 0 and 1, one process
    each), learns what one process learns, with ZeRO-3 (ZeRO-2: the Slurm test below, which runs
    this template through examples/slurm/launch_node.sh and checks the same). Each machine's output goes to
    a file: ZeRO-3 warns on every collective, and a machine whose pipe nobody reads blocks on
    write while the other waits for it in a collective (that looked like a ZeRO-3 hang)."""
    import yaml

    stage = "zero3"
    launch = yaml.safe_load((ROOT / "accelerate_configs" / "multi_node_template.yaml").read_text())
    launch_config_for(stage, workdir)  # writes the test's copy of deepspeed_configs/{stage}.json
    launch["deepspeed_config"]["deepspeed_config_file"] = str(workdir / f"{stage}.json")
    port = free_port()
    out = workdir / f"multi_node_{stage}"
    shutil.rmtree(out, ignore_errors=True)
    recipe = write_recipe(workdir / f"multi_node_{stage}.yaml", **recipe_for(workdir, "full", out.name, micro=2))
    procs = []
    for rank in (0, 1):
        cfg = dict(launch, machine_rank=rank, num_processes=2, main_process_ip="127.0.0.1", main_process_port=port)
        (workdir / f"node{rank}.yaml").write_text(yaml.safe_dump(cfg))
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(workdir / f"node{rank}.yaml"),
               "-m", "toolkit", "train", str(recipe)]
        procs.append(start(cmd))
    for proc in procs:
        rc, _, err = finish(proc, timeout=600)
        assert rc == 0, err[-4000:]
    assert_same_as_reference(reference["full"], out, f"multi_node_{stage}", workdir)


def assert_same_as_reference(reference_dir, out, name: str, workdir) -> None:
    """Losses (recorded in diffs.jsonl) and final weights of a full fine-tuning run equal to the reference's."""
    rel = assert_same_losses(reference_dir, out, f"{name} full")
    (workdir / "diffs.jsonl").open("a").write(json.dumps({"backend": name, "mode": "full", "rel": rel}) + "\n")
    want, have = load_weights(reference_dir / "final"), load_weights(out / "final")
    assert want.keys() == have.keys() and want
    for k in want:
        torch.testing.assert_close(have[k], want[k], rtol=1e-4, atol=1e-4, msg=k)


def assert_same_losses(reference_dir, out, label: str) -> float:
    """Every step's loss within 1e-4 (relative) of the single-process reference; returns the largest difference."""
    ref, got = train_losses(reference_dir), train_losses(out)
    assert len(got) == len(ref) == STEPS
    rel = max(abs(a - b) / abs(a) for a, b in zip(ref, got))
    print(f"\n{label}: max relative loss difference {rel:.2e}")
    assert rel <= 1e-4, (ref, got)
    return rel


GUARD_SCRIPT = """
import os, sys
sys.stdout = open(os.path.join(os.path.dirname(__file__), "rank" + os.environ["RANK"] + ".txt"), "w")
from accelerate import Accelerator
from toolkit.backends import for_launch
from toolkit.errors import ToolkitError
backend = for_launch()
backend.accelerator = Accelerator()  # what a plain script gets on a CPU host: not distributed
try:
    backend.check_distributed()
    print("not refused", accelerator.distributed_type.name, accelerator.num_processes)
except ToolkitError as e:
    print("refused:", e)
"""


def test_processes_that_would_train_alone_are_refused(tmp_path):
    """`accelerate launch` started 2 processes, but a plain Accelerator() on a CPU host is not
    distributed: the documented trap where every rank trains alone without an error."""
    script = tmp_path / "guard.py"
    script.write_text(GUARD_SCRIPT)
    cmd = accelerate_launch(ROOT / "accelerate_configs" / "ddp.yaml")[:-1] + [str(script)]
    proc = run_command(cmd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        line = (tmp_path / f"rank{rank}.txt").read_text().strip()
        assert line.startswith("refused: launch: 2 processes were started but accelerate sees 1 (NO)"), line


def test_slurm_launch_script_on_two_loopback_nodes(workdir, reference):
    """examples/slurm/launch_node.sh, the per-node command of train.sbatch, run as Slurm would run
    it on two nodes (SLURM_NNODES=2, SLURM_NODEID 0 and 1, the main address), here both on
    127.0.0.1 with one process each and ZeRO-2: the shipped multi-node template learns what one
    process learns, losses and weights (this is also the ZeRO-2 multi-node rehearsal)."""
    launch_config_for("zero2", workdir)
    import yaml

    launch = yaml.safe_load((ROOT / "accelerate_configs" / "multi_node_template.yaml").read_text())
    launch["deepspeed_config"]["deepspeed_config_file"] = str(workdir / "zero2.json")
    (workdir / "slurm_launch.yaml").write_text(yaml.safe_dump(launch))
    out = workdir / "slurm_zero2"
    shutil.rmtree(out, ignore_errors=True)
    recipe = write_recipe(workdir / "slurm_zero2.yaml", **recipe_for(workdir, "full", out.name, micro=2))
    common = {"SLURM_NNODES": "2", "MAIN_ADDR": "127.0.0.1", "MAIN_PORT": str(free_port()), "GPUS_PER_NODE": "1",
              "LAUNCH": str(workdir / "slurm_launch.yaml"), "RECIPE": str(recipe), "PYTHON": sys.executable}
    procs = [start(["bash", str(ROOT / "examples" / "slurm" / "launch_node.sh")],
                   env={**common, "SLURM_NODEID": str(n)})
             for n in (0, 1)]
    for proc in procs:
        rc, _, err = finish(proc, timeout=600)
        assert rc == 0, err[-4000:]
    assert_same_as_reference(reference["full"], out, "multi_node_zero2", workdir)


def test_a_host_copy_that_fails_is_raised_only_after_every_gather():
    """`trainable_weights` under ZeRO-3 and FSDP2 takes a host copy between gathers (collectives every rank runs):
    a copy that fails on the main process (out of host memory) must not stop its loop early, or the other ranks
    would wait in the next gather; `HostCopies` keeps the first failure and raises it at `done`, taking no more
    copies after it."""
    from toolkit.backends.base import HostCopies

    copies = HostCopies(torch.float16)
    copies.take("a", torch.ones(2))
    copies.take("b", torch.ones(2, device="meta"))  # a tensor whose host copy fails
    copies.take("c", torch.ones(3))  # the loop goes on, copying nothing more
    assert list(copies) == ["a"] and copies["a"].dtype == torch.float16
    with pytest.raises(NotImplementedError):
        copies.done()
    fine = HostCopies(None)
    fine.take("a", torch.ones(2, dtype=torch.float64))
    assert fine.done()["a"].dtype == torch.float64
