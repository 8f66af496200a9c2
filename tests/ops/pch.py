"""The precompiled-header path of tests/ops/c++ (the C++ compiler the tests build DeepSpeed's ops
with), which calls this only inside the build folder of an op of 4 sources or more. It runs the
system's c++ with the same arguments, with two changes that leave the generated code as it was
(same -O3, -march, -fopenmp, macros):

- no `-g`: the debug information of the torch headers was most of every object file (cpu_adam:
  37 MB of objects instead of 1 MB) and a quarter of each compile;
- for an op of 4 sources or more (async_io has 12), torch/extension.h precompiled once and included
  first (`-include`): every op source includes it, and parsing it is about 17 of the 26 seconds each
  source takes on 2 cores; building the header takes about 35 s, so ops of 2 or 3 sources (the
  others) are faster without it. The precompiled header (about 800 MB) is built under a lock, for the flags that shape it (those of the source minus
  its own files, include folders and extension name), in $TORCH_EXTENSIONS_DIR/_pch/<hash>. GCC
  uses it only where the flags match and otherwise reads the header as text (the same result,
  slower); a compile that fails with it is run again without it.

TOOLKIT_REAL_CXX names the compiler (default /usr/bin/c++); TOOLKIT_NO_PCH=1 turns the header off.
"""

import fcntl
import hashlib
import os
import subprocess
import sys
from pathlib import Path

REAL = os.environ.get("TOOLKIT_REAL_CXX", "/usr/bin/c++")
SOURCES = (".cpp", ".cc", ".cxx", ".c")


def run(args: list[str]) -> int:
    return subprocess.run([REAL, *args]).returncode


def header_flags(args: list[str]) -> list[str] | None:
    """The flags of a one-source compile that shape torch/extension.h, or None for anything else
    (a link, a version probe, a header build, an op of few sources)."""
    if "-c" not in args or "-x" in args or sum(a.endswith(SOURCES) for a in args) != 1:
        return None
    flags, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in ("-o", "-MF"):
            skip = True
        elif not (a in ("-c", "-MMD") or a.endswith(SOURCES) or a.startswith(("-I", "-DTORCH_EXTENSION_NAME="))):
            flags.append(a)
    return flags


def precompiled(flags: list[str]) -> Path | None:
    """torch/extension.h's precompiled header for these flags (built the first time), or None."""
    key = hashlib.sha256("\0".join([REAL, *flags]).encode()).hexdigest()[:16]
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", "/tmp/torch_extensions")) / "_pch" / key
    header, gch = root / "torch_extension.h", root / "torch_extension.h.gch"
    if not gch.is_file() and not (root / "failed").is_file():
        root.mkdir(parents=True, exist_ok=True)
        with open(root / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not gch.is_file() and not (root / "failed").is_file():
                header.write_text("#include <torch/extension.h>\n")
                part = root / f"part.{os.getpid()}.gch"
                if run(["-x", "c++-header", *flags, str(header), "-o", str(part)]) == 0:
                    os.replace(part, gch)
                else:
                    part.unlink(missing_ok=True)
                    (root / "failed").touch()
    return header if gch.is_file() else None


def main() -> int:
    args = [a for a in sys.argv[1:] if a != "-g"]
    flags = None if os.environ.get("TOOLKIT_NO_PCH") == "1" else header_flags(args)
    header = precompiled(flags) if flags is not None else None
    if header is not None and run(["-include", str(header), *args]) == 0:
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
