"""The speed benchmark runs in CI at a tiny size, so it cannot rot: every contender trains, the
same-tokens check passes (the toolkit, the hand-written loop and the Trainer on the same rows step by
step; TRL on the same documents in total), and the ratios are reported. No speed is asserted here:
the figures come from runs of the script (benchmarks/NOTES.md)."""

import json
import subprocess
import sys

import pytest

from helpers import ROOT

pytestmark = pytest.mark.launch  # every test here starts processes

TINY = ["--hidden", "64", "--layers", "2", "--seq", "64", "--micro", "2", "--steps", "6", "--warmup", "2",
        "--repeats", "1"]


# The packed case runs every contender; the padding-free case changes only the toolkit's batches, so it
# runs the toolkit and the hand-written loop it is checked against step by step (the Trainer and TRL
# would train exactly as in the packed case).
CASES = {"packed": ([], ["toolkit", "plain_pytorch", "hf_trainer", "trl"]),
         "padding_free": (["data.padding_free=true"], ["toolkit", "plain_pytorch"]),
         # the 8B LoRA piece of gpu_check.py at a tiny size: the shape options, a bf16 base, LoRA
         "lora_bf16_base": (["model.dtype=bf16", "data.padding_free=true"], ["toolkit", "plain_pytorch"]),
         # benchmarks/optimizers.py's pair: the toolkit and the Trainer with the same `optim` (8-bit AdamW)
         "optim": ([], ["toolkit", "hf_trainer"])}
EXTRA = {"optim": ["--optim", "adamw_8bit"],
         "lora_bf16_base": ["--intermediate", "128", "--heads", "2", "--kv-heads", "1", "--model-dtype", "bf16",
                            "--lora", "--precision", "bf16"]}


@pytest.mark.parametrize("case", list(CASES))
def test_loop_speed_benchmark_runs(case):
    toolkit, contenders = CASES[case]
    pytest.importorskip("trl", reason="TRL is the benchmark's contender: pip install '.[test]'")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "loop_speed.py"), *TINY, *EXTRA.get(case, []),
                           "--only", *contenders,
                           *(["--toolkit", *toolkit] if toolkit else [])],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()  # libraries may print to stdout too (DeepSpeed's accelerator line)
    result = json.loads(next(line for line in lines if line.startswith("{")))
    assert result["same_tokens"]["check"] == "passed"
    assert sorted(result["same_tokens"]["identical_in_total"]) == sorted(contenders)
    assert "plain_pytorch" in result["same_tokens"]["identical_per_step"] or case == "optim"
    assert result["optim"] == ("adamw_8bit" if case == "optim" else "adamw_torch")
    for other in contenders[1:]:
        assert result[f"speed_vs_{other}"] > 0 and result[f"memory_vs_{other}"] > 0
    assert result["toolkit_overrides"] == toolkit
    assert all(t > 0 for t in result["tflops"].values()) and "mfu" not in result  # MFU needs a GPU's peak
    assert result["model_dtype"] == ("bf16" if case == "lora_bf16_base" else "fp32")
    assert lines[-1].startswith("| ") and lines[-1].count("|") == 16  # the NOTES.md row


@pytest.mark.slow  # by hand before a GPU lease (gpu_check's last piece); 64 s in CI was over its budget
def test_long_context_benchmark_runs():
    """benchmarks/long_context.py at a tiny size: checkpointing and tiled MLP + offload, on one process
    and with each sequence split across 2 (sp 2); the script itself exits 1 if any variant's losses
    differ from the reference's."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "long_context.py"), "--hidden", "128", "--layers",
                           "2", "--seq", "256", "--steps", "2", "--only", "checkpointing", "tiled_offload",
                           "--sp", "1", "2", "--baseline-seq", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"variant"')]
    assert [(r["variant"], r["ok"]) for r in results] == [("checkpointing", True), ("tiled_offload", True),
                                                          ("checkpointing sp2", True), ("tiled_offload sp2", True)]
    assert all(len(r["peaks_gib"]) == r["sp"] for r in results)  # one peak per rank
    assert proc.stdout.rstrip().splitlines()[-1].startswith("| tiled_offload sp2 |")


def test_grpo_speed_benchmark_runs(tmp_path):
    """benchmarks/grpo_speed.py --tiny: one GRPO setup trained by the toolkit and by TRL's GRPOTrainer,
    each in its own process; the JSON holds both sides' step times, peak memory, completion lengths
    (at most --max-new-tokens, as the script checks) and the ratios. No speed is asserted."""
    pytest.importorskip("trl", reason="TRL is the benchmark's contender: pip install '.[test]'")
    out = tmp_path / "grpo_speed.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "grpo_speed.py"), "--tiny", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{"))) == result
    for side in ("toolkit", "trl"):
        s = result[side]
        assert s["seconds_per_step"] > 0 and s["peak_rss_mib"] > 0, side
        assert [len(steps) for steps in s["steps_seconds"]] == [result["steps"] - 1], side  # steps 2..N, 1 process
        assert 0 < s["mean_completion_length"] <= s["max_completion_length_seen"] <= result["max_new_tokens"], side
    assert result["toolkit"]["step_profile"].startswith("step profile")
    assert result["ratio_seconds_per_step"] > 0 and result["ratio_peak_rss_mib"] > 0
    assert proc.stdout.rstrip().splitlines()[-1].startswith("| ")  # the NOTES.md row


@pytest.mark.real_model
@pytest.mark.slow  # by hand; --lora with a bf16 base runs in CI (case lora_bf16_base)
def test_loop_speed_benchmark_runs_on_a_model_folder_with_lora(tmp_path, real_model_dir):
    """loop_speed.py --model --lora --threads on a folder with SmolLM2's tokenizer (chat template with a
    system prompt, end-of-turn padding) and a tiny random Llama of its vocabulary: the one-token-word
    documents tokenize to the planned lengths for every contender, and CPU time per step is reported."""
    pytest.importorskip("trl", reason="TRL is the benchmark's contender: pip install '.[test]'")
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    AutoTokenizer.from_pretrained(real_model_dir).save_pretrained(tmp_path / "model")
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                 num_attention_heads=1, num_key_value_heads=1, tie_word_embeddings=True,
                                 bos_token_id=1, eos_token_id=2, pad_token_id=2)).save_pretrained(tmp_path / "model")
    model = str(tmp_path / "model")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "loop_speed.py"), "--model", model, "--lora",
                           "--threads", "1", "--seq", "128", "--micro", "1", "--steps", "4", "--warmup", "1",
                           "--repeats", "1", "--only", "toolkit", "plain_pytorch", "trl"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert result["same_tokens"]["check"] == "passed" and result["lora"]["r"] == 16 and result["threads"] == 1
    assert result["model"] == model
    assert all(v is None or v > 0 for v in result["cpu_ms_per_step"].values())
    assert result["toolkit_step_profile"].startswith("step profile")
