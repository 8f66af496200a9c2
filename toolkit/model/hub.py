"""Models and datasets by Hub id (`org/name`), resolved through the Hugging Face cache.

The cache is huggingface_hub's (`HF_HUB_CACHE`, by default `$HF_HOME/hub`). With `HF_HUB_OFFLINE=1`
only the cache is read; otherwise the Hub is asked first and the cache is the fallback when it
cannot answer. Light imports only (no torch): `datasets` is imported when a dataset is loaded.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from huggingface_hub import HfApi, constants, snapshot_download
from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError, RevisionNotFoundError
from huggingface_hub.utils import HFValidationError, validate_repo_id

from ..errors import ToolkitError
from ..stops import TrainingStopped

DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".txt", ".arrow")
# Weights of other frameworks and runtimes, and Meta's original checkpoints beside the converted ones.
OTHER_FORMATS = ["*.h5", "*.msgpack", "*.onnx", "*.onnx_data", "*.gguf", "*.tflite", "*.ot", "onnx/*", "original/*"]


CONNECT_S = 10.0  # seconds to connect to the Hub (HF_ENDPOINT)
ANSWER_S = 60.0  # seconds a request may go without an answer (between two reads) before it fails


def network_timeouts(answer_s: float = ANSWER_S) -> None:
    """Every request of huggingface_hub, and of transformers and datasets through it, with timeouts: its own client
    has none, so an endpoint that takes the connection and never answers would hold the process forever. One that
    times out raises, and its caller's one line says so (`timed_out`). Set when this module is imported."""
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils._http import default_client_factory

    def with_timeouts():
        client = default_client_factory()
        client.timeout = type(client.timeout)(answer_s, connect=min(CONNECT_S, answer_s))
        return client

    set_client_factory(with_timeouts)


def timed_out(e: BaseException, answer_s: float = ANSWER_S) -> str | None:
    """What a request that timed out (`network_timeouts`) waited for, in words; None for another error."""
    while e is not None:
        name = type(e).__name__
        if name == "ConnectTimeout":
            return f"no connection within {min(CONNECT_S, answer_s):g} s"
        if name.endswith("Timeout") or isinstance(e, TimeoutError):
            return f"no answer within {answer_s:g} s (the endpoint took the request and did not answer)"
        e = e.__cause__ or e.__context__
    return None


network_timeouts()


def is_hub_id(s: str) -> bool:
    """`name` or `org/name` that is not an existing local path and does not end like a data file."""
    if os.path.exists(s) or s.lower().endswith(DATA_SUFFIXES):
        return False
    try:
        validate_repo_id(s)
    except HFValidationError:
        return False
    return True


def resolve_model(path: str, revision: str | None = None) -> str:
    """The local folder of `model.path`: a local Hugging Face folder as given, or a Hub id's snapshot
    in the cache (`model.revision`: a branch, tag or commit; default `main`)."""
    return _resolve_model(path, revision, constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE)


@functools.lru_cache(maxsize=8)  # the tokenizer and the model resolve the same path: ask the Hub once
def _resolve_model(path: str, revision: str | None, cache: str, offline: bool) -> str:
    if not is_hub_id(path):
        p = Path(path).expanduser()
        if not p.is_dir():
            raise ToolkitError(f"model.path: folder not found: {path}")
        if not (p / "config.json").is_file():
            raise ToolkitError(f"model.path: {path} has no config.json; expected a Hugging Face model folder")
        if revision is not None:
            raise ToolkitError(f"model.revision: {revision!r} is for a Hub id; model.path {path} is a local folder")
        return str(p)
    folder, hub_error = None, None
    if not offline:
        try:
            folder = _download_model(path, revision, cache)
        except TrainingStopped:
            raise
        except Exception as e:  # Hub unreachable, private or missing: the cache may still hold it
            hub_error = e
    folder = folder or _cached_snapshot(path, revision, "model", "model.path", "model.revision", cache, hub_error)
    if not (Path(folder) / "config.json").is_file():
        raise ToolkitError(f"model.path: the snapshot of Hub model {path!r} has no config.json ({folder})")
    return folder


