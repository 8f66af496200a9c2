"""The key reference: every recipe key with its type, default and meaning, as Markdown
(docs/recipe-keys.md, written by `make docs`; tests/test_config.py keeps the two in sync)."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

from . import data, model, objectives, recipe, train
from .data import DataSource
from .model import RopeScaling
from .objectives import RewardConfig
from .recipe import Recipe

SCHEMA = (recipe, model, data, train, objectives)  # the modules whose classes' docstrings are the reference


def key_reference() -> str:
    """Every recipe key with its type, default and meaning, as Markdown (docs/recipe-keys.md is this,
    kept in sync by a test). The meanings are the attribute docstrings of the schema's dataclasses."""
    import ast

    nodes = {n.name: n for module in SCHEMA for n in ast.parse(Path(module.__file__).read_text(encoding="utf-8")).body
             if isinstance(n, ast.ClassDef)}

    def docs(cls_name: str) -> dict[str, str]:
        body, found = nodes[cls_name].body, {}
        for node, after in zip(body, body[1:] + [None]):
            if (isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant)):
                found[node.target.id] = " ".join(after.value.value.split())
        return found

    def shown(kind) -> str:
        text = kind.__name__ if isinstance(kind, type) else str(kind).replace("typing.", "")
        return "`" + re.sub(r"toolkit\.config\.(\w+\.)?", "", text).replace("|", "\\|") + "`"

    def default(f: dataclasses.Field) -> str:
        if f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
            return "" if dataclasses.is_dataclass(value) else f"`{value!r}`"
        return f"`{f.default!r}`"

    lines = ["# Recipe keys", "",
             "Generated from the docstrings of `toolkit/config/` by `make docs`; a test keeps it in sync.",
             "Set a key in the recipe YAML or on the command line as a dotted override (`train.max_steps=20`).", ""]

    def table(cls, prefix: str, title: str) -> None:
        meaning = docs(cls.__name__)
        lines.extend([f"## {title}", "", "| key | type | default | meaning |", "|---|---|---|---|"])
        nested = []
        for f in dataclasses.fields(cls):
            kind = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(kind):
                nested.append((kind, f"{prefix}{f.name}.", f"`{f.name}`: {meaning.get(f.name, '')}"))
                continue
            text = meaning.get(f.name, "").replace("|", "\\|")
            lines.append(f"| `{prefix}{f.name}` | {shown(kind)} | {default(f)} | {text} |")
        lines.append("")
        for kind, sub, sub_title in nested:
            table(kind, sub, sub_title)

    table(Recipe, "", "Top level")
    for cls, title, prefix in ((DataSource, "Entries of data.train_files / data.eval_files written as mappings", ""),
                               (RewardConfig, "Entries of rl.rewards written as mappings", ""),
                               (RopeScaling, "`model.rope_scaling`: " + docs_of(RopeScaling), "model.rope_scaling.")):
        lines.extend([f"## {title}", "", "| key | type | default | meaning |", "|---|---|---|---|"])
        meaning = docs(cls.__name__)
        for f in dataclasses.fields(cls):
            text = meaning.get(f.name, "").replace("|", "\\|")
            lines.append(f"| `{prefix}{f.name}` | {shown(typing.get_type_hints(cls)[f.name])} | "
                         f"{default(f)} | {text} |")
        lines.append("")
    return "\n".join(lines[:-1]) + "\n"


def docs_of(cls) -> str:
    return " ".join((cls.__doc__ or "").split())
