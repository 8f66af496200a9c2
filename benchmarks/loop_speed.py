"""Throughput of `toolkit train` against a hand-written PyTorch loop and the Hugging Face Trainer,
measured in the same run on the same machine, model, data and batch, reported as ratios.

    python benchmarks/loop_speed.py                      # CPU-sized defaults
    python benchmarks/loop_speed.py --hidden 1024 --layers 8 --seq 1024 --micro 8 --precision bf16   # a GPU

Each contender runs as its own process and records the wall-clock time at the end of every
optimizer step (the toolkit in metrics.jsonl's `time` field, the others through a callback).
The time per step is the median interval between consecutive step ends after --warmup steps: the
steady-state loop with everything it does per step (forward, backward, clipping, optimizer and
scheduler, logging, metrics, progress bar, data loading), without imports, model loading and data
preparation, which are reported separately as each process's total wall time. The median over
--repeats processes is reported; contenders are interleaved so drift hits all alike.

All three train the same local Hugging Face model folder (written here, loaded through the real
`model.path` code) on documents of exactly `--seq` tokens, so no batch carries padding and every
contender processes micro x seq tokens per micro-batch. Results go to stdout as one JSON line and
a Markdown row for benchmarks/NOTES.md.
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
CONTENDERS = ("toolkit", "plain_pytorch", "hf_trainer")


def prepare(work: Path, a) -> None:
    """Model folder, tokenizer and a text dataset of documents that tokenize to exactly a.seq."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT))
    from toolkit.model import build_byte_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=262, hidden_size=a.hidden, intermediate_size=int(a.hidden * 2.75) // 8 * 8,
                         num_hidden_layers=a.layers, num_attention_heads=max(1, a.hidden // 64),
                         num_key_value_heads=max(1, a.hidden // 128), max_position_embeddings=a.seq,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(work / "model")
    build_byte_tokenizer().save_pretrained(work / "model")
    rng = random.Random(0)
    n_docs = a.steps * a.micro * a.accumulation
    alphabet = "abcdefghijklmnopqrstuvwxyz ,."
    with open(work / "train.jsonl", "w") as f:  # bos + (seq - 2) bytes + eos = seq tokens
        for _ in range(n_docs):
            f.write(json.dumps({"text": "".join(rng.choice(alphabet) for _ in range(a.seq - 2))}) + "\n")
    recipe = {
        "output_dir": str(work / "toolkit_run"), "overwrite": True, "seed": 0,
        "model": {"path": str(work / "model")},
        "data": {"train_files": [str(work / "train.jsonl")], "format": "text", "max_seq_len": a.seq,
                 "packing": False, "eval_fraction": 0.0},
        "train": {"micro_batch_size": a.micro, "gradient_accumulation_steps": a.accumulation,
                  "learning_rate": 1e-4, "warmup_steps": 2, "precision": a.precision, "max_grad_norm": 1.0,
                  "log_every_steps": 10},
    }
    import yaml

    (work / "recipe.yaml").write_text(yaml.safe_dump(recipe))


def batches(work: Path, a, steps: int):
    """The same token batches the toolkit reads (bos + bytes + eos), as tensors."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(work / "model")
    lines = (work / "train.jsonl").read_text().splitlines()[: steps * a.micro * a.accumulation]
    ids = [[tok.bos_token_id] + tok(json.loads(line)["text"], add_special_tokens=False)["input_ids"]
           + [tok.eos_token_id] for line in lines]
    assert all(len(x) == a.seq for x in ids), "documents must tokenize to exactly --seq tokens"
    return torch.tensor(ids).view(steps * a.accumulation, a.micro, a.seq)


def run_plain_pytorch(work: Path, a, steps: int) -> None:
    """What a careful engineer writes by hand: AdamW, warmup + cosine, clipping, accumulation,
    the loss read back every step."""
    import math

    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(work / "model").to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / 2 if s < 2 else 0.5 * (1 + math.cos(math.pi * (s - 2) / max(1, steps - 2))))
    data = batches(work, a, steps)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.precision)
    stamps = []
    for step in range(steps):
        for i in range(a.accumulation):
            ids = data[step * a.accumulation + i].to(device, non_blocking=True)
            with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
                loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
            (loss / a.accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        stamps.append(time.time())
    (work / "stamps_plain_pytorch.json").write_text(json.dumps(stamps))


def run_hf_trainer(work: Path, a, steps: int) -> None:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    stamps = []

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.time())

    data = batches(work, a, steps).view(-1, a.seq)
    ds = datasets.Dataset.from_dict({"input_ids": data.tolist(), "attention_mask": torch.ones_like(data).tolist(),
                                     "labels": data.tolist()})
    args = TrainingArguments(
        output_dir=str(work / "trainer_run"), per_device_train_batch_size=a.micro,
        gradient_accumulation_steps=a.accumulation, max_steps=steps, learning_rate=1e-4, warmup_steps=2,
        lr_scheduler_type="cosine", max_grad_norm=1.0, logging_steps=10, save_strategy="no", report_to="none",
        use_cpu=not torch.cuda.is_available(), bf16=a.precision == "bf16", fp16=a.precision == "fp16",
        dataloader_num_workers=0, disable_tqdm=True, seed=0)
    model = AutoModelForCausalLM.from_pretrained(work / "model")
    Trainer(model=model, args=args, train_dataset=ds, callbacks=[Stamp()]).train()
    (work / "stamps_hf_trainer.json").write_text(json.dumps(stamps))


def run_toolkit(work: Path, a, steps: int) -> None:
    cmd = [sys.executable, "-m", "toolkit", "train", str(work / "recipe.yaml"), f"train.max_steps={steps}"]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (work / "toolkit_run" / "metrics.jsonl").read_text().splitlines()]
    (work / "stamps_toolkit.json").write_text(json.dumps([r["time"] for r in rows if "loss" in r]))


def timed(work: Path, a, who: str) -> tuple[float, float]:
    """(median seconds per steady-state step, wall time of the whole process)."""
    cmd = [sys.executable, __file__, "--_run", who, "--_work", str(work)] + forwarded(a)
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"{who} failed:\n{proc.stderr[-3000:]}")
    stamps = json.loads((work / f"stamps_{who}.json").read_text())
    assert len(stamps) == a.steps, (who, len(stamps))
    intervals = [b - a_ for a_, b in zip(stamps[a.warmup:], stamps[a.warmup + 1:])]
    return statistics.median(intervals), wall


def forwarded(a) -> list[str]:
    return ["--hidden", str(a.hidden), "--layers", str(a.layers), "--seq", str(a.seq), "--micro", str(a.micro),
            "--accumulation", str(a.accumulation), "--precision", a.precision,
            "--steps", str(a.steps), "--warmup", str(a.warmup)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--accumulation", type=int, default=1)
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the per-step median")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", choices=CONTENDERS, nargs="*", default=list(CONTENDERS))
    p.add_argument("--_run", choices=CONTENDERS, help=argparse.SUPPRESS)
    p.add_argument("--_work", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a._run:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        {"toolkit": run_toolkit, "plain_pytorch": run_plain_pytorch, "hf_trainer": run_hf_trainer}[a._run](
            Path(a._work), a, a.steps)
        return

    with tempfile.TemporaryDirectory(prefix="loop_speed_") as tmp:
        work = Path(tmp)
        prepare(work, a)
        per_step = {who: [] for who in a.only}
        walls = {who: [] for who in a.only}
        for r in range(a.repeats):  # interleaved, so drift in the machine's speed hits all alike
            for who in a.only:
                step_s, wall = timed(work, a, who)
                per_step[who].append(step_s)
                walls[who].append(wall)
                print(f"repeat {r + 1}/{a.repeats} {who}: {step_s * 1000:.1f} ms/step, process {wall:.1f} s",
                      file=sys.stderr)
    tokens_per_step = a.micro * a.accumulation * a.seq
    import torch

    result = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)",
        "torch": torch.__version__, "precision": a.precision,
        "model": f"llama hidden {a.hidden} x {a.layers} layers", "tokens_per_step": tokens_per_step,
        "steps": a.steps, "warmup": a.warmup, "repeats": a.repeats,
        "ms_per_step": {w: round(statistics.median(v) * 1000, 1) for w, v in per_step.items()},
        "ms_per_step_best": {w: round(min(v) * 1000, 1) for w, v in per_step.items()},
        "ms_per_step_all_repeats": {w: [round(x * 1000, 1) for x in v] for w, v in per_step.items()},
        "process_seconds": {w: round(statistics.median(v), 1) for w, v in walls.items()},
    }
    result["tokens_per_second"] = {w: round(tokens_per_step / (ms / 1000)) for w, ms in result["ms_per_step"].items()}
    if "toolkit" in per_step:  # > 1: the toolkit is faster. On a shared host the best of the repeats
        for other in sorted(per_step.keys() - {"toolkit"}):  # (as timeit reports) is the steadier figure
            for kind, key in (("", "ms_per_step"), ("_best", "ms_per_step_best")):
                result[f"speed_vs_{other}{kind}"] = round(result[key][other] / result[key]["toolkit"], 3)
    print(json.dumps(result))
    ms, best = result["ms_per_step"], result["ms_per_step_best"]
    print(f"| {result['date']} | {result['device']} | {result['model']}, seq {a.seq}, micro {a.micro}, "
          f"{a.precision} | " + " | ".join(f"{ms.get(w, '-')} ({best.get(w, '-')})" for w in CONTENDERS) + " | "
          + " | ".join(f"{result.get(f'speed_vs_{w}', '-')} ({result.get(f'speed_vs_{w}_best', '-')})"
                       for w in CONTENDERS[1:]) + " |")

if __name__ == "__main__":
    main()
