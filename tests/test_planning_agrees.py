"""What a planning verb accepts, the launch accepts: `toolkit config show --accelerate-config` and
`toolkit estimate --sp-size` judge a sequence-parallel split of the model's attention heads with the
launch's own check (`backends.sequence.check_heads`, which `DeepSpeed.check_model` asks of the built
model), so they refuse in the launch's words what it would refuse, and pass what it passes."""

import pytest
import yaml

from toolkit.backends.deepspeed import DeepSpeed
from toolkit.config import ModelConfig, Recipe
from toolkit.errors import ToolkitError
from toolkit.model.load import build_model

from helpers import ROOT, run_toolkit, user_error_line, write_recipe

# tiny-llama-mini: 4 attention heads over 2 key/value heads; 3 ranks cannot share them
WORDS = "parallelism_config_sp_size is 3 but the model has 4 attention heads and 2 key/value heads; sp_size must divide"


def launch_refusal(sp: int) -> str | None:
    """The launch's verdict on the built model (the backend hook a DeepSpeed launch calls)."""
    backend = DeepSpeed.__new__(DeepSpeed)
    backend.sequence_parallel = sp
    try:
        backend.check_model(build_model(ModelConfig(preset="tiny-llama-mini")), Recipe())
    except ToolkitError as e:
        return str(e)
    return None


def split_launch(tmp_path, sp: int):
    """accelerate_configs/zero2_sp.yaml with `sp` ranks to a sequence, on `sp` processes."""
    config = yaml.safe_load((ROOT / "accelerate_configs" / "zero2_sp.yaml").read_text())
    config["num_processes"] = sp
    config["parallelism_config"]["parallelism_config_sp_size"] = sp
    path = tmp_path / f"sp{sp}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_launch_refuses_heads_the_split_does_not_divide():
    assert launch_refusal(3) == (f"accelerate config: {WORDS} the heads (and divide or be a multiple of the "
                                 "key/value heads)")
    assert launch_refusal(2) is None and launch_refusal(4) is None  # 4 heads; 2 key/value heads repeated up to 4


@pytest.mark.launch
def test_config_show_and_estimate_refuse_what_the_launch_refuses(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", output_dir=str(tmp_path / "run"), model={"preset": "tiny-llama-mini"},
                          data={"train_files": ["a.jsonl"]}, train={"micro_batch_size": 2})
    launch = split_launch(tmp_path, 3)
    words = launch_refusal(3).split(": ", 1)[1]  # the launch's line, less where the size came from
    shown = user_error_line(run_toolkit("config", "show", recipe, "--accelerate-config", launch, "--assume-gpu"))
    assert shown == f"error: {launch}: {words}"
    estimated = user_error_line(run_toolkit("estimate", "--model", "tiny-llama-mini", "--gpus", "3", "--sp-size", "3"))
    assert estimated == f"error: --sp-size: {words}"
    from_launch = user_error_line(run_toolkit("estimate", "--recipe", recipe, "--config_file", launch))
    assert from_launch == f"error: {launch}: {words}"


@pytest.mark.launch
def test_config_show_and_estimate_pass_what_the_launch_passes(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", output_dir=str(tmp_path / "run"), model={"preset": "tiny-llama-mini"},
                          data={"train_files": ["a.jsonl"]}, train={"micro_batch_size": 2})
    assert launch_refusal(4) is None
    shown = run_toolkit("config", "show", recipe, "--accelerate-config", split_launch(tmp_path, 4), "--assume-gpu")
    assert shown.returncode == 0 and "sequence parallel 4" in shown.stdout, shown.stderr[-2000:]
    estimated = run_toolkit("estimate", "--model", "tiny-llama-mini", "--gpus", "4", "--sp-size", "4")
    assert estimated.returncode == 0 and "parallelism_config_sp_size: 4" in estimated.stdout, estimated.stderr[-2000:]
