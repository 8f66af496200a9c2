"""Command line: `toolkit train RECIPE.yaml [key=value ...]`, `toolkit config show RECIPE.yaml`, and
the other verbs, each a module of its own with `add_arguments(parser)` and `run(args)`:
`toolkit estimate` (before launch), `toolkit merge`, `toolkit generate`, `toolkit eval`, `toolkit export`,
`toolkit push`, `toolkit checkpoint convert` (after training).

User mistakes (ToolkitError) end with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from .config import load_recipe
from .errors import EXIT_OK, EXIT_USER_ERROR, ToolkitError
from .observe import noise
from .stops import Preemption, TrainingStopped, mark_refused

# Verbs that write results: a signal ends them in one line (their partial output removed), exit 75.
STOP_TEXTS = {"train": "before training started; nothing was trained or saved. Run again to start over",
              "merge": "during merge; nothing was written (its partial folder removed). Run it again",
              "checkpoint": "during checkpoint convert; nothing was written (its partial folder removed). Run it again",
              "eval": "during eval; no results were written. Run it again",
              "export": "during export; nothing was written (its partial file removed). Run it again",
              "push": "during push; the Hub takes a push as one commit, whole or not at all. Run it again"}
VERBS = {"estimate": ("estimate", "which strategy (DDP, FSDP, ZeRO, offload) fits a model on your GPUs, before launch"),
         "merge": ("merge", "merge a LoRA adapter into its base: a plain Hugging Face folder"),
         "generate": ("generate", "answer prompts with a model, merged model or adapter folder"),
         "eval": ("evaluate", "loss, perplexity and answer accuracy of a model on a data file, or lm-eval tasks"),
         "export": ("export", "a model as one GGUF file (f16, q8_0, ...) for llama.cpp, Ollama and LM Studio"),
         "push": ("push", "a model folder and its model card onto the Hugging Face Hub, as one commit"),
         "checkpoint": ("convert", "a training checkpoint's weights as a plain Hugging Face folder (or adapter)"),
         "plot": ("plot", "a PNG of loss, eval loss, learning rate, grad norm and throughput of one or more runs"),
         "doctor": ("doctor", "check the launch under accelerate launch: versions, devices, collectives, bandwidth")}


def verb_module(name: str):
    import importlib

    return importlib.import_module(f"toolkit.verbs.{VERBS[name][0]}")


def report_user_error(e: ToolkitError, wait_for_main_s: float = 30.0) -> None:
    """One line from rank 0. Another rank that meets the same mistake first waits for it: exiting
    at once would make the launcher stop rank 0 before it prints (seen with 2 CPU ranks). If rank 0
    has not ended the launch in `wait_for_main_s` (a mistake only this rank saw), it speaks."""
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        mark_refused()  # the launcher ends the other ranks next: they exit EXIT_USER_ERROR, not as preempted
    else:
        for sig in (signal.SIGTERM, signal.SIGINT):  # the launcher ending the job ends this wait quietly, exit 2
            signal.signal(sig, lambda *_: os._exit(EXIT_USER_ERROR))
        time.sleep(wait_for_main_s)
        mark_refused()
    print(f"error: {e}" if rank == 0 else f"error: (rank {rank}) {e}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    noise.install()  # every rank runs this before a library can speak: their known noise, dropped by message
    # Before anything slow (a verb's module may import torch): a signal while torch imports or data
    # tokenizes still ends in one line.
    command = next((a for a in argv if not a.startswith("-")), None)
    preemption = Preemption(STOP_TEXTS[command]) if command in STOP_TEXTS else None
    parser = argparse.ArgumentParser(prog="toolkit", description="Fine-tune causal LMs with one Accelerate loop.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train", help="train from a YAML recipe",
        description="Train from a YAML recipe on one process; on several GPUs (DDP, FSDP, DeepSpeed): "
                    "accelerate launch --config_file LAUNCH.yaml -m toolkit train RECIPE.yaml [key=value ...]")
    train.add_argument("recipe", help="the recipe (YAML); every key: docs/recipe-keys.md")
    train.add_argument("overrides", nargs="*", help="dotted overrides such as train.max_steps=20")
    train.add_argument("--trl", choices=["sft", "dpo", "grpo"], default=None,
                       help="read RECIPE as the TRL config of this trainer (`trl sft --config`); found from its "
                            "fields when not given (docs/trl-configs.md)")
    show = sub.add_parser("config", help="inspect configs without training",
                          description="The recipe as the run will read it (every default filled in); with "
                                      "--accelerate-config, the launch it makes and whether it fits.")
    show.add_argument("action", choices=["show"], help="show (the only action; `toolkit config RECIPE` means it)")
    show.add_argument("recipe", help="the recipe (YAML)")
    show.add_argument("overrides", nargs="*", help="dotted overrides such as train.max_steps=20")
    show.add_argument("--trl", choices=["sft", "dpo", "grpo"], default=None, help="as for train")
    show.add_argument("--accelerate-config", "--config_file", dest="accelerate_config",
                      help="an accelerate launch config (YAML) to resolve against the recipe (the file "
                           "`accelerate launch --config_file` takes)")
    show.add_argument("--num-processes", type=int, default=None,
                      help="processes the launch starts (default: the accelerate config's num_processes)")
    show.add_argument("--assume-gpu", action="store_true", help="judge the launch as on a CUDA host (from a laptop)")
    for name, (_, text) in VERBS.items():  # only the verb being run is imported (doctor imports torch)
        verb_parser = sub.add_parser(name, help=text, description=text)
        if name == command:
            verb_module(name).add_arguments(verb_parser)
    after = argv.index("config") + 1 if command == "config" else 0
    if after and argv[after:] and argv[after] not in ("show", "-h", "--help"):  # `toolkit config RECIPE` means show
        argv.insert(after, "show")
    args = parser.parse_args(argv)
    try:
        if args.command in VERBS:
            return verb_module(args.command).run(args)
        if args.command == "config" and args.num_processes is not None and args.num_processes < 1:
            raise ToolkitError(f"--num-processes: must be positive, got {args.num_processes}")
        recipe = load_recipe(args.recipe, args.overrides, args.trl)
        if args.command == "train":
            from .training.run import run

            run(recipe, args.recipe, preemption)
        else:
            from .verbs import show

            show.run(args, recipe)
    except Exception as e:  # noqa: BLE001 - a stop a signal raised may surface as whatever it interrupted
        stop = preemption.cause_of(e) if preemption is not None else None
        if stop is not None:
            e = stop
        if isinstance(e, TrainingStopped):
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"stopped: {e}", file=sys.stderr)
            return e.exit_code
        if isinstance(e, ToolkitError):
            report_user_error(e)
            return EXIT_USER_ERROR
        raise
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
