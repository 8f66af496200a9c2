"""SFT on TRL's prompt-completion rows (data.format=prompt_completion), standard (text) and conversational
(chat messages): the loss on the completion only (TRL's completion_only_loss, its default for these rows), all of
the row with data.train_on_prompt; TRL 1.16's SFTTrainer and ours from the same rows on the same model agree
step for step (its own trainer code, end to end); prompt + completion columns under another format name the
format that reads them."""

import pytest
import torch

from families import build_family
from helpers import load_weights, read_metrics, run_toolkit, user_error_line, write_jsonl, write_recipe

TEXT_ROWS = [{"prompt": f"Question: what is {a} plus {b}?\nAnswer:", "completion": f" {a + b}. Because {a}+{b}."}
             for a, b in ((2, 3), (10, 7), (4, 40), (8, 1), (12, 12), (5, 6), (30, 3), (7, 70))]
CHAT_ROWS = [{"prompt": [{"role": "system", "content": "You add numbers."},
                         {"role": "user", "content": f"What is {a} plus {b}?"}],
              "completion": [{"role": "assistant", "content": f"It is {a + b}."}]}
             for a, b in ((2, 3), (10, 7), (4, 40), (8, 1), (12, 12), (5, 6), (30, 3), (7, 70))]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return build_family("llama3", tmp_path_factory.mktemp("pc") / "llama3")


def test_only_the_completion_is_trained_unless_train_on_prompt(family):
    from transformers import AutoTokenizer

    from toolkit.data.tokenize import tokenize_example

    tok = AutoTokenizer.from_pretrained(family)
    for row in (TEXT_ROWS[0], CHAT_ROWS[0]):
        ex = tokenize_example(row, "prompt_completion", tok, 256, train_on_prompt=False)
        trained = tok.decode([t for t, label in zip(ex["input_ids"], ex["labels"]) if label != -100])
        completion = row["completion"] if isinstance(row["completion"], str) else row["completion"][0]["content"]
        assert trained.startswith(completion.strip()) or trained.startswith(completion), trained
        assert "plus" not in trained  # no prompt token trains
        assert trained.endswith(tok.eos_token) or isinstance(row["completion"], list), trained
        everything = tokenize_example(row, "prompt_completion", tok, 256, train_on_prompt=True)
        assert everything["input_ids"] == ex["input_ids"]
        assert (torch.tensor(everything["labels"][1:]) != -100).all()


@pytest.mark.launch
@pytest.mark.parametrize("rows", [TEXT_ROWS, CHAT_ROWS], ids=["standard", "conversational"])
def test_prompt_completion_sft_matches_trl(rows, family, tmp_path):
    """Full fine-tuning, one process, fp32, 4 rows of unequal length in one global batch (micro 2 x accumulation
    2: TRL normalises by the global batch's completion tokens as we do), AdamW, clipping at 1.0, constant learning
    rate, 3 steps (each over the same 4 rows, so the samplers' orders do not matter): losses and gradient norms
    equal TRL SFTTrainer's within 1e-5 relative, the weights after the last step within 1e-5."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    rows = rows[:4]
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    path = write_recipe(tmp_path / "sft.yaml", output_dir=str(tmp_path / "ours"), seed=0, model={"path": str(family)},
                        data={"train_files": [str(data)], "format": "prompt_completion", "max_seq_len": 512},
                        train={"micro_batch_size": 2, "gradient_accumulation_steps": 2, "max_steps": 3,
                               "learning_rate": 1e-3, "lr_scheduler_type": "constant", "max_grad_norm": 1.0,
                               "weight_decay": 0.0, "log_every_steps": 1})
    result = run_toolkit("train", str(path))
    assert result.returncode == 0, result.stderr[-3000:]
    ours = [r for r in read_metrics(tmp_path / "ours") if "loss" in r]

    torch.manual_seed(0)
    args = SFTConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                     learning_rate=1e-3, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
                     max_steps=3, logging_steps=1, max_length=512, seed=0, report_to=[], use_cpu=True, bf16=False,
                     save_strategy="no", dataloader_num_workers=0)
    trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(family, dtype=torch.float32), args=args,
                         train_dataset=Dataset.from_list(rows), processing_class=AutoTokenizer.from_pretrained(family))
    trainer.train()
    theirs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(theirs) == len(ours) == 3
    for mine, trl in zip(ours, theirs):
        for key in ("loss", "grad_norm"):
            assert mine[key] == pytest.approx(trl[key], rel=1e-5), (key, mine, trl)
    assert ours[2]["loss"] != ours[0]["loss"]
    weights, start = load_weights(tmp_path / "ours" / "final"), load_weights(family)
    for name, value in trainer.model.state_dict().items():
        assert (value - start[name]).abs().max() > 1e-4, name  # moved: equality is not of the starting weights
        torch.testing.assert_close(weights[name], value, rtol=0, atol=1e-5, msg=name)


@pytest.mark.launch
def test_prompt_and_completion_columns_under_another_format_name_prompt_completion(tmp_path):
    data = write_jsonl(tmp_path / "rows.jsonl", TEXT_ROWS)
    path = write_recipe(tmp_path / "r.yaml", output_dir=str(tmp_path / "out"), model={"preset": "tiny-llama-mini"},
                        data={"train_files": [str(data)], "format": "alpaca"})
    line = user_error_line(run_toolkit("train", str(path)))
    assert "data.format=alpaca needs column(s) instruction, output" in line
    assert "which data.format=prompt_completion reads" in line, line
