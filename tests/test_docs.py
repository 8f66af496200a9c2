"""The README and docs/ say what is there: the README stays a front door (under 200 lines) that names
every verb, and its exit-code table is the one in toolkit/errors.py; in README.md and docs/*.md every
`make X` is a Makefile target, every relative link (and its #anchor) leads somewhere, and every
`import toolkit...` / `from toolkit... import ...` line in a code block imports.
Each check is a helper run on the real files and on a bad example, so it can fail. Starts no process."""

import argparse
import re
from pathlib import Path

import pytest

from helpers import ROOT

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)


def prose(text: str) -> str:
    """The text without its fenced code blocks."""
    return FENCE.sub("", text)


def code_blocks(text: str) -> list[str]:
    return [m.group(0) for m in FENCE.finditer(text)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_\[\]]|\]\([^)]*\)", "", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose(text), re.M)}


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """Relative links of a markdown page whose file (or #anchor in a markdown file) does not exist."""
    text = page.read_text()
    broken = []
    for target in re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose(text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or root.resolve() not in (file, *file.parents):
            broken.append(f"{page.name}: {target}: no such file in the repository")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(f"{page.name}: {target}: no heading #{anchor} in {file.name}")
    return broken


def import_lines(text: str) -> list[str]:
    """The `import toolkit...` and `from toolkit... import ...` statements in a page's code blocks
    (a parenthesised import may run over several lines)."""
    found = []
    for block in code_blocks(text):
        lines = block.splitlines()
        i = 0
        while i < len(lines):
            line = lines[i].strip()
            if re.match(r"(from\s+toolkit(\.\w+)*\s+import\s|import\s+toolkit\b)", line):
                statement = line
                while statement.count("(") > statement.count(")") and i + 1 < len(lines):
                    i += 1
                    statement += " " + lines[i].strip()
                found.append(statement)
            i += 1
    return found


def failed_imports(statements: list[str]) -> list[str]:
    failed = []
    for statement in statements:
        try:
            exec(compile(statement, "<docs>", "exec"), {})
        except Exception as e:  # noqa: BLE001 - any failure is the finding
            failed.append(f"{statement}: {type(e).__name__}: {e}")
    return failed


def make_targets_named(text: str) -> set[str]:
    """`make X` where it is a command: in a code span or a code block."""
    code = "\n".join(code_blocks(text) + re.findall(r"`([^`]+)`", prose(text)))
    return set(re.findall(r"(?:^|[\s;(])make[ \t]+([A-Za-z][\w-]*)", code, re.M))


def makefile_targets(makefile: str) -> set[str]:
    targets = set()
    for m in re.finditer(r"^([A-Za-z][\w\- ]*?)\s*:(?!=)", makefile, re.M):
        targets.update(m.group(1).split())
    return targets


def verb_phrases() -> list[str]:
    """`toolkit train`, `toolkit config show`, and each verb of toolkit.cli.VERBS as typed (a verb whose
    first argument is a fixed action, as `checkpoint convert`, with that action)."""
    from toolkit.cli import VERBS, verb_module

    phrases = ["toolkit train", "toolkit config show"]
    for name in VERBS:
        parser = argparse.ArgumentParser()
        verb_module(name).add_arguments(parser)
        first = next((a for a in parser._actions if not a.option_strings), None)
        action = f" {first.choices[0]}" if first is not None and first.choices else ""
        phrases.append(f"toolkit {name}{action}")
    return phrases


def exit_table_codes(text: str) -> set[int]:
    """The codes in the first column of the table under the README's `## Exit codes` heading
    (`128 + N` stands for the signal base, 128)."""
    section = re.search(r"^## Exit codes\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, "the README has no `## Exit codes` section"
    codes = set()
    for m in re.finditer(r"^\|\s*(\d+)(\s*\+\s*N)?\s*\|", section.group(1), re.M):
        codes.add(int(m.group(1)))
    return codes


# ----------------------------------------------------------------------------- the real files


def test_the_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) < 200, f"README.md has {len(lines)} lines; move reference text to docs/"


def test_the_readme_names_every_verb():
    text = README.read_text()
    missing = [p for p in verb_phrases() if p not in text]
    assert missing == [], f"README.md does not name {missing}"


def test_every_relative_link_leads_somewhere():
    assert [b for page in PAGES for b in broken_links(page)] == []


def test_every_import_in_a_code_block_imports():
    statements = {s: page.name for page in PAGES for s in import_lines(page.read_text())}
    assert statements, "no `import toolkit` line found in any code block (the check would check nothing)"
    failed = failed_imports(list(statements))
    assert failed == [], "\n".join(failed)


def test_every_make_target_named_exists():
    assert {"train", "test"} <= make_targets_named(README.read_text())
    targets = makefile_targets((ROOT / "Makefile").read_text())
    missing = {f"{page.name}: make {t}" for page in PAGES for t in make_targets_named(page.read_text()) - targets}
    assert missing == set(), f"make targets the Makefile lacks: {sorted(missing)}"


def test_the_readme_exit_codes_are_the_table_in_errors():
    from toolkit.errors import EXIT_CODES

    assert exit_table_codes(README.read_text()) == set(EXIT_CODES)


# ----------------------------------------------------------------------------- the checks can fail


def test_a_broken_link_and_a_missing_anchor_are_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## Exit codes\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n[ok](other.md) [ok](other.md#exit-codes) [ok](#page) [web](https://example.com)\n"
                    "[gone](missing.md) [bad](other.md#no-such-heading)\n\n```\n[in code](ignored.md)\n```\n")
    assert broken_links(page, root=tmp_path) == ["page.md: missing.md: no such file in the repository",
                                                 "page.md: other.md#no-such-heading: no heading #no-such-heading "
                                                 "in other.md"]


