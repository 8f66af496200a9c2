"""`make gpu-check`'s plan, checked without a GPU: pieces under 10 minutes, under 50 in all, every
GPU test in exactly one piece, every benchmark piece's arguments accepted by its script, what a
--budget picks for a lease, and every wheel it carries to a bare CUDA image pinned in constraints.txt."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_installs import normalized, pins

from helpers import ROOT

spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)  # a dataclass needs its module there
spec.loader.exec_module(gpu_check)


def the_plan() -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--plan", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    return json.loads(proc.stdout)


def collected(*selection: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           *selection], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return [line for line in proc.stdout.splitlines() if "::" in line]


@pytest.mark.launch
def test_pieces_fit_the_limits_and_every_gpu_test_runs_once():
    plan = the_plan()
    assert plan["problems"] == []
    assert all(p["timeout_s"] < 600 for p in plan["pieces"])
    assert sum(p["timeout_s"] for p in plan["pieces"]) <= plan["total_limit_s"] == 70 * 60
    every = collected("-m", "gpu", "tests/test_gpu.py")
    assert every, "no GPU test collected"
    picked = []
    for piece in plan["pieces"]:
        command = piece["command"]
        if command[1:3] == ["-m", "pytest"]:
            plain = gpu_check.with_options(command, {"-n": ["0"]})  # collected in this process
            picked += collected(*[c for c in plain[3:] if c not in ("-s", "-q", "-rs")])
    assert sorted(picked) == sorted(every)
    assert any("loop_speed.py" in " ".join(p["command"]) for p in plan["pieces"])


def test_a_wrong_benchmark_argument_is_a_problem_of_the_plan(monkeypatch):
    piece = gpu_check.BY_NAME["loop-1b"]
    wrong = gpu_check.Piece(**{**vars(piece), "command": piece.command + ["--warmup", "0"]})
    monkeypatch.setattr(gpu_check, "PIECES", [wrong])
    monkeypatch.setattr(gpu_check, "PRIORITY", ["loop-1b"])
    monkeypatch.setattr(gpu_check, "BY_NAME", {"loop-1b": wrong})
    assert gpu_check.check_plan() and all("refuses" in x for x in gpu_check.check_plan())


def plan_of(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """gpu_check.py --plan ARGS in this process: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--plan", *args])
    code = gpu_check.main()
    out, err = capsys.readouterr()
    return code, out, err


def test_without_a_budget_the_plan_is_every_piece_at_full_size(monkeypatch, capsys):
    code, out, _ = plan_of(monkeypatch, capsys, "--json")
    plan = json.loads(out)
    assert code == 0 and set(plan) == {"pieces", "total_limit_s", "problems"}
    assert plan["pieces"] == [{"name": p.name, "command": p.command, "timeout_s": p.timeout_s, "what": p.what}
                              for p in gpu_check.PIECES]
    names = [p["name"] for p in plan["pieces"]]
    assert names == ["gpu-first", "gpu-bf16", "gpu-other", "loop-1b", "loop-8b-lora", "loop-1b-compile", "long-context"]
    _, out, _ = plan_of(monkeypatch, capsys)
    assert out.splitlines()[-1] == "in all at most 3780 s" and "left out" not in out


@pytest.mark.parametrize("wheels", [0, 16], ids=["no-wheels", "16-wheels"])
def test_a_budget_of_540_plans_the_most_valuable_pieces_that_fit(monkeypatch, capsys, wheels):
    """On a lent machine (16 wheels to install) as on a host that needs none: the tests no GPU has run
    yet at full size, then the everyday benchmark scaled down, in priority order, limits and fixed
    costs within 540 s; the rest named with the command for the next lease."""
    monkeypatch.setattr(gpu_check, "needed_wheels", lambda: [Path(f"w{i}-1.0-py3-none-any.whl") for i in range(wheels)])
    code, out, _ = plan_of(monkeypatch, capsys, "--json", "--budget", "540")
    plan = json.loads(out)
    assert code == 0 and plan["problems"] == [] and plan["budget_s"] == 540
    names = [p["name"] for p in plan["pieces"]]
    assert names == ["gpu-first", "loop-1b"]
    assert plan["left_out"] == [n for n in gpu_check.PRIORITY if n not in names]
    fixed = sum(s for _, s in plan["fixed_costs"])
    assert fixed == 15 + (60 if wheels else 0)
    assert fixed + sum(p["timeout_s"] for p in plan["pieces"]) <= 540
    first, loop = plan["pieces"]
    assert not first["scaled"] and first["command"][-4:] == ["-n", "4", "--dist", "load"]
    assert loop["scaled"] and loop["minimum_s"] <= loop["timeout_s"] < 600
    assert loop["command"][loop["command"].index("--steps") + 1] == "12"
    assert loop["command"][loop["command"].index("--warmup") + 1] == "4"
    _, out, _ = plan_of(monkeypatch, capsys, "--budget", "540")
    assert out.splitlines()[-1] == (f"left out for the next lease: {', '.join(plan['left_out'])}: make gpu-check "
                                    f'GPU_CHECK_ARGS="--budget 540 --only {" ".join(plan["left_out"])}"')


