"""Tools for tests/test_tools.py: good ones, one that raises, one that hangs, and ones rl.tools refuses."""

import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def divide(a: int, b: int) -> float:
    """Divide a by b.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


def nap(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "awake"


def no_docstring(a: int) -> int:
    return a


def no_hints(a):
    """Return a.

    Args:
        a: Anything.
    """
    return a


async def later(a: int) -> int:
    """Return a, later.

    Args:
        a: The value.
    """
    return a


NOT_A_FUNCTION = 3
