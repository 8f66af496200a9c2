"""Preparing: the sources tokenized once into Arrow, split into train and eval, mixed by weight and
packed, then opened by every rank (`build_datasets`).

Prepared data lives in Arrow, never in Python lists: the main process of each node tokenizes once
(in `data.num_proc` processes) into `$HF_DATASETS_CACHE/toolkit/<fingerprint>/`, written under a
temporary name and renamed when complete; the other ranks wait for that folder by polling the
file system (not in a collective that could time out during a long tokenization) and then
memory-map the same files, so every rank shares one copy through the page cache. Each part (train,
eval) is kept as numbers into the tokenized documents; packing places whole documents into rows of
`max_seq_len` (best fit decreasing, packing.py), kept as the documents of each row.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..config import DataConfig
from ..errors import ToolkitError
from ..storage import disk
from .batching import Examples, bins_dataset
from .formats import IGNORE
from .packing import best_fit_decreasing, pack_stats
from .sources import Source, cache_root, load_rows, resolve_sources
from .tokenize import Report, tokenize_source

TOKENIZE_VERSION = 8  # bump when tokenization or preparation changes what it produces


def build_datasets(cfg: DataConfig, tokenizer, seed: int, packing: bool, *, prepares: bool = True,
                   on_wait: Callable[[], None] | None = None, margins: bool = False) -> Datasets:
    """The prepared train and eval examples. `prepares`: this process tokenizes when the data is not
    prepared yet (the main process of each node); the others wait for its folder (calling `on_wait`
    while they do, e.g. to check the preparing process is alive). `margins` (a reward model's
    preference pairs): each row's `margin` column kept, in data prepared apart from other runs'."""
    sources = resolve_sources(cfg.train_files, cfg, "data.train_files")
    eval_sources = resolve_sources(cfg.eval_files, cfg, "data.eval_files") if cfg.eval_files else []
    read = {}
    extra = f"{cfg.eval_fraction}/{seed}/{packing}" + ("/margins" if margins else "")
    train_fp = fingerprint(sources, cfg, tokenizer, extra=extra, contents=read)
    content = fingerprint(sources, cfg, tokenizer, extra=extra, contents=read, by_content=True)  # a resume's
    fp = fingerprint(sources + eval_sources, cfg, tokenizer, extra=extra, contents=read) if eval_sources else train_fp
    folder = cache_root() / fp
    if not (folder / "report.json").is_file():
        if prepares:
            prepare(cfg, tokenizer, seed, packing, sources, eval_sources, folder, cfg.num_proc or default_num_proc(),
                    margins)
        else:
            while not (folder / "report.json").is_file():
                if on_wait is not None:
                    on_wait()
                time.sleep(0.5)
    return load_prepared(folder, packing, fp, train_fp, content)


@dataclass
class Datasets:
    train: "Examples"
    eval: "Examples"
    fingerprint: str  # the prepared data's (train and eval)
    lines: list  # the start-of-run `data:` summary
    warnings: list
    train_fingerprint: str = ""  # the training data's alone: eval files may change on resume
    train_content: str = ""  # the same without the files' paths: what a resume must not change
    folder: Path | None = None  # where it is prepared (preference pairs keep their reference log-probabilities there)


def fingerprint(sources: list[Source], cfg: DataConfig, tokenizer, extra: str = "",
                contents: dict | None = None, by_content: bool = False) -> str:
    """Identifies the prepared data: file contents, tokenizer, template and every setting that
    shapes examples (changing any of them prepares the data again). `contents`: digests of files
    already read (each file is read once however many fingerprints include it). `by_content`: the
    files' paths left out (what a resume compares: the same data moved to another folder is the same)."""
    contents = {} if contents is None else contents
    h = hashlib.sha256()
    for s in sources:
        h.update(json.dumps([s.key, s.format, s.weight, s.max_rows, s.hub_id, s.split, s.revision]
                            + ([sorted(s.columns.items())] if s.columns else [])).encode())
        if s.hub_id:
            if s.hub_id not in contents:
                contents[s.hub_id] = load_rows(s)._fingerprint
            h.update(contents[s.hub_id].encode())
        for f in s.files:
            h.update(b"" if by_content else f.encode())
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
    # The tokens rows get added (text gets BOS and EOS, alpaca EOS), which tokenizer_config.json may change
    # without changing the vocabulary above.
    h.update(json.dumps([tokenizer.bos_token, tokenizer.eos_token, tokenizer.bos_token_id, tokenizer.eos_token_id,
                         tokenizer.pad_token_id]).encode())
    h.update(json.dumps([cfg.format, cfg.max_seq_len, cfg.train_on_prompt, cfg.overlong or "truncate",
                         TOKENIZE_VERSION, extra]).encode())
    return h.hexdigest()[:16]


