"""An adapter knows its base (toolkit/model/base_identity.py), on real launches of the CLI: a LoRA run
over a local base folder named by a relative model.path records that base by its absolute path (so
generate works from any folder), and merge, generate and eval refuse a base folder that now holds
another model of the same shapes, in one line; `merge --base` names the original again."""

import json
import shutil

import pytest

from helpers import (
    alpaca_folder,
    run_toolkit,
    short_recipe,
    user_error_line,
)

pytestmark = pytest.mark.launch  # every test here starts processes


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return alpaca_folder(tmp_path_factory.mktemp("adapter_base"))


recipe = short_recipe


@pytest.fixture(scope="module")
def lora_on_a_folder(work):
    """A LoRA run over a local base folder named by a relative model.path."""
    from toolkit.config import ModelConfig
    from toolkit.model.load import build_byte_tokenizer, build_model

    base = work / "base"
    build_model(ModelConfig(preset="tiny-llama-mini")).save_pretrained(base)
    build_byte_tokenizer().save_pretrained(base)
    r = recipe(work, "lora", model={"path": "base"}, lora={"enabled": True}, checkpoint={"every_steps": 1})
    proc = run_toolkit("train", r, cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return work / "lora" / "final", base


def test_adapter_records_its_base_by_absolute_path(lora_on_a_folder, tmp_path):
    final, base = lora_on_a_folder
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base.resolve())
    proc = run_toolkit("generate", final, "--prompt", "hi", "--max-new-tokens", "2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_replaced_base_is_refused_by_merge_generate_and_eval(lora_on_a_folder, work, tmp_path):
    from toolkit.config import ModelConfig
    from toolkit.model.load import build_model

    final, base = lora_on_a_folder
    kept = tmp_path / "original"
    shutil.copytree(base, kept)
    try:
        import torch

        torch.manual_seed(123)
        build_model(ModelConfig(preset="tiny-llama-mini")).save_pretrained(base)  # another model, same shapes
        for args in (["merge", final, "--out", tmp_path / "merged"], ["generate", final, "--prompt", "hi"],
                     ["eval", final, "--data", work / "eval.jsonl"]):
            line = user_error_line(run_toolkit(*args))
            assert f"the base model {base}" in line and "is not the one" in line, line
        assert not (tmp_path / "merged").exists()
        proc = run_toolkit("merge", final, "--out", tmp_path / "merged", "--base", kept)
        assert proc.returncode == 0, proc.stderr[-2000:]
    finally:
        shutil.rmtree(base)
        shutil.copytree(kept, base)


def test_a_changed_base_is_refused_on_resume_and_convert_and_a_moved_one_is_not(lora_on_a_folder, work, tmp_path):
    """Issue 52: a LoRA checkpoint does not carry its frozen base, so the base is an input of every resume. A base
    folder now holding another model of the same shapes is refused by resume (before the model loads) and by
    checkpoint convert, in one line naming it; resume_accept_changed=[model] continues with it; the same base
    copied to another folder resumes (identity by content, not by path)."""
    from toolkit.config import ModelConfig
    from toolkit.model.load import build_model

    final, base = lora_on_a_folder
    run = tmp_path / "run"
    shutil.copytree(final.parent, run, ignore=shutil.ignore_patterns("final", ".toolkit.lock", "step-000003"))
    step = run / "checkpoints" / "step-000002"
    kept = tmp_path / "elsewhere" / "base"
    shutil.copytree(base, kept)
    r = recipe(work, "lora", model={"path": "base"}, lora={"enabled": True}, checkpoint={"every_steps": 1})
    resume = [f"output_dir={run}", "resume=auto"]
    try:
        import torch

        torch.manual_seed(123)
        build_model(ModelConfig(preset="tiny-llama-mini")).save_pretrained(base)  # another model, same shapes
        line = user_error_line(run_toolkit("train", r, *resume, cwd=work))
        assert line.startswith(f"error: resume: the base model (model.path: its weights and config) changed since "
                               f"{step} was written") and "resume_accept_changed=[model]" in line, line
        line = user_error_line(run_toolkit("checkpoint", "convert", step, "--out", tmp_path / "merged", cwd=work))
        assert line.startswith("error: checkpoint convert: the base model (model.path: its weights and config) "
                               "changed since"), line
        assert not (tmp_path / "merged").exists()
        proc = run_toolkit("train", r, *resume, "resume_accept_changed=[model]", cwd=work)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"resumed from {step} at step 2" in proc.stdout, proc.stdout[-3000:]
    finally:
        shutil.rmtree(base)
        shutil.copytree(kept, base)
    shutil.rmtree(run / "final")
    shutil.rmtree(run / "checkpoints" / "step-000003")
    proc = run_toolkit("train", r, *resume, f"model.path={kept}", cwd=work)  # the same base, elsewhere
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {step} at step 2" in proc.stdout, proc.stdout[-3000:]
