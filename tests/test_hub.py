"""Models and datasets by Hub id, offline, from a Hugging Face cache written here by hand in the real
layout (`models--org--name/refs/main` holding a commit hash, `snapshots/<hash>/` the files). Nothing
here reaches the network: HF_HUB_OFFLINE=1, and HF_HOME is a temporary folder."""

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from toolkit.errors import ToolkitError
from toolkit.model.hub import is_hub_id, load_hub_dataset, resolve_model

from helpers import (
    alpaca_rows,
    base_recipe,
    read_metrics,
    run_command,
    run_toolkit,
    train_losses,
    user_error_line,
    write_jsonl,
    write_recipe,
)

MAIN, V1 = "a" * 40, "b" * 40  # commit hashes
SEED = 7  # base_recipe's seed: the cached model holds the weights a preset run of this seed starts from


def cache_repo(hub: Path, kind: str, repo_id: str, files: Path, refs: dict[str, str]) -> dict[str, Path]:
    """One cached repo: a snapshot per commit holding a copy of `files`, refs/<name> naming its commit."""
    repo = hub / f"{kind}s--{repo_id.replace('/', '--')}"
    snapshots = {}
    for ref, commit in refs.items():
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
        snapshots[ref] = repo / "snapshots" / commit
        if not snapshots[ref].exists():
            shutil.copytree(files, snapshots[ref])
    return snapshots


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """The tiny preset's initial weights for SEED and the byte tokenizer, saved as a Hub model would be."""
    from accelerate.utils import set_seed

    from toolkit.config import ModelConfig
    from toolkit.model.load import build_byte_tokenizer, build_model

    folder = tmp_path_factory.mktemp("tiny_model")
    set_seed(SEED)
    build_model(ModelConfig(preset="tiny-llama-mini")).save_pretrained(folder)
    build_byte_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture
def hub(tmp_path, tiny_model, monkeypatch):
    """HF_HOME=tmp with org/name (main, tag v1), org/custom (needs remote code) and dataset org/data,
    offline. The environment is for the launches; huggingface_hub and datasets read it at import, so
    their constants are set to the same for the calls made in this process."""
    from datasets import config as datasets_config
    from huggingface_hub import constants

    home = tmp_path / "hf"
    models = cache_repo(home / "hub", "model", "org/name", tiny_model, {"main": MAIN, "v1": V1})
    custom = tmp_path / "custom"
    shutil.copytree(tiny_model, custom)
    config = json.loads((custom / "config.json").read_text())
    config.update(model_type="tiny-custom", auto_map={"AutoConfig": "tiny.TinyConfig",
                                                      "AutoModelForCausalLM": "tiny.TinyForCausalLM"})
    (custom / "config.json").write_text(json.dumps(config))
    (custom / "tiny.py").write_text("raise RuntimeError('remote code ran')\n")
    cache_repo(home / "hub", "model", "org/custom", custom, {"main": MAIN})
    data = tmp_path / "data_repo"
    write_jsonl(data / "data" / "train.jsonl", alpaca_rows(10, seed=5))
    write_jsonl(data / "data" / "test.jsonl", alpaca_rows(3, seed=6))
    datasets = cache_repo(home / "hub", "dataset", "org/data", data, {"main": MAIN})

    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets_config, "HF_DATASETS_CACHE", home / "datasets")
    monkeypatch.setattr(datasets_config, "HF_HUB_OFFLINE", True)
    return SimpleNamespace(home=home, cache=home / "hub", main=models["main"], v1=models["v1"],
                           data=datasets["main"])


# ----------------------------------------------------------------------------- resolve_model


def test_resolve_model_from_the_cache(hub):
    assert resolve_model("org/name", None) == str(hub.main)
    assert resolve_model("org/name", "v1") == str(hub.v1)  # a tag or branch under refs/
    assert resolve_model("org/name", V1) == str(hub.v1)  # a commit hash
    assert resolve_model(str(hub.main), None) == str(hub.main)  # a local folder, as before


