"""What every run's weights are moved by: the optimizer (`optimizers.py`, `train.optim` by transformers'
names) and the learning-rate schedule (`schedules.py`, `train.lr_scheduler_type`). Built by the
backend (`backends/`) for the launch; named in the recipe (`config/train.py`)."""
