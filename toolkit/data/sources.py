"""Sources: each entry of data.train_files or data.eval_files (a file, a folder or glob of shards, a
saved dataset, a Hub dataset id) resolved to a `Source` (`resolve_sources`), and one source's rows
read as a memory-mapped `datasets.Dataset`, its columns checked (`load_rows`). Malformed JSON and
fields whose values mix kinds are refused by file and row before anything is tokenized; CSV cells
are read as the text they are."""

from __future__ import annotations

import glob
import json
from dataclasses import dataclass
from pathlib import Path

from ..config import DataConfig, DataSource
from ..errors import ToolkitError
from ..storage import disk
from .formats import COLUMNS

LOADERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


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


def cache_root() -> Path:
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE) / "toolkit"
