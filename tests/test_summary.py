"""The start-of-run summary (toolkit/training/summary.py): on a CPU host a half precision says what it
costs there (issue 45: bf16 on a CPU without bf16 instructions trained 3x and more slower than fp32,
and nothing said so), while the recipe's choice stands."""

from types import SimpleNamespace

import pytest
import torch

from toolkit.config import load_recipe
from toolkit.training import summary
from toolkit.training.summary import cpu_flags, cpu_precision_cost, run_summary

from helpers import ROOT

EMULATED = "emulated on this CPU (no avx512_bf16 or amx_bf16 instructions): slower than fp32, several times on " \
           "most CPUs; train.precision=fp32 trains fastest here"


def test_a_half_precision_on_a_cpu_says_what_it_costs():
    assert cpu_precision_cost("fp32", {"avx2"}) == ""
    assert cpu_precision_cost("bf16", {"fpu", "avx2", "fma"}) == f"; {EMULATED}"
    assert cpu_precision_cost("bf16", {"avx512f", "avx512bw"}) == f"; {EMULATED}"  # AVX-512 without its bf16 part
    assert "natively (avx512_bf16): about as fast as fp32" in cpu_precision_cost("bf16", {"avx512f", "avx512_bf16"})
    assert "natively (amx_bf16)" in cpu_precision_cost("bf16", {"amx_bf16", "amx_tile"})
    assert "natively (bf16)" in cpu_precision_cost("bf16", {"fp", "asimd", "bf16"})  # Arm's Features line
    assert "emulated on this CPU (no avx512_fp16 or amx_fp16" in cpu_precision_cost("fp16", {"avx512_bf16"})
    assert "emulated by most CPUs and slower than fp32" in cpu_precision_cost("bf16", set())  # no /proc/cpuinfo
    assert isinstance(cpu_flags(), set)


def summary_of(precision: str, device: str) -> list[str]:
    recipe = load_recipe(ROOT / "examples" / "recipes" / "quickstart_full.yaml", [f"train.precision={precision}"])
    accelerator = SimpleNamespace(num_processes=1, device=torch.device(device))
    backend = SimpleNamespace(accelerator=accelerator, describe=lambda: "one process", sequence_parallel=1,
                              data_parallel=lambda: (0, 1))
    return run_summary(recipe, backend, None, rows=100, eval_rows=10, steps_per_epoch=7, total_steps=105)


def test_the_precision_line_says_it_on_a_cpu_host_only(monkeypatch):
    """The recipe's precision is kept (tests train bf16 on a CPU on purpose); only the line changes."""
    monkeypatch.setattr(summary, "estimate_for_run", lambda *args: ("estimate (not made here)", None))
    cpu = next(line for line in summary_of("bf16", "cpu") if line.startswith("precision "))
    assert cpu.startswith("precision bf16 (train.precision); ") and cpu.endswith(cpu_precision_cost("bf16")), cpu
    assert next(line for line in summary_of("bf16", "cuda") if line.startswith("precision ")) == \
        "precision bf16 (train.precision)"
    assert next(line for line in summary_of("fp32", "cpu") if line.startswith("precision ")) == \
        "precision fp32 (train.precision)"


def test_an_rl_run_counts_prompts_and_completions(tmp_path):
    """rl.method: micro_batch_size counts prompts; the batch line says prompts x num_generations completions
    and the sequences trained on; the estimate line counts those sequences and the KV cache of sampling."""
    from helpers import write_recipe

    path = write_recipe(tmp_path / "rl.yaml", output_dir=str(tmp_path / "run"), model={"preset": "tiny-llama"},
                        data={"train_files": [str(tmp_path / "prompts.jsonl")], "format": "prompt", "max_seq_len": 64},
                        rl={"method": "grpo", "num_generations": 8, "max_new_tokens": 16, "rewards": ["exact_match"]},
                        train={"micro_batch_size": 2, "gradient_accumulation_steps": 4, "max_steps": 10})
    accelerator = SimpleNamespace(num_processes=2, device=torch.device("cpu"))
    backend = SimpleNamespace(accelerator=accelerator, describe=lambda: "DDP, 2 processes", sequence_parallel=1,
                              data_parallel=lambda: (0, 2))
    lines = run_summary(load_recipe(path), backend, None, rows=100, eval_rows=10, steps_per_epoch=6, total_steps=10)
    batch = next(line for line in lines if line.startswith("batch "))
    assert batch.startswith("batch 16 prompts x 8 completions (128 sequences of prompt + completion) per optimizer "
                            "step = micro_batch_size 2 x gradient_accumulation_steps 4 x 2 processes; "), batch
    estimate = next(line for line in lines if line.startswith("estimate per process"))
    # 2 x 4 layers x 64 (2 KV heads of 32) x 64 sequences (2 x 4 x 8) x 80 tokens x 4 bytes (fp32) = 10 MiB
    assert "(micro-batch 16 sequences (2 prompts x 8 completions) x 80 tokens (prompt + up to 16 new)), KV cache " \
           "10.0 MiB (64 completions sampled at once" in estimate, estimate
    # no learning rate in the recipe: the line says it got SFT's default and what TRL's GRPO default is (issue 49)
    optimizer = next(line for line in lines if line.startswith("optimizer "))
    assert optimizer.endswith("(recipe); that lr is the default, made for SFT: TRL's GRPO default is 1e-6 "
                              "(full fine-tuning); set train.learning_rate"), optimizer
    lines = run_summary(load_recipe(path, ["train.learning_rate=1e-6"]), backend, None, rows=100, eval_rows=10,
                        steps_per_epoch=6, total_steps=10)
    assert next(line for line in lines if line.startswith("optimizer ")).endswith("matrices only (recipe)")


