"""Tokenizing: one source's rows -> examples with response-only labels, in Arrow (`tokenize_source`).

Each row is rendered to text (`render`: the Alpaca template, the tokenizer's chat template, plain
text, or a preference pair's two completions) with the character spans that carry loss, encoded
and labelled. Every example has `input_ids` and `labels` of equal length; `labels` is -100
(`IGNORE`) wherever no loss is taken (the prompt, by default, and always the first token of a
document, which nothing predicts). Overlong rows are truncated or dropped (data.overlong); rows
left without a target token are dropped under the EMPTY_ROWS_TOLERATED rule; rows that train but
look like a mistake (a system turn after the last answer: `note`) are said in a warning."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import faults
from ..config import DataConfig
from ..errors import ToolkitError
from .chat import (
    MissingField,
    chat_examples,
    chat_messages,
    check_rendered,
    need_chat_template,
    template_fields,
    trailing_system_turn,
)
from .formats import ALPACA_PROMPT, ALPACA_PROMPT_WITH_INPUT, IGNORE
from .sources import Source, load_rows

EMPTY_ROWS_TOLERATED = 0.01
"""Rows left without a target token (an empty response, or a prompt that fills max_seq_len) are
dropped with a warning while they are at most this share of their file; more is an error."""
ROWS_PER_PROCESS = 1000  # fewer rows than this per tokenizing process is not worth a process
ENCODE_ROWS = 256  # rows per tokenizer call
MAP_BATCH_ROWS = 1000  # rows per Arrow record batch (each costs a rank its header page when it opens the file)


def tokenize_source(source: Source, index: int, cfg: DataConfig, tokenizer, num_proc: int, report: "Report",
                    cache_file: Path, margins: bool = False):
    """One source tokenized into Arrow, overlong rows truncated or dropped, rows left without a
    target dropped (an error when they are more than EMPTY_ROWS_TOLERATED of the source). `margins`:
    a reward model's pairs, their `margin` column kept where they have one (and their overlong ones
    said dropped as TRL's RewardTrainer drops them)."""

    import datasets

    reward_model = margins
    from jinja2 import TemplateError

    ds = load_rows(source)
    margins = margins and source.format == "preference" and "margin" in ds.column_names
    procs = max(1, min(num_proc, math.ceil(len(ds) / ROWS_PER_PROCESS)))
    datasets.enable_progress_bars()  # the one bar worth showing; only the preparing process runs this
    threads = os.environ.get("TOKENIZERS_PARALLELISM")
    if procs > 1 and threads is None:  # num_proc processes of one core each, not num_proc x cores threads
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    faults.at("data")
    try:
        tokenized = ds.map(_tokenize_batch, batched=True, with_indices=True, batch_size=MAP_BATCH_ROWS,
                           remove_columns=ds.column_names,
                           features=_features(source.format, margins), num_proc=procs if procs > 1 else None,
                           cache_file_name=str(cache_file), new_fingerprint=cache_file.stem,
                           fn_kwargs=dict(fmt=source.format, tokenizer=tokenizer, max_seq_len=cfg.max_seq_len,
                                          train_on_prompt=cfg.train_on_prompt, source=index, margins=margins),
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
    cols = tokenized.select_columns(["n_targets", "full_targets", "full_length", "length", "missing", "note",
                                     "row"]).with_format("numpy")[:]
    row_of = cols["row"] + 1  # an example's row in the file (a chat may give several examples: render)
    n_targets, full_targets, full_length = cols["n_targets"], cols["full_targets"], cols["full_length"]
    all_targets = (n_targets == cols["length"] - 1) & (n_targets > 0)
    if source.format not in ("text", "prompt") and not cfg.train_on_prompt and all_targets.mean() > 0.5:
        # A prompt format whose prompts carry no tokens: the chat template dropped them (or a field is empty).
        raise ToolkitError(f"{source.name}: row {int(row_of[np.flatnonzero(all_targets)[0]])}: every token is a target "
                           f"in {int(all_targets.sum())} of {len(tokenized)} rows, although "
                           f"data.format={source.format} trains on responses only; the tokenizer's chat template "
                           "probably renders no prompt (or data.train_on_prompt=true was meant)")
    overlong = full_length > cfg.max_seq_len
    keep = np.ones(len(tokenized), dtype=bool)
    unit = "pairs" if source.format == "preference" else "rows"
    report.unit = unit
    if cfg.overlong == "drop" or source.format == "prompt":  # a cut prompt would lose where the answer starts
        keep &= ~overlong
        report.dropped_overlong += int(overlong.sum())
        if reward_model:
            report.dropped_why = REWARD_MODEL_DROPS
        if source.format != "prompt":  # a prompt row has no targets (its completions are sampled in training)
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
    if source.format == "preference" and (keep & overlong).any():
        report.warnings += identical_once_cut(tokenized, np.flatnonzero(keep & overlong), row_of, source.name,
                                              cfg.max_seq_len)
    report.rows += len(tokenized)
    noted = np.unique(row_of[cols["note"] != ""])  # rows in the file (a chat may give several examples)
    if len(noted):
        note = cols["note"][np.flatnonzero(row_of == noted[0])[0]]
        report.warnings.append(f"{source.name}: row {int(noted[0])}: {note}; {len(noted)} of {len(ds)} rows end so")
    if len(tokenized) > len(ds):
        report.warnings.append(f"{source.name}: {len(ds)} rows gave {len(tokenized)} examples: the chat template "
                               "renders earlier assistant turns differently once later turns follow (as Qwen3 drops "
                               "earlier <think> blocks), so each turn is trained as rendered at its point")
    if not keep.any():
        why = ("prompts longer than data.max_seq_len are dropped, never cut" if source.format == "prompt"
               else REWARD_MODEL_DROPS if reward_model else "data.overlong=drop")
        raise ToolkitError(f"{source.name}: no {unit} left after dropping the {int(overlong.sum())} {unit} longer "
                           f"than data.max_seq_len={cfg.max_seq_len} ({why}); raise data.max_seq_len")
    return tokenized, np.flatnonzero(keep)


REWARD_MODEL_DROPS = ("a reward model's pairs longer than data.max_seq_len are dropped, as TRL's RewardTrainer drops "
                      "them: a cut pair's score would be read mid-answer; data.overlong=truncate cuts them instead")


def identical_once_cut(tokenized, cut: np.ndarray, row_of: np.ndarray, name: str, max_seq_len: int) -> list[str]:
    """The warning for preference pairs (`cut`: those kept and cut at max_seq_len) whose chosen and
    rejected sequences are the same once cut (the completions differ only past max_seq_len): such a
    pair's loss has no gradient (DPO, SimPO, a reward model; ORPO keeps only the chosen answer's NLL)."""
    columns = ["input_ids", "labels", "rejected_input_ids", "rejected_labels"]
    pairs = tokenized.select(cut).select_columns(columns).with_format("numpy")
    same = [int(i) for i, p in zip(cut, pairs) if np.array_equal(p["input_ids"], p["rejected_input_ids"])
            and np.array_equal(p["labels"], p["rejected_labels"])]
    if not same:
        return []
    return [f"{name}: row {int(row_of[same[0]])}: chosen and rejected are the same once cut to data.max_seq_len="
            f"{max_seq_len} (they differ only past it), so the pair teaches nothing (ORPO: only the chosen answer's "
            f"NLL); {len(same)} such pair(s) of {len(tokenized)}: raise data.max_seq_len, or set data.overlong=drop"]


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
    unit: str = "rows"  # what a row of the data is in the `data:` lines (preference: pairs)
    dropped_why: str = ""  # why overlong rows are dropped, where a default chose it (a reward model's)
    counts: dict = field(default_factory=dict)  # per part: examples, tokens, targets (so no rank scans the columns)
    warnings: list = field(default_factory=list)
    lines: list = field(default_factory=list)


def _tokenize_batch(batch: dict, indices: list[int], fmt: str, tokenizer, max_seq_len: int, train_on_prompt: bool,
                    source: int, margins: bool = False) -> dict:
    """`datasets.map` function: a batch of rows rendered, encoded in one call, and labelled."""
    from jinja2 import TemplateError

    rows = [dict(zip(batch, vals)) for vals in zip(*batch.values())]
    out = []
    missing = {}  # row within this batch -> the null field (the row becomes a placeholder without targets)

    def rendered_row(k) -> list:
        try:
            if margins:
                margin(rows[k])  # a margin that is no number is refused with the row's number
            return render(rows[k], fmt, tokenizer)
        except MissingField as e:
            missing[k] = str(e)
            return [("", [], True)] * (2 if fmt == "preference" else 1)
        except ToolkitError as e:
            raise ToolkitError(f"row {indices[k] + 1}: {e}") from None
        except (KeyError, TypeError, AttributeError, TemplateError) as e:  # e.g. a message without `content`
            raise ToolkitError(f"row {indices[k] + 1} does not fit data.format={fmt} "
                               f"({type(e).__name__}: {e})") from None

    placeholder_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    for start in range(0, len(rows), ENCODE_ROWS):  # the offsets come back as Python tuples: few rows at a time
        rendered = [(k, r) for k in range(start, min(start + ENCODE_ROWS, len(rows))) for r in rendered_row(k)]
        enc = tokenizer([r[0] for _, r in rendered], add_special_tokens=False, return_offsets_mapping=True,
                        truncation=False)
        for (k, r), i, o in zip(rendered, enc["input_ids"], enc["offset_mapping"]):
            if k in missing:  # one token, no target: dropped below by the rule for rows without targets
                i, o = [placeholder_id], [(0, 0)]
            out.append(_example(*r, i, o, fmt, tokenizer, max_seq_len, train_on_prompt))
            if fmt == "prompt":  # one prompt, no targets (its completions are sampled in training)
                out[-1].update(n_targets=1, full_targets=1, fields=json.dumps(rows[k], default=str))
            if fmt == "unpaired":
                out[-1]["label"] = 0 if k in missing else desirable(rows[k])
            if margins:
                out[-1]["margin"] = 0.0 if k in missing else margin(rows[k])
            out[-1]["missing"] = missing.get(k, "")
            out[-1]["note"] = "" if k in missing or fmt != "messages" else trailing_system_turn(rows[k])
            out[-1]["row"] = indices[k]
            if k in missing:
                out[-1].update(n_targets=0, full_targets=0, labels=np.full(1, IGNORE, dtype=np.int32))
        del rendered, enc
    if fmt == "preference":
        out = [pair(chosen, rejected) for chosen, rejected in zip(out[::2], out[1::2])]
    if fmt == "prompt":
        for o in out:
            o.setdefault("fields", "{}")
    columns = {k: [o[k] for o in out] for k in out[0]}
    columns["source"] = [source] * len(out)
    return columns


def _features(fmt: str = "text", margins: bool = False):
    from datasets import Features, Sequence, Value

    pairs = {"rejected_input_ids": Sequence(Value("int32")), "rejected_labels": Sequence(Value("int32"))}
    whole = {"completion_ids": Sequence(Value("int32")), "completion_labels": Sequence(Value("int32"))}
    return Features({"input_ids": Sequence(Value("int32")), "labels": Sequence(Value("int32")),
                     **(pairs if fmt == "preference" else {}), **(whole if fmt == "unpaired" else {}),
                     **({"fields": Value("string")} if fmt == "prompt" else {}),
                     **({"label": Value("int8")} if fmt == "unpaired" else {}),
                     **({"margin": Value("float32")} if margins else {}),
                     "n_targets": Value("int32"), "full_targets": Value("int32"), "length": Value("int32"),
                     "full_length": Value("int32"), "source": Value("int16"), "missing": Value("string"),
                     "note": Value("string"), "row": Value("int32")})


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
    if fmt == "unpaired":
        desirable(row)  # a label that is neither true nor false is refused with the row's number
        return preference_examples(row, tokenizer, ("completion",))
    if fmt == "prompt_completion":  # TRL's prompt-completion rows: the loss on the completion (unless train_on_prompt)
        return preference_examples(row, tokenizer, ("completion",))
    if fmt == "prompt":
        return [prompt_example(row, tokenizer)]
    return chat_examples(chat_messages(row), row.get("tools") or None, tokenizer)


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


def preference_examples(row: dict, tokenizer, names: tuple[str, ...] = ("chosen", "rejected")
                        ) -> list[tuple[str, list[tuple[int, int]], bool]]:
    """A preference row as its examples, prompt + chosen and prompt + rejected (`names`: the
    completion columns; an unpaired row's is `completion`), each with its completion as the span
    that carries loss (TRL's standard and conversational formats).
    Text: the completions get eos (unless they end with it), and BOS is added as for `text`.
    Chat: the prompt is the template's rendering with the generation prompt, each completion what
    the template adds after it (where the prompt alone renders differently, the text both share).
    A pair without `prompt` whose chosen and rejected conversations open alike has those turns as
    its prompt. Empty or identical completions: MissingField (the 1% rule)."""
    values = [row.get(name) for name in names]
    for name, value in zip(names, values):
        if value is None:
            raise MissingField(name)
    chat = isinstance(values[0], list)
    if any(chat != isinstance(v, list) for v in values):
        raise ToolkitError("chosen and rejected must both be text or both be lists of chat messages")
    if chat:
        prompt = row.get("prompt")
        if prompt is None and "prompt" not in row and len(values) == 2:  # implicit prompt: the turns both open with
            chosen, rejected = values
            shared = 0
            while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
                shared += 1
            prompt, values = chosen[:shared], [chosen[shared:], rejected[shared:]]
        if prompt is None:
            raise MissingField("prompt")
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        need_chat_template(tokenizer, "preference rows written as chat messages")
        checked = {}
        for name, value in (("prompt", prompt), *zip(names, values)):
            if not value:
                raise MissingField(name, "is empty")
            answer = [{"role": "assistant", "content": ""}] if name == "prompt" else []
            checked[name] = template_fields(chat_messages({name: value + answer}, name)[:len(value)], tokenizer, name)
        prompt = checked["prompt"]
        turns, starts = zip(*(completion_turns(prompt, checked[name], name) for name in names))
        tools = row.get("tools") or None
        before = tokenizer.apply_chat_template(prompt, tools=tools, tokenize=False, add_generation_prompt=True)
        texts = [tokenizer.apply_chat_template(prompt + t, tools=tools, tokenize=False) for t in turns]
        cut = min(len(os.path.commonprefix([before, t])) for t in texts)
        completions = [t[cut:] for t in texts]
        check_rendered(prompt, before, "prompt")
        for name, t, completion, at in zip(names, turns, completions, starts):
            check_rendered(t, completion, name, at)
        empty = [not "".join(str(m.get("content") or "") for m in t).strip() and not any(
            m.get("tool_calls") for m in t) for t in turns]
        spans = [completion_spans(prompt, t, tools, tokenizer, text, cut) for t, text in zip(turns, texts)]
        has_specials = True
    else:
        prompt = text_value(row, "prompt")
        completions = [text_value(row, name) for name in names]
        empty = [not c.strip() for c in completions]
        eos = tokenizer.eos_token or ""
        completions = [c if c.endswith(eos) else c + eos for c in completions]
        texts, cut, has_specials = [prompt + c for c in completions], len(prompt), False
        spans = [[(cut, len(t))] for t in texts]
    for name, is_empty in zip(names, empty):
        if is_empty:
            raise MissingField(name, "is empty")
    if len(completions) == 2 and completions[0] == completions[1]:
        raise MissingField("chosen", "is identical to rejected")
    return [(t, s, has_specials) for t, s in zip(texts, spans)]


def margin(row: dict) -> float:
    """A preference row's `margin` for a reward model (TRL's column: how much higher the chosen score
    should be; its loss subtracts it): a number, or a number written as text (a CSV file's); 0 where
    it is null. Anything else is refused with the row's number."""
    value = row.get("margin")
    if value is None:
        return 0.0
    try:
        number = float(value) if isinstance(value, str) and not isinstance(value, bool) else value
    except ValueError:
        number = None
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
        raise ToolkitError(f"margin must be a finite number, got {value!r}")
    return float(number)


def desirable(row: dict) -> int:
    """An unpaired row's `label`: 1 (desirable) for true, 0 for false (TRL's booleans; 1 and 0, and
    the text "true" and "false" of a CSV file, too)."""
    label = row.get("label")
    if label is None:
        raise MissingField("label")
    if isinstance(label, str) and label.strip().lower() in ("true", "false"):
        return int(label.strip().lower() == "true")
    if isinstance(label, bool) or (isinstance(label, (int, float)) and label in (0, 1)):
        return int(label)
    raise ToolkitError(f"label must be true (desirable) or false (undesirable), got {label!r}")


def completion_spans(prompt: list[dict], turns: list[dict], tools, tokenizer, text: str, cut: int) -> list:
    """The spans of a chat completion that carry loss: from `cut` to its end, but for each tool
    result (from where its content starts to the assistant header after it): what a tool returned
    is not the model's to predict, as in data.format=messages. Located by rendering, as `cut` is:
    a tool turn written otherwise shows where its content starts."""
    def shared(messages: list[dict], **kw) -> int:
        return len(os.path.commonprefix([text, tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                                              **kw)]))

    spans, start = [], cut
    for j, m in enumerate(turns):
        if m["role"] == "tool":
            spans.append((start, shared(prompt + turns[:j] + [{**m, "content": "\0" + str(m.get("content") or "")}])))
            start = shared(prompt + turns[:j + 1], add_generation_prompt=True)
    return [(a, b) for a, b in spans + [(start, len(text))] if b > a]


