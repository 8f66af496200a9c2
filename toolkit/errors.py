"""The error a user can fix: a recipe, a data file, a path, a launch that does not fit. The CLI
prints it as one line and exits 2, never with a traceback. Signals and non-finite losses stop a
run through `stops.TrainingStopped`, with exit codes of their own."""


class ToolkitError(Exception):
    """A mistake the user can fix: printed as one line, exit code 2, no traceback."""
