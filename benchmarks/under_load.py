"""Races in how a run ends, repeated with the CPUs busy (as on a loaded CI machine), counted.

    python benchmarks/under_load.py                        # every case, 10 tries each, 2 busy loops
    python benchmarks/under_load.py --case doctor --tries 25

Cases:
- `data-signal`: SIGTERM (or `--signal INT`) to the run's group while 2 datasets workers tokenize;
  a try fails when the exit is not 75 or a process of the run is alive right after it.
- `doctor`: `toolkit doctor` on 2 gloo processes under `accelerate launch`; a try fails on a non-zero
  exit (a rank that aborted at exit: "terminate called without an active exception").
- `full-cache`: training with HF_DATASETS_CACHE on a 200 KiB tmpfs (needs mount: root); a try fails
  when it does not end with exit 2 within 45 s (a pool teardown that hung).

Prints `CASE: F of N tries failed` per case; exit 1 if any try failed.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def data_signal(work: Path, sig: str) -> bool:
    import test_faults as tf

    out, code, _, _, proc, _ = tf.run_cell(work, "data", sig, Path(tempfile.mkdtemp()) / "cache")
    return code == 75 and tf.no_process_left(proc) == []


def doctor(work: Path, _sig: str) -> bool:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / "ddp.yaml"), "--num_processes", "2", "--main_process_port", "0",
           "-m", "toolkit", "doctor"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=300).returncode == 0


def full_cache(work: Path, _sig: str) -> bool:
    import test_faults as tf

    cache = Path(tempfile.mkdtemp()) / "cache"
    cache.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(cache)]).returncode != 0:
        raise SystemExit("full-cache: cannot mount a tmpfs here (needs root)")
    proc = tf.launch(["train", tf.recipe(work, f"cache-{os.urandom(4).hex()}")], env={"HF_DATASETS_CACHE": str(cache)})
    try:
        return proc.wait(timeout=45) == 2
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return False
    finally:
        subprocess.run(["umount", "-l", str(cache)])


CASES = {"data-signal": data_signal, "doctor": doctor, "full-cache": full_cache}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", nargs="+", choices=list(CASES), default=list(CASES))
    p.add_argument("--tries", type=int, default=10)
    p.add_argument("--busy", type=int, default=2, help="busy-loop processes beside the runs (default 2)")
    p.add_argument("--signal", choices=["TERM", "INT"], default="TERM", help="data-signal: which signal")
    a = p.parse_args()
    from helpers import alpaca_rows, write_jsonl

    work = Path(tempfile.mkdtemp(prefix="under_load_"))
    write_jsonl(work / "train.jsonl", alpaca_rows(3000, seed=21))  # as tests/test_faults.py's data
    write_jsonl(work / "eval.jsonl", alpaca_rows(8, seed=22))
    loops, failed_any = busy(a.busy), False
    try:
        for case in a.case:
            failed = sum(not CASES[case](work, a.signal) for _ in range(a.tries))
            failed_any |= failed > 0
            print(f"{case}: {failed} of {a.tries} tries failed ({a.busy} busy loops)", flush=True)
    finally:
        for loop in loops:
            loop.kill()
    return 1 if failed_any else 0


if __name__ == "__main__":
    sys.exit(main())