def completion_turns(prompt: list[dict], turns: list[dict], name: str) -> tuple[list[dict], int]:
    """A preference completion's turns (and where they start in the row's `name`): the answer to
    the prompt, all of which trains. A conversation pasted whole (`chosen` = the prompt's turns,
    then the answer) has the prompt's turns taken off, so that the user's text does not train as
    the answer; a completion that opens with anything but an assistant turn, or holds a user or
    system turn, is refused (its prompt text would train)."""
    def written(m: dict) -> dict:
        return {k: v for k, v in m.items() if v is not None}  # Arrow gives absent keys as null

    start = 0
    if len(turns) > len(prompt) and all(written(a) == written(b) for a, b in zip(prompt, turns)):
        start = len(prompt)
    for j, m in enumerate(turns[start:], start):
        if m["role"] not in ("assistant", "tool") or (j == start and m["role"] != "assistant"):
            raise ToolkitError(f"{name}[{j}] is a {m['role']} turn, and all of a completion trains as the answer: "
                               f"{name} holds the answer (assistant turns), `prompt` the conversation before it "
                               "(a pasted conversation must repeat the prompt's turns exactly)")
    return turns[start:], start


def prompt_example(row: dict, tokenizer) -> tuple[str, list[tuple[int, int]], bool]:
    """An online-RL prompt up to where the answer starts: text as written (BOS added), or chat
    messages through the template with its generation prompt (TRL's prompt-only formats)."""
    value = row.get("prompt")
    if value is None or (isinstance(value, list) and not value):
        raise MissingField("prompt")
    if isinstance(value, str) and not value.strip():  # a BOS alone would be sampled from, as if it were a prompt
        raise MissingField("prompt", "is empty")
    if not isinstance(value, list):
        return text_value(row, "prompt"), [], False
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ToolkitError(f"prompt[{i}] is not a chat message with text `role` and `content`")
    need_chat_template(tokenizer, "prompts written as chat messages")
    return tokenizer.apply_chat_template(value, tokenize=False, add_generation_prompt=True), [], True


