"""Caches keyed by everything that changes what they hold: for each artifact kept between runs, each
input that changes its numbers changes its key (a recompute), and inputs that change only how a run
trains leave it (a reuse). DPO's precomputed reference log-probabilities (`reference.weights_key`)
and the prepared data (`prepare.fingerprint`, through `build_datasets`); the reference pass runs in
the run's micro-batches, not one pair at a time."""

import copy
import dataclasses
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from toolkit.config import DataConfig, DataSource, ModelConfig, RopeScaling, load_recipe
from toolkit.data import prepare
from toolkit.data.batching import Collator
from toolkit.data.prepare import build_datasets
from toolkit.model.load import build_byte_tokenizer, build_model
from toolkit.training import reference
from toolkit.training.loss import use_token_loss
from toolkit.training.reference import weights_key

from helpers import ROOT, run_toolkit, write_jsonl, write_recipe

PAIRS = ROOT / "examples" / "data" / "tasks_preference_train.jsonl"


def pairs(n: int) -> list[dict]:
    with open(PAIRS) as f:
        return [json.loads(line) for line in f][:n]


def dpo_recipe(tmp_path, *overrides, model=None, **sections):
    body = {"output_dir": str(tmp_path / "run"), "seed": 5, "model": model or {"preset": "tiny-llama-mini"},
            "data": {"train_files": [str(tmp_path / "pairs.jsonl")], "format": "preference", "max_seq_len": 64},
            "preference": {"method": "dpo", "reference": "precomputed"}, **sections}
    return load_recipe(write_recipe(tmp_path / "r.yaml", **body), list(overrides))


def changed(recipe, dotted: str, value):
    out = copy.deepcopy(recipe)
    *path, name = dotted.split(".")
    target = out
    for part in path:
        target = getattr(target, part)
    setattr(target, name, value)
    return out


# ----------------------------------------------------------------------------- DPO's reference log-probabilities

# A recipe key and a value that changes the starting weights' log-probabilities.
CHANGES_THE_REFERENCE = {
    "model.rope_scaling": RopeScaling(rope_type="linear", factor=2.0),
    "model.max_position_embeddings": 2048,
    "model.dtype": "bf16",
    "train.precision": "bf16",
    "model.attn_implementation": "eager",
    "model.add_special_tokens": ["<tool>"],
    "model.load_in_4bit": True,
    "data.padding_free": True,
    "train.loss": "full",
    "train.loss_chunk_tokens": 64,
    "seed": 6,  # a preset's weights are drawn from it
    "model.preset": "tiny-llama",
}
# Keys that change how a run trains, not the starting weights' numbers: the kept values serve it.
KEEPS_THE_REFERENCE = {"train.learning_rate": 1e-3, "train.max_steps": 3, "output_dir": "/elsewhere",
                       "preference.beta": 0.5, "train.micro_batch_size": 2, "train.eval_batch_size": 8,
                       "model.gradient_checkpointing": True, "train.warmup_steps": 1}


@pytest.mark.parametrize("key", sorted(CHANGES_THE_REFERENCE))
def test_the_reference_is_computed_again_when_its_numbers_change(tmp_path, key):
    recipe = dpo_recipe(tmp_path)
    assert weights_key(changed(recipe, key, CHANGES_THE_REFERENCE[key])) != weights_key(recipe), key


def test_the_reference_is_reused_by_runs_that_only_train_differently(tmp_path):
    recipe = dpo_recipe(tmp_path)
    for key, value in KEEPS_THE_REFERENCE.items():
        assert weights_key(changed(recipe, key, value)) == weights_key(recipe), key


def test_dora_magnitudes_change_the_reference(tmp_path):
    lora = dpo_recipe(tmp_path, "lora.enabled=true")
    assert weights_key(changed(lora, "lora.use_dora", True)) != weights_key(lora)
    assert weights_key(changed(lora, "lora.r", 16)) == weights_key(lora)  # B = 0: the same numbers at step 0


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    """A model folder (tiny-llama-mini's weights, saved) that model.path loads."""
    folder = tmp_path_factory.mktemp("base")
    build_model(ModelConfig(preset="tiny-llama-mini")).save_pretrained(folder)
    return folder


