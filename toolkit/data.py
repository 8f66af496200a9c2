"""Data: local files -> tokenized examples with response-only labels -> (packed) batches.

Every example becomes `input_ids` and `labels` of equal length; `labels` is -100 wherever no loss
is taken (the prompt, by default, and always the first token of a document, which nothing
predicts). Packing concatenates examples into rows of `max_seq_len` with `position_ids` that
restart at each document; the model then builds a block-diagonal causal mask, so no token
attends across a document boundary (checked at start-up by `packing_is_isolated`).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch.utils.data import Sampler

from .config import DataConfig, ToolkitError

IGNORE = -100
LOADERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
COLUMNS = {"alpaca": ("instruction", "output"), "messages": ("messages",), "text": ("text",)}
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"


# ----------------------------------------------------------------------------- reading files


def check_files(files: list[str], key: str) -> None:
    """Fail fast, naming the key, the file and (for JSON Lines) the line."""
    for f in files:
        p = Path(f)
        if not p.is_file():
            raise ToolkitError(f"{key}: file not found: {f}")
        if p.suffix.lower() not in LOADERS:
            raise ToolkitError(f"{key}: {f}: unsupported file type '{p.suffix}' (use {', '.join(LOADERS)})")
        if p.stat().st_size == 0:
            raise ToolkitError(f"{key}: {f}: file is empty")
        if p.suffix.lower() == ".jsonl":
            with open(p, encoding="utf-8") as fh:
                for lineno, line in enumerate(fh, 1):
                    if line.strip():
                        try:
                            row = json.loads(line)
                        except json.JSONDecodeError as e:
                            raise ToolkitError(f"{f}: line {lineno}: malformed JSON ({e.msg})") from None
                        if not isinstance(row, dict):
                            raise ToolkitError(f"{f}: line {lineno}: expected a JSON object per line")
        elif p.suffix.lower() == ".json":
            try:
                json.loads(p.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise ToolkitError(f"{f}: line {e.lineno}: malformed JSON ({e.msg})") from None


def load_rows(path: str, fmt: str):
    """One file as a `datasets.Dataset`, with its required columns checked."""
    import datasets

    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(LOADERS[Path(path).suffix.lower()], data_files=[str(path)], split="train")
    except Exception as e:  # datasets wraps parser errors in several exception types
        raise ToolkitError(f"{path}: cannot read as {Path(path).suffix} ({str(e).splitlines()[0][:200]})") from None
    if len(ds) == 0:
        raise ToolkitError(f"{path}: no rows")
    missing = [c for c in COLUMNS[fmt] if c not in ds.column_names]
    if missing:
        raise ToolkitError(f"{path}: data.format={fmt} needs column(s) {', '.join(missing)}; "
                           f"found {', '.join(ds.column_names)}")
    return ds


# ----------------------------------------------------------------------------- tokenizing


def render(row: dict, fmt: str, tokenizer) -> tuple[str, list[tuple[int, int]], bool]:
    """Text of one example, the character spans that carry loss, and whether the text already
    holds its own BOS (alpaca and chat templates write it; plain text gets it added)."""
    if fmt == "alpaca":
        inp = row.get("input") or ""
        template = ALPACA_PROMPT_WITH_INPUT if inp else ALPACA_PROMPT
        prompt = (tokenizer.bos_token or "") + template.format(instruction=row["instruction"], input=inp)
        text = prompt + str(row["output"]) + tokenizer.eos_token
        return text, [(len(prompt), len(text))], True
    if fmt == "text":
        return str(row["text"]) + tokenizer.eos_token, [], False
    messages = row["messages"]
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not upto.startswith(before):
            raise ToolkitError("data.format=messages: the tokenizer's chat template does not render turns "
                               "as prefixes of each other, so assistant turns cannot be located")
        spans.append((len(before), len(upto)))
    return tokenizer.apply_chat_template(messages, tokenize=False), spans, True


def tokenize_example(row: dict, fmt: str, tokenizer, max_seq_len: int, train_on_prompt: bool) -> dict:
    text, spans, has_specials = render(row, fmt, tokenizer)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, truncation=False)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    if fmt == "text" and tokenizer.bos_token_id is not None and not has_specials:
        ids, offsets = [tokenizer.bos_token_id] + ids, [(0, 0)] + offsets
    if fmt == "text" or train_on_prompt:
        labels = list(ids)
    else:
        labels = [t if any(s <= a < e for s, e in spans) else IGNORE for t, (a, _) in zip(ids, offsets)]
    full_targets = sum(1 for t in labels[1:] if t != IGNORE)
    ids, labels = ids[:max_seq_len], labels[:max_seq_len]
    labels[0] = IGNORE  # nothing predicts a document's first token
    return {"input_ids": ids, "labels": labels, "n_targets": sum(1 for t in labels if t != IGNORE),
            "full_targets": full_targets, "length": len(ids)}


def fingerprint(files: list[str], cfg: DataConfig, tokenizer, extra: str = "") -> str:
    """Identifies the tokenized data: file contents, tokenizer and the settings that shape examples."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    h.update(tokenizer.backend_tokenizer.to_str().encode() if hasattr(tokenizer, "backend_tokenizer") else b"")
    h.update(str(getattr(tokenizer, "chat_template", "")).encode())
    h.update(json.dumps([cfg.format, cfg.max_seq_len, cfg.train_on_prompt, TOKENIZE_VERSION, extra]).encode())
    return h.hexdigest()[:16]