def test_a_link_out_of_the_repository_is_broken(tmp_path):
    (tmp_path / "outside.md").write_text("x")
    (tmp_path / "repo").mkdir()
    page = tmp_path / "repo" / "page.md"
    page.write_text("[out](../outside.md)\n")
    assert broken_links(page, root=tmp_path / "repo") == ["page.md: ../outside.md: no such file in the repository"]


def test_a_wrong_import_in_a_code_block_fails():
    text = ("Prose: from toolkit.nowhere import x is not code.\n\n```python\n"
            "from toolkit.model.inference import (load_for_inference,\n    generate_answers)\n"
            "from toolkit.generate import generate_answers\nimport toolkit.no_such_module\n```\n")
    statements = import_lines(text)
    assert statements == ["from toolkit.model.inference import (load_for_inference, generate_answers)",
                          "from toolkit.generate import generate_answers", "import toolkit.no_such_module"]
    failed = failed_imports(statements)
    assert [f.split(":")[0] for f in failed] == statements[1:]


def test_a_make_target_the_makefile_lacks_is_found():
    makefile = ".PHONY: setup train\nsetup: $(STAMP)\n\tpip install\ntrain test: setup\nVAR := 1\n"
    assert makefile_targets(makefile) == {"setup", "train", "test"}
    text = "Run `make train`, then\n\n```bash\nmake bench   # no such target\n```\nto make it fast.\n"
    assert make_targets_named(text) == {"train", "bench"}
    assert make_targets_named(text) - makefile_targets(makefile) == {"bench"}


def test_an_exit_table_row_is_read_as_its_code():
    text = ("## Exit codes\n\n| exit code | meaning |\n|---|---|\n| 0 | ok |\n| 75 | preempted |\n"
            "| 128 + N | abort |\n\n## Next\n| 9 | x |\n")
    assert exit_table_codes(text) == {0, 75, 128}


@pytest.mark.parametrize("heading, anchor", [
    ("Exit codes", "exit-codes"),
    ("Stopping, preemption and exit codes", "stopping-preemption-and-exit-codes"),
    ("`toolkit estimate`: which strategy fits", "toolkit-estimate-which-strategy-fits")])
def test_headings_get_github_anchors(heading, anchor):
    assert slug(heading) == anchor


# ----------------------------------------------------------------------------- commands as they run after `make setup`
# `make setup` installs into .venv/ and activates nothing: `toolkit ...` copied from the README, and
# the quickstart's closing `python -m toolkit generate ...`, failed with "command not found" or the
# system python. The convention: a command line shown to the user names the program as
# `.venv/bin/PROGRAM`; the README says once how to activate instead; in prose `toolkit eval` names a
# verb and `accelerate launch` the launcher.