def test_a_tiny_budget_runs_the_first_piece_at_its_minimum_or_nothing_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "needed_wheels", lambda: [])
    first = gpu_check.BY_NAME[gpu_check.PRIORITY[0]]
    code, out, _ = plan_of(monkeypatch, capsys, "--json", "--budget", str(15 + first.minimum_s))
    plan = json.loads(out)
    assert code == 0 and [(p["name"], p["timeout_s"]) for p in plan["pieces"]] == [(first.name, first.minimum_s)]
    assert plan["left_out"] == gpu_check.PRIORITY[1:]
    least = min(p.minimum_s for p in gpu_check.PIECES)
    code, out, err = plan_of(monkeypatch, capsys, "--budget", str(15 + least - 1))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith(f"error: gpu_check: --budget {15 + least - 1}: nothing fits")
    assert f"give at least {15 + least}" in err


def test_under_a_budget_each_piece_gets_what_remains_and_the_notes_name_the_rest(monkeypatch, capsys, tmp_path):
    """The run, with the pieces and the clock faked: wheels that take 200 s instead of the planned 60
    leave loop-1b under its minimum, so it is not started and joins the left-out pieces in the notes."""
    clock = [0.0]

    def install_wheels(env, site):
        clock[0] += 200
        return "16 wheels from .whl/ installed"

    def run_piece(name, command, timeout, env, logs):
        ran.append((name, timeout))
        clock[0] += timeout
        return {"name": name, "command": "python x", "exit": 0, "seconds": timeout, "figures": ["| row |"], "tail": []}

    ran = []
    monkeypatch.setattr(gpu_check, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(gpu_check, "needed_wheels", lambda: [Path("w-1.0-py3-none-any.whl")] * 16)
    monkeypatch.setattr(gpu_check, "install_wheels", install_wheels)
    monkeypatch.setattr(gpu_check, "versions", lambda env: "NVIDIA H100 80GB HBM3; torch 2.11.0")
    monkeypatch.setattr(gpu_check, "run_piece", run_piece)
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--budget", "540", "--notes", str(tmp_path / "NOTES.md")])
    assert gpu_check.main() == 0
    assert ran == [("gpu-first", 240)]
    section = (tmp_path / "NOTES.md").read_text()
    assert section == (tmp_path / "gpu_notes.md").read_text()
    assert "## GPU check " in section and "--budget 540" in section and "NVIDIA H100 80GB HBM3; torch 2.11.0" in section
    assert section.rstrip().endswith("left out for the next lease: loop-1b, loop-8b-lora, gpu-other, gpu-bf16, "
                                     'loop-1b-compile, long-context (`make gpu-check GPU_CHECK_ARGS="--budget 540 '
                                     '--only loop-1b loop-8b-lora gpu-other gpu-bf16 loop-1b-compile long-context"`).')


def test_the_wheels_it_carries_are_pinned():
    names = re.search(r"^GPU_WHEELS := (.+)$", (ROOT / "Makefile").read_text(), re.M).group(1).split()
    assert {normalized(n) for n in names} - pins().keys() == set()


@pytest.mark.launch
def test_a_piece_runs_and_its_section_is_appended(tmp_path):
    """On this CPU host: refused in one line without --allow-cpu; with it, one piece runs (its GPU
    tests skip, and the section says so) and a dated section with versions and the command is appended."""
    script = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--only", "gpu-other",
              "--log-dir", str(tmp_path / "logs"), "--notes", str(tmp_path / "NOTES.md")]
    refused = subprocess.run(script, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (refused.returncode == 2
            and refused.stderr.strip().startswith("error: gpu_check: no CUDA GPU")), refused.stderr
    assert not (tmp_path / "NOTES.md").exists()
    proc = subprocess.run(script + ["--allow-cpu"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    section = (tmp_path / "NOTES.md").read_text()
    assert "## GPU check " in section and "torch " in section and "transformers " in section
    assert (f"`python -m pytest -s -q -rs -m gpu tests/test_gpu.py -k 'not bf16 and not ({gpu_check.FIRST})'`: "
            "exit 0") in section
    assert "skipped" in section and (tmp_path / "logs" / "gpu-other.log").is_file()


@pytest.mark.launch
def test_a_cpu_host_is_refused_leaving_no_folder_behind(tmp_path):
    """Refused without a GPU, it leaves no log folder (the one given or a temporary one) and no
    folder of wheels behind: it used to make its log folder before looking for a GPU."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "OUT"} | {"TMPDIR": str(temp)}
    for logs in ([], ["--log-dir", str(tmp_path / "logs")]):
        refused = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--only", "gpu-other",
                                  "--notes", str(tmp_path / "NOTES.md"), *logs],
                                 cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2 and "no CUDA GPU" in refused.stderr, refused.stderr
        assert list(temp.iterdir()) == [] and not (tmp_path / "logs").exists() and not (tmp_path / "NOTES.md").exists()
