"""KTO (preference.method=kto, data.format=unpaired): TRL's KTOTrainer and ours from the same rows
on the same model agree step for step; the KL estimate is taken over the global batch, so DDP, FSDP
and ZeRO-3 on 2 processes equal one process; a SIGKILL resumes bitwise; the rows, the pairing for
the KL estimate and the bad recipes are checked as a careless user would meet them."""

import json
import math
import sys

import numpy as np
import pytest
import torch

from families import build_family
from helpers import (
    ROOT,
    accelerate_launch,
    finish,
    kill_after_step,
    launch_config_for,
    load_weights,
    read_metrics,
    run_toolkit,
    start,
    user_error_line,
    write_jsonl,
    write_recipe,
)

ROWS = ROOT / "examples" / "data" / "tasks_unpaired_train.jsonl"
STEPS = 4


def rows(n: int, skip: int = 0) -> list[dict]:
    with open(ROWS) as f:
        return [json.loads(line) for line in f][skip:skip + n]


# ---- the loss and the data, in process ----

def test_the_loss_is_trls_formula_on_each_kind():
    from toolkit.training.kto import kto_losses

    ratios, desirable = torch.tensor([0.5, -1.0, 2.0, 0.0]), torch.tensor([True, False, False, True])
    got = kto_losses(ratios, desirable, 0.3, beta=0.1, desirable_weight=2.0, undesirable_weight=0.5)
    def sig(x):
        return torch.sigmoid(torch.as_tensor(x))

    want = torch.stack([2 * (1 - sig(0.1 * (0.5 - 0.3))), 0.5 * (1 - sig(0.1 * (0.3 + 1.0))),
                        0.5 * (1 - sig(0.1 * (0.3 - 2.0))), 2 * (1 - sig(0.1 * (0.0 - 0.3)))])
    torch.testing.assert_close(got, want)
    apo = kto_losses(ratios, desirable, 99.0, beta=0.1, loss_type="apo_zero_unpaired")
    torch.testing.assert_close(apo, torch.stack([1 - sig(0.05), sig(-0.1), sig(0.2), 1 - sig(0.0)]))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_family("llama3", tmp_path_factory.mktemp("kto-tok") / "llama3"))


def test_an_unpaired_row_trains_on_its_completion_and_keeps_its_label(tok):
    from toolkit.data.formats import IGNORE
    from toolkit.data.tokenize import tokenize_example

    for row in rows(2) + [{"prompt": "2+2=", "completion": " 4", "label": 1}]:
        ex = tokenize_example(row, "unpaired", tok, 128, False)
        target = np.asarray(ex["labels"]) != IGNORE
        text = tok.decode(np.asarray(ex["input_ids"])[target].tolist())
        completion = row["completion"] if isinstance(row["completion"], str) else row["completion"][0]["content"]
        assert text.strip().startswith(completion.strip()) and target.sum() < len(target), (text, row)


@pytest.mark.parametrize("labels, bad, words", [
    ([True, False], None, "label is null"), (["true", "False"], "yes", "label must be true"),
    ([1, 0], 2, "label must be true")])
def test_a_label_that_is_not_true_or_false_is_refused_by_file_and_row(tmp_path, tok, labels, bad, words):
    """Booleans, 1 and 0, and the text true and false (a CSV file's) are labels; anything else is
    refused by file and row."""
    from toolkit.config.data import DataConfig
    from toolkit.data.prepare import build_datasets
    from toolkit.errors import ToolkitError

    good = [{**r, "label": labels[i % 2]} for i, r in enumerate(rows(29))]
    data = write_jsonl(tmp_path / "good.jsonl", good)
    made = build_datasets(DataConfig(train_files=[str(data)], format="unpaired", max_seq_len=256), tok, 0, False)
    assert [int(x) for x in made.train.table["label"]] == [1 - i % 2 for i in range(29)]
    data = write_jsonl(tmp_path / "bad.jsonl", good + [{**rows(1)[0], "label": bad}])
    with pytest.raises(ToolkitError, match=f"bad.jsonl: row 30.*{words}"):
        build_datasets(DataConfig(train_files=[str(data)], format="unpaired", max_seq_len=256), tok, 0, False)


