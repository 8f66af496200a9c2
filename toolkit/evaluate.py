"""`toolkit eval`: not written yet."""

from __future__ import annotations

from .config import ToolkitError


def add_arguments(p) -> None:
    pass


def run(args) -> int:
    raise ToolkitError("toolkit eval: not implemented yet")