@pytest.mark.launch
def test_hf_hub_cache_is_respected(hub, tmp_path):
    """In a fresh process: HF_HUB_CACHE wins over HF_HOME, as in huggingface_hub."""
    code = "from toolkit.model.hub import resolve_model; print(resolve_model('org/name', None))"
    proc = run_command([sys.executable, "-c", code],
                       env={"HF_HOME": str(tmp_path / "elsewhere"), "HF_HUB_CACHE": str(hub.cache)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == str(hub.main)


@pytest.mark.parametrize("path, revision, expected", [
    ("org/missing", None, "model.path: 'org/missing' is neither a local folder nor a Hub model in the cache "
                          "(HF_HUB_OFFLINE=1; cache: {cache})"),
    ("org/name", "v9", "model.revision: revision 'v9' of Hub model 'org/name' is not in the cache "
                       "(cached: main, v1; HF_HUB_OFFLINE=1; cache: {cache})"),
    ("org/name", "c" * 40, "model.revision: revision 'ccc"),
    ("./org/name", None, "model.path: folder not found: ./org/name"),
    ("/no/such/folder", None, "model.path: folder not found: /no/such/folder"),
    ("a/b/c", None, "model.path: folder not found: a/b/c"),
])
def test_resolve_model_errors_name_the_key(hub, path, revision, expected):
    with pytest.raises(ToolkitError) as e:
        resolve_model(path, revision)
    assert str(e.value).startswith(expected.format(cache=hub.cache)), str(e.value)
    assert "\n" not in str(e.value)


def test_a_partly_downloaded_model_resolves(hub):
    """transformers downloads only the files it needs, but huggingface_hub caches the repo's whole
    listing (trees/<commit>.json); offline, that snapshot reads as incomplete. A model folder still
    resolves (from_pretrained checks what it needs); a dataset missing files is refused."""
    for kind, repo_id in (("models", "org--name"), ("datasets", "org--data")):
        listing = {"format_version": 1, "files": {"pytorch_model.bin": {"size": 1, "blob_id": "0" * 40}}}
        (hub.cache / f"{kind}--{repo_id}" / "trees").mkdir()
        (hub.cache / f"{kind}--{repo_id}" / "trees" / f"{MAIN}.json").write_text(json.dumps(listing))
    assert resolve_model("org/name", None) == str(hub.main)
    with pytest.raises(ToolkitError, match=r"^data.train_files: the cached snapshot of Hub dataset 'org/data' misses "
                                           r"files \(IncompleteSnapshotError: .*pytorch_model.bin"):
        load_hub_dataset("org/data", "train", None, "data.train_files")


def test_every_request_to_the_hub_has_a_timeout():
    """Issue 69.5: huggingface_hub's client waits forever by default, so a Hub endpoint that takes the connection
    and never answers held a process forever. With the toolkit's hub module imported (every way to the Hub goes
    through it: models, datasets, estimate's config, push), every request of huggingface_hub, and of transformers
    and datasets through it, has a connect and a read timeout; a session made again after a connection error too."""
    import huggingface_hub

    import toolkit.model.hub as hub

    for _ in range(2):
        timeout = huggingface_hub.get_session().timeout
        assert (timeout.connect, timeout.read, timeout.write, timeout.pool) == (hub.CONNECT_S, *[hub.ANSWER_S] * 3)
        huggingface_hub.close_session()


@pytest.mark.launch
def test_an_unreachable_hub_falls_back_to_the_cache(hub):
    """Not offline, but the Hub refuses connections: the cache answers; a repo it lacks is one line."""
    code = ("from toolkit.model.hub import load_hub_dataset, resolve_model\nfrom toolkit.errors import ToolkitError\n"
            "print(resolve_model('org/name', None))\n"
            "print(len(load_hub_dataset('org/data', 'train', None, 'data.train_files')))\n"
            "try:\n    resolve_model('org/missing', None)\nexcept ToolkitError as e:\n    print(e)\n")
    proc = run_command([sys.executable, "-c", code], timeout=120, env={
        "HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    found, rows, error = proc.stdout.strip().splitlines()[-3:]
    assert found == str(hub.main) and rows == "10"
    assert error.startswith("model.path: 'org/missing' is neither a local folder nor a Hub model in the cache "
                            "(Hub: ConnectError: "), error


@pytest.mark.parametrize("files, kept", [
    (["config.json", "model.safetensors", "pytorch_model.bin", "tokenizer.json", "flax_model.msgpack",
      "onnx/model.onnx", "original/consolidated.00.pth"], ["config.json", "model.safetensors", "tokenizer.json"]),
    (["config.json", "pytorch_model.bin"], ["config.json", "pytorch_model.bin"]),  # .bin only: keep it
])
def test_a_download_skips_weights_pytorch_never_reads(monkeypatch, tmp_path, files, kept):
    """Online, the files are listed first (no Hub here: the listing and the download are stand-ins)."""
    from huggingface_hub.utils import filter_repo_objects

    import toolkit.model.hub

    asked = {}
    monkeypatch.setattr(toolkit.model.hub.HfApi, "model_info",
                        lambda self, repo_id, revision=None: SimpleNamespace(siblings=[SimpleNamespace(rfilename=f)
                                                                                       for f in files]))
    monkeypatch.setattr(toolkit.model.hub, "snapshot_download", lambda repo_id, **kw: asked.update(kw) or str(tmp_path))
    toolkit.model.hub._download_model("org/name", "v1", str(tmp_path))
    assert asked["revision"] == "v1"  # the name, not its commit: snapshot_download records refs/v1
    assert list(filter_repo_objects(files, ignore_patterns=asked["ignore_patterns"])) == kept


def test_revision_of_a_local_folder_is_refused(hub):
    with pytest.raises(ToolkitError, match=r"^model.revision: 'v1' is for a Hub id; model.path .* is a local folder$"):
        resolve_model(str(hub.main), "v1")


# ----------------------------------------------------------------------------- through the CLI


@pytest.mark.launch
def test_training_from_a_hub_id(hub, tmp_path):
    """model.path: org/name trains, offline, exactly like the preset whose weights the cache holds."""
    train, evaluation = (write_jsonl(tmp_path / f"{n}.jsonl", alpaca_rows(16, seed=i)) for i, n in enumerate("te"))
    runs = {}
    for name, model in (("hub", {"path": "org/name"}), ("preset", {"preset": "tiny-llama-mini"})):
        recipe = base_recipe(tmp_path, train, evaluation, out=name, model=model, train__max_steps=2,
                             train__warmup_steps=0, train__micro_batch_size=2, train__log_every_steps=1)
        proc = run_toolkit("train", write_recipe(tmp_path / f"{name}.yaml", **recipe))
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = tmp_path / name
    losses = {name: train_losses(run) for name, run in runs.items()}
    assert len(losses["hub"]) == 2
    torch.testing.assert_close(torch.tensor(losses["hub"]), torch.tensor(losses["preset"]), rtol=1e-5, atol=0)
    assert read_metrics(runs["hub"])[0]["eval_loss"] == pytest.approx(read_metrics(runs["preset"])[0]["eval_loss"])
    assert "path: org/name" in (runs["hub"] / "config.yaml").read_text()


@pytest.mark.launch
@pytest.mark.parametrize("model, key", [
    ({"path": "org/missing"}, "model.path: 'org/missing' is neither a local folder nor a Hub model in the cache"),
    ({"path": "org/name", "revision": "v9"}, "model.revision: revision 'v9' of Hub model 'org/name'"),
    ({"path": "org/custom"}, "model.trust_remote_code: org/custom ("),
], ids=["missing", "revision", "remote-code"])
def test_cli_refuses_in_one_line(hub, tmp_path, data_files, model, key):
    recipe = base_recipe(tmp_path, *data_files, model=model)
    line = user_error_line(run_toolkit("train", write_recipe(tmp_path / "r.yaml", **recipe)))
    assert line.startswith(f"error: {key}"), line
    assert "HF_HUB_OFFLINE=1" in line or "set model.trust_remote_code=true" in line, line


@pytest.mark.launch
def test_remote_code_runs_only_when_trusted(hub, tmp_path, data_files):
    """With trust_remote_code=true the model's own Python file is imported (here it raises)."""
    recipe = base_recipe(tmp_path, *data_files, model={"path": "org/custom", "trust_remote_code": True})
    proc = run_toolkit("train", write_recipe(tmp_path / "r.yaml", **recipe))
    assert proc.returncode != 0 and "remote code ran" in proc.stderr, proc.stderr[-3000:]


# ----------------------------------------------------------------------------- datasets


@pytest.mark.launch
def test_load_hub_dataset_offline(hub):
    """In a fresh process (datasets reads HF_HOME at import): both splits of org/data, from the cache."""
    code = ("import json; from toolkit.model.hub import load_hub_dataset\n"
            "print(json.dumps({s: load_hub_dataset('org/data', s, None, 'data.train_files').to_list() "
            "for s in ('train', 'test')}))")
    proc = run_command([sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rows == {"train": alpaca_rows(10, seed=5), "test": alpaca_rows(3, seed=6)}
    assert (hub.home / "datasets").is_dir()  # the Arrow cache went under HF_HOME too


@pytest.mark.parametrize("repo_id, split, revision, expected", [
    ("org/nodata", "train", None, "data.train_files: 'org/nodata' is neither a local file nor a Hub dataset "
                                  "in the cache (HF_HUB_OFFLINE=1; cache: {cache})"),
    ("org/data", "train", "v2", "data.train_files: revision 'v2' of Hub dataset 'org/data' is not in the cache "
                                "(cached: main; HF_HUB_OFFLINE=1"),
    ("org/data", "validation", None, "data.train_files: cannot load split 'validation' of Hub dataset 'org/data'"),
])
def test_load_hub_dataset_errors_name_the_key(hub, repo_id, split, revision, expected):
    with pytest.raises(ToolkitError) as e:
        load_hub_dataset(repo_id, split, revision, "data.train_files")
    assert str(e.value).startswith(expected.format(cache=hub.cache)), str(e.value)
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- is_hub_id


@pytest.mark.parametrize("s, expected", [
    ("org/name", True), ("gpt2", True), ("Org-1/name_2.v3", True),
    ("train.jsonl", False), ("org/data.parquet", False), ("org/data.csv", False), ("data.json", False),
    ("./org/name", False), ("/abs/path", False), ("~/models/x", False), ("a/b/c", False),
    ("org--x/name", False), ("org/na..me", False), ("", False), ("has space/x", False),
])
def test_is_hub_id(s, expected):
    assert is_hub_id(s) is expected


def test_an_existing_path_is_not_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_id("org/name")
