"""Data formats, label masking token by token, truncation, packing isolation."""

import pytest
import torch

from helpers import write_jsonl
from toolkit.config import DataConfig, ModelConfig
from toolkit.errors import ToolkitError
from toolkit.data.batching import Collator, Examples, bins_dataset, packing_is_isolated
from toolkit.data.formats import IGNORE
from toolkit.data.prepare import build_datasets
from toolkit.data.tokenize import tokenize_example
from toolkit.model.load import build_byte_tokenizer, build_model


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_alpaca_labels_cover_only_the_response(tok):
    row = {"instruction": "Reverse.", "input": "abc", "output": "cba"}
    ex = tokenize_example(row, "alpaca", tok, 512, False)
    prompt = "<s>### Instruction:\nReverse.\n\n### Input:\nabc\n\n### Response:\n"
    expected_ids = ids(tok, prompt) + ids(tok, "cba") + [tok.eos_token_id]
    assert ex["input_ids"] == expected_ids
    n_prompt = len(ids(tok, prompt))
    assert ex["labels"] == [IGNORE] * n_prompt + ids(tok, "cba") + [tok.eos_token_id]


def test_alpaca_without_input_and_train_on_prompt(tok):
    row = {"instruction": "Say hi.", "input": "", "output": "hi"}
    ex = tokenize_example(row, "alpaca", tok, 512, True)
    assert tok.decode(ex["input_ids"]) == "<s>### Instruction:\nSay hi.\n\n### Response:\nhi</s>"
    assert ex["labels"] == [IGNORE] + ex["input_ids"][1:]  # the first token is never a target


def test_messages_labels_cover_every_assistant_turn(tok):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"},
            {"role": "assistant", "content": "ok"}]
    ex = tokenize_example({"messages": msgs}, "messages", tok, 512, False)
    assert tok.decode(ex["input_ids"]) == tok.apply_chat_template(msgs, tokenize=False)
    kept = [t for t in ex["labels"] if t != IGNORE]
    assert kept == ids(tok, "yo") + [tok.eos_token_id] + ids(tok, "\n") + ids(tok, "ok") + [tok.eos_token_id] + ids(tok, "\n")
    # token by token: each target sits exactly where the assistant text sits
    for i, (t, lab) in enumerate(zip(ex["input_ids"], ex["labels"])):
        assert lab in (IGNORE, t)
    first = ex["labels"].index(ids(tok, "y")[0])
    assert tok.decode(ex["input_ids"][:first]).endswith("<|assistant|>\n")


def test_text_format_trains_on_everything(tok):
    ex = tokenize_example({"text": "hello"}, "text", tok, 512, False)
    assert ex["input_ids"] == [tok.bos_token_id] + ids(tok, "hello") + [tok.eos_token_id]
    assert ex["labels"] == [IGNORE] + ids(tok, "hello") + [tok.eos_token_id]


def test_truncation_keeps_max_seq_len(tok):
    row = {"instruction": "x", "input": "", "output": "y" * 100}
    ex = tokenize_example(row, "alpaca", tok, 40, False)
    assert len(ex["input_ids"]) == len(ex["labels"]) == 40 and ex["n_targets"] > 0


def test_prompt_filling_the_length_is_an_error_naming_file_and_row(tmp_path, tok):
    f = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "a", "input": "", "output": "b"},
                                          {"instruction": "long " * 40, "input": "", "output": "b"}])
    with pytest.raises(ToolkitError, match=r"d.jsonl: row 2: no target tokens left \(the prompt fills"):
        build_datasets(DataConfig(train_files=[str(f)], max_seq_len=48), tok, 0, False)


def test_missing_column_and_malformed_line(tmp_path, tok):
    f = write_jsonl(tmp_path / "d.jsonl", [{"question": "a", "answer": "b"}])
    with pytest.raises(ToolkitError, match="needs column.*instruction"):
        build_datasets(DataConfig(train_files=[str(f)]), tok, 0, False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "a", "output": "b"}\n{"instruction": oops}\n')
    with pytest.raises(ToolkitError, match="bad.jsonl: line 2: malformed JSON"):
        build_datasets(DataConfig(train_files=[str(bad)]), tok, 0, False)


