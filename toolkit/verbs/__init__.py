"""The CLI verbs besides `train`, each a module with `add_arguments(parser)` and `run(args)`: before
launch `estimate`, `doctor`; while and after training `plot`; after training `generate`, `evaluate`
(`toolkit eval`), `merge`, `convert` (`toolkit checkpoint convert`). The training run never imports
them (tests/test_layout.py)."""
