"""Sources: each entry of data.train_files or data.eval_files (a file, a folder or glob of shards, a
saved dataset, a Hub dataset id) resolved to a `Source` (`resolve_sources`), and one source's rows
read as a memory-mapped `datasets.Dataset`, its columns checked (`load_rows`). Malformed JSON and
fields whose values mix kinds are refused by file and row before anything is tokenized; CSV cells
are read as the text they are. `check_first_rows` finds a missing column from the first rows alone,
before the run builds its model."""

from __future__ import annotations

import glob
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..config import DataConfig, DataSource
from ..errors import ToolkitError
from ..storage import disk
from .formats import COLUMNS, format_of

LOADERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def resolve_sources(entries: list, cfg: DataConfig, key: str) -> list[Source]:
    """Each entry (a path, a folder or glob of shards, a Hub dataset id, or a mapping with `path`,
    `format`, `weight`, `max_rows`) as a Source whose files exist and are of one readable type."""
    sources = []
    for i, entry in enumerate(entries):
        e = entry if isinstance(entry, DataSource) else DataSource(path=entry)
        k = f"{key}[{i}]" if len(entries) > 1 or isinstance(entry, DataSource) else key
        fmt = e.format or cfg.format
        files = expand_files(e.path, k)
        if files is None:  # not a local path: a Hub dataset id
            from ..model.hub import is_hub_id

            if not is_hub_id(e.path):
                raise ToolkitError(f"{k}: file not found: {e.path}")
            if fmt is None:
                raise ToolkitError(f"{k}: {e.path} is a Hub dataset, whose columns are known only once it is read: "
                                   "set data.format (or the entry's format)")
            sources.append(Source(k, [], fmt, e.weight, e.max_rows, hub_id=e.path, split=e.split, revision=e.revision,
                                  columns=dict(e.columns)))
        else:
            fmt = fmt or detected_format(files, e.columns, k)
            sources.append(Source(k, files, fmt, e.weight, e.max_rows, split=e.split,  # split: a saved DatasetDict
                                  columns=dict(e.columns)))
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
    columns: dict[str, str] = field(default_factory=dict)  # renames: {column in the data: column the format reads}

    @property
    def name(self) -> str:
        if self.hub_id:
            return f"{self.hub_id}[{self.split}]"
        return self.files[0] if len(self.files) == 1 else f"{Path(self.files[0]).parent}/ ({len(self.files)} files)"


def expand_files(path: str, key: str) -> list[str] | None:
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


def detected_format(files: list[str], renames: dict, key: str) -> str:
    """data.format unset: the format of the first file's first row (after the entry's column renames), as TRL
    finds a dataset's type from its columns; one line naming the columns where none fits."""
    if is_saved_dataset(Path(files[0])):
        import datasets

        ds = datasets.load_from_disk(files[0])
        columns = next(iter(ds.values())).column_names if isinstance(ds, datasets.DatasetDict) else ds.column_names
    else:
        columns = first_columns(files[0]) or []
    columns = [renames.get(c, c) for c in columns]
    fmt = format_of(columns)
    if fmt is None:
        raise ToolkitError(f"{key}: {files[0]}: data.format is not set and its first row's columns "
                           f"({', '.join(columns) or 'none'}) are none of a format's (messages, prompt + completion, "
                           "chosen + rejected, instruction + output, text, prompt): set data.format, or rename "
                           "columns with the entry's `columns`")
    return fmt


def check_first_rows(source: Source) -> None:
    """The columns source.format needs, looked for in each file's first row (a JSON lines file's
    first line, the start of a .json array, a CSV header, a Parquet schema, a saved dataset's
    features): cheap on files of any size, so a run checks this before it builds its model. Only
    where the first rows lack a column are the JSON files read whole (a column may first appear
    further down), so this refuses what load_rows would, in its words. A Hub dataset is left to
    load_rows (reading one may mean a download)."""
    if source.hub_id:
        return
    if is_saved_dataset(Path(source.files[0])):
        check_columns(source.name, source.format, renamed(source, load_saved_dataset(source).column_names))
        return
    firsts = [first_columns(f) for f in source.files]
    found = [c for columns in firsts for c in columns or []]
    if all(c in found for c in source.columns) and not missing_columns(source.format, renamed(source, found)):
        return
    if LOADERS[Path(source.files[0]).suffix.lower()] == "json":
        found = list(dict.fromkeys(key for f in source.files for row, _, _ in json_rows(f) for key in row))
    elif None in firsts:
        return  # a file this cannot read: load_rows says why
    check_columns(source.name, source.format, renamed(source, list(dict.fromkeys(found))))


