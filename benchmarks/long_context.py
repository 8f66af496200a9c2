"""Peak memory and speed of one long sequence per step, with model.tiled_mlp and
model.activation_offload on and off (issue 30), each variant a `toolkit train` run of its own.

    python benchmarks/long_context.py                        # CPU: hidden 256 x 4 layers, 16,384 tokens, fp32
    python benchmarks/long_context.py --hidden 2048 --layers 22 --seq 32768 --precision bf16 --attn varlen  # GPU, 1.0B
    python benchmarks/long_context.py --hidden 64 --layers 2 --seq 512 --steps 2              # seconds: a check

Model: a Llama-architecture model with random weights (intermediate 2.75 x hidden, heads of 64,
grouped-query key/values, untied output layer, the byte tokenizer's 262 tokens), saved to a
folder and loaded by `toolkit train` like any model.path. Data: text documents of exactly --seq
tokens, one per row (data.packing), micro-batch 1, every position a target; the same documents in
the same order for every variant. Each variant trains --steps optimizer steps from the same seed.

Variants (recipe keys over the same recipe):
- no_checkpointing: nothing kept off (may not fit: reported as failed);
- checkpointing: model.gradient_checkpointing (the reference the ratios divide by);
- tiled: + model.tiled_mlp;
- offload: + model.activation_offload;
- tiled_offload: + both.

Each variant runs once per --sp size: 1 is one process; N > 1 is `accelerate launch` of N processes
with accelerate_configs/zero2_sp.yaml at parallelism_config_sp_size N (DeepSpeed ZeRO-2, the
sequence split across the N ranks, one data-parallel rank: the same global batch). The default is
1 and 2, or 1 alone on a host with exactly one GPU.

Figures, from the run's own metrics.jsonl: peak memory per rank (the largest `peak_memory_gib` of
any rank and step: the CUDA allocator's peak on a GPU, the process's peak resident set on a CPU
host, which includes the libraries, ~0.5 GiB, more with DeepSpeed), the median step time after the
first step, tokens per second (--seq / median step time, all ranks together), the peak above the
same launch's baseline (a run of --baseline-seq tokens: libraries, model, optimizer, DeepSpeed's
buffers; on a CPU host most of the peak), and the losses:
every variant's must equal the reference's (checkpointing on one process) within --loss-rtol (the
features change memory, not what is learned), or the script exits 1. Prints one JSON line per
variant and a Markdown table for benchmarks/NOTES.md; with $OUT set, writes long_context.json there
too.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEED = 5
VARIANTS = {
    "no_checkpointing": [],
    "checkpointing": ["model.gradient_checkpointing=true"],
    "tiled": ["model.gradient_checkpointing=true", "model.tiled_mlp=true"],
    "offload": ["model.gradient_checkpointing=true", "model.activation_offload=true"],
    "tiled_offload": ["model.gradient_checkpointing=true", "model.tiled_mlp=true", "model.activation_offload=true"],
}
REFERENCE = "checkpointing"


def prepare(work: Path, a) -> Path:
    import torch
    import yaml
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT))
    from toolkit.model.load import build_byte_tokenizer

    torch.manual_seed(SEED)
    config = LlamaConfig(vocab_size=262, hidden_size=a.hidden, intermediate_size=int(a.hidden * 2.75) // 8 * 8,
                         num_hidden_layers=a.layers, num_attention_heads=max(1, a.hidden // 64),
                         num_key_value_heads=max(1, a.hidden // 256), max_position_embeddings=a.seq,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(work / "model")
    build_byte_tokenizer().save_pretrained(work / "model")
    rng = random.Random(SEED)
    alphabet = "abcdefghijklmnopqrstuvwxyz ,."
    with open(work / "train.jsonl", "w") as f:  # BOS + text + EOS = seq tokens with the byte tokenizer
        for _ in range(a.steps):
            f.write(json.dumps({"text": "".join(rng.choice(alphabet) for _ in range(a.seq - 2))}) + "\n")
    recipe = {
        "output_dir": str(work / "run"), "overwrite": True, "seed": SEED,
        "model": {"path": str(work / "model"), "attn_implementation": a.attn},
        "data": {"train_files": [str(work / "train.jsonl")], "format": "text", "max_seq_len": a.seq,
                 "packing": True, "eval_fraction": 0.0},
        "train": {"micro_batch_size": 1, "gradient_accumulation_steps": 1, "max_steps": a.steps,
                  "learning_rate": 1e-4, "warmup_steps": 0, "precision": a.precision, "log_every_steps": 1},
    }
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def launcher(work: Path, sp: int) -> list[str]:
    """`accelerate launch` of sp processes, each sequence split across them (nothing for sp 1)."""
    if sp == 1:
        return [sys.executable]
    import yaml

    launch = yaml.safe_load((ROOT / "accelerate_configs" / "zero2_sp.yaml").read_text())
    launch["parallelism_config"]["parallelism_config_sp_size"] = sp
    launch["deepspeed_config"]["deepspeed_config_file"] = str(ROOT
                                                              / launch["deepspeed_config"]["deepspeed_config_file"])
    path = work / f"sp{sp}.yaml"
    path.write_text(yaml.safe_dump(launch))
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(path), "--num_processes", str(sp),
            "--main_process_port", "0"]


def run_variant(work: Path, recipe: Path, name: str, a, sp: int = 1) -> dict:
    label = name if sp == 1 else f"{name} sp{sp}"
    out = work / f"run_{name}_sp{sp}"
    cmd = [*launcher(work, sp), "-m", "toolkit", "train", str(recipe), f"output_dir={out}", *VARIANTS[name], *a.toolkit]
    began = time.monotonic()
    with open(work / f"{name}_sp{sp}.log", "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=a.timeout)
    text = (work / f"{name}_sp{sp}.log").read_text(errors="replace")
    if proc.returncode != 0:
        lines = [line for line in text.splitlines() if line.strip()]
        last = [line for line in lines if line.startswith("error: ")][:1] or lines[-1:] or ["?"]  # the refusal
        return {"variant": label, "sp": sp, "ok": False, "why": last[0][-300:],
                "seconds": round(time.monotonic() - began)}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    times = [b["time"] - a_["time"] for a_, b in zip(rows, rows[1:])]
    step = statistics.median(times) if times else None
    return {"variant": label, "sp": sp, "ok": True, "losses": [r["loss"] for r in rows],
            "peaks_gib": [round(x, 3) for x in rows[-1]["peak_memory_gib"]],
            "peak_gib": round(max(max(r["peak_memory_gib"]) for r in rows), 3),
            "step_s": round(step, 3) if step else None,
            "tokens_per_s": round(a.seq / step) if step else None,
            "tiles": next((line.split("runs as ")[1].split(" tiles")[0] for line in text.splitlines()
                           if "tiled MLP: each of" in line), None),
            "seconds": round(time.monotonic() - began)}


def table(results: list[dict], a, device: str) -> str:
    ref = next((r for r in results if r["variant"] == REFERENCE and r["ok"]), None)
    lines = [f"| variant | peak memory GiB per rank | above baseline | vs {REFERENCE} | step s | tokens/s | "
             f"vs {REFERENCE} | max rel loss diff |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if not r["ok"]:
            lines.append(f"| {r['variant']} | failed: {r['why'][:120]} | | | | | | |")
            continue
        above = f"{r['above_baseline_gib']:.3f}" if r.get("above_baseline_gib") is not None else "-"
        mem = f"{r['peak_gib'] / ref['peak_gib']:.3f}" if ref else "-"
        speed = (f"{r['tokens_per_s'] / ref['tokens_per_s']:.3f}" if ref and r["tokens_per_s"] and ref["tokens_per_s"]
                 else "-")
        diff = f"{r['loss_rel_diff']:.1e}" if r.get("loss_rel_diff") is not None else "-"
        lines.append(f"| {r['variant']} | {r['peak_gib']:.3f} | {above} | {mem} | {r['step_s']} | "
                     f"{r['tokens_per_s']} | {speed} | {diff} |")
    head = (f"{device}; hidden {a.hidden} x {a.layers} layers, {a.seq} tokens per step (micro-batch 1), "
            f"{a.precision}, attention {a.attn}, {a.steps} steps")
    return head + "\n\n" + "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--attn", default="sdpa")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--only", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--baseline-seq", type=int, default=64,
                   help="tokens of the baseline run per sp size (checkpointing; 0: none)")
    p.add_argument("--sp", nargs="+", type=int, default=None,
                   help="sequence-parallel sizes (default 1 and 2; 1 alone with exactly one GPU)")
    p.add_argument("--loss-rtol", type=float, default=None, help="default 1e-4 in fp32, 2e-2 in bf16/fp16")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per variant")
    p.add_argument("--toolkit", nargs="*", default=[], help="more recipe overrides for every variant")
    a = p.parse_args(argv)
    rtol = a.loss_rtol if a.loss_rtol is not None else (1e-4 if a.precision == "fp32" else 2e-2)
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    sizes = a.sp or ([1] if torch.cuda.device_count() == 1 else [1, 2])
    work = Path(tempfile.mkdtemp(prefix="long_context_"))
    recipe = prepare(work, a)
    results = []
    baselines = {}
    if a.baseline_seq:
        short = argparse.Namespace(**{**vars(a), "seq": a.baseline_seq})
        (work / "baseline").mkdir()
        recipe_short = prepare(work / "baseline", short)
        for sp in sizes:
            b = run_variant(work / "baseline", recipe_short, REFERENCE, short, sp)
            print(json.dumps({**b, "baseline": True}), flush=True)
            baselines[sp] = b["peak_gib"] if b["ok"] else None
    for sp in sizes:
        for name in a.only:
            r = run_variant(work, recipe, name, a, sp)
            if r["ok"] and baselines.get(sp) is not None:
                r["above_baseline_gib"] = round(r["peak_gib"] - baselines[sp], 3)
            results.append(r)
            print(json.dumps(r), flush=True)
    ref = next((r for r in results if r["variant"] == REFERENCE and r["ok"]), None)
    bad = []
    for r in results:
        if r["ok"] and ref:
            r["loss_rel_diff"] = max(abs(x - y) / abs(y) for x, y in zip(r["losses"], ref["losses"]))
            if r["loss_rel_diff"] > rtol:
                bad.append(f"{r['variant']}: losses differ from {REFERENCE}'s by {r['loss_rel_diff']:.2e} (> {rtol:g})")
    text = table(results, a, device)
    print("\n" + text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "long_context.json").write_text(json.dumps({"setup": vars(a), "device": device,
                                                                            "baselines_gib": baselines,
                                                                            "results": results}, indent=1))
    for line in bad:
        print(f"error: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
