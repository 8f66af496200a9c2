"""The training run: `run` (start to end), `build` (the run, in named stages), `loop` (`fit`, one
`train_step` per optimizer step, evaluation, checkpoints, `final/`), `objectives` (the typed contract
the loop asks for a batch's loss, and its implementations; config/methods.py names which a run builds),
`online` (online RL's objective, GRPO), `online_setup` (online RL's objectives built with their reference,
sampler or teacher),
`policy_loss` (its loss), `rewards` (its reward functions), `loss` (chunked or full cross-entropy,
log-probabilities), `reference` (DPO's precomputed reference), `summary` (the start-of-run lines),
`samples` (answers generated at each evaluation), `card` (final/README.md, the run's model card)."""
