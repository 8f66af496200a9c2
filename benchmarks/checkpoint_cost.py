"""What the portable state costs per checkpoint, against the backend's own state, in one run.

Trains a few steps of a real model (SmolLM2-135M-Instruct, fetched by tests/fetch_real_model.sh;
`--preset NAME` for a built-in one) with a checkpoint every step, under each launch given, with
`checkpoint.portable` on. Every checkpoint logs `checkpoint step-N in T s (backend state A s,
portable B s, read-back C s)`; this script takes those lines (the first checkpoint left out as
warm-up), the bytes of `portable/` and of everything else in the last checkpoint, and prints the
portable part as a ratio of the backend's own state, in time and in bytes.

    .venv/bin/python benchmarks/checkpoint_cost.py                       # single process, full fine-tuning
    .venv/bin/python benchmarks/checkpoint_cost.py --launch single ddp zero3 fsdp --lora
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^checkpoint step-(\d+) in ([\d.]+) s \(backend state ([\d.]+) s, portable ([\d.]+) s, "
                  r"read-back ([\d.]+) s\)")


def real_model() -> str:
    proc = subprocess.run(["bash", str(ROOT / "tests" / "fetch_real_model.sh"), sys.executable], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        sys.exit(f"checkpoint_cost: {proc.stderr.strip() or 'cannot fetch the real model'}; use --preset")
    return proc.stdout.strip()


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launch", nargs="+", default=["single"], help="single, or accelerate_configs/NAME.yaml names")
    p.add_argument("--preset", default=None, help="a built-in preset instead of the real model")
    p.add_argument("--lora", action="store_true", help="LoRA instead of full fine-tuning")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    a = p.parse_args()
    model = {"preset": a.preset} if a.preset else {"path": real_model()}
    results = []
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        rows = [{"text": " ".join(f"word{i * 7 + j}" for j in range(a.seq))} for i in range(64)]
        (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        for launch in a.launch:
            out = d / launch
            world = 1 if launch == "single" else 2
            recipe = {"output_dir": str(out), "model": model, "lora": {"enabled": a.lora},
                      "data": {"train_files": [str(d / "train.jsonl")], "format": "text", "max_seq_len": a.seq},
                      "train": {"micro_batch_size": 4 // world, "gradient_accumulation_steps": 1, "max_steps": a.steps,
                                "warmup_steps": 0, "eval_every_steps": 0, "log_every_steps": 1000},
                      "checkpoint": {"every_steps": 1, "keep_last": 1, "portable": True}}
            (d / f"{launch}.yaml").write_text(yaml.safe_dump(recipe))
            cmd = [sys.executable, "-m", "toolkit", "train", str(d / f"{launch}.yaml")]
            if launch != "single":
                cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                       str(ROOT / "accelerate_configs" / f"{launch}.yaml"), "--num_processes", "2",
                       "--main_process_port", "0", "-m", *cmd[2:]]
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"checkpoint_cost: {launch} failed:\n{proc.stderr[-3000:]}")
            found = [m for line in (proc.stdout + proc.stderr).splitlines() if (m := LINE.match(line.strip()))][1:]
            last = sorted((out / "checkpoints").glob("step-*"))[-1]
            portable_bytes = folder_bytes(last / "portable")
            backend_seconds = statistics.median(float(m[3]) for m in found)
            portable_seconds = statistics.median(float(m[4]) for m in found)
            results.append({
                "launch": launch, "processes": world, "lora": a.lora, "checkpoints_timed": len(found),
                "seconds_backend_state": backend_seconds, "seconds_portable": portable_seconds,
                "seconds_read_back": statistics.median(float(m[5]) for m in found),
                "seconds_total": statistics.median(float(m[2]) for m in found),
                "mib_backend_state": round((folder_bytes(last) - portable_bytes) / 2**20, 1),
                "mib_portable": round(portable_bytes / 2**20, 1),
                "portable_vs_backend_time": round(portable_seconds / backend_seconds, 3) if backend_seconds else None,
                "portable_vs_backend_bytes": round(portable_bytes / (folder_bytes(last) - portable_bytes), 3)})
            print(json.dumps(results[-1]), flush=True)


if __name__ == "__main__":
    main()
