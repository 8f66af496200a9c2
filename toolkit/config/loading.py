"""Loading a recipe: the YAML read, `a.b=value` overrides applied, each value coerced to its key's type
and the dataclasses built, then validated (`validate.py`); every mistake a ConfigError naming the file
(or the command line) and the dotted key, with the near miss or a peer toolkit's name suggested."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from ..errors import ConfigError
from . import trl_config
from .recipe import Recipe
from .validate import validate


def load_recipe(path: str | Path, overrides: list[str] = (), trl: str | None = None) -> Recipe:
    """Read a YAML recipe (or a TRL config: trl_config.py; `trl`: which trainer's, when its fields do not say),
    apply `a.b=value` overrides, build and validate the dataclasses."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(source, "", "recipe file not found") from None
    except UnicodeDecodeError as e:
        raise ConfigError(source, "", f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                                      "save the recipe as UTF-8") from None
    except IsADirectoryError:
        raise ConfigError(source, "", "is a folder, not a recipe file") from None
    except OSError as e:
        raise ConfigError(source, "", f"cannot read recipe: {e.strerror}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark else ""
        raise ConfigError(source, "", f"{where}invalid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(data, dict):
        raise ConfigError(source, "", "a recipe must be a mapping of keys to values")
    if trl is not None or trl_config.is_trl_config(data):
        data, notes = trl_config.from_trl(data, source, trl)
        if os.environ.get("RANK", "0") == "0":
            print("\n".join(f"note: {line}" for line in notes), file=sys.stderr)
    given = {}  # key -> the override that set it: a mistake there is the command line's, not the file's
    for item in overrides:
        _apply_override(data, item)
        given[item.partition("=")[0]] = item
    _one_model_source(data, given, source)
    try:
        recipe = _build(Recipe, data, "", source)
        validate(recipe, source)
    except ConfigError as e:
        if e.key not in given:
            raise
        raise ConfigError(f"command line ({given[e.key]})", e.key, e.message) from None
    return recipe


def _one_model_source(data: dict, given: dict, source: str) -> None:
    """`model.path=...` on the command line replaces the file's model.preset (and `model.preset=...` its
    model.path), with a note: the recipes' comments say "point model.path at your model"."""
    model = data.get("model")
    if not isinstance(model, dict):
        return
    for chosen, other in (("path", "preset"), ("preset", "path")):
        if f"model.{chosen}" in given and model.get(chosen) is not None and f"model.{other}" not in given \
                and model.get(other) is not None:
            dropped = model.pop(other)
            if os.environ.get("RANK", "0") == "0":
                print(f"note: model.{chosen} from the command line replaces {source}'s model.{other} ({dropped})",
                      file=sys.stderr)


def _apply_override(data: dict, item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ConfigError("command line", item, "overrides take the form key=value, e.g. train.max_steps=20")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError("command line", key, f"'{part}' is not a section")
    node[parts[-1]] = value


def _build(cls, data: Any, prefix: str, source: str):
    if not isinstance(data, dict):
        raise ConfigError(source, prefix.rstrip("."), f"expected a section (mapping), got {_kind(data)}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise ConfigError(source, prefix + str(key),
                              f"unknown key{_suggest(str(key), names)} (known here: {', '.join(sorted(names))})")
    kwargs = {}
    for name in names:
        if name not in data:
            continue
        key, hint = prefix + name, hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, data[name], key + ".", source)
        else:
            kwargs[name] = _coerce(data[name], hint, key, source)
    return cls(**kwargs)


# What peers (peft, TRL, the HF Trainer, axolotl) call a key that has another name here.
PEER_NAMES = {"rank": "r", "lora_r": "r", "lora_alpha": "alpha", "lora_dropout": "dropout", "lr": "learning_rate",
              "num_train_epochs": "epochs", "per_device_train_batch_size": "micro_batch_size",
              "batch_size": "micro_batch_size", "max_length": "max_seq_len", "sequence_len": "max_seq_len"}


def _suggest(key: str, names: set[str]) -> str:
    """`; did you mean max_steps?` for a near miss here or a peer's name for a key here (`rank` for
    `r`), or the dotted key of a section that has it."""
    import difflib

    if PEER_NAMES.get(key) in names:
        return f"; did you mean {PEER_NAMES[key]}?"
    close = difflib.get_close_matches(key, sorted(names), n=1, cutoff=0.75)
    if close:
        return f"; did you mean {close[0]}?"
    sections = {name: hint for name, hint in typing.get_type_hints(Recipe).items() if dataclasses.is_dataclass(hint)}
    elsewhere = [f"{name}.{key}" for name, hint in sections.items()
                 if key in {f.name for f in dataclasses.fields(hint)}]
    return f"; did you mean {elsewhere[0]}?" if elsewhere and key not in names else ""


def _coerce(value: Any, hint: Any, key: str, source: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key + ".", source)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        choices = [a for a in args if a is not type(None)]
        if len(choices) == 1:  # Optional[X]: X's own message
            return _coerce(value, choices[0], key, source)
        sections = [a for a in args if dataclasses.is_dataclass(a)]
        if isinstance(value, dict) and sections:
            return _build(sections[0], value, key + ".", source)
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key, source)
            except ConfigError as e:
                errors.append(e)
        raise ConfigError(source, key, f"expected {_describe(hint)}, got {_kind(value)} {value!r}")
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(source, key, f"must be one of {', '.join(map(str, args))}; got {value!r}")
    if origin is list:
        if isinstance(value, str) and (args[0] is str or str in typing.get_args(args[0])):
            return [value]  # a single path or name is a list of one
        if not isinstance(value, list):
            raise ConfigError(source, key, f"expected a list, got {_kind(value)}")
        return [_coerce(v, args[0], f"{key}[{i}]", source) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(source, key, f"expected {_describe(hint)}, got {_kind(value)} {value!r}")
        return {_coerce(k, args[0], key, source): _coerce(v, args[1], f"{key}.{k}", source) for k, v in value.items()}
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads 2e-4 as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):
                raise ConfigError(source, key, f"must be a finite number, got {value!r}")
            return number
    elif hint is str:
        if isinstance(value, str):
            return value
    raise ConfigError(source, key, f"expected {_describe(hint)}, got {_kind(value)} {value!r}")


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in args if a is not type(None))
    if origin is list:
        return f"a list of {_describe(args[0])}"
    if origin is dict:
        return f"a mapping of {_describe(args[0])} to {_describe(args[1])}"
    if dataclasses.is_dataclass(hint):
        return "a mapping"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(hint, str(hint))


def _kind(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "list",
            dict: "mapping", type(None): "nothing"}.get(type(value), type(value).__name__)


def dump_recipe(r: Recipe) -> str:
    return yaml.safe_dump(r.to_dict(), sort_keys=False)
