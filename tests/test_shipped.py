"""Everything the repository ships is loaded and resolved: every recipe (with the launch config
its header names, judged as on a GPU host) and every accelerate launch config (on this host and
as on a GPU host), through the same code `toolkit config show` and a launch run."""

import re
from pathlib import Path

import pytest

from toolkit.backends.launch_config import plan, worker_env
from toolkit.config import Recipe, load_recipe

from helpers import ROOT

RECIPES = sorted((ROOT / "examples" / "recipes").rglob("*.yaml"))
LAUNCHES = sorted((ROOT / "accelerate_configs").glob("*.yaml"))


def launch_named_in(path: Path) -> Path:
    m = re.search(r"^# launch: (?:\.venv/bin/)?accelerate launch --config_file (\S+)", path.read_text(), re.M)
    return ROOT / (m.group(1) if m else "accelerate_configs/single.yaml")


@pytest.mark.parametrize("path", RECIPES, ids=[str(p.relative_to(ROOT / "examples" / "recipes")) for p in RECIPES])
def test_every_shipped_recipe_loads_and_plans_with_its_launch_config(path):
    recipe = load_recipe(path)
    launch = launch_named_in(path)
    assert launch.is_file(), launch
    env = worker_env(str(launch), num_processes=8 if "single" not in launch.name else None,
                     extra_args=["--num_machines", "1"])
    notes, ds = plan(recipe, env, cuda=True, source=str(launch))
    if "zero" in launch.name:
        assert ds["bf16"]["enabled"] is (recipe.train.precision == "bf16")
        assert ds["train_micro_batch_size_per_gpu"] == recipe.train.micro_batch_size


def small_recipe() -> Recipe:
    r = Recipe(output_dir="x")
    r.model.preset = "tiny-llama"
    r.data.train_files = ["a.jsonl"]
    r.train.max_steps = 10
    return r


@pytest.mark.parametrize("cuda", [False, True], ids=["this-host", "gpu-host"])
@pytest.mark.parametrize("path", LAUNCHES, ids=[p.name for p in LAUNCHES])
def test_every_shipped_launch_config_plans(path, cuda, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the YAMLs name their JSONs relative to the repository root
    env = worker_env(str(path), num_processes=2, extra_args=["--num_machines", "1", "--machine_rank", "0"])
    if "nvme" in path.name:  # the JSON names /local_nvme: refused by name unless it exists
        from toolkit.errors import ToolkitError

        if not Path("/local_nvme").is_dir():
            with pytest.raises(ToolkitError, match="nvme_path: folder does not exist"):
                plan(small_recipe(), env, cuda=cuda, source=str(path))
            return
    notes, ds = plan(small_recipe(), env, cuda=cuda, source=str(path))
    assert (ds is not None) == ("zero" in path.name or "multi_node" in path.name)


def commented_commands(path: Path) -> list[list[str]]:
    """The `toolkit train THIS.yaml key=value ...` commands a recipe's comments tell a user to run: their overrides."""
    comments = " ".join(line[1:].strip() for line in path.read_text().splitlines() if line.startswith("#"))
    return [found.split() for found in re.findall(r"`(?:\.venv/bin/)?toolkit train THIS\.yaml ([^`]*)`", comments)]


COMMENTED = [(p, c) for p in RECIPES for c in commented_commands(p)]


@pytest.mark.parametrize("path,overrides", COMMENTED,
                         ids=[f"{p.name}:{' '.join(c)}" for p, c in COMMENTED])
def test_every_command_a_recipe_comment_gives_loads_as_written(path, overrides, capsys):
    """Issue 68: a comment's command alone (model.path=... on a recipe with a preset) loads; the path replaces the
    recipe's preset with a note."""
    recipe = load_recipe(path, overrides)
    if any(o.startswith("model.path=") for o in overrides):
        assert recipe.model.preset is None and recipe.model.path == overrides[0].partition("=")[2]
        assert "note: model.path from the command line replaces" in capsys.readouterr().err


def test_the_quickstart_comments_are_found():
    assert {p.name for p, _ in COMMENTED} >= {"quickstart_dpo.yaml", "quickstart_kto.yaml", "quickstart_reward.yaml"}
