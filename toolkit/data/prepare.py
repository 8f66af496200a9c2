"""Data: local files (or Hub datasets) -> tokenized examples with response-only labels -> batches.

Every example becomes `input_ids` and `labels` of equal length; `labels` is -100 wherever no loss
is taken (the prompt, by default, and always the first token of a document, which nothing
predicts). Packing places whole documents into rows of `max_seq_len` (best fit decreasing) with
`position_ids` that restart at each document; the model then builds a block-diagonal causal mask,
so no token attends across a document boundary (checked at start-up by `packing_is_isolated`).

Prepared data lives in Arrow, never in Python lists: the main process of each node tokenizes once
(in `data.num_proc` processes) into `$HF_DATASETS_CACHE/toolkit/<fingerprint>/`, written under a
temporary name and renamed when complete; the other ranks wait for that folder by polling the
file system (not in a collective that could time out during a long tokenization) and then
memory-map the same files, so every rank shares one copy through the page cache. Batches are read
from Arrow by index.
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import Sampler

from ..storage import disk
from .. import faults
from ..config import DataConfig, DataSource
from ..errors import ToolkitError
from .packing import best_fit_decreasing, pack_stats

IGNORE = -100
LOADERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
COLUMNS = {"alpaca": ("instruction", "output"), "messages": ("messages",), "text": ("text",),
           "preference": ("chosen", "rejected")}  # `prompt` too, unless the conversations carry it (implicit)
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
TOKENIZE_VERSION = 6  # bump when tokenization or preparation changes what it produces
EMPTY_ROWS_TOLERATED = 0.01
"""Rows left without a target token (an empty response, or a prompt that fills max_seq_len) are
dropped with a warning while they are at most this share of their file; more is an error."""
ROWS_PER_PROCESS = 1000  # fewer rows than this per tokenizing process is not worth a process
ENCODE_ROWS = 256  # rows per tokenizer call
MAP_BATCH_ROWS = 1000  # rows per Arrow record batch (each costs a rank its header page when it opens the file)


# ----------------------------------------------------------------------------- sources


@dataclass
class Source:
    """One entry of data.train_files or data.eval_files, resolved to what is read."""
    key: str  # e.g. data.train_files[1]
    files: list[str]  # local files (all of one type); empty for a Hub dataset
    format: str
    weight: float | None = None
    max_rows: int | None = None
    hub_id: str | None = None
    split: str = "train"
    revision: str | None = None

    @property
    def name(self) -> str:
        if self.hub_id:
            return f"{self.hub_id}[{self.split}]"
        return self.files[0] if len(self.files) == 1 else f"{Path(self.files[0]).parent}/ ({len(self.files)} files)"


def resolve_sources(entries: list, cfg: DataConfig, key: str) -> list[Source]:
    """Each entry (a path, a folder or glob of shards, a Hub dataset id, or a mapping with `path`,
    `format`, `weight`, `max_rows`) as a Source whose files exist and are of one readable type."""
    sources = []
    for i, entry in enumerate(entries):
        e = entry if isinstance(entry, DataSource) else DataSource(path=entry)
        k = f"{key}[{i}]" if len(entries) > 1 or isinstance(entry, DataSource) else key
        fmt = e.format or cfg.format
        files = _expand(e.path, k)
        if files is None:  # not a local path: a Hub dataset id
            from ..model.hub import is_hub_id

            if not is_hub_id(e.path):
                raise ToolkitError(f"{k}: file not found: {e.path}")
            sources.append(Source(k, [], fmt, e.weight, e.max_rows, hub_id=e.path, split=e.split, revision=e.revision))
        else:
            sources.append(Source(k, files, fmt, e.weight, e.max_rows, split=e.split))  # split: a saved DatasetDict
    weighted = [s.weight is not None for s in sources]
    if any(weighted) and not all(weighted):
        raise ToolkitError(f"{key}: give a weight to every entry or to none")
    return sources


def _expand(path: str, key: str) -> list[str] | None:
    """The files of one entry: a file, every data file in a folder, or a glob's matches (sorted).
    None when nothing local is named (the entry may be a Hub id)."""
    p = Path(path).expanduser()
    if any(c in path for c in "*?["):
        files = sorted(f for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
        if not files:
            raise ToolkitError(f"{key}: no files match {path}")
    elif is_saved_dataset(p):
        return [str(p)]  # a `datasets` save_to_disk folder: read as one
    elif p.is_dir():
        files = sorted(str(f) for f in p.rglob("*") if f.is_file() and f.suffix.lower() in LOADERS)
        if not files:
            raise ToolkitError(f"{key}: {path} holds no {', '.join(LOADERS)} files")
    elif p.exists() or p.suffix.lower() in LOADERS or path.startswith(("/", ".", "~")):
        files = [str(p)]
    else:
        return None
    for f in files:
        q = Path(f)
        if not q.is_file():
            raise ToolkitError(f"{key}: file not found: {f}")
        if q.suffix.lower() not in LOADERS:
            raise ToolkitError(f"{key}: {f}: unsupported file type '{q.suffix}' (use {', '.join(LOADERS)})")
        if q.stat().st_size == 0:
            raise ToolkitError(f"{key}: {f}: file is empty")
    kinds = {LOADERS[Path(f).suffix.lower()] for f in files}
    if len(kinds) > 1:
        raise ToolkitError(f"{key}: {path} mixes file types ({', '.join(sorted(kinds))}); give one entry per type")
    return files


def is_saved_dataset(p: Path) -> bool:
    """A folder written by `datasets`' save_to_disk (a Dataset, or a DatasetDict of splits)."""
    return p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file())


def load_saved_dataset(source: "Source"):
    """A save_to_disk folder, memory-mapped; of a DatasetDict, the entry's `split`."""
    import datasets

    folder = source.files[0]
    try:
        ds = datasets.load_from_disk(folder)
    except Exception as e:  # noqa: BLE001 - datasets raises several types for a damaged folder
        raise ToolkitError(f"{source.key}: {folder}: cannot read as a saved dataset "
                           f"({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})") from None
    if isinstance(ds, datasets.DatasetDict):
        if source.split not in ds:
            raise ToolkitError(f"{source.key}: {folder} has splits {', '.join(ds)}; no split {source.split!r} "
                               "(set the entry's split)")
        ds = ds[source.split]
    return ds


