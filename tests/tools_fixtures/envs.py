"""Environments for tests/test_environments.py: a counter and a safe (each with state of its own, a reward read from
it), and ones rl.environment refuses."""

MADE = []  # every instance made, in order: the pool's growth is checked against TRL's


class Counter:
    """Counts from the row's `start`; its reward is where it ended."""

    def __init__(self):
        self.total, self.steps, self.resets = 0, [], 0
        MADE.append(self)

    def reset(self, **row):
        self.total, self.steps = int(row["start"]), []
        self.resets += 1
        self.row = dict(row)
        return f" Start at {self.total}."

    def step(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: How much to add.
        """
        self.total += by
        self.steps.append(by)
        return self.total

    def peek(self) -> str:
        """Say where the counter is."""
        return f"at {self.total}"

    def get_reward(self) -> float:
        return float(self.total)

    def _private(self) -> None:
        raise AssertionError("not a tool")

    @property
    def doubled(self) -> int:  # listed on the class: never evaluated
        raise AssertionError("a property is not a tool")


class Safe:
    """A lock with a code; reset says nothing, the reward comes later (async)."""

    def __init__(self):
        self.code, self.tries = "", []
        MADE.append(self)

    def reset(self, **row):
        self.code, self.tries = str(row["code"]), []
        self.row = dict(row)

    def guess(self, code: str) -> str:
        """Try a code.

        Args:
            code: The code to try.
        """
        self.tries.append(code)
        if code == "boom":
            raise RuntimeError("the safe exploded")
        return "open" if code == self.code else "shut"

    async def get_reward(self) -> float:
        return 1.0 if self.code in self.tries else 0.0


class AlsoCounter(Counter):
    """A subclass: its own reward column, never counted as Counter's."""


class NoReset:
    def step(self, by: int) -> int:
        """Add.

        Args:
            by: How much.
        """
        return by


class NoTools:
    def reset(self, **row):
        return None

    def get_reward(self) -> float:
        return 0.0


class Undescribed:
    def reset(self, **row):
        return None

    def step(self, by):
        return by


class AsyncTool:
    def reset(self, **row):
        return None

    async def step(self, by: int) -> int:
        """Add.

        Args:
            by: How much.
        """
        return by


class Breaks:
    def __init__(self):
        raise OSError("no such device")


class ShadowsATool(NoReset):
    def reset(self, **row):
        return None

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return a + b


class ResetsBadly(Counter):
    def reset(self, **row):
        return 3


NOT_A_CLASS = 3
