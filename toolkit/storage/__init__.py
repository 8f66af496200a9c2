"""What a run stores and reads back: `disk` (writes the file system refuses: full, read-only, each
ending in one line), `verify` (every save read back before it is called saved), `portable` (the
layout-free training state for resume under another backend), `checkpoint` (atomic checkpoints and
the trainer state), `run_folder` (the output folder: its lock, overwrite, resume compatibility and
the launch record)."""
