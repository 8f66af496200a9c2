"""Writes that fail for the file system's reasons (full, quota, read-only, permissions) end in one
line naming the path, what the write needed and what was free, with the half-written folder
removed; the libraries that write (torch, safetensors, datasets) report these in errors of their
own types, so the cause is found in the error chain and its text. Light imports only."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path

from .. import faults
from ..errors import EXIT_DISK, ToolkitError
from ..stops import TrainingStopped

REASONS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
           errno.EROFS: "read-only file system", errno.EACCES: "permission denied", errno.EPERM: "permission denied"}
TEXTS = {"no space left on device": "no space left on device", "os error 28": "no space left on device",
         "disk quota exceeded": "disk quota exceeded", "read-only file system": "read-only file system",
         "permission denied": "permission denied"}

TORCH_WRITER = ("write failed", "failed writing", "unexpected pos", "inline_container")


def write_problem(e: BaseException, target: Path | None = None) -> str | None:
    """Why a write failed, when the file system refused it (None: some other error)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in REASONS:
            return REASONS[e.errno]
        text = str(e).lower()
        for fragment, reason in TEXTS.items():
            if fragment in text:
                return reason
        if any(f in text for f in TORCH_WRITER) and target is not None and free_bytes(target) < (1 << 20):
            return "no space left on device"  # torch's zip writer does not say why a write failed
        e = e.__cause__ or e.__context__
    return None


def free_bytes(path: Path) -> int:
    """Free bytes on the file system that holds `path` (or would: its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return 0


def size_of(path: Path) -> int:
    """Bytes of a file or of a folder's files."""
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    total = 0
    for root, _, files in os.walk(p):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


@contextlib.contextmanager
def renamed_into_place(out: Path, phase: str):
    """Yields `out`.tmp to write into (a leftover of a killed write removed first); when the block
    completes, renames it to `out` (an empty `out` is replaced). However the block ends (an error,
    a signal), no partial `out`.tmp is left. `phase`: the fault seam just before the rename."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        yield tmp
        faults.at(phase)
        if out.exists():
            out.rmdir()  # empty: the verbs refuse a non-empty one before writing
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def writing(what: str, partial: Path, needed: int | None = None, error=None, remove: bool = True):
    """A block that writes `partial` (a folder or file, removed if the write fails for the file
    system's reasons). Such a failure becomes `error(message)` (default: a TrainingStopped with
    EXIT_DISK) naming `what`, the path, the bytes needed (`needed`, or at least what was written
    before the failure) and the bytes free."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - torch and safetensors raise their own types for OS errors
        reason = write_problem(e, partial)
        if reason is None:
            raise
        written = size_of(partial) if Path(partial).exists() and remove else 0
        if not remove:
            pass
        elif Path(partial).is_dir():
            shutil.rmtree(partial, ignore_errors=True)
        elif Path(partial).exists():
            with contextlib.suppress(OSError):
                Path(partial).unlink()
        message = f"{what}: cannot write {partial}: {reason}"
        if reason in ("no space left on device", "disk quota exceeded"):
            free = f"{human(free_bytes(partial))} free"
            if needed:
                message += f" (it needs about {human(needed)}; {free})"
            elif written:
                message += f" (it needs more than the {human(written)} written before it failed; {free})"
            else:
                message += f" ({free})"
        if error is None:
            raise TrainingStopped(message + ("; the partial write was removed" if remove else "")
                                  + ", earlier checkpoints are intact; free space (or fix the permissions) and run "
                                  "again with resume=auto",
                                  EXIT_DISK) from None
        raise error(message) from None


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a completely written folder into place; one already there is moved aside first and
    deleted only after, so `final` is always either the old or the new folder, never partial."""
    if final.exists():
        old = final.with_name(".del-" + final.name)
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)


def check_writable(out: Path, what: str) -> None:
    """Before any work whose result goes to the file `out`: its folder exists (or can be made) and takes a
    file, else one ToolkitError naming `what` and the reason (a read-only disk, no permission, a file where
    the folder should be). The probe file is removed again."""
    probe = out.with_name(f".{out.name}.{os.getpid()}.probe")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe.open("xb").close()
    except OSError as e:
        raise ToolkitError(f"{what}: cannot write {out}: {write_problem(e) or e.strerror or e}") from None
    with contextlib.suppress(OSError):
        probe.unlink()


def write_file(out: Path, what: str, write) -> None:
    """`write(f)` into a temporary file beside `out` (binary), then renamed to `out`: a reader never sees a
    half-written file and an earlier `out` stays whole if the write fails. A file-system failure is one
    ToolkitError naming `what`; no temporary file is left where the disk lets one be removed."""
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")  # beside `out`: the rename stays on one disk
    try:
        with open(tmp, "xb") as f:
            write(f)
        os.replace(tmp, out)
    except OSError as e:
        raise ToolkitError(f"{what}: cannot write {out}: {write_problem(e) or e.strerror or e}") from None
    finally:
        with contextlib.suppress(OSError):  # a read-only disk refuses even this unlink (EROFS)
            tmp.unlink(missing_ok=True)
