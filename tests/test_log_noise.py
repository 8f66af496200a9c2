"""What a run prints is the toolkit's lines, not the libraries' noise: `toolkit/observe/noise.py`
drops each known library warning by its message and module (never a whole category or library),
the CLI installs it in every process, and a 2-process ZeRO-3 run's output stays short with every
line of the toolkit's own still there."""

import ast
import logging
import re
import sys
import warnings

import pytest

from toolkit.observe import noise

from helpers import RESUME_STEPS, ROOT, run_command

# helpers.layout_recipe under ZeRO-3, 2 processes, 8 steps, a checkpoint every 2: 2,071 lines before
# the noise was dropped (1,982 of them torch's FutureWarning on DeepSpeed's collectives, ~250 a step),
# 89 after (start-of-run lines, a line per step, eval and checkpoint lines, progress bars, the launcher's
# banner). The bound leaves room for slower hosts' progress-bar refreshes.
MAX_LINES = 200


def emitted(category, message: str, module: str) -> list[str]:
    """The warnings that reach the user when `module` warns `message`, with the noise filters installed."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        noise.install()
        warnings.warn_explicit(message, category, f"{module.replace('.', '/')}.py", 1, module=module)
    return [str(w.message) for w in caught]


@pytest.mark.parametrize("category, pattern, module", noise.WARNINGS,
                         ids=[re.sub(r"\W+", "_", w[1]).strip("_")[:40] for w in noise.WARNINGS])
def test_each_known_noise_is_dropped_and_only_it(category, pattern, module):
    name = module.replace("\\", "")
    message = pattern.replace("\\", "") + ". Please use the new name instead."
    assert emitted(category, message, name) == []
    # The same module's other warnings, the same message in another category or from another module all print.
    assert emitted(category, "some other deprecation", name) == ["some other deprecation"]
    assert emitted(UserWarning, message, name) == [message]
    assert emitted(category, message, "toolkit.training.loop") == [message]


def test_known_log_records_are_dropped_and_only_they():
    def record(name: str, level: int, message: str) -> logging.LogRecord:
        return logging.LogRecord(name, level, "real_accelerator.py", 1, message, None, None)

    for name, drop in noise.FILTERS:
        logger = logging.getLogger(name)
        noise.install()
        noise.install()  # once is enough; twice adds nothing
        assert logger.filters.count(drop) == 1
        noisy = next(m for n, _, m in noise.LOG_RECORDS if n == name).replace("\\", "")
        assert not drop.filter(record(name, drop.level, noisy + " More words."))
        assert drop.filter(record(name, drop.level, "ZeRO-3 could not gather a parameter"))
        assert drop.filter(record(name, logging.ERROR, noisy))  # the same words at another level print
        logger.removeFilter(drop)


def test_the_noise_module_imports_only_the_standard_library():
    """The CLI installs it before a verb imports torch; importing a library here would load it first."""
    tree = ast.parse((ROOT / "toolkit" / "observe" / "noise.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    assert imported <= {"__future__", "logging", "re", "warnings"}, imported


@pytest.mark.launch
def test_a_zero3_run_prints_the_toolkits_lines_and_little_else(layout_runs):
    """The shared 8-step ZeRO-3 run of 2 processes (conftest's `layout_runs`, its output in train.log)."""
    lines = (layout_runs("zero3") / "train.log").read_text().splitlines()
    assert [line for line in lines if "FutureWarning" in line] == []
    # One is the launcher's: `accelerate launch` imports DeepSpeed before any rank (or toolkit code) starts.
    assert sum("Setting accelerator to CPU" in line for line in lines) <= 1, lines
    assert len(lines) <= MAX_LINES, "\n".join(lines[:60])
    assert sum(line.startswith("run: ") for line in lines) >= 5, lines
    assert any(re.match(rf"step {RESUME_STEPS}/{RESUME_STEPS} \| loss ", line) for line in lines), lines
    assert sum(line.startswith("checkpoint step-") for line in lines) == RESUME_STEPS // 2, lines
    assert any(line.startswith("saved ") and line.endswith("/final") for line in lines), lines


@pytest.mark.launch
def test_a_process_that_installs_it_never_prints_deepspeeds_cpu_line(monkeypatch):
    """The filter is set on DeepSpeed's logger before DeepSpeed creates it; its other warnings still print."""
    code = ("from toolkit.observe import noise; noise.install()\n"
            "from deepspeed.accelerator import get_accelerator; get_accelerator()\n"
            "from deepspeed.utils import logger; logger.warning('a real DeepSpeed warning')")
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)  # DeepSpeed detects the accelerator, and would say so
    proc = run_command([sys.executable, "-c", code], timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Setting accelerator to CPU" not in proc.stdout + proc.stderr
    assert "a real DeepSpeed warning" in proc.stdout