def _example(text, spans, has_specials, enc_ids, offsets, fmt, tokenizer, max_seq_len, train_on_prompt) -> dict:
    """Labels: a token is a target when its first character lies inside a span that carries loss."""
    ids = np.asarray(enc_ids, dtype=np.int64)
    starts = np.asarray([a for a, _ in offsets], dtype=np.int64)
    # prompt_completion: BOS where the tokenizer's own encoding adds one, as TRL's SFTTrainer tokenizes these rows
    bos = tokenizer.bos_token_id is not None and not has_specials and (
        fmt in ("text", "preference", "unpaired", "prompt") or fmt == "prompt_completion" and adds_bos(tokenizer))
    if bos:
        ids, starts = np.concatenate([[tokenizer.bos_token_id], ids]), np.concatenate([[0], starts])
    if fmt == "text" or train_on_prompt:
        target = np.ones(len(ids), dtype=bool)
    else:
        bounds = np.asarray(spans, dtype=np.int64).reshape(-1)  # [s0, e0, s1, e1, ...], ascending
        target = np.searchsorted(bounds, starts, side="right") % 2 == 1  # inside some [s, e)
    full_targets = int(target[1:].sum())
    full_length = len(ids)
    whole = {}
    if fmt == "unpaired":  # KTO's mismatched sequences take another row's completion as written, before any cut
        start = 1 + int(np.argmax(target[1:])) if full_targets else len(ids)
        whole = {"completion_ids": ids[start:].astype(np.int32),
                 "completion_labels": np.where(target, ids, IGNORE)[start:].astype(np.int32)}
    ids, target = ids[:max_seq_len], target[:max_seq_len].copy()
    target[0] = False  # nothing predicts a document's first token
    labels = np.where(target, ids, IGNORE)  # numpy, not lists: datasets writes a list of arrays in one copy
    return {"input_ids": ids.astype(np.int32), "labels": labels.astype(np.int32), "n_targets": int(target.sum()),
            "full_targets": full_targets, "length": len(ids), "full_length": full_length, **whole}


def adds_bos(tokenizer) -> bool:
    """Whether the tokenizer's own encoding (special tokens on) starts a text with its BOS."""
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bool(ids) and ids[0] == tokenizer.bos_token_id


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


def tokenize_examples(row: dict, fmt: str, tokenizer, max_seq_len: int, train_on_prompt: bool) -> list[dict]:
    """A row's examples (one, or one per group of chat turns: render) as `input_ids`/`labels`
    (truncated to max_seq_len) with their target and length counts."""
    out = []
    for text, spans, has_specials in render(row, fmt, tokenizer):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, truncation=False)
        ex = _example(text, spans, has_specials, enc["input_ids"], enc["offset_mapping"], fmt, tokenizer,
                      max_seq_len, train_on_prompt)
        out.append({**ex, **{k: v.tolist() for k, v in ex.items() if isinstance(v, np.ndarray)}})
    return out


def tokenize_example(row: dict, fmt: str, tokenizer, max_seq_len: int, train_on_prompt: bool) -> dict:
    """The example of a row that gives one (every alpaca and text row; chats of most templates)."""
    (example,) = tokenize_examples(row, fmt, tokenizer, max_seq_len, train_on_prompt)
    return example