def renamed(source: Source, columns: list[str]) -> list[str]:
    """`columns` after the entry's `columns` renames; a rename of a column the data lacks, or onto one
    it already has, is refused naming the key."""
    for old, new in source.columns.items():
        if old not in columns:
            raise ToolkitError(f"{source.key}.columns: {source.name} has no column {old!r} to rename "
                               f"(found {', '.join(columns) or 'none'})")
        if new in columns and new not in source.columns:
            raise ToolkitError(f"{source.key}.columns: renaming {old!r} to {new!r}, but {source.name} already has "
                               f"a column {new!r}")
    return [source.columns.get(c, c) for c in columns]


def first_columns(file: str) -> list[str] | None:
    """The columns of a file's first row, read without reading the rest; None where that cannot be
    told cheaply (a damaged Parquet or CSV file, a .json that does not open with a list of objects:
    load_rows says why). A malformed first line of JSON lines is refused as load_rows would."""
    kind = Path(file).suffix.lower()
    try:
        if kind == ".jsonl":
            row = next(iter(json_rows(file)), (None,))[0]
            return list(row) if row is not None else None
        if kind == ".json":
            return first_json_object(file)
        if kind == ".csv":
            import csv

            with open(file, newline="", encoding="utf-8") as f:
                return next(csv.reader(f), [])
        import pyarrow.parquet as pq

        return pq.read_schema(file).names
    except ToolkitError:
        raise
    except Exception:  # noqa: BLE001 - pyarrow and the csv reader raise several types for a damaged file
        return None


def first_json_object(file: str, chunk: int = 1 << 16) -> list[str] | None:
    """The keys of the first object of a .json file's top-level list, read from as little of its
    start as holds that object; None when it is not such a list or not readable so."""
    decoder = json.JSONDecoder()
    with open(file, encoding="utf-8") as f:
        text = f.read(chunk)
        while True:
            head = text.lstrip()
            if not head.startswith("["):
                return None
            try:
                row, _ = decoder.raw_decode(head[1:].lstrip())
                return list(row) if isinstance(row, dict) else None
            except json.JSONDecodeError:
                more = f.read(len(text))  # twice as much each time
                if not more:
                    return None
                text += more


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
    check_columns(source.name, source.format, renamed(source, ds.column_names))
    if source.columns:
        ds = ds.rename_columns(source.columns)
    if source.max_rows is not None:
        ds = ds.select(range(min(source.max_rows, len(ds))))
    return ds


def check_columns(name: str, fmt: str, columns: list[str]) -> None:
    """The one line for a source whose columns lack one that data.format needs (formats.COLUMNS),
    naming the format its columns do fit, if one does (`alpaca`, the default, left on a chat file)."""
    missing = missing_columns(fmt, columns)
    if missing:
        # the format that reads the most of these columns: prompt + completion are prompt_completion's, not prompt's
        fits = sorted((f for f in COLUMNS if f != fmt and not missing_columns(f, columns)),
                      key=lambda f: -len(COLUMNS[f]))
        raise ToolkitError(f"{name}: data.format={fmt} needs column(s) {', '.join(missing)}; found "
                           f"{', '.join(columns) or 'none'}" + (f", which data.format={fits[0]} reads" if fits else ""))


def missing_columns(fmt: str, columns: list[str]) -> list[str]:
    return [c for c in COLUMNS[fmt] if c not in columns and not (c == "messages" and "conversations" in columns)]


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
        for row, number, where in json_rows(f):
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
        seen |= set(kinds)
    return seen


def json_rows(f: str):
    """The rows of a .json or .jsonl file in order, as (row, its number, where: `row N`, with its
    line where that differs); malformed JSON, a row that is not an object and text that is not
    UTF-8 refused by file and line. A .jsonl file is read one line at a time."""
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
                        yield checked_row(f, row, number, f"row {number}" + (f" (line {lineno})" if lineno != number
                                                                              else ""))
        elif Path(f).suffix.lower() == ".json":
            try:
                data = json.loads(Path(f).read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise ToolkitError(f"{f}: line {e.lineno}: malformed JSON ({e.msg})") from None
            for number, row in enumerate(data if isinstance(data, list) else [], 1):
                yield checked_row(f, row, number, f"row {number}")
    except UnicodeDecodeError as e:
        raise ToolkitError(f"{f}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})") from None


def checked_row(f: str, row, number: int, where: str) -> tuple[dict, int, str]:
    if not isinstance(row, dict):
        raise ToolkitError(f"{f}: {where}: expected a JSON object per row")
    return row, number, where


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
