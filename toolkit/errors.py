"""The error a user can fix, and every exit code the toolkit ends with (the README shows this table).

A `ToolkitError` is a mistake the user can fix: a recipe, a data file, a path, a launch that does not
fit. The CLI prints it as one line and exits `EXIT_USER_ERROR`, never with a traceback. Signals,
non-finite losses, saves that do not read back and refused writes stop a run through
`stops.TrainingStopped` with the codes below. A message that suggests a command writes it with
`command`, as it runs from where the user is."""

import os
import shutil
import sys
from pathlib import Path

EXIT_OK = 0
EXIT_CHECK_FAILED = 1  # `toolkit doctor`: a check failed (its FAIL lines say which)
EXIT_USER_ERROR = 2  # a ToolkitError: one line naming the file, key or row; nothing on disk changed
EXIT_NONFINITE = 3  # train.max_nonfinite_steps steps in a row not applied (loss or gradient not finite)
EXIT_SAVE_MISMATCH = 4  # a save read back differently from what was written; earlier checkpoints intact
EXIT_DISK = 74  # EX_IOERR: the file system refused a write; earlier checkpoints are intact
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: a signal; the step finished and a checkpoint saved; resume=auto continues
EXIT_SIGNAL_BASE = 128  # 128 + N: a second signal N more than 2 s after the first aborted at once

EXIT_CODES = {
    EXIT_OK: "trained (or the verb did what it was asked)",
    EXIT_CHECK_FAILED: "toolkit doctor: a check failed",
    EXIT_USER_ERROR: "a mistake you can fix: one line naming the file, key or row; nothing on disk changed",
    EXIT_NONFINITE: "loss or gradient not finite for train.max_nonfinite_steps steps in a row; "
                    "last good checkpoint named",
    EXIT_SAVE_MISMATCH: "a save did not read back as written; it is not marked complete, earlier ones are intact",
    EXIT_DISK: "the file system refused a write (full, read-only); earlier checkpoints are intact",
    EXIT_PREEMPTED: "stopped by a signal: the step finished, a checkpoint was saved; resume=auto continues",
    EXIT_SIGNAL_BASE: "128 + N: a second signal N aborted at once; resume=auto continues from the last checkpoint",
}


class ToolkitError(Exception):
    """A mistake the user can fix: printed as one line, exit code 2, no traceback."""


class ConfigError(ToolkitError):
    """A recipe's mistake (toolkit/config/): `SOURCE: KEY: MESSAGE`, the source a file or the command line."""

    def __init__(self, source: str, key: str, message: str):
        self.source, self.key, self.message = source, key, message
        super().__init__(f"{source}: {key}: {message}" if key else f"{source}: {message}")


def command(line: str) -> str:
    """`line` (`toolkit ...`, `python ...`, `accelerate ...`: a program of this Python's environment) as
    the user can type it here: the program as named when it is this environment's own on PATH, else by
    its path, relative when under the working directory (`.venv/bin/toolkit ...` after `make setup`,
    whose venv is not on PATH until activated)."""
    program, _, rest = line.partition(" ")
    path = Path(sys.executable).absolute()
    if program != "python":
        path = path.parent / program
        if program == "toolkit" and not path.exists():  # a Python without the console script beside it
            path, rest = Path(sys.executable).absolute(), f"-m toolkit {rest}"
    found = shutil.which(path.name)
    if found is not None and Path(found).absolute() == path:
        return f"{path.name} {rest}".rstrip()
    shown = os.path.relpath(path) if Path.cwd() in path.parents else str(path)
    return f"{shown} {rest}".rstrip()


def first_line(err: BaseException) -> str:
    """An exception's first line of text (its type's name where it has none), for a one-line error."""
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__
