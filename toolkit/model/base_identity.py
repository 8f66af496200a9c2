"""What base model an adapter was trained on: `toolkit_base.json` beside `adapter_config.json`
holds the base folder's absolute path and a content fingerprint. `merge`, `generate` and `eval`
refuse a base whose content no longer matches (a folder replaced by another model after training
would otherwise be merged or evaluated silently), wherever the base now lives.

The fingerprint reads config.json whole and, of each weight file, its size, its first MiB (a
safetensors header: every tensor's name, dtype, shape and offsets) and 32 samples of 64 KiB spread
over the file: a replaced or retrained model differs there, and a 140 GB base is read in well under
a second."""

from __future__ import annotations

import hashlib
import inspect
import json
from pathlib import Path

from ..config.methods import method_of
from ..errors import ToolkitError

RECORD = "toolkit_base.json"
WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth")
HEAD, SAMPLES, SAMPLE = 1 << 20, 32, 1 << 16


def fingerprint(folder: str | Path) -> str:
    folder = Path(folder)
    h = hashlib.sha256()
    config = folder / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    files = sorted({f for pattern in WEIGHTS for f in folder.glob(pattern) if f.is_file()})
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(HEAD))
            for k in range(SAMPLES):
                fh.seek(size * k // SAMPLES)
                h.update(fh.read(SAMPLE))
    return h.hexdigest()[:16]


def record(base_folder: str | Path, config: dict | None = None) -> str:
    """The text of `toolkit_base.json` for an adapter trained on `base_folder`; `config`: what the
    run changed in the base's config (`model.config_overrides`: RoPE scaling, maximum positions),
    which every verb that loads the adapter applies to the base."""
    base = Path(base_folder).resolve()
    return json.dumps({"path": str(base), "fingerprint": fingerprint(base), **({"config": config} if config else {})},
                      indent=1) + "\n"


def config_overrides(adapter: str | Path) -> dict:
    """The base config changes the adapter's run made (`record`'s `config`), or {}."""
    path = Path(adapter) / RECORD
    try:
        recorded = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}  # `check` names an unreadable record
    return recorded.get("config") or {} if isinstance(recorded, dict) else {}


def check(adapter: str | Path, base_folder: str | Path, verb: str,
          remedy: str = "put the original base back at that path, or train the adapter again") -> None:
    """Refuse `base_folder` for `adapter` when the adapter recorded another base's content. An
    adapter without a record (trained elsewhere, or by an older toolkit) is not checked."""
    path = Path(adapter) / RECORD
    if not path.is_file():
        return
    try:
        recorded = json.loads(path.read_text())
        want = recorded["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ToolkitError(f"{verb}: {path} cannot be read; it should record the adapter's base model") from None
    have = fingerprint(base_folder)
    if have != want:
        raise ToolkitError(f"{verb}: the base model {base_folder} is not the one {adapter} was trained on "
                           f"({recorded.get('path')}; content fingerprint {want} there, {have} here): it was replaced "
                           f"or changed since: {remedy}")


def identities(recipe, rewards: list = (), tools: list = ()) -> dict[str, str]:
    """{input: content fingerprint} of what a run learns from besides its data (storage/inputs.py compares
    them on resume): `model`, the base folder's `fingerprint` (and its Python code under trust_remote_code);
    `rewards`, the source files of rl.rewards' functions, by function name, not path; `reward_models`, the
    reward models' folders by content (weights, config, tokenizer files); `teacher`, rl.teacher's folder by
    content (distillation); `tools`, the source files of rl.tools' functions, by name. A preset model is its
    name and seed, already in the recipe; built-in rewards are the toolkit's."""
    from ..config import BUILT_IN_REWARDS
    from .hub import resolve_model

    out = {}
    m = recipe.model
    if m.preset is None and m.path:
        folder = Path(resolve_model(m.path, m.revision))
        h = hashlib.sha256(fingerprint(folder).encode())
        for f in sorted(folder.glob("*.py")) if m.trust_remote_code else []:
            h.update(f.name.encode() + f.read_bytes())
        out["model"] = h.hexdigest()[:16]
    code = sorted({(r.name.rpartition(":")[2], Path(f).read_bytes()) for r in rewards  # not paths: files may move
                   if r.name not in BUILT_IN_REWARDS and (f := _source_file(r.function)) is not None})
    if code:
        out["rewards"] = hashlib.sha256(b"".join(name.encode() + source for name, source in code)).hexdigest()[:16]
    tool_code = sorted({(t.name, Path(f).read_bytes()) for t in tools if (f := _source_file(t.function)) is not None})
    if tool_code:
        out["tools"] = hashlib.sha256(b"".join(name.encode() + source for name, source in tool_code)).hexdigest()[:16]
    models = [fingerprint(folder) + _tokenizer_files(folder)  # its tokenizer and template change its scores too
              for r in rewards if (folder := getattr(r.function, "folder", None)) is not None]
    if models:  # a reward model (training/reward_model.py) by its weights
        out["reward_models"] = hashlib.sha256("".join(models).encode()).hexdigest()[:16]
    if method_of(recipe).teacher and recipe.rl.teacher:
        out["teacher"] = hashlib.sha256(fingerprint(Path(resolve_model(recipe.rl.teacher))).encode()).hexdigest()[:16]
    return out


def _tokenizer_files(folder: Path) -> str:
    h = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "tokenizer.model", "vocab.json", "merges.txt"):
        f = Path(folder) / name
        h.update(name.encode() + (f.read_bytes() if f.is_file() else b""))
    return h.hexdigest()


def _source_file(function) -> str | None:
    try:
        f = inspect.getsourcefile(function)
    except TypeError:  # a built-in or C function
        return None
    return f if f and Path(f).is_file() else None