VENV_PROGRAMS = ("toolkit", "accelerate", "python", "python3", "pytest", "hf", "huggingface-cli", "ruff", "pip")
RECIPES = sorted((ROOT / "examples" / "recipes").rglob("*.yaml"))


def programs_run(line: str) -> list[str]:
    """The program of each command in a shell line: the first word, after `|` or `&&`, past any
    leading VAR=value (a comment line, or what follows ` #`, runs nothing)."""
    code = "" if line.lstrip().startswith("#") else re.split(r"\s#", line)[0]
    programs = []
    for part in re.split(r"\s\|\|?\s|\s&&\s", code):
        words = part.split()
        while words and re.match(r"[A-Za-z_]\w*=", words[0]):
            words.pop(0)
        programs += words[:1]
    return programs


def bare_commands(text: str) -> list[str]:
    """Command lines of a markdown page that run a program .venv/bin/ holds by its bare name: every
    line of a shell or plain code block, and the code spans of the prose that are command lines (a
    span starting with python, pytest, pip, hf)."""
    bare = []
    for block in code_blocks(text):
        if re.match(r"(```|~~~)(python|yaml|json)\b", block):
            continue
        bare += [line.strip() for line in block.splitlines()[1:-1]
                 if any(p in VENV_PROGRAMS for p in programs_run(line))]
    for span in re.findall(r"`([^`]+)`", prose(text)):
        if span.split()[:1] and span.split()[0] in ("python", "python3", "pytest", "pip", "hf", "huggingface-cli"):
            bare.append(span)
    return bare


def bare_commands_in_recipe(text: str) -> list[str]:
    """The same in a recipe's comments: `# launch: COMMAND`, an indented `#   COMMAND` line, and the
    code spans of the other comment lines."""
    bare = []
    for line in text.splitlines():
        if not line.startswith("#"):
            continue
        command = re.match(r"#\s*launch:\s(.*)|#\s{3,}(\S.*)", line)
        if command and any(p in VENV_PROGRAMS for p in programs_run(command.group(1) or command.group(2))):
            bare.append(line)
        bare += [f"{line}: `{span}`" for span in re.findall(r"`([^`]+)`", line)
                 if span.split()[:1] and span.split()[0] in VENV_PROGRAMS and len(span.split()) > 2]
    return bare


def test_every_command_shown_names_the_venv():
    assert "source .venv/bin/activate" in prose(README.read_text())
    bare = [f"{page.name}: {c}" for page in PAGES if page.name != "recipe-keys.md"
            for c in bare_commands(page.read_text())]
    bare += [f"{path.relative_to(ROOT)}: {c}" for path in RECIPES for c in bare_commands_in_recipe(path.read_text())]
    assert bare == [], "write these as .venv/bin/PROGRAM ...:\n" + "\n".join(bare)


def test_a_bare_command_is_found():
    text = ("Run `toolkit eval` (a verb named) under `accelerate launch`, or `python -m pytest tests`.\n\n"
            "```bash\n.venv/bin/toolkit train r.yaml   # fine\ntoolkit train r.yaml\n"
            "echo hi | toolkit generate m\nX=1 accelerate launch -m toolkit train r.yaml\n"
            "# toolkit in a comment\n.venv/bin/toolkit eval m --format alpaca|text\n```\n\n"
            "```python\nimport toolkit\n```\n\n```\nrecommendation: DDP; toolkit estimate says so\n```\n")
    assert bare_commands(text) == ["toolkit train r.yaml", "echo hi | toolkit generate m",
                                   "X=1 accelerate launch -m toolkit train r.yaml", "python -m pytest tests"]
    recipe = ("# launch: accelerate launch --config_file a.yaml -m toolkit train r.yaml\n"
              "# launch: .venv/bin/accelerate launch --config_file a.yaml -m toolkit train r.yaml\n"
              "#   toolkit config show r.yaml\n# by `toolkit estimate`; from `hf download org/model --local-dir x`\n"
              "seed: 1  # `toolkit train r.yaml x=1` is not a comment line\n")
    assert bare_commands_in_recipe(recipe) == [
        "# launch: accelerate launch --config_file a.yaml -m toolkit train r.yaml", "#   toolkit config show r.yaml",
        "# by `toolkit estimate`; from `hf download org/model --local-dir x`: `hf download org/model --local-dir x`"]


