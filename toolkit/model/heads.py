"""What a model folder's head is, read from its config.json and its weights' headers before it loads: a
sequence-classification model (a reward model) or not, and how many labels (rows of its score head) it has.
transformers loads a folder as whatever class it is asked for: a classifier as a causal LM with a random
output layer (a warning only), a head of two rows into a one-label model (a traceback)."""

from __future__ import annotations

import json
from pathlib import Path

HEADS = ("score", "classifier")  # a sequence-classification model's head, by family


def folder_config(folder) -> dict:
    """A folder's config.json; {} where unreadable (loading it then says why, in one line)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def is_scorer(config: dict) -> bool:
    return any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or [])


def config_labels(config: dict) -> int:
    """The labels config.json gives: the most of id2label's entries and num_labels (transformers takes one or
    the other, by version and by which is written), 2 where neither is written (transformers' default)."""
    given = [len(config["id2label"])] if isinstance(config.get("id2label"), dict) and config["id2label"] else []
    given += [config["num_labels"]] if isinstance(config.get("num_labels"), int) else []
    return max(given) if given else 2


def head_rows(folder) -> tuple[str, int] | None:
    """(the tensor, its rows) of the score head in the folder's safetensors weights, from their headers (no
    tensor read); None where there is none to read (other formats: loading them checks)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    try:
        files = ({name: folder / file for name, file in json.loads(index.read_text())["weight_map"].items()}
                 if index.is_file() else None)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if files is None:
        if not (folder / "model.safetensors").is_file():
            return None
        from safetensors import safe_open

        try:
            with safe_open(folder / "model.safetensors", framework="pt") as f:
                files = {name: folder / "model.safetensors" for name in f.keys()}
        except Exception:  # noqa: BLE001 - a broken file: loading it says why
            return None
    names = sorted((n for n in files if n.split(".")[-2:-1] and n.split(".")[-2] in HEADS and n.endswith(".weight")),
                   key=len)
    if not names:
        return None
    from safetensors import safe_open

    try:
        with safe_open(files[names[0]], framework="pt") as f:
            shape = f.get_slice(names[0]).get_shape()
    except Exception:  # noqa: BLE001 - as above
        return None
    return (names[0], shape[0]) if shape else None


def one_label_problem(folder) -> str | None:
    """Why a sequence-classification folder cannot load as a one-label model (a reward model), as what it has
    ("2 labels"), or None: its config.json gives another number of labels, or its weights hold a head of
    another number of rows."""
    labels = config_labels(folder_config(folder))
    if labels != 1:
        return f"{labels} labels"
    found = head_rows(folder)
    if found is not None and found[1] != 1:
        return f"a score head of {found[1]} outputs ({found[0]} in its weights) where its config.json says 1 label"
    return None


# What a load that transformers refused for a tensor of another shape than the config gives says instead of its
# own words ("You set `ignore_mismatched_sizes` to `False`...", its report of which tensors above them).
MISFIT = "its weights do not fit its config.json (a tensor of another shape than the config gives: was it edited?)"


def misfit(e: BaseException) -> bool:
    """Whether a load failed for weights of other shapes than the config gives (transformers' RuntimeError)."""
    return isinstance(e, RuntimeError) and "ignore_mismatched_sizes" in str(e)