def default_num_proc() -> int:
    return max(1, min(len(os.sched_getaffinity(0)), 16))


def prepare(cfg: DataConfig, tokenizer, seed: int, packing: bool, sources, eval_sources, folder: Path,
            num_proc: int, margins: bool = False) -> None:
    """Tokenize into `folder`/docs/ (Arrow, written once), then choose rows (filter, split, mix) as
    numbers into those documents (train.npy, eval.npy) and pack them (*_bins/); report.json says
    which files make each part. Written under a temporary name and renamed when complete."""
    start = time.time()
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with disk.writing("data: the prepared data (HF_DATASETS_CACHE)", tmp, error=ToolkitError):
        _prepare(cfg, tokenizer, seed, packing, sources, eval_sources, folder, tmp, num_proc, start, margins)


def _prepare(cfg, tokenizer, seed, packing, sources, eval_sources, folder, tmp, num_proc, start, margins) -> None:
    (tmp / "docs").mkdir(parents=True)
    try:
        report = Report(num_proc=num_proc)

        def tokenized(entries, tag):
            files, rows, src, offset = [], [], [], 0
            for i, s in enumerate(entries):
                ds, keep = tokenize_source(s, i, cfg, tokenizer, num_proc, report, tmp / "docs" / f"{tag}-{i}.arrow",
                                           margins)
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
            held = np.random.default_rng(seed).permutation(len(train_rows))[
                : math.ceil(cfg.eval_fraction * len(train_rows))]
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
                bins_dataset(bins).save_to_disk(str(tmp / f"{name}_bins"))
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


def _open_docs(folder: Path, files: list[str]):
    """The tokenized documents of one part, memory-mapped from their Arrow files."""
    import datasets

    return datasets.concatenate_datasets([datasets.Dataset.from_file(str(folder / f)) for f in files])


def load_prepared(folder: Path, packing: bool, fp: str, train_fp: str | None = None, train_content: str = ""
                  ) -> Datasets:
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
        lines.append(f"{report.truncated:,} of {report.rows:,} {report.unit} truncated to data.max_seq_len "
                     f"({report.targets_lost:,} target tokens lost; data.overlong=drop drops them instead)")
    if report.dropped_overlong:
        lines.append(f"{report.dropped_overlong:,} of {report.rows:,} {report.unit} longer than data.max_seq_len "
                     "dropped" + (f" ({report.targets_lost:,} target tokens lost)" if report.targets_lost else "")
                     + (f"; {report.dropped_why}" if report.dropped_why else ""))
    lines += report.lines
    return Datasets(train=train, eval=evaluation or Examples(None, None), fingerprint=fp, lines=lines,
                    warnings=report.warnings, train_fingerprint=train_fp or fp, train_content=train_content,
                    folder=folder)


def remove_partial_data() -> None:
    """This process's half-prepared data folders (`prepare` names them after its pid)."""
    for tmp in cache_root().glob(f"*.tmp-{os.getpid()}"):
        shutil.rmtree(tmp, ignore_errors=True)


def label_audit(example: dict, tokenizer, width: int = 240) -> str:
    """One training example as text with its trained tokens inside [[ ]] (a packed row: its first
    document), so a wrong chat template or masking shows before any training. Long runs of text
    keep their start and end."""
    ids, labels = np.asarray(example["input_ids"]), np.asarray(example["labels"])
    if "fields" in example:  # an online-RL prompt: nothing in it is a target; its answers are sampled
        text = tokenizer.decode(ids.tolist()).replace("\n", "\\n")
        return f"first prompt ({len(ids)} tokens; the completions sampled after it are what trains): {text}"
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
    if "label" in example:  # unpaired (KTO): the label, and the mismatched completion its KL estimate takes
        other = np.asarray(example["rejected_input_ids"])[np.asarray(example["rejected_labels"]) != IGNORE]
        line = line.replace("first training example", "first training example, "
                            + ("desirable" if example["label"] else "undesirable"), 1)
        line += (" | mismatched for the KL estimate: the same prompt with an earlier row's completion "
                 f"[[{tokenizer.decode(other.tolist()).replace(chr(10), chr(92) + 'n')}]]")
    elif "rejected_input_ids" in example:  # a preference pair: the rejected completion as trained against
        rejected = np.asarray(example["rejected_input_ids"])[np.asarray(example["rejected_labels"]) != IGNORE]
        line = line.replace("first training example", "first training pair, chosen", 1)
        line += f" | rejected: [[{tokenizer.decode(rejected.tolist()).replace(chr(10), chr(92) + 'n')}]]"
    return line
