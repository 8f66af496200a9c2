"""Every GPU check in one command, in pieces of under 10 minutes each (`make gpu-check`).

    python benchmarks/gpu_check.py --plan               # what would run: pieces, commands, time limits
    python benchmarks/gpu_check.py                      # all pieces at full size (under 70 minutes in all)
    python benchmarks/gpu_check.py --only gpu-bf16      # one piece
    python benchmarks/gpu_check.py --budget 540         # what fits in 540 s, most valuable first (a lent machine)
    python benchmarks/gpu_check.py --plan --budget 540  # what that would run, and what it leaves for the next lease

Each piece runs with its own time limit; one that fails or runs out is reported and the next one
runs. At the end a section is appended to benchmarks/NOTES.md (and to $OUT/gpu_notes.md when $OUT
is set, as on a lent device machine, whose files do not come back otherwise): date, GPU, versions,
and for each piece its command, exit status, duration and the figures it printed. Full logs go to
$OUT (or --log-dir). The figures are what the pieces measured; nothing is judged here.

A lent device machine gives a session 15 minutes, its start included, and a call at most 10. With
--budget SECONDS the pieces are taken in PRIORITY order, each at full size where its limit fits in
what remains, else scaled down (fewer steps, pytest-xdist processes, fewer variants) with its limit
cut to what remains, and left out when that is under its minimum; the fixed costs (reading the
versions, installing wheels) are subtracted first. The left-out pieces are named, with the
`--only` that runs them in the next lease.

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
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
LOOP = ["benchmarks/loop_speed.py"]
# A ~1B-parameter Llama (hidden 2048 x 16 layers), bf16, 2,048-token rows: the size of the GPU goals.
ONE_B = ["--hidden", "2048", "--layers", "16", "--seq", "2048", "--micro", "4", "--precision", "bf16",
         "--steps", "20", "--warmup", "5", "--repeats", "1"]
TEST = [PY, "-m", "pytest", "-s", "-q", "-rs", "-m", "gpu", "tests/test_gpu.py"]  # -rs: each skip with its reason
FEWER_STEPS = {"--steps": ["12"], "--warmup": ["4"]}  # 8 steps of steady state
XDIST = {"-n": ["8"], "--dist": ["load"]}  # 8 test processes sharing the one GPU


@dataclass(frozen=True)
class Piece:
    name: str
    command: list[str]
    timeout_s: int  # its limit at full size
    what: str
    scaled: dict[str, list[str]]  # under --budget when the full size does not fit: these options replaced or added,
    scaled_timeout_s: int  # this limit,
    minimum_s: int  # and not started with less time than this. Estimates, until a lease measures them: at 8
    # processes gpu-bf16 took 185 s (NOTES.md); the loop benchmarks have not run on a GPU.


# Tests no GPU has passed yet (their own piece, first in a short lease): QLoRA under ZeRO-3 / FSDP2 and a GPU run's
# checkpoints (read back across devices since the H200 run of 2026-11-27), the varlen kernel's assertion that the
# flash path ran, GRPO after the temperature change, fp8; and those that passed once there (LoRA + ZeRO-3 +
# gradient checkpointing, QLoRA, Liger's kernels), cheap to keep here.
FIRST = "grpo or gradient_checkpointing or qlora or liger or fp8 or checkpoints_read_back or varlen"

PIECES = [
    Piece("gpu-first", [*TEST, "-k", FIRST, "-n", "4", "--dist", "load"], 240,
          "never run on a GPU before: GRPO (LoRA, beta 0.04, num_iterations 2; one process and ZeRO-3), LoRA + "
          "ZeRO-3 + gradient checkpointing in bf16, QLoRA, model.kernels=liger, mixed_precision fp8",
          {"-n": ["6"]}, 220, 150),
    Piece("gpu-bf16", [*TEST, "-k", f"bf16 and not ({FIRST})"], 590,
          "bf16 learns what fp32 learns: one process and ZeRO-1/2/3 (+ CPU offload); full, LoRA, LoRA over a bf16 base",
          XDIST, 220, 190),
    Piece("gpu-other", [*TEST, "-k", f"not bf16 and not ({FIRST})"], 590,
          "fp16 with loss scaling, overflow skips, DeepSpeed's minimum scale, QLoRA, the varlen flash kernel, "
          "fused AdamW and compile", XDIST, 210, 150),
    Piece("loop-1b", [PY, *LOOP, *ONE_B, "--only", "toolkit", "plain_pytorch", "trl",
                      "--toolkit", "data.padding_free=true"], 590,
          "useful tokens/s and peak memory against a hand-written loop and TRL, ~1B model, bf16, padding-free",
          FEWER_STEPS, 240, 150),
    Piece("loop-8b-lora", [PY, *LOOP, "--hidden", "4096", "--layers", "32", "--intermediate", "14336", "--heads", "32",
                           "--kv-heads", "8", "--seq", "2048", "--micro", "2", "--precision", "bf16",
                           "--model-dtype", "bf16", "--lora", "--steps", "12", "--warmup", "4", "--repeats", "1",
                           "--only", "toolkit", "plain_pytorch", "trl",
                           "--toolkit", "model.dtype=bf16", "data.padding_free=true"], 590,
          "LoRA (r 16, every linear layer) over a bf16 Llama-3-8B-shaped model (vocabulary 262, 7.5B parameters): "
          "useful tokens/s and peak memory against a hand-written loop and TRL (goal: >= 1.3x TRL at <= its memory)",
          {"--steps": ["8"], "--warmup": ["3"]}, 330, 240),
    Piece("loop-1b-compile", [PY, *LOOP, *ONE_B, "--only", "toolkit", "plain_pytorch",
                              "--toolkit", "data.padding_free=true", "train.compile=true"], 590,
          "the same with train.compile against the hand-written loop", FEWER_STEPS, 300, 200),
    Piece("long-context", [PY, "benchmarks/long_context.py", "--hidden", "2048", "--layers", "22", "--seq", "32768",
                           "--precision", "bf16", "--attn", "varlen", "--steps", "3", "--timeout", "150",
                           "--only", "checkpointing", "tiled", "offload", "tiled_offload"], 590,
          "one 32k-token sequence per step on a ~1B model: peak memory and tokens/s with tiled MLP and activation "
          "offload",
          {"--only": ["checkpointing", "tiled_offload"], "--timeout": ["100"]}, 210, 150),
]
BY_NAME = {p.name: p for p in PIECES}
# What a short lease runs first: the tests no GPU has run, the everyday case's benchmark (never measured on a GPU
# yet), the other tests, the bf16 tests, compile, long context.
PRIORITY = ["gpu-first", "loop-1b", "loop-8b-lora", "gpu-other", "gpu-bf16", "loop-1b-compile", "long-context"]
TOTAL_LIMIT_S = 70 * 60
VERSIONS_S = 15  # the fixed costs of a run: importing torch to read the GPU and the versions,
WHEELS_S = 60  # and installing the wheels of .whl/ where this Python needs them (estimates)


def plan() -> list[dict]:
    """Every piece at full size, in PIECES order (no --budget)."""
    return [{"name": p.name, "command": p.command, "timeout_s": p.timeout_s, "what": p.what} for p in PIECES]


def fixed_costs() -> list[tuple[str, int]]:
    costs = [("reading the GPU and versions", VERSIONS_S)]
    if wheels := needed_wheels():
        costs.append((f"installing {len(wheels)} wheels from .whl/", WHEELS_S))
    return costs


def budget_plan(budget_s: int, fixed_s: int, names: list[str] | None = None) -> tuple[list[dict], list[str]]:
    """The pieces (of `names`, default all) that fit in budget_s seconds after fixed_s, in PRIORITY order:
    each at full size where its limit fits in what remains, else scaled down with its limit cut to what
    remains if that is at least its minimum; and the names of those left out."""
    remaining = budget_s - fixed_s
    chosen, left_out = [], []
    for p in (BY_NAME[n] for n in PRIORITY if not names or n in names):
        if p.timeout_s <= remaining:
            entry = {"command": p.command, "timeout_s": p.timeout_s, "scaled": False}
        elif min(remaining, p.scaled_timeout_s) >= p.minimum_s:
            entry = {"command": with_options(p.command, p.scaled), "timeout_s": min(remaining, p.scaled_timeout_s),
                     "scaled": True}
        else:
            left_out.append(p.name)
            continue
        chosen.append({"name": p.name, **entry, "minimum_s": p.minimum_s, "what": p.what})
        remaining -= entry["timeout_s"]
    return chosen, left_out


def with_options(command: list[str], options: dict[str, list[str]]) -> list[str]:
    """`command` with each option's values replaced (those up to the next option), or the option added."""
    out = list(command)
    for option, values in options.items():
        if option in out:
            start = end = out.index(option) + 1
            while end < len(out) and not out[end].startswith("-"):
                end += 1
            out[start:end] = values
        else:
            out += [option, *values]
    return out