def test_the_quickstart_hint_names_the_venv(tmp_path, monkeypatch):
    """`make train` ends with a `toolkit generate` command to try: .venv/bin/toolkit from where it
    runs (it printed `python -m toolkit generate ...`, which the system python cannot run), or plain
    `toolkit` where that is the venv's own on PATH (activated)."""
    import importlib.util
    import stat
    import sys

    spec = importlib.util.spec_from_file_location("quickstart", ROOT / "examples" / "quickstart.py")
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "toolkit"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(stat.S_IRWXU)
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "elsewhere"))
    out = Path("runs/quickstart-full")
    assert quickstart.ask_yourself(out, "Last letter. plum", chat=True) == \
        ".venv/bin/toolkit generate runs/quickstart-full/final --prompt 'Last letter. plum'"
    assert quickstart.ask_yourself(out, "it's", chat=False) == \
        ".venv/bin/toolkit generate runs/quickstart-full/final --prompt 'it'\"'\"'s' --no-chat-template"
    monkeypatch.setenv("PATH", str(bin_dir))
    assert quickstart.ask_yourself(out, "x", chat=True) == "toolkit generate runs/quickstart-full/final --prompt x"


def recipe_commands(text: str) -> list[list[str]]:
    """`toolkit train R ...` and `toolkit config show R ...` command lines shown in a page's shell blocks
    or a recipe's `# launch:` and `#   ` comment lines, as argument lists from the recipe on, where
    R is a file of the repository (placeholders such as RECIPE.yaml are left out)."""
    import shlex

    lines = [line for block in code_blocks(text) if not re.match(r"(```|~~~)(python|yaml|json)\b", block)
             for line in block.splitlines()[1:-1]]
    lines += [m.group(1) or m.group(2) for m in re.finditer(r"^#\s*launch:\s(.*)$|^#\s{3,}(\S.*)$", text, re.M)]
    found = []
    for line in lines:
        try:
            words = shlex.split(line.split(" #")[0])
        except ValueError:  # a quote in prose
            continue
        for i, w in enumerate(words):
            rest = words[i + 1:]
            if w.endswith("toolkit") and rest[:1] == ["train"]:
                args = rest[1:]
            elif w.endswith("toolkit") and rest[:2] == ["config", "show"]:
                args = rest[2:]
            else:
                continue
            if args and (ROOT / args[0]).is_file():
                found.append(args)
    return found


def test_every_train_and_config_show_command_shown_loads_as_written(monkeypatch):
    """Issue 53: the recipe and key=value overrides of each `toolkit train` / `toolkit config show` command
    in the README, docs/ and the recipes' own comments load as written (the path relative to the
    repository root, where the docs run them), and each --accelerate-config file named exists."""
    from toolkit.config import load_recipe

    monkeypatch.chdir(ROOT)
    commands = [(page.name, c) for page in PAGES + RECIPES for c in recipe_commands(page.read_text())]
    assert len(commands) > 30, commands
    for where, args in commands:
        overrides = [a for a in args[1:] if "=" in a and not a.startswith("-")]
        load_recipe(args[0], overrides)
        for flag, value in zip(args, args[1:]):
            if flag in ("--accelerate-config", "--config_file"):
                assert (ROOT / value).is_file(), (where, args)


def test_a_command_with_a_wrong_override_is_found():
    from toolkit.config import ConfigError, load_recipe

    text = ("```bash\n.venv/bin/toolkit train examples/recipes/quickstart_full.yaml train.lr=1 # note\n"
            ".venv/bin/toolkit train RECIPE.yaml x=1\n```\n")
    assert recipe_commands(text) == [["examples/recipes/quickstart_full.yaml", "train.lr=1"]]
    with pytest.raises(ConfigError, match="train.lr: unknown key"):
        load_recipe(ROOT / "examples/recipes/quickstart_full.yaml", ["train.lr=1"])