TOKENIZE_VERSION = 1  # bump when tokenize_example changes what it produces


def tokenize_file(path: str, cfg: DataConfig, tokenizer):
    """Tokenize one file (cached by `datasets` under a content fingerprint) and check every row
    keeps at least one target token after truncation."""
    ds = load_rows(path, cfg.format)
    fp = fingerprint([path], cfg, tokenizer)

    def fn(batch):
        rows = [dict(zip(batch, vals)) for vals in zip(*batch.values())]
        out = [tokenize_example(r, cfg.format, tokenizer, cfg.max_seq_len, cfg.train_on_prompt) for r in rows]
        return {k: [o[k] for o in out] for k in out[0]}

    try:
        tokenized = ds.map(fn, batched=True, remove_columns=ds.column_names, new_fingerprint=fp,
                           desc=f"tokenizing {Path(path).name}")
    except ToolkitError as e:
        raise ToolkitError(f"{path}: {e}") from None
    except (KeyError, TypeError) as e:
        raise ToolkitError(f"{path}: a row does not fit data.format={cfg.format} ({type(e).__name__}: {e})") from None
    empty = [i for i, n in enumerate(tokenized["n_targets"]) if n == 0]
    if empty:
        i = empty[0]
        reason = (f"the prompt fills data.max_seq_len={cfg.max_seq_len}"
                  if tokenized[i]["full_targets"] > 0 else "it has no response tokens")
        raise ToolkitError(f"{path}: row {i + 1}: no target tokens left ({reason}); "
                           f"{len(empty)} row(s) affected")
    return tokenized


@dataclass
class Datasets:
    train: list[dict]
    eval: list[dict]
    fingerprint: str


def build_datasets(cfg: DataConfig, tokenizer, seed: int, packing: bool) -> Datasets:
    """Tokenized train and eval examples (packed into rows when `packing`)."""
    import datasets

    check_files(cfg.train_files, "data.train_files")
    check_files(cfg.eval_files, "data.eval_files")
    train = datasets.concatenate_datasets([tokenize_file(f, cfg, tokenizer) for f in cfg.train_files])
    if cfg.eval_files:
        evaluation = datasets.concatenate_datasets([tokenize_file(f, cfg, tokenizer) for f in cfg.eval_files])
    elif cfg.eval_fraction > 0:
        split = train.train_test_split(test_size=cfg.eval_fraction, seed=seed, shuffle=True)
        train, evaluation = split["train"], split["test"]
    else:
        evaluation = None
    columns = ["input_ids", "labels"]
    train_rows = train.select_columns(columns).to_list()
    eval_rows = evaluation.select_columns(columns).to_list() if evaluation is not None else []
    if packing:
        train_rows, eval_rows = pack(train_rows, cfg.max_seq_len), pack(eval_rows, cfg.max_seq_len)
    fp = fingerprint(cfg.train_files + cfg.eval_files, cfg, tokenizer, extra=f"{cfg.eval_fraction}/{seed}/{packing}")
    return Datasets(train=train_rows, eval=eval_rows, fingerprint=fp)


