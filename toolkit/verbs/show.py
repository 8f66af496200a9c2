"""`toolkit config show RECIPE.yaml [--accelerate-config X.yaml]`: the plan first (the model and how it
trains, the objective, the data, the launch, the global batch, the steps, where the results go), then
what the launch config changes, the resolved recipe (every key, defaults included) and, for
DeepSpeed, the resolved JSON. Nothing is loaded or downloaded: a Hub id stays a name, and the
steps come from the rows the local files hold (a Hub dataset's rows are counted when a run reads it)."""

from __future__ import annotations

import math
from pathlib import Path

from ..config import DataSource, Recipe, dump_recipe
from ..config.methods import method_of
from ..optim import schedules


def run(args, recipe: Recipe) -> None:
    from ..backends.launch_config import show, worker_env
    from ..backends.run_sizing import check_split

    launch, ds, ranks = [], "", 1
    if args.accelerate_config:
        launch, ds, ranks = show(recipe, args.accelerate_config, args.num_processes, args.assume_gpu)
        check_split(recipe, worker_env(args.accelerate_config, args.num_processes), args.accelerate_config)
    found = recipe.data.format is None and recipe.data.train_files and all_here(recipe.data.train_files)
    if found:  # unset: found from the files' first rows, as the run finds it
        from ..data.sources import resolve_sources

        recipe.data.format = resolve_sources(recipe.data.train_files, recipe.data, "data.train_files")[0].format
    print("\n".join(plan_lines(recipe, args.recipe, ranks, launch, found=bool(found))))
    print("# the resolved recipe, every key (docs/recipe-keys.md):")
    print(dump_recipe(recipe), end="")
    if ds:
        print(ds)


def plan_lines(recipe: Recipe, path: str, ranks: int, launch: list[str], found: bool = False) -> list[str]:
    """The plan as `# ` lines: what a newcomer checks before spending GPU hours (`found`: data.format was found
    from the files' columns)."""
    t, d = recipe.train, recipe.data
    lines = [f"# plan for {path}:", f"#   model:       {model_line(recipe)}",
             f"#   objective:   {method_of(recipe).plan(recipe)}",
             f"#   data:        {data_line(recipe)}" + (" (data.format found from the columns)" if found else "")]
    if launch:
        lines += [f"#   launch:      {launch[0].removeprefix('# ')}"] + [f"#                {x.removeprefix('# ')}"
                                                                        for x in launch[1:]]
    else:
        lines.append("#   launch:      one process (plain `toolkit train`); --accelerate-config X.yaml shows yours")
    per_step = t.micro_batch_size * t.gradient_accumulation_steps * ranks
    online = method_of(recipe).online
    unit = "prompts" if online else "pairs" if d.format == "preference" else \
        "completions" if d.format == "unpaired" else (
        f"packed rows of {d.max_seq_len} tokens" if d.packing else "examples")
    lines.append(f"#   batch:       {t.micro_batch_size} x {t.gradient_accumulation_steps} accumulation x {ranks} "
                 f"data-parallel rank(s) = {per_step} {unit} per optimizer step"
                 + (f" ({per_step * recipe.rl.num_generations} completions)" if online else ""))
    lines.append(f"#   steps:       {steps_line(recipe, per_step)}")
    c = recipe.checkpoint
    lines.append("#   checkpoints: " + (f"every {c.every_steps} steps, the last {c.keep_last} kept" if c.every_steps
                                       else "none periodic (checkpoint.every_steps=0); a stop by signal saves one")
                 + "; resume with resume=auto")
    lines.append(f"#   results:     {Path(recipe.output_dir) / 'final'} (metrics.jsonl, plot.png beside it)")
    return lines


def model_line(recipe: Recipe) -> str:
    m, lora = recipe.model, recipe.lora
    if m.preset:
        where = f"the built-in preset {m.preset} (toolkit/model/presets/{m.preset}.json)"
    elif Path(m.path).expanduser().exists():
        where = f"{m.path} (a local folder)"
    else:
        where = f"{m.path} (a Hub id: downloaded into the Hugging Face cache at the first run, or read from it)"
    targets = lora.target_modules if isinstance(lora.target_modules, str) else ", ".join(lora.target_modules)
    how = f"LoRA r={lora.r} alpha={lora.alpha:g} on {targets}" if lora.enabled else "full fine-tuning"
    if m.load_in_4bit:
        how = "QLoRA: the base in 4-bit NF4, " + how
    checkpointing = ", gradient checkpointing" if m.gradient_checkpointing else ""
    return f"{where}; {how}; {recipe.train.precision}{checkpointing}"