def check_json_lines(files: list[str]) -> set[str]:
    """Fail fast on malformed JSON, naming the file and line (only before a tokenization), and on a
    top-level field whose values mix kinds across rows (text in one row, a number in another): the
    Arrow reader cannot hold such a column and `datasets` then falls back to pandas, which guesses
    types and changes values (`"null"` became a null, `"1.50"` the number 1.5). Returns the fields
    seen in any row."""
    seen = set()
    for f in files:
        kinds = {}  # field -> (kind of its first non-null value, row where it was seen)

        def check_row(row, number: int, where: str) -> None:
            if not isinstance(row, dict):
                raise ToolkitError(f"{f}: {where}: expected a JSON object per row")
            for key, value in row.items():
                if value is None:
                    continue
                kind = json_kind(value)
                kinds.setdefault(key, None)
                first = kinds[key] = kinds[key] or (kind, number)
                if first[0] != kind:
                    raise ToolkitError(f"{f}: {where}: {key} is {kind} ({json.dumps(value)[:40]}) but {first[0]} in "
                                       f"row {first[1]}; a field must hold one kind of value in every row (write "
                                       "numbers as strings in quotes for text), or the reader changes values")

        try:
            if Path(f).suffix.lower() == ".jsonl":
                with open(f, encoding="utf-8") as fh:
                    number = 0
                    for lineno, line in enumerate(fh, 1):
                        if line.strip():
                            number += 1
                            try:
                                row = json.loads(line)
                            except json.JSONDecodeError as e:
                                raise ToolkitError(f"{f}: line {lineno}: malformed JSON ({e.msg})") from None
                            check_row(row, number, f"row {number}" + (f" (line {lineno})" if lineno != number else ""))
            elif Path(f).suffix.lower() == ".json":
                try:
                    data = json.loads(Path(f).read_text(encoding="utf-8"))
                except json.JSONDecodeError as e:
                    raise ToolkitError(f"{f}: line {e.lineno}: malformed JSON ({e.msg})") from None
                for number, row in enumerate(data if isinstance(data, list) else [], 1):
                    check_row(row, number, f"row {number}")
        except UnicodeDecodeError as e:
            raise ToolkitError(f"{f}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})") from None
        seen |= set(kinds)
    return seen


def json_kind(value) -> str:
    if isinstance(value, bool):
        return "true/false"
    return {str: "text", int: "an integer", float: "a decimal number", list: "a list", dict: "an object"}.get(
        type(value), type(value).__name__)


def csv_as_text(files: list[str]) -> dict:
    """CSV cells read as the text they are (`02139` stays `02139`, `1.50` stays `1.50`, `NA` stays
    `NA`; an empty cell is an empty string): every column typed string, no missing-value guessing."""
    import csv

    from datasets import Features, Value

    with open(files[0], newline="", encoding="utf-8") as f:
        header = next(csv.reader(f), [])
    return dict(features=Features({name: Value("string") for name in header}), keep_default_na=False,
                na_filter=False)


def load_rows(source: Source, cache_dir: Path | None = None):
    """One source's rows as a memory-mapped `datasets.Dataset`, its columns checked. `cache_dir`:
    where `datasets` keeps its Arrow copy of local files (a folder the caller removes)."""
    import datasets

    datasets.disable_progress_bars()
    if source.hub_id:
        from ..model.hub import load_hub_dataset

        ds = load_hub_dataset(source.hub_id, source.split, source.revision, source.key)
    elif is_saved_dataset(Path(source.files[0])):
        ds = load_saved_dataset(source)
    else:
        fields = check_json_lines(source.files)
        loader = LOADERS[Path(source.files[0]).suffix.lower()]
        if loader == "json" and not fields:
            raise ToolkitError(f"{source.name}: no row has a field with a value; data.format={source.format} needs "
                               f"column(s) {', '.join(COLUMNS[source.format])}")
        try:
            ds = datasets.load_dataset(loader, data_files=source.files, split="train",
                                       cache_dir=str(cache_dir) if cache_dir else None,
                                       **(csv_as_text(source.files) if loader == "csv" else {}))
        except Exception as e:  # datasets wraps parser errors in several exception types
            if disk.write_problem(e, cache_dir or cache_root()):  # its Arrow copy of the file, not the file
                raise
            raise ToolkitError(f"{source.name}: cannot read as {Path(source.files[0]).suffix} "
                               f"({str(e).splitlines()[0][:200]})") from None
    if len(ds) == 0:
        raise ToolkitError(f"{source.name}: no rows")
    missing = [c for c in COLUMNS[source.format] if c not in ds.column_names
               and not (c == "messages" and "conversations" in ds.column_names)]
    if missing:
        raise ToolkitError(f"{source.name}: data.format={source.format} needs column(s) {', '.join(missing)}; "
                           f"found {', '.join(ds.column_names)}")
    if source.max_rows is not None:
        ds = ds.select(range(min(source.max_rows, len(ds))))
    return ds


# ----------------------------------------------------------------------------- tokenizing


class MissingField(ToolkitError):
    """A row whose required field is null or absent (or that cannot train for another `reason`: a
    preference pair whose completions are empty or identical): dropped under the
    EMPTY_ROWS_TOLERATED rule (in training), refused by file and row otherwise. `field` names it
    (`output`, `messages[2].content`)."""

    def __init__(self, field: str, reason: str = "is null or missing"):
        super().__init__(f"{field} {reason}")
        self.field = field


def text_value(row: dict, key: str, required: bool = True) -> str:
    """A text field exactly as the user wrote it: a string as it is; an integer (JSON and Parquet
    write integers one way only) as its digits; null or absent: MissingField when required, else
    "". Anything else (a float, true/false, a list) would not train as written: refused."""
    value = row.get(key)
    if value is None:
        if required:
            raise MissingField(key)
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    kind = {bool: "true/false", float: "a number"}.get(type(value), type(value).__name__)
    raise ToolkitError(f"{key} is {kind} ({value!r}), not text; write it as a string in quotes so that it trains "
                       "exactly as written")


def chat_messages(row: dict) -> list[dict]:
    """A conversation's messages as the template will see them, checked: a list of mappings with a
    string role, at least one assistant turn, and text (or, for an assistant turn with tool calls,
    nothing) as content. Null or empty: MissingField."""
    messages = row.get("messages")
    if messages is None and "conversations" in row:  # ShareGPT: {"from": "human", "value": ...}
        messages = sharegpt_messages(row["conversations"])
    if not messages:
        raise MissingField("messages")
    if not isinstance(messages, list):
        raise ToolkitError(f"messages is {type(messages).__name__}, not a list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ToolkitError(f"messages[{i}] is not a message with a role ({m!r:.80})")
        content = m.get("content")
        if content is None and not (m["role"] == "assistant" and m.get("tool_calls")):
            raise MissingField(f"messages[{i}].content")
        if content is not None and not isinstance(content, (str, list)):
            raise ToolkitError(f"messages[{i}].content is {type(content).__name__} ({content!r:.40}), not text")
    if not any(m["role"] == "assistant" for m in messages):
        raise MissingField("an assistant message")
    return messages


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                  "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system",
                  "tool": "tool", "observation": "tool", "function_response": "tool", "ipython": "tool"}


