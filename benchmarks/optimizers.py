"""Peak memory and step time of each `train.optim` against transformers' Trainer with the same `optim`, full
fine-tuning and LoRA, measured in one run on the same machine, model, documents and steps (each pair by
benchmarks/loop_speed.py with `--optim NAME --only toolkit hf_trainer`), reported as ratios, and the peak
memory of each optimizer against AdamW's in the same run. The Trainer has no Muon: `muon` runs the toolkit alone.

    python benchmarks/optimizers.py --model $(bash tests/fetch_real_model.sh) --seq 128 --micro 2 --steps 6 \\
        --warmup 2 --threads 1                                     # SmolLM2-135M, full and LoRA, every optimizer
    python benchmarks/optimizers.py --hidden 64 --layers 2 --seq 64 --micro 2 --steps 4 --warmup 2 \\
        --optims adamw_torch adamw_8bit --modes full               # CI (tests/test_benchmarks.py)

Memory is each process's peak (RSS on a CPU host: the whole process, model and optimizer state included;
the CUDA allocator's peak on a GPU). Prints one JSON line per (mode, optimizer) and a Markdown table for
benchmarks/NOTES.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from toolkit.optim.optimizers import NAMES  # noqa: E402 - the repository's own package, found from here


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--optims", nargs="*", default=list(NAMES), choices=NAMES)
    p.add_argument("--modes", nargs="*", default=["full", "lora"], choices=["full", "lora"])
    p.add_argument("--model", default="")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    return p.parse_args(argv)


def trainer_has(optim: str) -> bool:
    """Whether transformers' Trainer knows `optim` (it has no Muon: then the toolkit runs alone)."""
    from transformers.training_args import OptimizerNames

    return optim in {o.value for o in OptimizerNames}


def measure(a, optim: str, mode: str) -> dict:
    who = ["toolkit", "hf_trainer"] if trainer_has(optim) else ["toolkit"]
    cmd = [sys.executable, str(HERE / "loop_speed.py"), "--optim", optim, "--only", *who,
           "--seq", str(a.seq), "--micro", str(a.micro), "--steps", str(a.steps), "--warmup", str(a.warmup),
           "--repeats", str(a.repeats), "--threads", str(a.threads), "--precision", a.precision,
           *(["--model", a.model] if a.model else ["--hidden", str(a.hidden), "--layers", str(a.layers)]),
           *(["--lora"] if mode == "lora" else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"loop_speed.py --optim {optim} ({mode}) failed:\n{proc.stderr[-3000:]}")
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    return {"mode": mode, "optim": optim, "ms_per_step": result["ms_per_step"],
            "peak_memory_mib": result["peak_memory_mib"], "memory_kind": result["peak_memory_kind"],
            "speed_vs_hf_trainer": result.get("speed_vs_hf_trainer", "-"),
            "memory_vs_hf_trainer": result.get("memory_vs_hf_trainer", "-"),
            "device": result["device"], "date": result["date"], "model": result["model"],
            "torch": result["torch"], "transformers": result["transformers"]}


def main() -> None:
    a = parse()
    rows = []
    for mode in a.modes:
        for optim in a.optims:
            row = measure(a, optim, mode)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{rows[0]['date']}, {rows[0]['device']}, {rows[0]['model']}, seq {a.seq}, micro {a.micro}, {a.precision}, "
          f"torch {rows[0]['torch']}, transformers {rows[0]['transformers']}, peak memory as {rows[0]['memory_kind']}")
    print("\n| mode | optim | toolkit ms/step | Trainer ms/step | speed vs Trainer | toolkit peak MiB | "
          "Trainer peak MiB | memory vs Trainer | toolkit memory vs its AdamW |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        adamw = next((x for x in rows if x["mode"] == r["mode"] and x["optim"] == "adamw_torch"), None)
        vs = round(r["peak_memory_mib"]["toolkit"] / adamw["peak_memory_mib"]["toolkit"], 3) if adamw else "-"
        ms, mib = r["ms_per_step"], r["peak_memory_mib"]
        print(f"| {r['mode']} | {r['optim']} | {ms['toolkit']} | {ms.get('hf_trainer', '-')} | "
              f"{r['speed_vs_hf_trainer']} | {mib['toolkit']} | {mib.get('hf_trainer', '-')} | "
              f"{r['memory_vs_hf_trainer']} | {vs} |")


if __name__ == "__main__":
    main()
