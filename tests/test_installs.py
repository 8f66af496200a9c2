"""Installs are what was tested: `make setup` installs with constraints.txt, the exact versions CI
last passed with, so a fresh machine does not pick up a release nobody ran the suite on."""

import re
from importlib import metadata

import tomllib

from helpers import ROOT


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> dict[str, str]:
    found = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not NAME==VERSION"
            found[normalized(name)] = version
    return found


def test_every_requirement_is_pinned():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    names = {normalized(re.match(r"[A-Za-z0-9_.-]+", r).group()) for r in wanted} - {"torch"}
    assert names - pins().keys() == set(), "pin these in constraints.txt (make constraints)"
    assert "torch" not in pins(), "torch is pinned by the Makefile's TORCH_VERSION, not constraints.txt"


def test_this_environment_has_the_pinned_versions():
    """CI builds .venv from constraints.txt; a mismatch here means the suite ran on other versions."""
    differ = {}
    for name, version in pins().items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue  # an optional package this environment has not installed
        if installed != version:
            differ[name] = (installed, version)
    assert differ == {}, f"installed vs constraints.txt: {differ}; run `make setup` in a fresh .venv"