def sharegpt_messages(turns) -> list[dict] | None:
    """ShareGPT `conversations` (`from`/`value`) as chat messages (`role`/`content`)."""
    if not turns:
        return None
    if not isinstance(turns, list):
        raise ToolkitError(f"conversations is {type(turns).__name__}, not a list of turns")
    messages = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or "from" not in t:
            raise ToolkitError(f"conversations[{i}] has no `from` ({t!r:.80})")
        role = SHAREGPT_ROLES.get(str(t["from"]).lower())
        if role is None:
            raise ToolkitError(f"conversations[{i}]: unknown speaker from={t['from']!r} (known: "
                               f"{', '.join(sorted(SHAREGPT_ROLES))})")
        messages.append({"role": role, "content": t.get("value")})
    return messages


def render(row: dict, fmt: str, tokenizer) -> list[tuple[str, list[tuple[int, int]], bool]]:
    """The examples of one row: (text, the character spans that carry loss, whether the text already
    holds its own BOS; alpaca and chat templates write it, plain text gets it added). Every value
    reaches the text as the user wrote it (text_value, chat_messages). One example per row, except a
    chat whose template renders an earlier assistant turn differently once later turns follow (Qwen3
    drops the <think> block of turns before the last user message): each assistant turn is then
    trained as the template renders it at that point of the conversation, in as few examples as
    that allows (chat_examples)."""
    if fmt == "alpaca":
        instruction, output = text_value(row, "instruction"), text_value(row, "output")
        inp = text_value(row, "input", required=False)
        template = ALPACA_PROMPT_WITH_INPUT if inp != "" else ALPACA_PROMPT
        prompt = (tokenizer.bos_token or "") + template.format(instruction=instruction, input=inp)
        text = prompt + output + tokenizer.eos_token
        return [(text, [(len(prompt), len(text))], True)]
    if fmt == "text":
        return [(text_value(row, "text") + tokenizer.eos_token, [], False)]
    if fmt == "preference":
        return preference_examples(row, tokenizer)
    return chat_examples(chat_messages(row), row.get("tools") or None, tokenizer)


def preference_examples(row: dict, tokenizer) -> list[tuple[str, list[tuple[int, int]], bool]]:
    """A preference row as its two examples, prompt + chosen and prompt + rejected, each with its
    completion as the span that carries loss (TRL's standard and conversational formats).
    Text: the completions get eos (unless they end with it), and BOS is added as for `text`.
    Chat: the prompt is the template's rendering with the generation prompt, each completion what
    the template adds after it (where the prompt alone renders differently, the text both share).
    A row without `prompt` whose chosen and rejected conversations open alike has those turns as
    its prompt. Empty or identical completions: MissingField (the 1% rule)."""
    chosen, rejected = row.get("chosen"), row.get("rejected")
    if chosen is None or rejected is None:
        raise MissingField("chosen" if chosen is None else "rejected")
    chat = isinstance(chosen, list)
    if chat != isinstance(rejected, list):
        raise ToolkitError("chosen and rejected must both be text or both be lists of chat messages")
    if chat:
        prompt = row.get("prompt")
        if prompt is None and "prompt" not in row:  # implicit prompt: the turns both conversations open with
            shared = 0
            while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
                shared += 1
            prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        if prompt is None:
            raise MissingField("prompt")
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        for name, turns in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
            if not turns:
                raise MissingField(name, "is empty")
            chat_messages({"messages": turns + ([{"role": "assistant", "content": ""}] if name == "prompt" else [])})
        need_chat_template(tokenizer, "preference pairs written as chat messages")
        tools = row.get("tools") or None
        before = tokenizer.apply_chat_template(prompt, tools=tools, tokenize=False, add_generation_prompt=True)
        texts = [tokenizer.apply_chat_template(prompt + turns, tools=tools, tokenize=False)
                 for turns in (chosen, rejected)]
        cut = min(len(os.path.commonprefix([before, t])) for t in texts)
        completions = [t[cut:] for t in texts]
        empty = [not "".join(str(m.get("content") or "") for m in turns).strip() and not any(
            m.get("tool_calls") for m in turns) for turns in (chosen, rejected)]
        has_specials = True
    else:
        prompt = text_value(row, "prompt")
        completions = [text_value(row, name) for name in ("chosen", "rejected")]
        empty = [not c.strip() for c in completions]
        eos = tokenizer.eos_token or ""
        completions = [c if c.endswith(eos) else c + eos for c in completions]
        texts, cut, has_specials = [prompt + c for c in completions], len(prompt), False
    for name, is_empty in zip(("chosen", "rejected"), empty):
        if is_empty:
            raise MissingField(name, "is empty")
    if completions[0] == completions[1]:
        raise MissingField("chosen", "is identical to rejected")
    return [(t, [(cut, len(t))], has_specials) for t in texts]


