"""Faster kernels behind a switch, refused in one line where they cannot run: model.kernels (Liger-Kernel's
fused RMSNorm, RoPE and MLP activation; toolkit/model/load.py `apply_kernels`, refused at recipe load and with
the launch, toolkit/backends/launch_config.py) and a launch config's mixed_precision fp8 (accelerate's torchao or
Transformer Engine backend; launch_config `_check_fp8`). What they compute is checked on a GPU only
(tests/test_gpu.py: test_liger_kernels_match_plain_bf16_on_cuda, test_fp8_trains_close_to_bf16_on_cuda).
Starts no process."""

import importlib.util

import pytest
import torch
import yaml

from toolkit.backends.launch_config import check, fp8, plan, worker_env
from toolkit.config import ConfigError, ModelConfig, Recipe, key_reference, load_recipe
from toolkit.errors import ToolkitError
from toolkit.model.load import apply_kernels, build_model

from helpers import write_recipe

cpu_host_only = pytest.mark.skipif(torch.cuda.is_available(), reason="judges a host without CUDA")


def recipe_file(tmp_path, **model):
    return write_recipe(tmp_path / "recipe.yaml", output_dir=str(tmp_path / "run"),
                        model={"preset": "tiny-llama-mini", **model}, data={"train_files": ["a.jsonl"]},
                        train={"precision": "bf16"})


def pretend(monkeypatch, **installed):
    """importlib finds (or not) the packages named, whatever this environment has."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: (object() if installed[name] else None)
                        if name in installed else real(name, *args))


def one_line(e) -> str:
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


# ----------------------------------------------------------------------------- model.kernels


def test_kernels_default_to_none_which_changes_nothing(tmp_path):
    assert Recipe().model.kernels == "none" and load_recipe(recipe_file(tmp_path)).model.kernels == "none"
    model = build_model(ModelConfig(preset="tiny-llama-mini"))
    assert apply_kernels(model, ModelConfig(preset="tiny-llama-mini")) is None
    assert not any("forward" in m.__dict__ for m in model.modules())  # no module's forward replaced
    assert "| `model.kernels` | `Literal['none', 'liger']` | `'none'` |" in key_reference()


def test_an_unknown_kernels_value_is_refused_with_the_known_ones(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_recipe(recipe_file(tmp_path, kernels="triton"))
    assert "model.kernels: must be one of none, liger; got 'triton'" in one_line(e)


def test_liger_without_its_package_is_refused_at_load_with_the_install_command(tmp_path, monkeypatch):
    pretend(monkeypatch, liger_kernel=False)
    with pytest.raises(ConfigError) as e:
        load_recipe(recipe_file(tmp_path, kernels="liger"))
    line = one_line(e)
    assert "model.kernels: liger needs the liger-kernel package" in line and "pip install 'liger-kernel>=0.7'" in line


@cpu_host_only
def test_liger_is_refused_in_one_line_on_this_host(tmp_path):
    """Here: at load where liger-kernel is not installed; with it installed, when the launch is checked
    (the Accelerator is built), before any model loads."""
    with pytest.raises(ToolkitError) as e:
        check(load_recipe(recipe_file(tmp_path, kernels="liger")), {}, cuda=torch.cuda.is_available())
    assert "model.kernels: liger" in one_line(e)
    recipe = Recipe(output_dir="x")
    recipe.model.kernels = "liger"
    with pytest.raises(ToolkitError) as e:
        check(recipe, {}, cuda=False)
    assert one_line(e) == ("model.kernels: liger's Triton kernels run on a CUDA GPU and this host has none; "
                           "set model.kernels=none")


def test_liger_with_tiled_mlp_is_refused(tmp_path, monkeypatch):
    pretend(monkeypatch, liger_kernel=True)
    with pytest.raises(ConfigError) as e:
        load_recipe(recipe_file(tmp_path, kernels="liger", tiled_mlp=True))
    assert "model.kernels: liger replaces each MLP's forward" in one_line(e)


# ----------------------------------------------------------------------------- mixed_precision: fp8


def fp8_yaml(tmp_path):
    path = tmp_path / "fp8.yaml"
    path.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", "distributed_type": "NO",
                                    "mixed_precision": "fp8", "num_processes": 1}))
    return path


def bf16_recipe(precision="bf16") -> Recipe:
    r = Recipe(output_dir="x")
    r.model.preset, r.data.train_files, r.train.precision = "tiny-llama-mini", ["a.jsonl"], precision
    return r


def gpu(monkeypatch, capability=(9, 0), name="NVIDIA H100 80GB HBM3", torchao=True, te=False):
    """As on a CUDA host with that GPU and those fp8 packages."""
    import accelerate.utils

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    monkeypatch.setattr(accelerate.utils, "is_torchao_available", lambda: torchao)
    monkeypatch.setattr(accelerate.utils, "is_transformer_engine_available", lambda: te)


@cpu_host_only
def test_an_fp8_launch_yaml_is_refused_on_this_host_naming_what_is_missing(tmp_path, monkeypatch):
    """Without any fp8 package accelerate's own launcher refuses first (what `accelerate launch` prints);
    with one, the workers' check refuses the missing GPU in one line."""
    from accelerate.utils import is_fp8_available

    path = fp8_yaml(tmp_path)
    if not is_fp8_available():
        with pytest.raises(ToolkitError) as e:
            worker_env(str(path))
        assert "FP8 is not available on this machine" in one_line(e)
        monkeypatch.setattr("accelerate.utils.launch.is_fp8_available", lambda: True)
    env = worker_env(str(path))
    assert fp8(env)
    with pytest.raises(ToolkitError) as e:
        plan(bf16_recipe(), env, cuda=False, source=str(path))
    line = one_line(e)
    assert line.startswith(f"{path}: mixed_precision 'fp8' needs a CUDA GPU of compute capability 8.9 or later "
                           "(Ada, Hopper, Blackwell), and this host has none"), line
    assert line.endswith("; use mixed_precision: bf16")
    if not importlib.util.find_spec("torchao") and not importlib.util.find_spec("transformer_engine"):
        assert "; and torchao or Transformer Engine, not installed (" in line and "pip install torchao)" in line


