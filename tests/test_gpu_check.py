"""`make gpu-check`'s plan, checked without a GPU: pieces under 10 minutes, under 50 in all, every
GPU test in exactly one piece, every benchmark piece's arguments accepted by its script, and every
wheel it carries to a bare CUDA image pinned in constraints.txt."""

import json
import os
import re
import subprocess
import sys

import pytest
from test_installs import normalized, pins

from helpers import ROOT


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
    assert sum(p["timeout_s"] for p in plan["pieces"]) <= plan["total_limit_s"] == 50 * 60
    every = collected("-m", "gpu", "tests/test_gpu.py")
    assert every, "no GPU test collected"
    picked = []
    for piece in plan["pieces"]:
        command = piece["command"]
        if command[1:3] == ["-m", "pytest"]:
            picked += collected(*[c for c in command[3:] if c not in ("-s", "-q")])
    assert sorted(picked) == sorted(every)
    assert any("loop_speed.py" in " ".join(p["command"]) for p in plan["pieces"])


def test_a_wrong_benchmark_argument_is_a_problem_of_the_plan(monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    piece = gpu_check.PIECES[2]
    monkeypatch.setattr(gpu_check, "PIECES", [(piece[0], piece[1] + ["--warmup", "0"], piece[2], piece[3])])
    assert gpu_check.check_plan() and "refuses" in gpu_check.check_plan()[0]


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
    assert "`python -m pytest -s -q -m gpu tests/test_gpu.py -k 'not bf16'`: exit 0" in section
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
