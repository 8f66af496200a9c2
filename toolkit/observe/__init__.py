"""Watching a run without changing what it learns: `measure` (throughput, MFU, peak memory, the step
clock, profiler traces), `watchdog` (a step, a collective or a save that stops moving), and `monitor`
(the one object the loop talks to: phases, metrics.jsonl, trackers)."""
