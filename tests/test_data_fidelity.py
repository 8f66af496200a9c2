"""Data fidelity, as properties: generated rows with every JSON type, nulls, empty strings, leading
zeros, numbers written as text, unicode and whitespace, written as .jsonl, .json, .csv, .parquet and
a `datasets` save_to_disk folder, then prepared by the real preparation (`build_datasets`, into a
cache of the test's own). What is tokenized must be exactly what the user wrote (decoded back, the
whole text and the trained part), or the file is refused in one ToolkitError naming the file and
the row. Rules checked (toolkit/data/tokenize.py `text_value`):

- a string is taken as it is; an integer as its digits; CSV cells are text, always;
- a null or missing required field drops its row under the 1% rule (more is an error naming the
  first such row); a null `input` is no input;
- a float, true/false or a list is refused by row (it would not train as written);
- a JSON field whose values mix kinds across rows (text and numbers) is refused at the first row
  that differs: `datasets` would read such a column through pandas, which changes values.

Hypothesis draws the rows (derandomized: the same cases on every run).
"""

import csv
import json
import os
from pathlib import Path

import datasets
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from toolkit.config import DataConfig
from toolkit.data.formats import ALPACA_PROMPT, ALPACA_PROMPT_WITH_INPUT
from toolkit.data.prepare import build_datasets
from toolkit.errors import ToolkitError
from toolkit.model.load import build_byte_tokenizer

TOKENIZER = build_byte_tokenizer()
SETTINGS = settings(max_examples=int(os.environ.get("FIDELITY_EXAMPLES", "40")), deadline=None, derandomize=True,
                    database=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
MISSING = object()  # the key is absent from the row
ALPACA_FIELDS = {"instruction": True, "output": True, "input": False}  # rendered in this order; required?

TRICKY = ["02139", "1.50", "0", "", " ", "null", "None", "NaN", "nan", "true", "False", "1e3", "-0", " lead",
          "trail ", "\n", "a\r\nb", "tab\there", "é", "🙂", "日本語", '"quoted"', "comma, inside", "#", "\\n"]
text = st.one_of(st.sampled_from(TRICKY),
                 st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=24))
any_json = st.one_of(text, st.none(), st.integers(-10**6, 10**6), st.floats(allow_nan=False, allow_infinity=False),
                     st.booleans(), st.just(["a", "b"]), st.just(MISSING))
typed = st.one_of(text, st.none())  # what a typed column (parquet, Arrow) holds: one type, nulls allowed


def alpaca_rows(values):
    return st.lists(st.fixed_dictionaries({"instruction": values, "input": values, "output": values}),
                    min_size=1, max_size=12)


# ----------------------------------------------------------------------------- writing the files


def drop_missing(row: dict) -> dict:
    return {k: v for k, v in row.items() if v is not MISSING}


def write(rows: list[dict], kind: str, folder: Path) -> Path:
    rows = [drop_missing(r) for r in rows]
    if kind == "jsonl":
        path = folder / "data.jsonl"
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    elif kind == "json":
        path = folder / "data.json"
        path.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    elif kind == "csv":
        path = folder / "data.csv"
        names = sorted({k for r in rows for k in r})
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(names)
            for r in rows:
                w.writerow(["" if r.get(k) is None else r[k] for k in names])
    elif kind == "parquet":
        path = folder / "data.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    else:
        path = folder / "saved"
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def as_written(rows: list[dict], kind: str) -> list[dict]:
    """The rows as the file holds them: a CSV holds text only (an empty cell for nothing)."""
    if kind != "csv":
        return rows
    names = sorted({k for r in rows for k, v in r.items() if v is not MISSING})
    return [{k: "" if r.get(k, MISSING) in (None, MISSING) else str(r[k]) for k in names} for r in rows]


# ----------------------------------------------------------------------------- what must come out


def verdict(value, required: bool) -> str:
    """"ok", "missing" (drop the row) or "refuse" for one field's value."""
    if value is None or value is MISSING:
        return "missing" if required else "ok"
    if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
        return "ok"
    return "refuse"


def as_text(value) -> str:
    return "" if value is None or value is MISSING else str(value)


def first_mixed_row(rows: list[dict]) -> int | None:
    """The first row where a field's value is of another JSON kind than in an earlier row."""
    first = {}
    for i, r in enumerate(rows):
        for k, v in r.items():
            if v is None or v is MISSING:
                continue
            kind = "bool" if isinstance(v, bool) else type(v).__name__
            if first.setdefault(k, kind) != kind:
                return i
    return None


def expected(rows: list[dict], fields: dict[str, bool], render, kind: str) -> tuple[str, int | None, list]:
    """("ok" | "refuse" | "too many missing", the row to name, [(text, trained text)] of kept rows)."""
    mixed = first_mixed_row(rows) if kind in ("jsonl", "json") else None
    if mixed is not None:  # a field with text in one row and a number in another: the file is refused there
        return "refuse", mixed, []
    # A row's first field that is not "ok", in the order the row is rendered, decides for it.
    marks = [next((v for v in (verdict(r.get(k, MISSING), req) for k, req in fields.items()) if v != "ok"), "ok")
             for r in rows]
    refused = [i for i, m in enumerate(marks) if m == "refuse"]
    if refused:
        return "refuse", refused[0], []
    missing = [i for i, m in enumerate(marks) if m == "missing"]
    if len(missing) > 0.01 * len(rows):
        return "too many missing", missing[0], []
    return "ok", None, [render(r) for i, r in enumerate(rows) if i not in missing]


