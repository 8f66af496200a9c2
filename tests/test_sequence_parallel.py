"""Sequence parallelism (issue 30): an accelerate config with `parallelism_config_sp_size: 2` and
DeepSpeed (accelerate_configs/zero2_sp.yaml) splits every row across the 2 processes, attention
gathers it whole (DeepSpeed's Ulysses), and the run learns what one process learns on the whole
rows: losses, grad norms and final weights within 1e-5, full and LoRA, plain, packed and
padding-free rows. The uninterrupted runs are conftest's `layout_runs("sp")`, shared with the
resume tests (test_resume.py kills and resumes one; test_portable_resume.py moves checkpoints
between it and one process). Refusals are one line naming the key."""

import pytest
import torch

from toolkit.backends import sequence
from toolkit.backends.launch_config import check, sequence_parallel_size, worker_env
from toolkit.config import Recipe
from toolkit.data.batching import Collator
from toolkit.data.formats import IGNORE
from toolkit.errors import ToolkitError

from helpers import (
    ROOT,
    finish,
    layout_command,
    layout_recipe,
    load_weights,
    read_metrics,
    run_toolkit,
    start,
    write_recipe,
)

SP_YAML = ROOT / "accelerate_configs" / "zero2_sp.yaml"
TOL = 1e-5


# ----------------------------------------------------------------------------- the split, on the host

def test_the_parts_of_a_row_hold_every_target_once_with_the_whole_rows_positions():
    rows = [{"input_ids": list(range(1, 8)), "labels": [IGNORE, IGNORE, 3, 4, 5, 6, 7]},
            {"input_ids": [9, 8, 7], "labels": [IGNORE, 8, 7]}]
    batch = Collator(0, multiple=4)(rows)
    assert batch["input_ids"].shape == (2, 8)  # 7 positions padded to a multiple of 4
    parts = [sequence.shard(batch, r, 4) for r in range(4)]
    assert all(p["input_ids"].shape == (2, 2) and "labels" not in p and "attention_mask" not in p for p in parts)
    joined = {k: torch.cat([p[k] for p in parts], dim=1) for k in ("input_ids", "position_ids", "shift_labels")}
    assert torch.equal(joined["input_ids"], batch["input_ids"])
    assert torch.equal(joined["position_ids"], torch.arange(8).expand(2, 8))
    # position i's target is token i + 1 of the whole row, also at a part's last position
    assert torch.equal(joined["shift_labels"][:, :-1], batch["labels"][:, 1:])
    assert (joined["shift_labels"][:, -1] == IGNORE).all()
    assert parts[1]["shift_labels"][0, -1] == 5  # rank 1's last position predicts rank 2's first token
    targets = sum(int((p["shift_labels"] != IGNORE).sum()) for p in parts)
    assert targets == int((batch["labels"][:, 1:] != IGNORE).sum())
    assert sequence.shard(batch, 0, 1) is batch