def need_chat_template(tokenizer, what: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ToolkitError(f"{what} render through the tokenizer's chat template, and this tokenizer has none "
                           "(no chat_template in its tokenizer_config.json or chat_template.jinja); use a model "
                           "that has one, or data.format=alpaca or text")


def chat_examples(messages: list[dict], tools, tokenizer) -> list[tuple[str, list[tuple[int, int]], bool]]:
    """Assistant turn i carries loss on what the template adds between the conversation up to its
    prompt (add_generation_prompt) and the conversation up to and including it. When every such
    rendering is a prefix of the whole conversation's, one example holds them all. Otherwise (the
    template rewrote earlier turns), the last turn's rendering is an example with every turn it
    renders alike, and so on backwards with the turns left; `tools` (function schemas) go to every
    rendering."""
    need_chat_template(tokenizer, "chat messages")
    turns = []  # (end of prompt, end of turn, rendering up to the turn's end)
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i == 0:  # an opening assistant turn (a greeting) answers nothing: context
            continue
        before = tokenizer.apply_chat_template(messages[:i], tools=tools, tokenize=False, add_generation_prompt=True)
        upto = tokenizer.apply_chat_template(messages[: i + 1], tools=tools, tokenize=False)
        if not upto.startswith(before):
            raise ToolkitError("data.format=messages: the tokenizer's chat template does not render turns "
                               "as prefixes of each other, so assistant turns cannot be located")
        turns.append((len(before), len(upto), upto))
    whole = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    if all(whole.startswith(upto) for _, _, upto in turns):
        return [(whole, [(a, b) for a, b, _ in turns], True)]
    examples = []
    while turns:
        text = turns[-1][2]
        alike = [t for t in turns if text.startswith(t[2])]
        examples.append((text, [(a, b) for a, b, _ in alike], True))
        turns = [t for t in turns if t not in alike]
    return examples[::-1]


def _example(text, spans, has_specials, enc_ids, offsets, fmt, tokenizer, max_seq_len, train_on_prompt) -> dict:
    """Labels: a token is a target when its first character lies inside a span that carries loss."""
    ids = np.asarray(enc_ids, dtype=np.int64)
    starts = np.asarray([a for a, _ in offsets], dtype=np.int64)
    if fmt in ("text", "preference") and tokenizer.bos_token_id is not None and not has_specials:
        ids, starts = np.concatenate([[tokenizer.bos_token_id], ids]), np.concatenate([[0], starts])
    if fmt == "text" or train_on_prompt:
        target = np.ones(len(ids), dtype=bool)
    else:
        bounds = np.asarray(spans, dtype=np.int64).reshape(-1)  # [s0, e0, s1, e1, ...], ascending
        target = np.searchsorted(bounds, starts, side="right") % 2 == 1  # inside some [s, e)
    full_targets = int(target[1:].sum())
    full_length = len(ids)
    ids, target = ids[:max_seq_len], target[:max_seq_len].copy()
    target[0] = False  # nothing predicts a document's first token
    labels = np.where(target, ids, IGNORE)  # numpy, not lists: datasets writes a list of arrays in one copy
    return {"input_ids": ids.astype(np.int32), "labels": labels.astype(np.int32), "n_targets": int(target.sum()),
            "full_targets": full_targets, "length": len(ids), "full_length": full_length}


def tokenize_examples(row: dict, fmt: str, tokenizer, max_seq_len: int, train_on_prompt: bool) -> list[dict]:
    """A row's examples (one, or one per group of chat turns: render) as `input_ids`/`labels`
    (truncated to max_seq_len) with their target and length counts."""
    out = []
    for text, spans, has_specials in render(row, fmt, tokenizer):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, truncation=False)
        ex = _example(text, spans, has_specials, enc["input_ids"], enc["offset_mapping"], fmt, tokenizer,
                      max_seq_len, train_on_prompt)
        out.append({**ex, "input_ids": ex["input_ids"].tolist(), "labels": ex["labels"].tolist()})
    return out


def tokenize_example(row: dict, fmt: str, tokenizer, max_seq_len: int, train_on_prompt: bool) -> dict:
    """The example of a row that gives one (every alpaca and text row; chats of most templates)."""
    (example,) = tokenize_examples(row, fmt, tokenizer, max_seq_len, train_on_prompt)
    return example


def _tokenize_batch(batch: dict, indices: list[int], fmt: str, tokenizer, max_seq_len: int, train_on_prompt: bool,
                    source: int) -> dict:
    """`datasets.map` function: a batch of rows rendered, encoded in one call, and labelled."""
    from jinja2 import TemplateError

    rows = [dict(zip(batch, vals)) for vals in zip(*batch.values())]
    out = []
    missing = {}  # row within this batch -> the null field (the row becomes a placeholder without targets)

    def rendered_row(k) -> list:
        try:
            return render(rows[k], fmt, tokenizer)
        except MissingField as e:
            missing[k] = str(e)
            return [("", [], True)] * (2 if fmt == "preference" else 1)
        except ToolkitError as e:
            raise ToolkitError(f"row {indices[k] + 1}: {e}") from None
        except (KeyError, TypeError, AttributeError, TemplateError) as e:  # e.g. a message without `content`
            raise ToolkitError(f"row {indices[k] + 1} does not fit data.format={fmt} ({type(e).__name__}: {e})") from None

    placeholder_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    for start in range(0, len(rows), ENCODE_ROWS):  # the offsets come back as Python tuples: few rows at a time
        rendered = [(k, r) for k in range(start, min(start + ENCODE_ROWS, len(rows))) for r in rendered_row(k)]
        enc = tokenizer([r[0] for _, r in rendered], add_special_tokens=False, return_offsets_mapping=True,
                        truncation=False)
        for (k, r), i, o in zip(rendered, enc["input_ids"], enc["offset_mapping"]):
            if k in missing:  # one token, no target: dropped below by the rule for rows without targets
                i, o = [placeholder_id], [(0, 0)]
            out.append(_example(*r, i, o, fmt, tokenizer, max_seq_len, train_on_prompt))
            out[-1]["missing"] = missing.get(k, "")
            out[-1]["row"] = indices[k]
            if k in missing:
                out[-1].update(n_targets=0, full_targets=0, labels=np.full(1, IGNORE, dtype=np.int32))
        del rendered, enc
    if fmt == "preference":
        out = [pair(chosen, rejected) for chosen, rejected in zip(out[::2], out[1::2])]
    columns = {k: [o[k] for o in out] for k in out[0]}
    columns["source"] = [source] * len(out)
    return columns


def pair(chosen: dict, rejected: dict) -> dict:
    """A preference row's two examples as one: the chosen one's columns, `rejected_input_ids` and
    `rejected_labels`; its counts those of both (its targets 0 when either completion has none, so
    that the rules for rows without targets drop the pair), its full length the longer one's (so
    the pair is overlong when either is)."""
    both = chosen["n_targets"] > 0 and rejected["n_targets"] > 0
    return {**chosen, "rejected_input_ids": rejected["input_ids"], "rejected_labels": rejected["labels"],
            "n_targets": chosen["n_targets"] + rejected["n_targets"] if both else 0,
            "full_targets": chosen["full_targets"] + rejected["full_targets"],
            "length": chosen["length"] + rejected["length"],
            "full_length": max(chosen["full_length"], rejected["full_length"])}


def _features(fmt: str = "text"):
    from datasets import Features, Sequence, Value

    pairs = {"rejected_input_ids": Sequence(Value("int32")), "rejected_labels": Sequence(Value("int32"))}
    return Features({"input_ids": Sequence(Value("int32")), "labels": Sequence(Value("int32")),
                     **(pairs if fmt == "preference" else {}),
                     "n_targets": Value("int32"), "full_targets": Value("int32"), "length": Value("int32"),
                     "full_length": Value("int32"), "source": Value("int16"), "missing": Value("string"),
                     "row": Value("int32")})


def default_num_proc() -> int:
    return max(1, min(len(os.sched_getaffinity(0)), 16))


