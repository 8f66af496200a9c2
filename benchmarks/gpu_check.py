"""Every GPU check in one command, in pieces of under 10 minutes each (`make gpu-check`).

    python benchmarks/gpu_check.py --plan             # what would run: pieces, commands, time limits
    python benchmarks/gpu_check.py                    # all pieces (under 50 minutes in all)
    python benchmarks/gpu_check.py --only gpu-bf16    # one piece (a device session has 30 minutes)

Each piece runs with its own time limit; one that fails or runs out is reported and the next one
runs. At the end a section is appended to benchmarks/NOTES.md (and written to $OUT/gpu_notes.md
when $OUT is set, as on a lent device machine, whose files do not come back otherwise): date, GPU,
versions, and for each piece its command, exit status, duration and the figures it printed. Full
logs go to $OUT (or --log-dir). The figures are what the pieces measured; nothing is judged here.

A device image that lacks the toolkit's dependencies (DeepSpeed, datasets, TRL, or holds other
versions than constraints.txt) gets them from wheels in .whl/, made on a host with the package
index by `make gpu-wheels` and carried along; they are installed into a temporary folder first.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
LOOP = ["benchmarks/loop_speed.py"]
# A ~1B-parameter Llama (hidden 2048 x 16 layers), bf16, 2,048-token rows: the size of the GPU goals.
ONE_B = ["--hidden", "2048", "--layers", "16", "--seq", "2048", "--micro", "4", "--precision", "bf16",
         "--steps", "20", "--warmup", "5", "--repeats", "1"]

# (name, command, time limit in seconds, what it measures)
PIECES = [
    ("gpu-bf16", [PY, "-m", "pytest", "-s", "-q", "-m", "gpu", "tests/test_gpu.py", "-k", "bf16"], 590,
     "bf16 learns what fp32 learns: one process and ZeRO-1/2/3 (+ CPU offload); full, LoRA, LoRA over a bf16 base"),
    ("gpu-other", [PY, "-m", "pytest", "-s", "-q", "-m", "gpu", "tests/test_gpu.py", "-k", "not bf16"], 590,
     "fp16 with loss scaling, overflow skips, DeepSpeed's minimum scale, QLoRA, the varlen flash kernel, "
     "fused AdamW and compile"),
    ("loop-1b", [PY, *LOOP, *ONE_B, "--only", "toolkit", "plain_pytorch", "trl",
                 "--toolkit", "data.padding_free=true"], 590,
     "useful tokens/s and peak memory against a hand-written loop and TRL, ~1B model, bf16, padding-free"),
    ("loop-1b-compile", [PY, *LOOP, *ONE_B, "--only", "toolkit", "plain_pytorch",
                         "--toolkit", "data.padding_free=true", "train.compile=true"], 590,
     "the same with train.compile against the hand-written loop"),
    ("long-context", [PY, "benchmarks/long_context.py", "--hidden", "2048", "--layers", "22", "--seq", "32768",
                      "--precision", "bf16", "--attn", "varlen", "--steps", "3", "--timeout", "150",
                      "--only", "checkpointing", "tiled", "offload", "tiled_offload"], 590,
     "one 32k-token sequence per step on a ~1B model: peak memory and tokens/s with tiled MLP and activation offload"),
]
TOTAL_LIMIT_S = 50 * 60


def plan() -> list[dict]:
    return [{"name": n, "command": c, "timeout_s": t, "what": w} for n, c, t, w in PIECES]


def loop_speed():
    spec = importlib.util.spec_from_file_location("loop_speed", ROOT / "benchmarks" / "loop_speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_plan() -> list[str]:
    """What is wrong with the plan itself, found without a GPU (a CPU test runs this)."""
    problems = []
    if sum(t for _, _, t, _ in PIECES) > TOTAL_LIMIT_S:
        problems.append(f"the pieces' limits add up to more than {TOTAL_LIMIT_S} s")
    for name, command, timeout, _ in PIECES:
        if timeout >= 600:
            problems.append(f"{name}: a limit of {timeout} s is not under 10 minutes")
        if command[1:2] == LOOP:
            try:
                loop_speed().parse(command[2:])
            except SystemExit:
                problems.append(f"{name}: loop_speed.py refuses {shlex.join(command[2:])}")
    return problems


def install_wheels(env: dict, site: str) -> str:
    """Wheels in .whl/ (make gpu-wheels) whose package this Python lacks or holds in another version,
    installed into `site` (a temporary folder) ahead of the image's own packages."""
    from importlib import metadata

    def differs(wheel: Path) -> bool:
        name, version = wheel.name.split("-")[:2]
        try:
            return metadata.version(name) != version
        except metadata.PackageNotFoundError:
            return True

    wheels = [w for w in sorted((ROOT / ".whl").glob("*.whl")) if differs(w)]
    if not wheels:
        return "no wheels needed from .whl/ (none there, or the installed versions match them)"
    proc = subprocess.run([PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--no-cache-dir", "--target", site, *map(str, wheels)], capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return f"installing {len(wheels)} wheels from .whl/ failed ({last}): the image's own packages"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")]))
    return f"{len(wheels)} wheels from .whl/ installed into {site}: " + ", ".join(w.name.split("-")[0] for w in wheels)


def versions(env: dict) -> str:
    code = ("import importlib.metadata as m, torch\n"
            "names = ['torch', 'accelerate', 'transformers', 'peft', 'datasets', 'deepspeed', 'trl']\n"
            "def v(n):\n    try:\n        return m.version(n)\n"
            "    except m.PackageNotFoundError:\n        return 'missing'\n"
            "gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA GPU'\n"
            "print(gpu + '; ' + ', '.join(f'{n} {v(n)}' for n in names) + f'; CUDA {torch.version.cuda}')")
    proc = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True)
    return proc.stdout.strip() or proc.stderr.strip().splitlines()[-1]


def figures(output: str) -> list[str]:
    """The lines worth keeping: figures the tests print as JSON, the benchmark's table row, pytest's tally."""
    keep = []
    for line in output.splitlines():
        s = line.strip()
        if s.startswith("{") or s.startswith("| ") or (s.startswith("=") and ("passed" in s or "failed" in s)) \
                or s.endswith(("passed", "skipped", "failed")) and " in " in s:
            keep.append(s[:2000])
    return keep


def run_piece(name: str, command: list[str], timeout: int, env: dict, logs: Path) -> dict:
    began = time.monotonic()
    log = logs / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            code = "timed out"
    seconds = time.monotonic() - began
    text = log.read_text(errors="replace")
    print(f"{name}: exit {code} after {seconds:.0f} s (log {log})", flush=True)
    return {"name": name, "command": shlex.join(c.replace(PY, "python") for c in command), "exit": code,
            "seconds": round(seconds), "figures": figures(text), "tail": text.splitlines()[-5:]}


def adjusted(command: list[str], a: argparse.Namespace) -> list[str]:
    """A piece's command with --workers and --loop-steps applied."""
    if command[1:3] == ["-m", "pytest"] and a.workers > 1:
        return [*command, "-n", str(a.workers), "--dist", "load"]
    if command[1:2] == LOOP and a.loop_steps:
        out = list(command)
        out[out.index("--steps") + 1] = str(a.loop_steps)
        out[out.index("--warmup") + 1] = str(max(1, a.loop_steps // 3))
        return out
    return command


def notes_section(results: list[dict], setup: str, wheels: str) -> str:
    lines = [f"\n## GPU check {datetime.date.today().isoformat()} (`python benchmarks/gpu_check.py`)\n",
             f"{setup}. {wheels}.\n"]
    for r in results:
        lines.append(f"- **{r['name']}**: `{r['command']}`: exit {r['exit']} after {r['seconds']} s")
        for f in r["figures"] or r["tail"]:
            lines.append(f"    {f}")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", action="store_true", help="print the pieces and check them; run nothing")
    p.add_argument("--json", action="store_true", help="with --plan: as JSON")
    p.add_argument("--only", nargs="+", choices=[n for n, *_ in PIECES], help="these pieces only")
    p.add_argument("--log-dir", default=os.environ.get("OUT"),
                   help="where the full logs go (default $OUT or a temp folder)")
    p.add_argument("--workers", type=int, default=1,
                   help="pytest pieces: run their tests in N processes on the one GPU (pytest-xdist, --dist load)")
    p.add_argument("--timeout", type=int, help="cap every piece's time limit at this many seconds")
    p.add_argument("--loop-steps", type=int, help="benchmark pieces: this many steps (the first third left out)")
    p.add_argument("--allow-cpu", action="store_true", help="run on a host without CUDA too (the script's own check)")
    p.add_argument("--notes", default=str(ROOT / "benchmarks" / "NOTES.md"),
                   help="the notes file the section is appended to")
    a = p.parse_args()
    problems = check_plan()
    if a.plan:
        if a.json:
            print(json.dumps({"pieces": plan(), "total_limit_s": TOTAL_LIMIT_S, "problems": problems}))
        else:
            for piece in plan():
                print(f"{piece['name']} (at most {piece['timeout_s']} s): {piece['what']}\n    "
                      f"{shlex.join(piece['command'])}")
            print(f"in all at most {sum(t for *_, t, _ in PIECES)} s" + "".join(f"\nproblem: {x}" for x in problems))
        return 1 if problems else 0
    if problems:
        print("gpu_check: " + "; ".join(problems), file=sys.stderr)
        return 2
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="gpu_check_site_") as site:  # the wheels, for this run only
        return run_pieces(a, env, site)


def run_pieces(a: argparse.Namespace, env: dict, site: str) -> int:
    """The pieces `a` selects, on a CUDA host (or with --allow-cpu); the log folder is made only for a
    run that goes ahead, so a refusal leaves nothing behind (tests/test_gpu_check.py)."""
    wheels = install_wheels(env, site)
    setup = versions(env)
    print(f"gpu_check: {setup}", flush=True)
    if setup.startswith("no CUDA GPU") and not a.allow_cpu:
        print("error: gpu_check: no CUDA GPU here; its GPU tests would only skip (--allow-cpu runs them anyway)",
              file=sys.stderr)
        return 2
    logs = Path(a.log_dir or tempfile.mkdtemp(prefix="gpu_check_"))
    logs.mkdir(parents=True, exist_ok=True)
    env["TOOLKIT_GPU_FIGURES"] = str(logs / "gpu_figures.jsonl")
    results = [run_piece(n, adjusted(c, a), min(t, a.timeout or t), env, logs)
               for n, c, t, _ in PIECES if not a.only or n in a.only]
    section = notes_section(results, setup, wheels)
    with open(a.notes, "a") as f:
        f.write(section)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_notes.md").write_text(section)
    print(section)
    return 0 if all(r["exit"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
