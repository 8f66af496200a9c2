"""The CLI verbs besides `train`, each a module with `add_arguments(parser)` and `run(args)`: before
launch `show` (`toolkit config show`, whose arguments cli.py parses with train's), `estimate`, `doctor`;
while and after training `plot`; after training `generate`, `evaluate` (`toolkit eval`; `harness` for
its lm-eval tasks), `merge`, `export` (GGUF), `push` (the Hub), `convert` (`toolkit checkpoint
convert`). The training run never imports them (tests/test_layout.py)."""