def tokenize_source(source: Source, index: int, cfg: DataConfig, tokenizer, num_proc: int, report: "Report",
                    cache_file: Path):
    """One source tokenized into Arrow, overlong rows truncated or dropped, rows left without a
    target dropped (an error when they are more than EMPTY_ROWS_TOLERATED of the source)."""

    import datasets
    from jinja2 import TemplateError

    ds = load_rows(source)
    procs = max(1, min(num_proc, math.ceil(len(ds) / ROWS_PER_PROCESS)))
    datasets.enable_progress_bars()  # the one bar worth showing; only the preparing process runs this
    threads = os.environ.get("TOKENIZERS_PARALLELISM")
    if procs > 1 and threads is None:  # num_proc processes of one core each, not num_proc x cores threads
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    faults.at("data")
    try:
        tokenized = ds.map(_tokenize_batch, batched=True, with_indices=True, batch_size=MAP_BATCH_ROWS,
                           remove_columns=ds.column_names,
                           features=_features(source.format), num_proc=procs if procs > 1 else None,
                           cache_file_name=str(cache_file), new_fingerprint=cache_file.stem,
                           fn_kwargs=dict(fmt=source.format, tokenizer=tokenizer, max_seq_len=cfg.max_seq_len,
                                          train_on_prompt=cfg.train_on_prompt, source=index),
                           desc=f"tokenizing {Path(source.name).name}")
    except ToolkitError as e:
        raise ToolkitError(f"{source.name}: {e}") from None
    except (KeyError, TypeError, AttributeError, TemplateError) as e:
        raise ToolkitError(f"{source.name}: a row does not fit data.format={source.format} "
                           f"({type(e).__name__}: {e})") from None
    finally:
        datasets.disable_progress_bars()
        if procs > 1 and threads is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
    cols = tokenized.select_columns(["n_targets", "full_targets", "full_length", "length", "missing",
                                     "row"]).with_format("numpy")[:]
    row_of = cols["row"] + 1  # an example's row in the file (a chat may give several examples: render)
    n_targets, full_targets, full_length = cols["n_targets"], cols["full_targets"], cols["full_length"]
    all_targets = (n_targets == cols["length"] - 1) & (n_targets > 0)
    if source.format != "text" and not cfg.train_on_prompt and all_targets.mean() > 0.5:
        # A prompt format whose prompts carry no tokens: the chat template dropped them (or a field is empty).
        raise ToolkitError(f"{source.name}: row {int(row_of[np.flatnonzero(all_targets)[0]])}: every token is a target in "
                           f"{int(all_targets.sum())} of {len(tokenized)} rows, although data.format={source.format} "
                           "trains on responses only; the tokenizer's chat template probably renders no prompt "
                           "(or data.train_on_prompt=true was meant)")
    overlong = full_length > cfg.max_seq_len
    keep = np.ones(len(tokenized), dtype=bool)
    if cfg.overlong == "drop":
        keep &= ~overlong
        report.dropped_overlong += int(overlong.sum())
        report.targets_lost += int(full_targets[overlong].sum())
    else:
        report.truncated += int(overlong.sum())
        report.targets_lost += int((full_targets - n_targets)[overlong].sum())
    empty = keep & (n_targets == 0)
    if empty.any():
        i = int(np.flatnonzero(empty)[0])
        reason = (cols["missing"][i] if cols["missing"][i] else
                  f"the prompt fills data.max_seq_len={cfg.max_seq_len}" if full_targets[i] > 0
                  else "it has no response tokens")
        where = f"{source.name}: row {int(row_of[i])}: no target tokens left ({reason})"
        if empty.sum() > EMPTY_ROWS_TOLERATED * len(tokenized):
            raise ToolkitError(f"{where}; {int(empty.sum())} of {len(tokenized)} rows affected "
                               f"(more than {EMPTY_ROWS_TOLERATED:.0%})")
        report.warnings.append(f"{where}; dropped {int(empty.sum())} such row(s) of {len(tokenized)}")
        report.dropped_empty += int(empty.sum())
        keep &= ~empty
    report.rows += len(tokenized)
    if len(tokenized) > len(ds):
        report.warnings.append(f"{source.name}: {len(ds)} rows gave {len(tokenized)} examples: the chat template "
                               "renders earlier assistant turns differently once later turns follow (as Qwen3 drops "
                               "earlier <think> blocks), so each turn is trained as rendered at its point")
    if not keep.any():
        raise ToolkitError(f"{source.name}: no rows left after dropping overlong rows (data.overlong=drop)")
    return tokenized, np.flatnonzero(keep)


# ----------------------------------------------------------------------------- preparing


@dataclass
class Report:
    """What preparation did, for the start-of-run `data:` lines (kept beside the prepared data)."""
    rows: int = 0
    truncated: int = 0
    dropped_overlong: int = 0
    dropped_empty: int = 0
    targets_lost: int = 0
    seconds: float = 0.0
    num_proc: int = 1
    counts: dict = field(default_factory=dict)  # per part: examples, tokens, targets (so no rank scans the columns)
    warnings: list = field(default_factory=list)
    lines: list = field(default_factory=list)


def fingerprint(sources: list[Source], cfg: DataConfig, tokenizer, extra: str = "",
                contents: dict | None = None) -> str:
    """Identifies the prepared data: file contents, tokenizer, template and every setting that
    shapes examples (changing any of them prepares the data again). `contents`: digests of files
    already read (each file is read once however many fingerprints include it)."""
    contents = {} if contents is None else contents
    h = hashlib.sha256()
    for s in sources:
        h.update(json.dumps([s.key, s.format, s.weight, s.max_rows, s.hub_id, s.split, s.revision]).encode())
        if s.hub_id:
            if s.hub_id not in contents:
                contents[s.hub_id] = load_rows(s)._fingerprint
            h.update(contents[s.hub_id].encode())
        for f in s.files:
            h.update(f.encode())
            if f not in contents:
                digest = hashlib.sha256()
                parts = sorted(p for p in Path(f).rglob("*") if p.is_file()) if Path(f).is_dir() else [Path(f)]
                for part in parts:  # a saved dataset's folder: each of its files, by name and content
                    digest.update(str(part.relative_to(f) if part != Path(f) else "").encode())
                    with open(part, "rb") as fh:
                        for chunk in iter(lambda: fh.read(1 << 20), b""):
                            digest.update(chunk)
                contents[f] = digest.hexdigest()
            h.update(contents[f].encode())
    h.update(tokenizer.backend_tokenizer.to_str().encode() if hasattr(tokenizer, "backend_tokenizer") else b"")
    h.update(str(getattr(tokenizer, "chat_template", "")).encode())
    h.update(json.dumps([cfg.format, cfg.max_seq_len, cfg.train_on_prompt, cfg.overlong, TOKENIZE_VERSION,
                         extra]).encode())
    return h.hexdigest()[:16]


