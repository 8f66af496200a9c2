"""Watching a run without changing what it learns: `measure` (throughput, MFU, peak memory, the step
clock, profiler traces), `watchdog` (a step, a collective or a save that stops moving), `monitor`
(the one object the loop talks to: phases, metrics.jsonl, trackers), and `noise` (library warnings
that say nothing to the user, dropped by message; the CLI installs it in every process)."""