def all_here(entries: list) -> bool:
    """Whether every local file an entry names is here: config show plans a run on a machine that may not hold
    its data, so there data.format stays unset in the plan; files that are here but bad are refused as a run
    refuses them. A Hub id counts as here (resolve_sources asks for data.format where it is one)."""
    import glob

    from ..data.sources import LOADERS

    for e in entries:
        path = e.path if isinstance(e, DataSource) else e
        p = Path(path).expanduser()
        if any(c in path for c in "*?["):
            if not glob.glob(str(p), recursive=True):
                return False
        elif not p.exists() and (p.suffix.lower() in LOADERS or path.startswith(("/", ".", "~"))):
            return False
    return True


def data_line(recipe: Recipe) -> str:
    d = recipe.data

    def name(e) -> str:
        e = e if isinstance(e, DataSource) else DataSource(path=e)
        split = f"[{e.split}]" if e.split != "train" or not Path(e.path).expanduser().exists() else ""
        return e.path + split + (f" (first {e.max_rows:,} rows)" if e.max_rows else "")

    held = (", ".join(map(name, d.eval_files)) if d.eval_files else
            f"{d.eval_fraction:.0%} of the training rows" if d.eval_fraction else "none")
    fmt = d.format or "the format its columns show at launch (the files are not here to read)"
    return (f"{', '.join(map(name, d.train_files))} as {fmt}, max_seq_len {d.max_seq_len}"
            + (", packed" if d.packing else "") + f"; held out: {held}")


def steps_line(recipe: Recipe, per_step: int) -> str:
    t, d = recipe.train, recipe.data
    iterations = recipe.rl.num_iterations
    warmup = f"{t.warmup_ratio:g} of the steps" if t.warmup_ratio else t.warmup_steps
    if t.max_steps:
        return f"{t.max_steps} (train.max_steps), warmup {schedules.warmup_steps(t, t.max_steps)}"
    rows = local_rows(d.train_files)
    times = f" x {iterations} iterations" if iterations > 1 else ""
    if rows is None:
        return (f"{t.epochs} epoch(s) x (training rows // {per_step}){times}, warmup {warmup}: a Hub "
                "dataset's rows are counted when the run reads it (its first lines say)")
    if not d.eval_files and d.eval_fraction:
        rows -= math.ceil(d.eval_fraction * rows)
    per_epoch = rows // per_step
    if d.packing:
        return (f"at most {per_epoch * t.epochs * iterations:,} = {t.epochs} epoch(s) x {per_epoch:,} ({rows:,} "
                f"examples in the files // {per_step}){times}, warmup {warmup}; packed rows are fewer: the "
                "run counts them when it tokenizes")
    return (f"{per_epoch * t.epochs * iterations:,} = {t.epochs} epoch(s) x {per_epoch:,} ({rows:,} training rows in "
            f"the files // {per_step}){times}, warmup {warmup}")


def local_rows(entries: list) -> int | None:
    """Rows in the local files of `entries` (the files a run reads: data.sources.expand_files), JSON lines
    and Parquet counted cheaply, each entry's max_rows applied; None where an entry is a Hub dataset,
    another kind of file, or missing (the run says why)."""
    from ..data.sources import expand_files
    from ..errors import ToolkitError

    total = 0
    for e in entries:
        e = e if isinstance(e, DataSource) else DataSource(path=e)
        try:
            files = expand_files(e.path, "data") or []
        except ToolkitError:
            return None
        counts = [rows_in(f) for f in files]
        if not counts or None in counts:
            return None
        n = sum(counts)
        total += min(n, e.max_rows) if e.max_rows is not None else n
    return total


def rows_in(file: str) -> int | None:
    """Rows of a JSON lines file (its non-blank lines) or a Parquet file (its metadata); None for others."""
    suffix = Path(file).suffix.lower()
    if suffix == ".jsonl":
        with open(file, "rb") as f:
            return sum(1 for line in f if line.strip())
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(file).metadata.num_rows
    return None