def test_the_model_card_names_a_hub_base_its_license_and_hub_data(tmp_path):
    """training/card.py on a LoRA recipe over a Hub id with Hub data: base_model, datasets, and the
    license the base's own card states; a local base without a card gives no license."""
    import yaml

    from toolkit.storage.checkpoint import TrainerState
    from toolkit.training.card import model_card

    recipe = load_recipe(ROOT / "examples" / "recipes" / "tasks" / "lora-qwen2.5-1.5b.yaml")
    base = tmp_path / "base"
    base.mkdir()
    (base / "README.md").write_text("---\nlicense: apache-2.0\nlanguage: [en]\n---\n# Qwen\n")
    state = TrainerState(step=12, tokens_seen=3000, global_batch=32, data_content="0123456789abcdef")
    card = model_card(recipe, state, [{"step": 12, "loss": 1.25, "eval_loss": 1.5}], base)
    meta = yaml.safe_load(card.split("---\n", 2)[1])
    assert meta == {"library_name": "peft", "pipeline_tag": "text-generation", "tags": ["toolkit", "sft", "lora"],
                    "base_model": "Qwen/Qwen2.5-1.5B-Instruct", "license": "apache-2.0",
                    "datasets": ["trl-lib/Capybara"]}
    assert "12 optimizer steps of a global batch of 32 (3,000 tokens)" in card and "| loss | 1.25 | 12 |" in card
    (base / "README.md").unlink()
    assert "license" not in yaml.safe_load(model_card(recipe, state, [], base).split("---\n", 2)[1])


@pytest.mark.parametrize("name, words", [
    ("quickstart_grpo.yaml", "TRL's GRPO default is 1e-6"),
    ("quickstart_grpo.yaml:rl.method=rloo", "TRL's RLOO default is 1e-6"),
    ("quickstart_distill.yaml", "TRL's DistillationTrainer default is 1e-6"),
    ("quickstart_dpo.yaml", "TRL's DPO default is 1e-6"),
    ("quickstart_kto.yaml", "TRL's KTO default is 1e-6"),
    ("quickstart_reward.yaml", "TRL's RewardTrainer default is 1e-4"),
    ("quickstart_full.yaml", None),
])
def test_the_default_learning_rate_is_compared_with_the_runs_own_trl_default(monkeypatch, name, words):
    """Issue 69 (text written for one case shown in another): a run left at the toolkit's learning rate (made for
    SFT) is told the default of TRL's trainer of its own objective; distillation was told GRPO's and RLOO's, and
    DPO, KTO and reward modelling nothing. SFT's is the toolkit's own: no note."""
    monkeypatch.setattr(summary, "estimate_for_run", lambda *args: ("estimate (not made here)", None))
    file, _, override = name.partition(":")
    overrides = [f"train.learning_rate={type(load_recipe(ROOT / 'examples' / 'recipes' / file).train)().learning_rate}"]
    recipe = load_recipe(ROOT / "examples" / "recipes" / file, overrides + ([override] if override else []))
    accelerator = SimpleNamespace(num_processes=1, device=torch.device("cpu"))
    backend = SimpleNamespace(accelerator=accelerator, describe=lambda: "one process", sequence_parallel=1,
                              data_parallel=lambda: (0, 1))
    lines = run_summary(recipe, backend, None, rows=100, eval_rows=10, steps_per_epoch=7, total_steps=105)
    optimizer = next(line for line in lines if line.startswith("optimizer "))
    if words is None:
        assert optimizer.endswith("matrices only (recipe)"), optimizer
    else:
        assert optimizer.endswith(f"(recipe); that lr is the default, made for SFT: {words} (full fine-tuning); set "
                                  "train.learning_rate"), optimizer