@pytest.mark.parametrize("host, env, precision, words", [
    (dict(torchao=False), {}, "bf16", "needs torchao or Transformer Engine, not installed ("),
    (dict(torchao=True), {"ACCELERATE_FP8_BACKEND": "TE"}, "bf16",
     "needs Transformer Engine, not installed ("),
    (dict(capability=(8, 0), name="NVIDIA A100-SXM4-80GB"), {}, "bf16",
     "needs a GPU of compute capability 8.9 or later, and the NVIDIA A100-SXM4-80GB here has 8.0; use"),
    (dict(), {"ACCELERATE_FP8_BACKEND": "MSAMP"}, "bf16", "fp8_config.backend is MSAMP: not supported here"),
    (dict(), {}, "fp32", "train.precision is 'fp32'; set train.precision=bf16"),
    (dict(), {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}, "bf16", "not yet under FSDP"),
    (dict(), {"ACCELERATE_USE_DEEPSPEED": "true"}, "bf16", "not yet under DeepSpeed"),
], ids=["no-package", "te-missing", "older-gpu", "msamp", "fp32-recipe", "fsdp", "deepspeed"])
def test_fp8_is_refused_in_one_line_naming_what_is_missing(host, env, precision, words, monkeypatch):
    gpu(monkeypatch, **host)
    with pytest.raises(ToolkitError) as e:
        check(bf16_recipe(precision), {"ACCELERATE_MIXED_PRECISION": "fp8", **env}, cuda=True, source="fp8.yaml")
    assert words in one_line(e)


@pytest.mark.parametrize("host, backend", [(dict(torchao=True), "torchao"),
                                           (dict(torchao=False, te=True), "Transformer Engine")])
def test_fp8_on_an_fp8_gpu_with_a_backend_trains_and_says_how(host, backend, monkeypatch):
    gpu(monkeypatch, **host)
    notes, env = [], {"ACCELERATE_MIXED_PRECISION": "fp8", "WORLD_SIZE": "2"}
    check(bf16_recipe(), env, cuda=True, source="fp8.yaml", notes=notes)
    assert fp8(env) and not fp8({"ACCELERATE_MIXED_PRECISION": "bf16"})
    assert len(notes) == 1 and notes[0].startswith(f"fp8.yaml: mixed_precision fp8 through {backend}: the linear "
                                                   "layers compute in fp8"), notes