def loop_speed():
    spec = importlib.util.spec_from_file_location("loop_speed", ROOT / "benchmarks" / "loop_speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_plan() -> list[str]:
    """What is wrong with the plan itself, found without a GPU (a CPU test runs this)."""
    problems = []
    if sum(p.timeout_s for p in PIECES) > TOTAL_LIMIT_S:
        problems.append(f"the pieces' limits add up to more than {TOTAL_LIMIT_S} s")
    if sorted(PRIORITY) != sorted(BY_NAME):
        problems.append("PRIORITY does not name every piece once")
    for p in PIECES:
        if not p.minimum_s <= p.scaled_timeout_s <= p.timeout_s < 600:
            problems.append(f"{p.name}: its limits are not minimum <= scaled down <= full size < 600 s")
        for command in (p.command, with_options(p.command, p.scaled)):
            if command[1:2] == LOOP:
                try:
                    loop_speed().parse(command[2:])
                except SystemExit:
                    problems.append(f"{p.name}: loop_speed.py refuses {shlex.join(command[2:])}")
    return problems


def needed_wheels() -> list[Path]:
    """Wheels in .whl/ (make gpu-wheels) whose package this Python lacks or holds in another version."""
    from importlib import metadata

    def differs(wheel: Path) -> bool:
        name, version = wheel.name.split("-")[:2]
        try:
            return metadata.version(name) != version
        except metadata.PackageNotFoundError:
            return True

    return [w for w in sorted((ROOT / ".whl").glob("*.whl")) if differs(w)]


def slim_wheels(cuda_major: str) -> str:
    """bitsandbytes' wheel in .whl/ without its libraries for other CUDA majors and ROCm (the lent machine's
    image has one CUDA): the wheels must fit the 64 MiB that travels with a call. pip installs a wheel whose
    RECORD names files it no longer holds."""
    import re
    import zipfile

    said = []
    for wheel in sorted((ROOT / ".whl").glob("bitsandbytes-*.whl")):
        keep = re.compile(rf"libbitsandbytes_(cpu|cuda{cuda_major}\d+)\.")
        with zipfile.ZipFile(wheel) as src:
            items = [i for i in src.infolist() if "libbitsandbytes_" not in i.filename or keep.search(i.filename)]
            if len(items) == len(src.infolist()):
                continue
            slim = wheel.with_suffix(".slim")
            with zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
                for item in items:
                    dst.writestr(item, src.read(item))
        before = wheel.stat().st_size
        slim.replace(wheel)
        said.append(f"{wheel.name}: {before / 2**20:.1f} -> {wheel.stat().st_size / 2**20:.1f} MiB (CUDA {cuda_major} "
                    "and CPU libraries)")
    return "; ".join(said) or "nothing to slim"


def install_wheels(env: dict, site: str) -> str:
    """The needed wheels, installed into `site` (a temporary folder) ahead of the image's own packages."""
    wheels = needed_wheels()
    if not wheels:
        return "no wheels needed from .whl/ (none there, or the installed versions match them)"
    began = time.monotonic()
    proc = subprocess.run([PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--no-cache-dir", "--target", site, *map(str, wheels)], capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return f"installing {len(wheels)} wheels from .whl/ failed ({last}): the image's own packages"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")]))
    return (f"{len(wheels)} wheels from .whl/ installed into {site} in {time.monotonic() - began:.0f} s: "
            + ", ".join(w.name.split("-")[0] for w in wheels))


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
    """The lines worth keeping: figures the tests print as JSON, the benchmark's table row and each of its
    contenders' lines (which survive a piece stopped at its limit), pytest's tally."""
    keep = []
    for line in output.splitlines():
        s = line.strip()
        if s.startswith(("{", "| ", "repeat ")) or (s.startswith("=") and ("passed" in s or "failed" in s)) \
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
    """A piece's command with --workers and --loop-steps applied (over a scaled-down piece's own)."""
    if command[1:3] == ["-m", "pytest"] and a.workers > 1:
        return with_options(command, {"-n": [str(a.workers)], "--dist": ["load"]})
    if command[1:2] == LOOP and a.loop_steps:
        return with_options(command, {"--steps": [str(a.loop_steps)], "--warmup": [str(max(1, a.loop_steps // 3))]})
    return command


def selected(a: argparse.Namespace) -> tuple[list[dict], list[str]]:
    """The pieces to run with their commands and limits, and those a --budget leaves out."""
    if a.budget is None:
        pieces = [p for p in plan() if not a.only or p["name"] in a.only]
        left_out = []
    else:
        pieces, left_out = budget_plan(a.budget, sum(s for _, s in fixed_costs()), a.only)
    return [{**p, "command": adjusted(p["command"], a)} for p in pieces], left_out


def next_lease(a: argparse.Namespace, left_out: list[str]) -> str:
    return f'make gpu-check GPU_CHECK_ARGS="--budget {a.budget} --only {" ".join(left_out)}"'


def print_plan(a: argparse.Namespace, pieces: list[dict], left_out: list[str], problems: list[str]) -> None:
    if a.json:
        out = {"pieces": pieces, "total_limit_s": TOTAL_LIMIT_S, "problems": problems}
        if a.budget is not None:
            out |= {"budget_s": a.budget, "fixed_costs": fixed_costs(), "left_out": left_out}
        print(json.dumps(out))
        return
    costs = fixed_costs()
    fixed = sum(s for _, s in costs)
    if a.budget is not None:
        print(f"budget {a.budget} s: fixed costs {fixed} s (" + "; ".join(f"{what} {s} s" for what, s in costs)
              + f"), {a.budget - fixed} s for the pieces")
    for p in pieces:
        size = "" if not p.get("scaled") else f", scaled down, not started under {p['minimum_s']} s"
        print(f"{p['name']} (at most {p['timeout_s']} s{size}): {p['what']}\n    {shlex.join(p['command'])}")
    total = sum(p["timeout_s"] for p in pieces)
    print(f"in all at most {total} s" + (f" + {fixed} s fixed of {a.budget} s" if a.budget is not None else "")
          + (f"\nleft out for the next lease: {', '.join(left_out)}: {next_lease(a, left_out)}" if left_out else "")
          + "".join(f"\nproblem: {x}" for x in problems))


def notes_section(results: list[dict], setup: str, wheels: str, rest: str) -> str:
    lines = [f"\n## GPU check {datetime.date.today().isoformat()} "
             f"(`python benchmarks/gpu_check.py {shlex.join(sys.argv[1:])}`)\n", f"{setup}. {wheels}.\n"]
    for r in results:
        lines.append(f"- **{r['name']}**: `{r['command']}`: exit {r['exit']} after {r['seconds']} s")
        for f in r["figures"] or r["tail"]:
            lines.append(f"    {f}")
    if rest:
        lines.append(f"\n{rest}")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", action="store_true", help="print the pieces and check them; run nothing")
    p.add_argument("--json", action="store_true", help="with --plan: as JSON")
    p.add_argument("--only", nargs="+", choices=list(BY_NAME), help="these pieces only")
    p.add_argument("--budget", type=int, metavar="SECONDS",
                   help="run what fits in this many seconds, most valuable first (540 in one call on a lent machine)")
    p.add_argument("--log-dir", default=os.environ.get("OUT"),
                   help="where the full logs go (default $OUT or a temp folder)")
    p.add_argument("--workers", type=int, default=1,
                   help="pytest pieces: run their tests in N processes on the one GPU (pytest-xdist, --dist load)")
    p.add_argument("--timeout", type=int, help="cap every piece's time limit at this many seconds")
    p.add_argument("--loop-steps", type=int, help="benchmark pieces: this many steps (the first third left out)")
    p.add_argument("--allow-cpu", action="store_true", help="run on a host without CUDA too (the script's own check)")
    p.add_argument("--notes", default=str(ROOT / "benchmarks" / "NOTES.md"),
                   help="the notes file the section is appended to")
    p.add_argument("--slim-wheels", metavar="CUDA_MAJOR",
                   help="only slim .whl/'s bitsandbytes to this CUDA major's libraries (make gpu-wheels) and exit")
    a = p.parse_args()
    if a.slim_wheels:
        print(f"gpu_check: {slim_wheels(a.slim_wheels)}")
        return 0
    problems = check_plan()
    pieces, left_out = selected(a)
    if not pieces:
        fixed = sum(s for _, s in fixed_costs())
        least = min(BY_NAME[n].minimum_s for n in left_out)
        print(f"error: gpu_check: --budget {a.budget}: nothing fits: {a.budget - fixed} s after {fixed} s of fixed "
              f"costs, and the least a piece needs is {least} s; give at least {fixed + least}", file=sys.stderr)
        return 2
    if a.plan:
        print_plan(a, pieces, left_out, problems)
        return 1 if problems else 0
    if problems:
        print("gpu_check: " + "; ".join(problems), file=sys.stderr)
        return 2
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="gpu_check_site_") as site:  # the wheels, for this run only
        return run_pieces(a, pieces, left_out, env, site)


def run_pieces(a: argparse.Namespace, pieces: list[dict], left_out: list[str], env: dict, site: str) -> int:
    """`pieces` on a CUDA host (or with --allow-cpu), each within its limit and, under --budget, within
    what remains of it; the log folder is made only for a run that goes ahead, so a refusal leaves
    nothing behind (tests/test_gpu_check.py)."""
    began = time.monotonic()
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
    if left_out:
        print(f"gpu_check: --budget {a.budget} leaves out {', '.join(left_out)}", flush=True)
    results = []
    for p in pieces:
        limit = min(p["timeout_s"], a.timeout or p["timeout_s"])
        if a.budget is not None:  # the fixed costs may have taken longer than planned
            limit = min(limit, int(a.budget - (time.monotonic() - began)))
            if limit < p["minimum_s"]:
                print(f"{p['name']}: not started, {limit} s left of the budget", flush=True)
                left_out = sorted([*left_out, p["name"]], key=PRIORITY.index)
                continue
        results.append(run_piece(p["name"], p["command"], limit, env, logs))
    rest = (f"Budget {a.budget} s; left out for the next lease: {', '.join(left_out)} (`{next_lease(a, left_out)}`)."
            if left_out else "")
    section = notes_section(results, setup, wheels, rest)
    with open(a.notes, "a") as f:
        f.write(section)
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"], "gpu_notes.md"), "a") as f:
            f.write(section)
    print(section)
    return 0 if all(r["exit"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