def test_packed_and_padding_free_rows_keep_their_document_bounds():
    docs = [{"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7]}, {"input_ids": [8, 9], "labels": [IGNORE, 9]}]
    free = Collator(0, padding_free=True, bounds=True, multiple=2)(docs)
    assert free["input_ids"].shape == (1, 6)  # 5 tokens and one more document of padding
    assert free["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0]]
    assert free["cu_seq_lens_q"].tolist() == [0, 3, 5, 6]
    part = sequence.shard(free, 1, 2)
    assert part["position_ids"].tolist() == [[0, 1, 0]]
    assert part["cu_seq_lens_q"].tolist() == [0, 3, 5, 6]  # attention runs on the whole row: its bounds
    packed = Collator(0, packed=True, bounds=True, multiple=4)([{**docs[0], "position_ids": [0, 1, 2]}])
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0]]


def test_a_row_that_does_not_split_evenly_is_an_error():
    with pytest.raises(ValueError, match="does not split"):
        sequence.shard({"input_ids": torch.zeros(1, 5, dtype=torch.long),
                        "labels": torch.zeros(1, 5, dtype=torch.long)}, 0, 2)


# ----------------------------------------------------------------------------- the launch config

def recipe(**model) -> Recipe:
    r = Recipe(output_dir="x")
    r.model.preset = "tiny-llama"
    for k, v in model.items():
        setattr(r.model, k, v)
    r.data.train_files = ["a.jsonl"]
    r.train.max_steps = 10
    return r


def env(sp=2, world=2, kind="deepspeed", **extra):
    e = {"WORLD_SIZE": str(world), "ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_SP_SIZE": str(sp)}
    if kind == "deepspeed":
        e["ACCELERATE_USE_DEEPSPEED"] = "true"
    if kind == "fsdp":
        e.update(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2")
    return {**e, **extra}


@pytest.mark.parametrize("launch, r, words", [
    (env(kind="ddp"), recipe(), "sequence parallelism runs on DeepSpeed"),
    (env(kind="fsdp"), recipe(), "sequence parallelism runs on DeepSpeed"),
    (env(sp=2, world=3), recipe(), "a launch of 3 process(es) does not divide into groups of 2"),
    (env(), recipe(attn_implementation="eager"), "model.attn_implementation=sdpa"),
    (env(sp=1, PARALLELISM_CONFIG_CP_SIZE="2"), recipe(), "parallelism_config_cp_size is 2: context parallelism"),
    (env(sp=1, PARALLELISM_CONFIG_TP_SIZE="2"), recipe(), "parallelism_config_tp_size is 2: tensor parallelism"),
])
def test_what_sequence_parallelism_cannot_run_is_refused_in_one_line(launch, r, words):
    with pytest.raises(ToolkitError) as e:
        check(r, launch)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_preference_training_is_refused_under_sequence_parallelism():
    r = recipe()
    r.preference.method = "dpo"
    with pytest.raises(ToolkitError, match="does not run preference training"):
        check(r, env())


def test_the_yaml_attention_and_data_parallel_sizes_are_noted_not_obeyed():
    notes = []
    check(recipe(), env(world=2, PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION="flash_attention_2",
                        PARALLELISM_CONFIG_DP_SHARD_SIZE="2"), notes=notes)
    assert any("flash_attention_2 not used" in n for n in notes), notes
    assert any("make 1 data-parallel ranks" in n for n in notes), notes


def test_heads_that_do_not_split_are_refused_naming_the_key():
    from toolkit.backends.deepspeed import DeepSpeed
    from toolkit.config import ModelConfig
    from toolkit.model.load import build_model

    backend = DeepSpeed.__new__(DeepSpeed)
    backend.sequence_parallel = 3
    model = build_model(ModelConfig(preset="tiny-llama-mini"))  # 4 query heads over 2 key/value heads
    with pytest.raises(ToolkitError, match="sp_size is 3 but the model has 4 attention heads and 2 key/value heads"):
        backend.check_model(model, recipe())
    backend.sequence_parallel = 2
    backend.check_model(model, recipe())


@pytest.mark.launch
def test_config_show_knows_the_split(tmp_path):
    launch = worker_env(str(SP_YAML), num_processes=4)
    assert sequence_parallel_size(launch) == 2
    path = write_recipe(tmp_path / "r.yaml", output_dir=str(tmp_path / "o"), model={"preset": "tiny-llama"},
                        data={"train_files": ["a.jsonl"]},
                        train={"micro_batch_size": 2, "gradient_accumulation_steps": 3, "max_steps": 10})
    proc = run_toolkit("config", "show", path, "--accelerate-config", SP_YAML, "--num-processes", "4")
    assert proc.returncode == 0, proc.stderr
    assert "deepspeed, 4 process(es), sequence parallel 2 (2 data-parallel rank(s))" in proc.stdout, proc.stdout
    assert '"train_batch_size": 12' in proc.stdout  # micro 2 x accumulation 3 x 2 data-parallel ranks


# ----------------------------------------------------------------------------- what it learns

def assert_same_learning(reference, run, steps=None, padded=False):
    """`padded`: rows without an attention mask (packed, padding-free), whose padding to a multiple
    of the split counts among the processed tokens."""
    ref, got = read_metrics(reference), read_metrics(run)
    ref_steps, got_steps = [r for r in ref if "loss" in r], [r for r in got if "loss" in r]
    assert len(ref_steps) == len(got_steps) == (steps or len(ref_steps)) and got_steps
    for a, b in zip(ref_steps, got_steps):
        assert b["loss"] == pytest.approx(a["loss"], rel=TOL), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=TOL), (a, b)
        assert b["tokens"] == a["tokens"] or padded and 0 < b["tokens"] - a["tokens"] < 32, (a, b)  # once, not per rank
    evals = [(a["eval_loss"], b["eval_loss"]) for a, b in zip(ref, got) if a.get("eval_loss") is not None]
    assert evals and all(b == pytest.approx(a, rel=TOL) for a, b in evals), evals
    x, y = load_weights(reference / "final"), load_weights(run / "final")
    assert x.keys() == y.keys() and x
    worst = max(float((x[k] - y[k]).abs().max()) for k in x)
    print(f"\n{run.name}: max loss rel diff "
          f"{max(abs(b['loss'] - a['loss']) / a['loss'] for a, b in zip(ref_steps, got_steps)):.1e}, "
          f"max weight diff {worst:.1e}")
    assert worst <= TOL, worst
    assert ref_steps[-1]["loss"] < ref_steps[0]["loss"]


@pytest.mark.launch
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_two_ranks_on_each_sequence_learn_what_one_process_learns(lora, layout_runs):
    run = layout_runs("sp", lora)
    log = (run / "train.log").read_text()
    assert "backend DeepSpeed ZeRO-2, sequence parallel 2, 2 processes" in log, log[-3000:]
    assert "x 1 data-parallel rank (2 processes, each sequence split across 2)" in log
    assert_same_learning(layout_runs("single", lora), run)


@pytest.mark.launch
@pytest.mark.parametrize("data", ["packing", pytest.param("padding_free", marks=pytest.mark.slow)])
def test_documents_keep_their_bounds_across_the_split(data, layout_dir):
    runs = {}
    for layout in ("single", "sp"):
        name = f"sp_{data}_{layout}"
        path = layout_recipe(layout_dir, name, layout, **{f"data__{data}": True}, train__max_steps=4,
                             checkpoint__every_steps=0)
        rc, out, err = finish(start(layout_command(layout_dir, layout, path)))
        assert rc == 0, err[-3000:]
        runs[layout] = layout_dir / name
    assert "attention: varlen" in out  # split rows' attention takes no mask: documents bounded by varlen
    assert_same_learning(runs["single"], runs["sp"], steps=4, padded=True)


@pytest.mark.launch
@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_other_zero_stages_split_alike(stage, layout_dir, layout_runs):
    """ZeRO-1 and ZeRO-3 (its parameters gathered inside the split forward) under sp_size 2. ZeRO-3
    runs in CI: DeepSpeed 0.19.8's ZeRO-3 reduce-scatter divides a split row's gradients by every
    rank, not by the data-parallel ranks as its other reductions do; the loop's loss scale follows
    (`gradient_average`), and without that the grad norm here was half of one process's."""
    import yaml

    launch = yaml.safe_load(SP_YAML.read_text())
    launch["deepspeed_config"]["deepspeed_config_file"] = str(ROOT / "deepspeed_configs" / f"zero{stage}.json")
    config = layout_dir / f"zero{stage}_sp.yaml"
    config.write_text(yaml.safe_dump(launch))
    name = f"sp_zero{stage}"
    path = layout_recipe(layout_dir, name, "sp", checkpoint__every_steps=0)
    from helpers import accelerate_launch

    proc = run_toolkit("train", path, launcher=accelerate_launch(config))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"DeepSpeed ZeRO-{stage}, sequence parallel 2" in proc.stderr
    assert_same_learning(layout_runs("single"), layout_dir / name)