@pytest.mark.parametrize("suffix", ["json", "jsonl", "parquet", "csv"])
def test_every_file_type_loads(tmp_path, tok, suffix):
    import datasets

    rows = [{"instruction": f"i{i}", "input": "", "output": f"o{i}"} for i in range(10)]
    path = tmp_path / f"d.{suffix}"
    ds = datasets.Dataset.from_list(rows)
    {"json": lambda: ds.to_json(path, lines=False), "jsonl": lambda: ds.to_json(path),
     "parquet": lambda: ds.to_parquet(path), "csv": lambda: ds.to_csv(path, index=False)}[suffix]()
    data = build_datasets(DataConfig(train_files=[str(path)], eval_fraction=0.2), tok, 0, False)
    assert len(data.train) == 8 and len(data.eval) == 2


def test_pack_restarts_positions_and_never_splits(tmp_path, tok):
    words = ["aaaa", "bbbbbbbb", "cc", "dddddd", "e", "ffffffffff"]
    f = write_jsonl(tmp_path / "t.jsonl", [{"text": w} for w in words])
    data = build_datasets(DataConfig(train_files=[str(f)], format="text", max_seq_len=16), tok, 0, True)
    rows = list(data.train)
    assert len(rows) < len(words)  # documents did share rows
    docs = sorted(tuple(r["input_ids"][s:e]) for r in rows
                  for s, e in zip(*_starts_and_ends(r["position_ids"])))
    assert docs == sorted(tuple(tokenize_example({"text": w}, "text", tok, 16, False)["input_ids"]) for w in words)
    for r in rows:
        assert len(r["input_ids"]) <= 16 and len(r["labels"]) == len(r["position_ids"]) == len(r["input_ids"])
        for s in _starts_and_ends(r["position_ids"])[0]:
            assert r["labels"][s] == IGNORE  # nothing predicts across a document boundary


def _starts_and_ends(positions):
    starts = [i for i, p in enumerate(positions) if p == 0]
    return starts, starts[1:] + [len(positions)]


def packed_rows(docs: list[dict], bins: list[list[int]]) -> list[dict]:
    """Rows as training reads them: documents in Arrow, rows of document indices in Arrow."""
    import datasets
    import numpy as np

    table = datasets.Dataset.from_list([{k: d[k] for k in ("input_ids", "labels")} for d in docs])
    return list(Examples(table, bins_dataset([np.array(b) for b in bins])))


def test_packed_batch_gives_document_b_the_logits_of_b_alone(tok):
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="tiny-llama-mini")).eval()
    a = tokenize_example({"text": "first document, longer"}, "text", tok, 64, False)
    b = tokenize_example({"text": "second one"}, "text", tok, 64, False)
    collate = Collator(tok.pad_token_id)
    packed = collate(packed_rows([a, b], [[0, 1], [1]]))  # a second row, shorter: padded
    alone = collate([{k: b[k] for k in ("input_ids", "labels")}])
    with torch.no_grad():
        logits_packed = model(**{k: v for k, v in packed.items() if k != "labels"}, use_cache=False).logits
        logits_alone = model(**{k: v for k, v in alone.items() if k != "labels"}, use_cache=False).logits
    n_a, n_b = len(a["input_ids"]), len(b["input_ids"])
    torch.testing.assert_close(logits_packed[0, n_a:n_a + n_b], logits_alone[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits_packed[1, :n_b], logits_alone[0], atol=1e-5, rtol=1e-5)
    assert packing_is_isolated(model)


def test_packing_check_detects_a_leaky_model(tok):
    """The start-up probe must fail for attention that ignores position_ids (eager + full mask)."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="tiny-llama-mini"))

    class Leaky(torch.nn.Module):  # drops position_ids: documents see each other
        def __init__(self, m):
            super().__init__()
            self.m = m

        def get_input_embeddings(self):
            return self.m.get_input_embeddings()

        def forward(self, input_ids, position_ids=None, **kw):
            return self.m(input_ids=input_ids, **kw)

    assert not packing_is_isolated(Leaky(model))


def test_collator_pads_and_masks(tok):
    batch = Collator(tok.pad_token_id)([{"input_ids": [1, 5, 6], "labels": [IGNORE, 5, 6]},
                                        {"input_ids": [1, 7], "labels": [IGNORE, 7]}, None])
    assert batch["input_ids"].tolist() == [[1, 5, 6], [1, 7, 0], [0, 0, 0]]
    assert batch["labels"].tolist() == [[IGNORE, 5, 6], [IGNORE, 7, IGNORE], [IGNORE] * 3]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0], [1, 0, 0]]