def remove_partial_data() -> None:
    """This process's half-prepared data folders (`prepare` names them after its pid)."""
    for tmp in cache_root().glob(f"*.tmp-{os.getpid()}"):
        shutil.rmtree(tmp, ignore_errors=True)


def cache_root() -> Path:
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE) / "toolkit"


def mix(rows: np.ndarray, src: np.ndarray, sources: list[Source], seed: int) -> np.ndarray:
    """Rows (numbers into the tokenized documents; `src`: each one's source) drawn so that each
    source makes up its weight's share of the training set, which keeps the total size: a source
    is subsampled without repeats, or upsampled by repeating whole shuffled passes. Without
    weights, every row once, in order."""
    if sources[0].weight is None:
        return rows
    n = len(rows)
    weights = np.array([s.weight for s in sources], dtype=np.float64)
    counts = np.floor(weights / weights.sum() * n).astype(np.int64)
    counts[np.argsort(-(weights / weights.sum() * n - counts), kind="stable")[: n - counts.sum()]] += 1
    rng = np.random.default_rng(seed)
    picked = []
    for s, k in enumerate(counts):
        mine = rows[src == s]
        if len(mine) == 0 or k == 0:
            continue
        passes = [rng.permutation(mine) for _ in range(math.ceil(k / len(mine)))]
        picked.append(np.concatenate(passes)[:k])
    return np.sort(np.concatenate(picked))


def _bins_dataset(bins: list[np.ndarray]):
    import datasets
    import pyarrow as pa

    offsets = np.zeros(len(bins) + 1, dtype=np.int32)
    offsets[1:] = np.cumsum([len(b) for b in bins])
    values = np.concatenate(bins).astype(np.int64) if bins else np.zeros(0, dtype=np.int64)
    table = pa.table({"docs": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))})
    return datasets.Dataset(table)


def prepare(cfg: DataConfig, tokenizer, seed: int, packing: bool, sources, eval_sources, folder: Path,
            num_proc: int) -> None:
    """Tokenize into `folder`/docs/ (Arrow, written once), then choose rows (filter, split, mix) as
    numbers into those documents (train.npy, eval.npy) and pack them (*_bins/); report.json says
    which files make each part. Written under a temporary name and renamed when complete."""
    start = time.time()
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with disk.writing("data: the prepared data (HF_DATASETS_CACHE)", tmp, error=ToolkitError):
        _prepare(cfg, tokenizer, seed, packing, sources, eval_sources, folder, tmp, num_proc, start)


def _prepare(cfg, tokenizer, seed, packing, sources, eval_sources, folder, tmp, num_proc, start) -> None:
    (tmp / "docs").mkdir(parents=True)
    try:
        report = Report(num_proc=num_proc)

        def tokenized(entries, tag):
            files, rows, src, offset = [], [], [], 0
            for i, s in enumerate(entries):
                ds, keep = tokenize_source(s, i, cfg, tokenizer, num_proc, report, tmp / "docs" / f"{tag}-{i}.arrow")
                files += [str(Path(c["filename"]).relative_to(tmp)) for c in ds.cache_files]
                rows.append(keep + offset)
                src.append(np.full(len(keep), i, dtype=np.int16))
                offset += len(ds)
            return files, np.concatenate(rows), np.concatenate(src)

        train_files, train_rows, train_src = tokenized(sources, "train")
        parts = {}
        if eval_sources:
            eval_files, eval_rows, _ = tokenized(eval_sources, "eval")
            parts["eval"] = (eval_files, eval_rows)
        elif cfg.eval_fraction > 0:
            held = np.random.default_rng(seed).permutation(len(train_rows))[: math.ceil(cfg.eval_fraction * len(train_rows))]
            out = np.zeros(len(train_rows), dtype=bool)
            out[held] = True
            parts["eval"] = (train_files, train_rows[out])
            train_rows, train_src = train_rows[~out], train_src[~out]
        parts["train"] = (train_files, mix(train_rows, train_src, sources, seed))
        shutil.rmtree(tmp / "raw", ignore_errors=True)  # datasets' Arrow copy of the source files
        layout = {}
        for name, (files, rows) in parts.items():
            np.save(tmp / f"{name}.npy", rows.astype(np.int64))
            layout[name] = files
            cols = _open_docs(tmp, files).select_columns(["length", "n_targets"]).with_format("numpy")[:]
            lengths = cols["length"][rows]
            report.counts[name] = dict(examples=len(rows), tokens=int(lengths.sum()),
                                       targets=int(cols["n_targets"][rows].sum()))
            del cols
            if packing:
                bins = best_fit_decreasing(lengths, cfg.max_seq_len, seed)
                _bins_dataset(bins).save_to_disk(str(tmp / f"{name}_bins"))
                if name == "train":
                    stats = pack_stats(bins, lengths, cfg.max_seq_len)
                    report.lines.append(f"packed {stats.documents:,} examples into {stats.rows:,} rows of "
                                        f"{cfg.max_seq_len}: fill {stats.fill:.1%}, padding {1 - stats.fill:.1%}")
        report.seconds = time.time() - start
        (tmp / "layout.json").write_text(json.dumps(layout))
        (tmp / "report.json").write_text(json.dumps(report.__dict__))  # last: its presence marks the folder complete
        try:
            tmp.rename(folder)
        except OSError:  # another node's main process on a shared file system finished first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _open_docs(folder: Path, files: list[str]):
    """The tokenized documents of one part, memory-mapped from their Arrow files."""
    import datasets

    return datasets.concatenate_datasets([datasets.Dataset.from_file(str(folder / f)) for f in files])