def load_hub_dataset(repo_id: str, split: str, revision: str | None, key: str):
    """Load one split of a Hub dataset, from the cache when offline. Errors name `key`.

    `datasets.load_dataset(repo_id)` offline only finds datasets it has already converted to Arrow
    (its own HF_DATASETS_CACHE), never the raw files in the Hub cache; so a cached snapshot is loaded
    as the local folder it is (its README's configs and data/ layout are read the same way)."""
    import datasets
    from datasets.exceptions import DatasetsError

    hub_error = None
    if not datasets.config.HF_HUB_OFFLINE:  # HF_HUB_OFFLINE, or HF_DATASETS_OFFLINE where set
        try:
            HfApi().dataset_info(repo_id, revision=revision)  # fails fast; load_dataset retries for half a minute
            return datasets.load_dataset(repo_id, split=split, revision=revision)
        except TrainingStopped:
            raise
        except Exception as e:  # Hub unreachable, private or missing: the cache may still hold it
            hub_error = e
    folder = _cached_snapshot(repo_id, revision, "dataset", key, key, constants.HF_HUB_CACHE, hub_error)
    try:
        return datasets.load_dataset(folder, split=split)
    except (OSError, ValueError, DatasetsError) as e:
        raise ToolkitError(f"{key}: cannot load split {split!r} of Hub dataset {repo_id!r} ({folder}): "
                           f"{_first_line(e)}") from None


def _download_model(repo_id: str, revision: str | None, cache: str) -> str:
    """snapshot_download, skipping weights a PyTorch model never reads (other frameworks' formats,
    and .bin/.pt copies where safetensors exist: many repos ship both)."""
    files = [f.rfilename for f in HfApi().model_info(repo_id, revision=revision).siblings or []]
    ignore = OTHER_FORMATS + (["*.bin", "*.pt", "*.pth"] if any(f.endswith(".safetensors") for f in files) else [])
    return snapshot_download(repo_id, revision=revision, cache_dir=cache, ignore_patterns=ignore)


def _cached_snapshot(repo_id: str, revision: str | None, repo_type: str, key: str, revision_key: str, cache: str,
                     hub_error: Exception | None) -> str:
    """The cached snapshot folder of `repo_id` at `revision`, or a one-line ToolkitError saying why
    not: offline (no `hub_error`) or the Hub's answer, the cache, and the revisions it does hold."""
    incomplete = None
    try:
        return snapshot_download(repo_id, repo_type=repo_type, revision=revision, cache_dir=cache,
                                 local_files_only=True)
    except IncompleteSnapshotError as e:
        # transformers downloads only the files it needs but caches the whole repo's listing; a model
        # folder is checked by from_pretrained itself. Missing data files would silently drop rows.
        if repo_type == "model":
            return e.snapshot_path
        incomplete = e
    except (OSError, ValueError):
        pass
    why = "HF_HUB_OFFLINE=1" if hub_error is None else f"Hub: {_first_line(hub_error)}"
    if incomplete is not None:
        raise ToolkitError(f"{key}: the cached snapshot of Hub {repo_type} {repo_id!r} misses files "
                           f"({_first_line(incomplete)}; {why})")
    refs = _cached_revisions(Path(cache) / f"{repo_type}s--{repo_id.replace('/', '--')}")
    if not refs and not isinstance(hub_error, RevisionNotFoundError):
        what = "a local folder nor a Hub model" if repo_type == "model" else "a local file nor a Hub dataset"
        raise ToolkitError(f"{key}: {repo_id!r} is neither {what} in the cache ({why}; cache: {cache})")
    wanted = revision_key if revision is not None else key
    raise ToolkitError(f"{wanted}: revision {revision or 'main'!r} of Hub {repo_type} {repo_id!r} is not in the "
                       f"cache (cached: {', '.join(refs) or 'nothing'}; {why}; cache: {cache})")


def _cached_revisions(repo_folder: Path) -> list[str]:
    """Branch and tag names under refs/ whose snapshot is present, else the snapshots' commit hashes."""
    snapshots = repo_folder / "snapshots"
    refs = sorted(str(f.relative_to(repo_folder / "refs")) for f in (repo_folder / "refs").rglob("*") if f.is_file()
                  and (snapshots / f.read_text().strip()).is_dir())
    return refs or sorted(d.name for d in snapshots.glob("*") if d.is_dir())


def _first_line(e: BaseException) -> str:
    if isinstance(e, LocalEntryNotFoundError) and e.__cause__ is not None:
        e = e.__cause__  # the network error, not huggingface_hub's wrapper around it
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