def test_a_base_folder_is_keyed_by_its_content_and_code(tmp_path, base_folder):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "base"
    folder.mkdir()
    for f in base_folder.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    recipe = dpo_recipe(tmp_path, model={"path": str(folder)})
    before = weights_key(recipe)
    assert weights_key(changed(recipe, "seed", 6)) == before  # the weights are the folder's, not drawn
    assert weights_key(changed(changed(recipe, "model.add_special_tokens", ["<t>"]), "seed", 6)) != \
        weights_key(changed(recipe, "model.add_special_tokens", ["<t>"]))  # added rows are drawn from the seed

    (folder / "modeling_custom.py").write_text("SCALE = 1\n")
    remote = changed(recipe, "model.trust_remote_code", True)
    with_code = weights_key(remote)
    (folder / "modeling_custom.py").write_text("SCALE = 2\n")
    assert weights_key(remote) != with_code  # the model's own code computes the numbers too
    assert weights_key(recipe) == before  # without trust_remote_code no code of the folder runs

    weights = load_file(folder / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] + 1
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    assert weights_key(recipe) != before


# ----------------------------------------------------------------------------- the reference pass's batches

@pytest.fixture(scope="module")
def prepared_pairs(tmp_path_factory):
    path = write_jsonl(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", pairs(10))
    return build_datasets(DataConfig(train_files=[str(path)], format="preference", max_seq_len=64),
                          build_byte_tokenizer(), 0, False).train


def counted_forwards(monkeypatch) -> list[int]:
    """The rows of each forward the reference pass makes."""
    rows, forward = [], reference.token_logps

    def counting(model, batch):
        rows.append(batch["input_ids"].shape[0])
        return forward(model, batch)

    monkeypatch.setattr(reference, "token_logps", counting)
    return rows


ONE_PROCESS = SimpleNamespace(process_index=0, num_processes=1, device=torch.device("cpu"), gather=lambda t: t,
                              is_main_process=False, is_local_main_process=True)


@pytest.mark.parametrize("sections, batch", [({"train": {"micro_batch_size": 4}}, 4),
                                             ({"train": {"micro_batch_size": 4, "eval_batch_size": 3}}, 3),
                                             ({"train": {"micro_batch_size": 16}}, 10)])
def test_the_reference_pass_runs_in_the_runs_batches(tmp_path, monkeypatch, prepared_pairs, sections, batch):
    """Without eval data the pass ran one pair per forward (the eval batch of an empty eval set); it
    takes train.eval_batch_size (or micro_batch_size) pairs a forward, at most the part's pairs."""
    rows = counted_forwards(monkeypatch)
    recipe = dpo_recipe(tmp_path, **sections)
    model = build_model(recipe.model)
    use_token_loss(model)
    lines = reference.precompute(ONE_PROCESS, model, {"train": prepared_pairs}, tmp_path, recipe,
                                 Collator(0, pairs=True))
    n = len(prepared_pairs)
    assert n == 10 and len(rows) == math.ceil(n / batch) and rows[0] == 2 * batch, rows  # chosen and rejected rows
    assert prepared_pairs.reference.shape == (n, 2) and "computed for 10 pairs" in lines[0]
    assert (tmp_path / f"reference-{weights_key(recipe)}-train.npy").is_file()
    rows.clear()
    assert "read from" in reference.precompute(ONE_PROCESS, model, {"train": prepared_pairs}, tmp_path, recipe,
                                               Collator(0, pairs=True))[0] and rows == []


@pytest.mark.launch
def test_a_dpo_run_keeps_its_reference_under_the_key_in_micro_batches(tmp_path):
    """The one launch: a DPO run without eval data computes its reference in forwards of
    micro_batch_size pairs and keeps it under `weights_key` of its recipe."""
    write_jsonl(tmp_path / "pairs.jsonl", pairs(8))
    data = {"train_files": [str(tmp_path / "pairs.jsonl")], "format": "preference", "max_seq_len": 64}
    path = write_recipe(tmp_path / "dpo.yaml", output_dir=str(tmp_path / "run"), seed=5,
                        model={"preset": "tiny-llama-mini"}, data=data,
                        preference={"method": "dpo"}, train={"micro_batch_size": 4, "max_steps": 1})
    proc = run_toolkit("train", path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kept = re.search(r"reference: train: computed for 8 pairs with the starting weights, kept in (\S+)", proc.stdout)
    assert kept, proc.stdout
    assert Path(kept.group(1)).name == f"reference-{weights_key(load_recipe(path))}-train.npy"
    totals = re.findall(r"reference log-probabilities \(train\):.*?\d+/(\d+)", proc.stderr)
    assert totals and set(totals) == {"2"}, proc.stderr[-2000:]  # 8 pairs in 2 forwards of 4, not 8 of 1


# ----------------------------------------------------------------------------- the prepared data

@pytest.fixture
def data_key(monkeypatch):
    """The prepared data's fingerprint as `build_datasets` computes it (nothing prepared)."""
    monkeypatch.setattr(prepare, "prepare", lambda *args: None)
    monkeypatch.setattr(prepare, "load_prepared", lambda folder, packing, fp, train_fp=None, train_content="": fp)

    def key(cfg: DataConfig, tokenizer=None, seed: int = 0, packing: bool = False) -> str:
        return build_datasets(cfg, tokenizer or build_byte_tokenizer(), seed, packing)

    return key


def with_token(tokenizer):
    tokenizer.add_tokens(["<tool>"], special_tokens=True)
    return tokenizer


def with_template(tokenizer):
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tokenizer


def with_eos(tokenizer):
    tokenizer.eos_token = "<|assistant|>"  # tokenizer_config.json's eos_token changed; tokenizer.json as it was
    return tokenizer


def test_the_data_is_prepared_again_when_what_shapes_it_changes(tmp_path, data_key):
    train = write_jsonl(tmp_path / "train.jsonl", pairs(4))
    cfg = DataConfig(train_files=[str(train)], format="preference", max_seq_len=64)
    before = data_key(cfg)
    assert data_key(copy.deepcopy(cfg)) == before and data_key(dataclasses.replace(cfg, num_proc=3)) == before
    for name, value in {"max_seq_len": 32, "overlong": "drop", "train_on_prompt": True, "format": "messages",
                        "eval_fraction": 0.5, "train_files": [DataSource(path=str(train), max_rows=2)]}.items():
        assert data_key(dataclasses.replace(cfg, **{name: value})) != before, name
    assert data_key(cfg, seed=1) != before and data_key(cfg, packing=True) != before
    for change in (with_token, with_template):
        assert data_key(cfg, change(build_byte_tokenizer())) != before, change.__name__
    write_jsonl(train, pairs(5)[1:])
    assert data_key(cfg) != before


def test_the_data_is_prepared_again_when_the_tokenizers_eos_changes(tmp_path, data_key):
    cfg = DataConfig(train_files=[str(write_jsonl(tmp_path / "t.jsonl", pairs(4)))], format="preference")
    assert data_key(cfg, with_eos(build_byte_tokenizer())) != data_key(cfg)


def test_the_reference_line_counts_what_the_objective_trains_on(tmp_path):
    """Issue 69 (text written for one case shown in another): KTO's reference pass said "computed for 8 pairs" of
    rows that are single completions; it counts completions (each with its mismatched sequence), DPO's pairs."""
    rows = [json.loads(line) for line in (ROOT / "examples" / "data" / "tasks_unpaired_train.jsonl").open()][:8]
    path = write_jsonl(tmp_path / "unpaired.jsonl", rows)
    unpaired = build_datasets(DataConfig(train_files=[str(path)], format="unpaired", max_seq_len=64),
                              build_byte_tokenizer(), 0, False).train
    recipe = dpo_recipe(tmp_path, "preference.method=kto", "preference.loss_type=kto", "data.format=unpaired")
    model = build_model(recipe.model)
    use_token_loss(model)
    lines = reference.precompute(ONE_PROCESS, model, {"train": unpaired}, tmp_path, recipe,
                                 Collator(0, pairs=True, unpaired=True))
    assert lines[0].startswith("train: computed for 8 completions (each with its mismatched sequence) with the "
                               "starting weights"), lines