def label_audit(example: dict, tokenizer, width: int = 240) -> str:
    """One training example as text with its trained tokens inside [[ ]] (a packed row: its first
    document), so a wrong chat template or masking shows before any training. Long runs of text
    keep their start and end."""
    ids, labels = np.asarray(example["input_ids"]), np.asarray(example["labels"])
    if "position_ids" in example:
        restarts = np.flatnonzero(np.asarray(example["position_ids"])[1:] == 0)
        end = int(restarts[0]) + 1 if len(restarts) else len(ids)
        ids, labels = ids[:end], labels[:end]
    target = labels != IGNORE
    cuts = np.flatnonzero(np.diff(target.astype(np.int8))) + 1
    parts = []
    for run in np.split(np.arange(len(ids)), cuts):
        text = tokenizer.decode(ids[run].tolist()).replace("\n", "\\n")
        if len(text) > width:
            text = text[: width // 2] + " ... " + text[-width // 2:]
        parts.append(f"[[{text}]]" if target[run[0]] else text)
    line = (f"first training example, trained tokens in [[ ]] ({int(target.sum())} of {len(ids)} tokens): "
            + "".join(parts))
    if "rejected_input_ids" in example:  # a preference pair: the rejected completion as trained against
        rejected = np.asarray(example["rejected_input_ids"])[np.asarray(example["rejected_labels"]) != IGNORE]
        line = line.replace("first training example", "first training pair, chosen", 1)
        line += f" | rejected: [[{tokenizer.decode(rejected.tolist()).replace(chr(10), chr(92) + 'n')}]]"
    return line


@dataclass
class Datasets:
    train: "Examples"
    eval: "Examples"
    fingerprint: str  # the prepared data's (train and eval)
    lines: list  # the start-of-run `data:` summary
    warnings: list
    train_fingerprint: str = ""  # the training data's alone: eval files may change on resume
    folder: Path | None = None  # where it is prepared (preference pairs keep their reference log-probabilities there)


def build_datasets(cfg: DataConfig, tokenizer, seed: int, packing: bool, *, prepares: bool = True,
                   on_wait: Callable[[], None] | None = None) -> Datasets:
    """The prepared train and eval examples. `prepares`: this process tokenizes when the data is not
    prepared yet (the main process of each node); the others wait for its folder (calling `on_wait`
    while they do, e.g. to check the preparing process is alive)."""
    sources = resolve_sources(cfg.train_files, cfg, "data.train_files")
    eval_sources = resolve_sources(cfg.eval_files, cfg, "data.eval_files") if cfg.eval_files else []
    read = {}
    extra = f"{cfg.eval_fraction}/{seed}/{packing}"
    train_fp = fingerprint(sources, cfg, tokenizer, extra=extra, contents=read)  # what a resume must not change
    fp = fingerprint(sources + eval_sources, cfg, tokenizer, extra=extra, contents=read) if eval_sources else train_fp
    folder = cache_root() / fp
    if not (folder / "report.json").is_file():
        if prepares:
            prepare(cfg, tokenizer, seed, packing, sources, eval_sources, folder, cfg.num_proc or default_num_proc())
        else:
            while not (folder / "report.json").is_file():
                if on_wait is not None:
                    on_wait()
                time.sleep(0.5)
    return load_prepared(folder, packing, fp, train_fp)


def load_prepared(folder: Path, packing: bool, fp: str, train_fp: str | None = None) -> Datasets:
    import datasets

    report = Report(**json.loads((folder / "report.json").read_text()))

    layout = json.loads((folder / "layout.json").read_text())

    def part(name):
        if name not in layout:
            return None
        docs = _open_docs(folder, layout[name]).select(np.load(folder / f"{name}.npy"))
        bins = datasets.load_from_disk(str(folder / f"{name}_bins")) if packing else None
        return Examples(docs, bins)

    train, evaluation = part("train"), part("eval")
    counts = report.counts["train"]
    lines = [f"{counts['examples']:,} train examples, {counts['tokens']:,} tokens ({counts['targets']:,} targets, "
             f"{counts['targets'] / max(1, counts['tokens']):.1%}); "
             f"{report.counts.get('eval', {}).get('examples', 0):,} eval examples; prepared in "
             f"{report.seconds:.1f} s with {report.num_proc} process(es) into {folder}"]
    if report.truncated:
        lines.append(f"{report.truncated:,} of {report.rows:,} rows truncated to data.max_seq_len "
                     f"({report.targets_lost:,} target tokens lost; data.overlong=drop drops them instead)")
    if report.dropped_overlong:
        lines.append(f"{report.dropped_overlong:,} of {report.rows:,} rows longer than data.max_seq_len dropped "
                     f"({report.targets_lost:,} target tokens lost)")
    lines += report.lines
    return Datasets(train=train, eval=evaluation or Examples(None, None), fingerprint=fp, lines=lines,
                    warnings=report.warnings, train_fingerprint=train_fp or fp, folder=folder)


# ----------------------------------------------------------------------------- batching


class Examples(torch.utils.data.Dataset):
    """Examples read from Arrow by index: one document each, or (packed) one row of documents
    with `position_ids` restarting at each. Index None (eval padding) gives None."""

    def __init__(self, docs, bins=None):
        self.table = docs  # every column, for counting
        columns = [c for c in ("input_ids", "labels", "rejected_input_ids", "rejected_labels")
                   if docs is not None and c in docs.column_names]
        self.docs = docs.select_columns(columns).with_format("numpy") if docs is not None else None
        self.bins = bins.with_format("numpy") if bins is not None else None
        self.pairs = "rejected_input_ids" in columns
        self.reference = None  # preference pairs: each example's reference log-probabilities (chosen, rejected)

    def __len__(self) -> int:
        if self.docs is None:
            return 0
        return len(self.bins) if self.bins is not None else len(self.docs)

    def __getitem__(self, i):
        if i is None:
            return None
        if self.bins is None:
            example = self.docs[int(i)]
            if self.reference is not None:
                example["reference"] = self.reference[int(i)]
            return example
        rows = self.docs[self.bins[int(i)]["docs"]]
        ids = [np.asarray(x) for x in rows["input_ids"]]
        return {"input_ids": np.concatenate(ids), "labels": np.concatenate(list(rows["labels"])),
                "position_ids": np.concatenate([np.arange(len(x)) for x in ids])}

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def most_positions(recipe) -> int:
    """The most positions one training or eval batch can hold: its rows (the larger of the train
    and eval micro-batch; a preference pair is two sequences) of at most max_seq_len."""
    t = recipe.train
    sequences = max(t.micro_batch_size, t.eval_batch_size or 0) * (2 if recipe.preference.method else 1)
    return recipe.data.max_seq_len * sequences


def longest_row(recipe) -> int:
    """The most positions one row of a batch can hold: max_seq_len, or with data.padding_free the
    whole batch in one row."""
    return most_positions(recipe) if recipe.data.padding_free else recipe.data.max_seq_len


class Collator:
    """Batches a list of examples into tensors.

    - Unpacked examples are right-padded and get an attention mask.
    - Packed rows are right-padded and get `position_ids` instead (padding is one more document,
      which the real ones never see).
    - `padding_free`: the micro-batch's examples (rows or documents) are concatenated into one row
      with `position_ids` restarting at each document: no padding at all.
    - `bounds`: packed and padding-free batches also carry the documents' bounds for varlen
      attention (`cu_seq_lens_q/k`, `max_length_q/k`), computed here on the host.
    - `multiple`: rows are padded to a multiple of it (sequence parallelism splits each row into
      that many equal parts); a padding-free row gets one more document of padding.

    - `pairs` (preference pairs): the chosen sequences are the batch's first rows (padding-free:
      documents) and the rejected ones those after them, in the same order, so both go through one
      forward; `reference_logps` holds their reference log-probabilities where the examples carry them.

    An example of None (eval padding, see EvalShardSampler) becomes a row (padding-free: a document)
    without targets; a batch of nothing but None (a rank whose eval share ran out) is one such row
    per example."""

    def __init__(self, pad_token_id: int, packed: bool = False, padding_free: bool = False, bounds: bool = False,
                 pairs: bool = False, multiple: int = 1):
        self.pad_token_id, self.packed, self.padding_free, self.bounds = pad_token_id, packed, padding_free, bounds
        self.pairs, self.multiple = pairs, multiple

    def __call__(self, examples: list[dict | None]) -> dict:
        if self.pairs:
            return self.pair_batch(examples)
        real = [e for e in examples if e is not None]
        packed = "position_ids" in real[0] if real else self.packed
        examples = [e if e is not None else {"input_ids": [self.pad_token_id], "labels": [IGNORE],
                                             **({"position_ids": [0]} if packed else {})}
                    for e in examples]
        if self.padding_free and (short := -sum(len(e["input_ids"]) for e in examples) % self.multiple):
            examples = [*examples, {"input_ids": [self.pad_token_id] * short, "labels": [IGNORE] * short,
                                    **({"position_ids": list(range(short))} if packed else {})}]
        if self.padding_free:
            def row(parts):
                return torch.as_tensor(np.concatenate(parts), dtype=torch.long)[None]

            batch = {"input_ids": row([e["input_ids"] for e in examples]), "labels": row([e["labels"] for e in examples]),
                     "position_ids": row([e["position_ids"] if packed else np.arange(len(e["input_ids"]))
                                          for e in examples])}
            return self.with_bounds(batch)
        width = max(len(e["input_ids"]) for e in examples)
        width += -width % self.multiple
        ids = torch.full((len(examples), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
        for i, e in enumerate(examples):
            n = len(e["input_ids"])
            ids[i, :n] = torch.as_tensor(e["input_ids"])
            labels[i, :n] = torch.as_tensor(e["labels"])
        batch = {"input_ids": ids, "labels": labels}
        if packed:
            pos = torch.zeros((len(examples), width), dtype=torch.long)
            for i, e in enumerate(examples):
                n = len(e["position_ids"])
                pos[i, :n] = torch.as_tensor(e["position_ids"])
                pos[i, n:] = torch.arange(width - n)
            batch["position_ids"] = pos
            return self.with_bounds(batch)
        mask = torch.zeros((len(examples), width), dtype=torch.long)
        for i, e in enumerate(examples):
            mask[i, : len(e["input_ids"])] = 1
        batch["attention_mask"] = mask
        return batch

    def pair_batch(self, examples: list[dict | None]) -> dict:
        none = {"input_ids": [self.pad_token_id], "labels": [IGNORE]}
        rows = ([e or none for e in examples]
                + [{"input_ids": e["rejected_input_ids"], "labels": e["rejected_labels"]} if e else none
                   for e in examples])
        batch = Collator(self.pad_token_id, padding_free=self.padding_free, bounds=self.bounds)(rows)
        if any(e is not None and "reference" in e for e in examples):
            reference = np.zeros((len(examples), 2))
            for i, e in enumerate(examples):
                if e is not None:
                    reference[i] = e["reference"]
            batch["reference_logps"] = torch.as_tensor(np.concatenate([reference[:, 0], reference[:, 1]]),
                                                       dtype=torch.float32)
        return batch

    def with_bounds(self, batch: dict) -> dict:
        if self.bounds:
            from ..model.varlen import document_bounds

            cu, longest = document_bounds(batch["position_ids"].numpy())
            batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        return batch


class EpochSampler(Sampler[int]):
    """A seeded permutation per epoch, cut to whole global batches so that every optimizer step
    sees exactly `global_batch` examples. Identical on every rank; the launcher's sharding
    hands each rank its micro-batches."""

    def __init__(self, n: int, global_batch: int, seed: int):
        self.n, self.global_batch, self.seed, self.epoch = n, global_batch, seed, 0
        self.steps_per_epoch = n // global_batch
        self.resume_epoch, self.resume_offset = 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resume_at(self, epoch: int, offset: int) -> None:
        """Continue from sample `offset` of `epoch`'s permutation (the samples a checkpoint had
        seen): the first epoch iterated from here on starts there, no sample repeated or skipped.
        An offset that is not a whole number of this launch's global batches (the global batch
        was changed on resume) ends that epoch at the last whole global batch."""
        self.resume_epoch, self.resume_offset = epoch, offset

    def steps_in(self, epoch: int) -> int:
        """Optimizer steps (whole global batches) this sampler yields in `epoch`."""
        start = self.resume_offset if epoch == self.resume_epoch else 0
        return max(0, self.steps_per_epoch * self.global_batch - start) // self.global_batch

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        perm = torch.randperm(self.n, generator=g)[: self.steps_per_epoch * self.global_batch]
        start = self.resume_offset if self.epoch == self.resume_epoch else 0
        return iter(perm[start: start + self.steps_in(self.epoch) * self.global_batch].tolist())

    def __len__(self) -> int:
        return self.steps_per_epoch * self.global_batch


class EvalShardSampler(Sampler):
    """This rank's share of the eval set, padded with None to the same number of batches on every
    rank (sharded backends need every rank to run the same number of forward passes)."""

    def __init__(self, n: int, batch_size: int, rank: int, world: int):
        per_rank = math.ceil(n / world)
        per_rank = math.ceil(per_rank / batch_size) * batch_size
        mine = list(range(rank, n, world))
        self.indices = mine + [None] * (per_rank - len(mine))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def packing_is_isolated(model: torch.nn.Module, tol: float = 1e-4) -> bool:
    """Does this model keep packed documents apart? Compares a document's logits packed behind
    another with its logits alone."""
    vocab = model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(3, vocab, (1, 7), generator=g), torch.randint(3, vocab, (1, 5), generator=g)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    with torch.no_grad():
        alone = model(input_ids=b.to(device), use_cache=False).logits.float()
        pos = torch.cat([torch.arange(7), torch.arange(5)]).unsqueeze(0)
        packed = model(input_ids=torch.cat([a, b], 1).to(device), position_ids=pos.to(device),
                       use_cache=False).logits.float()[:, 7:]
    model.train(was_training)
    return bool(((packed - alone).abs().max() <= tol * max(1.0, alone.abs().max().item())).item())
