"""Prepared data in Arrow: batches as the list-based pipeline made them, ranks that wait on the file
system, parallel tokenization, overlong and empty rows, folders, globs and weighted mixing."""

import threading
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from toolkit.config import DataConfig, DataSource
from toolkit.data.batching import Collator, EpochSampler
from toolkit.data.prepare import build_datasets
from toolkit.data.sources import cache_root
from toolkit.data.tokenize import tokenize_example
from toolkit.errors import ToolkitError
from toolkit.model.load import build_byte_tokenizer

from helpers import alpaca_rows, base_recipe, run_toolkit, user_error_line, write_jsonl, write_recipe


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


def chat_rows(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        turns = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
        for t in range(1 + i % 2):
            turns += [{"role": "user", "content": f"question {i}.{t} " + "x" * int(rng.integers(1, 40))},
                      {"role": "assistant", "content": f"answer {i}.{t} " + "y" * int(rng.integers(1, 40))}]
        rows.append({"messages": turns})
    return rows


def batches(examples, n_rows, global_batch, seed, micro, packed, pad):
    sampler = EpochSampler(n_rows, global_batch, seed)
    loader = DataLoader(examples, batch_size=micro, sampler=sampler, collate_fn=Collator(pad, packed=packed))
    return list(loader)


@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
def test_arrow_batches_equal_the_list_pipeline_example_by_example(tmp_path, tok, packing):
    """The list pipeline this replaced: tokenize_example on each row, in file order, held in Python;
    packed rows concatenate the same documents in the order of the prepared bins."""
    train = write_jsonl(tmp_path / "train.jsonl", alpaca_rows(150, seed=1))
    cfg = DataConfig(train_files=[str(train)], max_seq_len=96, packing=packing)
    data = build_datasets(cfg, tok, 5, packing)
    import datasets

    listed = [tokenize_example(r, "alpaca", tok, 96, False) for r in datasets.load_dataset(
        "json", data_files=[str(train)], split="train").to_list()]
    if packing:
        bins = [[int(d) for d in b] for b in data.train.bins.with_format(None)["docs"]]
        listed = [{"input_ids": sum((listed[d]["input_ids"] for d in b), []),
                   "labels": sum((listed[d]["labels"] for d in b), []),
                   "position_ids": sum((list(range(listed[d]["length"])) for d in b), [])} for b in bins]
        assert sorted(d for b in bins for d in b) == list(range(150))  # every document once, none split
    else:
        listed = [{k: e[k] for k in ("input_ids", "labels")} for e in listed]
    assert len(data.train) == len(listed)
    got = batches(data.train, len(data.train), 8, 5, 4, packing, tok.pad_token_id)
    want = batches(listed, len(listed), 8, 5, 4, packing, tok.pad_token_id)
    assert len(got) == len(want) > 3
    for a, b in zip(got, want):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_other_ranks_wait_for_the_prepared_folder_then_read_the_same_data(tmp_path, tok):
    train = write_jsonl(tmp_path / "train.jsonl", alpaca_rows(40, seed=2))
    cfg = DataConfig(train_files=[str(train)], max_seq_len=96, packing=True)
    waited, result = [], {}

    def other_rank():
        result["data"] = build_datasets(cfg, tok, 0, True, prepares=False, on_wait=lambda: waited.append(1))

    thread = threading.Thread(target=other_rank, daemon=True)
    thread.start()
    time.sleep(1.5)
    assert thread.is_alive() and waited, "a waiting rank must not prepare the data itself"
    main = build_datasets(cfg, tok, 0, True)
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert main.fingerprint == result["data"].fingerprint
    assert [list(r["input_ids"]) for r in main.train] == [list(r["input_ids"]) for r in result["data"].train]


def test_two_tokenizing_processes_prepare_what_one_does(tmp_path, tok, monkeypatch):
    import datasets

    rows = chat_rows(2400, seed=3)
    train = write_jsonl(tmp_path / "chat.jsonl", rows)
    one = build_datasets(DataConfig(train_files=[str(train)], format="messages", max_seq_len=128, num_proc=1),
                         tok, 0, False)
    # num_proc does not change what is prepared (nor its fingerprint): prepare again in another cache
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    two = build_datasets(DataConfig(train_files=[str(train)], format="messages", max_seq_len=128, num_proc=2),
                         tok, 0, False)
    assert "with 1 process" in one.lines[0] and "with 2 process" in two.lines[0]
    assert len(one.train) == len(two.train) == 2400
    for i in (0, 1, 1199, 1200, 2399):
        assert list(one.train[i]["input_ids"]) == list(two.train[i]["input_ids"])
        assert list(one.train[i]["labels"]) == list(two.train[i]["labels"])


def test_preparing_again_only_when_what_shapes_examples_changes(tmp_path, tok):
    train = write_jsonl(tmp_path / "train.jsonl", alpaca_rows(30, seed=4))
    cfg = DataConfig(train_files=[str(train)], max_seq_len=96)
    a, b = build_datasets(cfg, tok, 0, False), build_datasets(cfg, tok, 0, False)
    assert a.fingerprint == b.fingerprint and (cache_root() / a.fingerprint / "report.json").is_file()
    changed = [build_datasets(DataConfig(train_files=[str(train)], max_seq_len=97), tok, 0, False),
               build_datasets(DataConfig(train_files=[str(train)], max_seq_len=96, train_on_prompt=True),
                              tok, 0, False),
               build_datasets(cfg, tok, 0, True)]
    write_jsonl(train, alpaca_rows(30, seed=5))
    changed.append(build_datasets(cfg, tok, 0, False))
    assert len({a.fingerprint, *(c.fingerprint for c in changed)}) == 5


def test_overlong_rows_are_truncated_or_dropped_and_counted(tmp_path, tok):
    rows = [{"instruction": "i", "input": "", "output": "o" * n} for n in (5, 10, 80, 120, 7)]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    full = [tokenize_example(r, "alpaca", tok, 10_000, False) for r in rows]
    over = [f for f in full if f["length"] > 96]
    assert len(over) == 2
    cut = build_datasets(DataConfig(train_files=[str(train)], max_seq_len=96), tok, 0, False)
    lost = sum(f["n_targets"] - tokenize_example(r, "alpaca", tok, 96, False)["n_targets"]
               for f, r in zip(full, rows) if f["length"] > 96)
    assert len(cut.train) == 5 and max(len(e["input_ids"]) for e in cut.train) == 96
    assert any(f"2 of 5 rows truncated to data.max_seq_len ({lost:,} target tokens lost" in line for line in cut.lines)
    dropped = build_datasets(DataConfig(train_files=[str(train)], max_seq_len=96, overlong="drop"), tok, 0, False)
    assert len(dropped.train) == 3
    lost = sum(f["n_targets"] for f in over)
    assert any(f"2 of 5 rows longer than data.max_seq_len dropped ({lost:,} target tokens lost)" in line
               for line in dropped.lines), dropped.lines


def test_a_few_rows_without_targets_are_dropped_with_a_warning_many_are_an_error(tmp_path, tok):
    rows = alpaca_rows(200, seed=6)
    rows[17] = {"instruction": "long " * 40, "input": "", "output": "b"}  # the prompt fills max_seq_len
    train = write_jsonl(tmp_path / "few.jsonl", rows)
    data = build_datasets(DataConfig(train_files=[str(train)], max_seq_len=96), tok, 0, False)
    assert len(data.train) == 199
    assert data.warnings == [f"{train}: row 18: no target tokens left (the prompt fills data.max_seq_len=96); "
                             "dropped 1 such row(s) of 200"]
    for i in range(5):
        rows[30 + i] = dict(rows[17])
    write_jsonl(train, rows)
    with pytest.raises(ToolkitError, match=r"few.jsonl: row 18: no target tokens left .*; 6 of 200 rows affected"):
        build_datasets(DataConfig(train_files=[str(train)], max_seq_len=96), tok, 0, False)


def test_folders_globs_and_formats_per_entry(tmp_path, tok):
    for i in range(3):
        write_jsonl(tmp_path / "shards" / f"part-{i}.jsonl", alpaca_rows(10, seed=10 + i))
    write_jsonl(tmp_path / "chat.jsonl", chat_rows(7, seed=1))
    cfg = DataConfig(train_files=[str(tmp_path / "shards"), DataSource(path=str(tmp_path / "chat.jsonl"),
                                                                          format="messages")], max_seq_len=128)
    data = build_datasets(cfg, tok, 0, False)
    assert len(data.train) == 37
    sources = list(data.train.table["source"])
    assert sources.count(0) == 30 and sources.count(1) == 7
    globbed = build_datasets(DataConfig(train_files=[str(tmp_path / "shards" / "part-*.jsonl")], max_seq_len=128),
                             tok, 0, False)
    assert [list(e["input_ids"]) for e in globbed.train] == [list(e["input_ids"]) for e in data.train][:30]
    capped = build_datasets(DataConfig(train_files=[DataSource(path=str(tmp_path / "shards"), max_rows=12)],
                                       max_seq_len=128), tok, 0, False)
    assert [list(e["input_ids"]) for e in capped.train] == [list(e["input_ids"]) for e in data.train][:12]


def test_mixing_weights_give_the_requested_proportions(tmp_path, tok):
    """Weights 3:1 over a 2,000-row and a 400-row file: over 10,000 sampled examples (4+ epochs of
    the sampler) the shares are 75% and 25% within 2 points; the set keeps 2,400 rows."""
    big = write_jsonl(tmp_path / "big.jsonl", alpaca_rows(2000, seed=7))
    small = write_jsonl(tmp_path / "small.jsonl", alpaca_rows(400, seed=8))
    cfg = DataConfig(train_files=[DataSource(path=str(big), weight=1.0), DataSource(path=str(small), weight=3.0)],
                     max_seq_len=96)
    data = build_datasets(cfg, tok, 0, False)
    assert len(data.train) == 2400
    source = np.array(data.train.table["source"])
    sampler = EpochSampler(len(data.train), 8, seed=0)
    drawn = []
    while len(drawn) < 10_000:
        sampler.set_epoch(len(drawn) // len(sampler))
        drawn += list(sampler)
    share = (source[np.array(drawn[:10_000])] == 1).mean()
    assert abs(share - 0.75) <= 0.02, share
    small_rows = [tuple(e["input_ids"]) for e, s in zip(data.train, source) if s == 1]
    distinct = {(r["instruction"], r["input"]) for r in alpaca_rows(400, seed=8)}
    assert len(set(small_rows)) == len(distinct)  # every row of the upsampled file is used, each ~4.5 times


@pytest.mark.launch
@pytest.mark.parametrize("entry, override, expected", [
    ("glob without matches", "data.train_files=[{path: DIR/none-*.jsonl}]", "data.train_files[0]: no files match"),
    ("missing shard", "data.train_files=[DIR/train.jsonl, DIR/missing.jsonl]", "data.train_files[1]: file not found"),
    ("unknown format", "data.train_files=[{path: DIR/train.jsonl, format: sharegpt}]",
     "data.train_files[0].format: must be one of"),
    ("weight <= 0", "data.train_files=[{path: DIR/train.jsonl, weight: 0}]",
     "data.train_files[0].weight: must be positive, got 0"),
    ("weights on some entries only", "data.train_files=[{path: DIR/train.jsonl, weight: 2}, DIR/train.jsonl]",
     "data.train_files: give a weight to every entry or to none"),
    ("unknown key in an entry", "data.train_files=[{path: DIR/train.jsonl, weigth: 2}]",
     "data.train_files[0].weigth: unknown key; did you mean weight?"),
    ("Hub dataset not in the cache", "data.train_files=[nobody/no-such-dataset]", "data.train_files"),
])
def test_a_bad_data_entry_stops_at_start_in_one_line(tmp_path, data_files, entry, override, expected):
    train, evaluation = data_files
    path = write_recipe(tmp_path / "run.yaml", **base_recipe(tmp_path, train, evaluation))
    proc = run_toolkit("train", path, override.replace("DIR", str(train.parent)), env={"HF_HUB_OFFLINE": "1"})
    line = user_error_line(proc)
    assert line.startswith(f"error: {expected}") or (f"{tmp_path}/run.yaml: {expected}" in line), line
    assert not (tmp_path / "run").exists()


@pytest.mark.launch
def test_prepared_data_in_a_run_reports_rows_tokens_and_fill(tmp_path, data_files):
    train, evaluation = data_files
    path = write_recipe(tmp_path / "run.yaml", **base_recipe(tmp_path, train, evaluation, data__packing=True,
                                                              train__max_steps=2))
    proc = run_toolkit("train", path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines() if line.startswith("data: ")]
    assert lines[0].startswith("data: 64 train examples,") and "12 eval examples" in lines[0], lines
    fill = [line for line in lines if "packed 64 examples into" in line]
    assert fill and "fill" in fill[0] and "padding" in fill[0], lines