def pack(rows: list[dict], max_seq_len: int) -> list[dict]:
    """Concatenate examples in order into rows of at most max_seq_len tokens; an example is never
    split. `position_ids` restart at 0 at each document."""
    packed, cur = [], {"input_ids": [], "labels": [], "position_ids": []}
    for r in rows:
        n = len(r["input_ids"])
        if cur["input_ids"] and len(cur["input_ids"]) + n > max_seq_len:
            packed.append(cur)
            cur = {"input_ids": [], "labels": [], "position_ids": []}
        cur["input_ids"] += r["input_ids"]
        cur["labels"] += r["labels"]
        cur["position_ids"] += list(range(n))
    if cur["input_ids"]:
        packed.append(cur)
    return packed


# ----------------------------------------------------------------------------- batching


class Collator:
    """Right-pads a list of examples into tensors. Unpacked batches get an attention mask; packed
    ones get `position_ids` instead (padding is one more document, which the real ones never see).
    An example of None (eval padding, see EvalShardSampler) becomes a row without targets; a batch
    of nothing but None (a rank whose eval share ran out) is one such row per example."""

    def __init__(self, pad_token_id: int, packed: bool = False):
        self.pad_token_id, self.packed = pad_token_id, packed

    def __call__(self, examples: list[dict | None]) -> dict[str, torch.Tensor]:
        real = [e for e in examples if e is not None]
        packed = "position_ids" in real[0] if real else self.packed
        width = max((len(e["input_ids"]) for e in real), default=1)
        examples = [e if e is not None else {"input_ids": [self.pad_token_id], "labels": [IGNORE],
                                             **({"position_ids": [0]} if packed else {})}
                    for e in examples]
        ids = torch.full((len(examples), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
        for i, e in enumerate(examples):
            n = len(e["input_ids"])
            ids[i, :n] = torch.tensor(e["input_ids"])
            labels[i, :n] = torch.tensor(e["labels"])
        batch = {"input_ids": ids, "labels": labels}
        if packed:
            pos = torch.zeros((len(examples), width), dtype=torch.long)
            for i, e in enumerate(examples):
                n = len(e["position_ids"])
                pos[i, :n] = torch.tensor(e["position_ids"])
                pos[i, n:] = torch.arange(width - n)
            batch["position_ids"] = pos
        else:
            mask = torch.zeros((len(examples), width), dtype=torch.long)
            for i, e in enumerate(examples):
                mask[i, : len(e["input_ids"])] = 1
            batch["attention_mask"] = mask
        return batch


class EpochSampler(Sampler[int]):
    """A seeded permutation per epoch, cut to whole global batches so that every optimizer step
    sees exactly `global_batch` examples. Identical on every rank; the launcher's sharding
    hands each rank its micro-batches."""

    def __init__(self, n: int, global_batch: int, seed: int):
        self.n, self.global_batch, self.seed, self.epoch = n, global_batch, seed, 0
        self.steps_per_epoch = n // global_batch
        self.resume_step = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resume_at(self, step: int) -> None:
        """Continue after `step` optimizer steps: the first epoch iterated from here on starts
        with that step's position in its permutation (no batch repeated or skipped)."""
        self.resume_step = step

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        perm = torch.randperm(self.n, generator=g)[: self.steps_per_epoch * self.global_batch]
        start = 0
        if self.steps_per_epoch and self.epoch == self.resume_step // self.steps_per_epoch:
            start = (self.resume_step % self.steps_per_epoch) * self.global_batch
        return iter(perm[start:].tolist())

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


class EvalRows(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return None if i is None else self.rows[i]


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