def render_alpaca(row: dict) -> tuple[str, str]:
    inp = as_text(row.get("input", MISSING))
    template = ALPACA_PROMPT_WITH_INPUT if inp != "" else ALPACA_PROMPT
    prompt = TOKENIZER.bos_token + template.format(instruction=as_text(row["instruction"]), input=inp)
    response = as_text(row["output"]) + TOKENIZER.eos_token
    return prompt + response, response


def render_text(row: dict) -> tuple[str, str]:
    whole = TOKENIZER.bos_token + as_text(row["text"]) + TOKENIZER.eos_token
    return whole, whole[len(TOKENIZER.bos_token):]  # the first token is never a target


def prepared(path: Path, fmt: str, cache: Path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    cfg = DataConfig(train_files=[str(path)], format=fmt, max_seq_len=4096, num_proc=1)
    return build_datasets(cfg, TOKENIZER, seed=0, packing=False)


def decoded(data) -> list[tuple[str, str]]:
    out = []
    for ex in data.train:
        ids, labels = list(ex["input_ids"]), list(ex["labels"])
        out.append((TOKENIZER.decode(ids), TOKENIZER.decode([t for t in labels if t != -100])))
    return out


def check(rows, kind, fmt, fields, render, tmp_path_factory, monkeypatch):
    folder = tmp_path_factory.mktemp(kind)
    path = write(rows, kind, folder)
    outcome, row, texts = expected(as_written(rows, kind), fields, render, kind)
    try:
        data = prepared(path, fmt, folder / "cache", monkeypatch)
    except ToolkitError as e:
        message = str(e)
        assert path.name in message, message
        if "needs column(s)" in message:  # a required field absent (or null) in every row: the file is refused
            columns = message.split("needs column(s) ")[1].split(";")[0].split(", ")
            assert any(all(r.get(c, MISSING) in (None, MISSING) for r in as_written(rows, kind))
                       for c in columns), message
            return
        assert outcome != "ok", f"refused although every row is trainable as written: {message}"
        assert f"row {row + 1}" in message, (outcome, row, message)
        return
    assert outcome == "ok", f"accepted although row {row + 1} should be {outcome}"
    assert decoded(data) == texts


@pytest.mark.parametrize("kind", ["jsonl", "json"])
@SETTINGS
@given(rows=alpaca_rows(any_json))
def test_alpaca_json_trains_what_was_written(rows, kind, tmp_path_factory, monkeypatch):
    check(rows, kind, "alpaca", ALPACA_FIELDS, render_alpaca,
          tmp_path_factory, monkeypatch)


@pytest.mark.parametrize("kind", ["csv", "parquet", "saved"])
@SETTINGS
@given(rows=alpaca_rows(typed))
def test_alpaca_typed_files_train_what_was_written(rows, kind, tmp_path_factory, monkeypatch):
    check(rows, kind, "alpaca", ALPACA_FIELDS, render_alpaca,
          tmp_path_factory, monkeypatch)


@SETTINGS
@given(rows=st.lists(st.fixed_dictionaries({"text": any_json}), min_size=1, max_size=12))
def test_text_format_trains_what_was_written(rows, tmp_path_factory, monkeypatch):
    check(rows, "jsonl", "text", {"text": True}, render_text, tmp_path_factory, monkeypatch)


def test_csv_keeps_leading_zeros_decimals_and_na(tmp_path, monkeypatch):
    """The cases of issue 27, named: pandas' type inference made 02139 into 2139.0, 1.50 into 1.5
    and NA into a null."""
    rows = [{"instruction": "zip", "input": "0", "output": out} for out in ("02139", "1.50", "NA", "null") * 30]
    path = write(rows, "csv", tmp_path)
    got = decoded(prepared(path, "alpaca", tmp_path / "cache", monkeypatch))
    assert [trained for _, trained in got[:4]] == [v + TOKENIZER.eos_token for v in ("02139", "1.50", "NA", "null")]
    assert "### Input:\n0\n" in got[0][0]  # an input of "0" is an input


def test_null_output_is_dropped_and_named_not_trained_as_none(tmp_path, monkeypatch):
    rows = [{"instruction": "q", "output": "a"}] * 150 + [{"instruction": "q", "output": None}]
    path = write(rows, "jsonl", tmp_path)
    data = prepared(path, "alpaca", tmp_path / "cache", monkeypatch)
    assert len(data.train) == 150
    assert all("None" not in text for text, _ in decoded(data))
    assert any("row 151: no target tokens left (output is null or missing)" in w for w in data.warnings), data.warnings