def test_each_example_is_mismatched_with_the_previous_rows_completion(tok):
    """The pairing of the KL estimate: example i's prompt, then example i-1's completion (the last
    one's for the first), cut to kl_max_length; in the collated batch, apart under kl_ keys."""
    import datasets

    from toolkit.data.batching import Collator, Examples
    from toolkit.data.formats import IGNORE
    from toolkit.data.tokenize import tokenize_example

    made = [tokenize_example(r, "unpaired", tok, 128, False) for r in rows(3)]
    table = datasets.Dataset.from_list([{"input_ids": m["input_ids"], "labels": m["labels"], "label": int(r["label"])}
                                        for m, r in zip(made, rows(3))])
    part = Examples(table)
    assert part.pairs and part.unpaired

    def split(m):
        start = int(np.argmax(np.asarray(m["labels"]) != IGNORE))
        return m["input_ids"][:start], m["input_ids"][start:]

    for i in range(3):
        prompt, _ = split(made[i])
        _, other = split(made[i - 1])
        assert part[i]["rejected_input_ids"].tolist() == prompt + other
    part.kl_max_length = 5
    assert len(part[0]["rejected_input_ids"]) == 5
    batch = Collator(tok.pad_token_id, pairs=True)([part[0], part[1], None])
    assert batch["input_ids"].shape[0] == batch["kl_input_ids"].shape[0] == 3
    assert batch["kto_labels"].tolist() == [bool(rows(1)[0]["label"]), bool(rows(2)[1]["label"]), False]
    assert (batch["labels"][2] == IGNORE).all() and (batch["kl_labels"][2] == IGNORE).all()  # eval padding


# ---- against TRL's own trainer ----

@pytest.mark.launch
def test_kto_matches_trl(tmp_path):
    """Full fine-tuning KTO, one process, fp32, 4 rows (desirable and undesirable) in one global
    batch (TRL's KL estimate over its micro-batch is then ours over the global batch, and its
    rotation within the batch our rotation over the data), AdamW without weight decay, clipping at
    1.0, constant learning rate, 3 steps: losses, KL, rewards and gradient norms equal TRL
    KTOTrainer's within 1e-5 relative, and the weights after the last step within 1e-5 (1% of one
    Adam step; measured: 4.2e-6 at most)."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    folder = build_family("llama3", tmp_path / "llama3")
    data_rows = rows(4, skip=4)
    assert {r["label"] for r in data_rows} == {True, False}
    data = write_jsonl(tmp_path / "rows.jsonl", data_rows)
    path = write_recipe(tmp_path / "kto.yaml", output_dir=str(tmp_path / "ours"), seed=0, model={"path": str(folder)},
                        data={"train_files": [str(data)], "format": "unpaired", "max_seq_len": 128},
                        preference={"method": "kto", "beta": 0.1, "desirable_weight": 1.5},
                        train={"micro_batch_size": 4, "max_steps": 3, "learning_rate": 1e-3, "min_lr_ratio": 1.0,
                               "max_grad_norm": 1.0, "weight_decay": 0.0, "log_every_steps": 1})
    result = run_toolkit("train", str(path))
    assert result.returncode == 0, result.stderr[-3000:]
    ours = read_metrics(tmp_path / "ours")[1:]

    torch.manual_seed(0)
    args = KTOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, learning_rate=1e-3,
                     lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, max_steps=3,
                     logging_steps=1, beta=0.1, desirable_weight=1.5, max_length=128, seed=0, report_to=[],
                     use_cpu=True, bf16=False, save_strategy="no", dataloader_num_workers=0)
    trainer = KTOTrainer(model=AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), args=args,
                         train_dataset=Dataset.from_list(data_rows), processing_class=AutoTokenizer.from_pretrained(folder))
    trainer.train()
    theirs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(theirs) == len(ours) == 3
    for mine, trl in zip(ours, theirs):
        for key, trl_key in (("loss", "loss"), ("kl", "kl"), ("rewards_chosen", "rewards/chosen"),
                             ("rewards_rejected", "rewards/rejected"), ("grad_norm", "grad_norm")):
            assert mine[key] == pytest.approx(trl[trl_key], rel=1e-5, abs=1e-7), (key, mine, trl)
    assert ours[2]["kl"] > 0 and ours[2]["loss"] != ours[0]["loss"]  # the steps moved, the KL estimate counts
    weights = load_weights(tmp_path / "ours" / "final")
    start = load_weights(folder)
    for name, value in trainer.model.state_dict().items():  # Adam's steps are about lr (1e-3) per element
        assert (value - start[name]).abs().max() > 1e-3, name  # moved: equality is not of the starting weights
        torch.testing.assert_close(weights[name], value, rtol=0, atol=1e-5, msg=name)
