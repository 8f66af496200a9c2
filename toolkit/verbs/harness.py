"""`toolkit eval MODEL_DIR --tasks NAME|FILE.yaml`: EleutherAI's lm-evaluation-harness on a model.

The harness does the measuring, through its own HF model class (`lm_eval.models.huggingface.HFLM`)
and its own `simple_evaluate`: this module finds the tasks, loads the model as every verb does
(a folder, a merged model, a LoRA adapter over its base, or a Hub id; `model.inference`), and
writes what the harness returns. A task is a name the harness knows (its own tasks, or a task in
an `--include` folder) or a task YAML file, whose folder is then included. Every task is built,
its data read, before the model loads: an unknown name, a file that is not a task, data that
cannot be read, or a metric the harness cannot compute for it (which it finds out only after every
answer is generated) ends in one line naming it. Results go to --out, and when MODEL_DIR is a run's
final/ also to RUN/eval/lm-eval-TIME.json (a new file each time; none when the run folder is
read-only). One process:
under `accelerate launch` the verb refuses (the harness takes a loaded model on one device).
"""

from __future__ import annotations

import difflib
import json
import os
import sys
import time
from pathlib import Path

from ..errors import ToolkitError
from ..storage.disk import check_writable, write_file

# What lm-eval 0.4's own scoring (ConfigurableTask.process_results) gives for each output type but generate_until:
# a metric a task of that type names besides these gets no value (an empty result). In a generate_until task,
# lm-eval's metrics of log-likelihoods (FROM_LIKELIHOODS: each passes its input through) give the pair
# [target, answer], which an average (AVERAGES) cannot take: it raises once every answer is generated.
SCORED = {"loglikelihood": {"perplexity", "acc"},
          "loglikelihood_rolling": {"word_perplexity", "byte_perplexity", "bits_per_byte"},
          "multiple_choice": {"acc", "acc_norm", "acc_bytes", "acc_mutual_info", "exact_match", "f1", "mcc",
                              "brier_score", "likelihood"}}
FROM_LIKELIHOODS = (set().union(*SCORED.values()) | {"acc_all"}) - {"exact_match"}
AVERAGES = ("mean", "median", "nanmean", "perplexity", "weighted_perplexity", "bits_per_byte")

# --data options that mean nothing to a task, whose YAML says how its rows are read and scored
DATA_ONLY = ("format", "max_seq_len", "train_on_prompt", "reward", "max_new_tokens")


def add_arguments(p) -> None:
    p.add_argument("--tasks", action="append", default=None, metavar="NAME|FILE.yaml",
                   help="lm-evaluation-harness tasks instead of --data: a task, group or tag name the harness "
                        "knows, or a task YAML file; comma-separated or repeated")
    p.add_argument("--include", action="append", default=None, metavar="DIR",
                   help="with --tasks: a folder of task YAML files to look names up in too (repeatable)")
    p.add_argument("--num-fewshot", type=int, default=None, metavar="N",
                   help="with --tasks: examples shown before each question (default: each task's own)")
    p.add_argument("--chat-template", action="store_true",
                   help="with --tasks: render each request with the model's chat template (instruct models)")


def run(args) -> int:
    """The tasks built (their data read), then the model loaded and the harness run."""
    from ..model.inference import locate_model

    refuse_mixed(args)
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise ToolkitError("eval --tasks: needs EleutherAI's lm-evaluation-harness: pip install 'lm-eval>=0.4.13,<0.5' "
                           "(the toolkit's `eval` extra)")
    locate_model(args.model)  # a wrong path fails here, before anything heavy is imported
    names, include = task_names(args.tasks, args.include or [])
    import logging

    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its notes on passing a loaded model are for its CLI
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager, get_task_dict

    manager = TaskManager(include_path=include or None)
    known = set(manager.all_tasks)
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            where = f" or in {', '.join(include)}" if include else ""
            raise ToolkitError(f"eval --tasks: {name!r} is not a task, group or tag of lm-eval's{where}{hint}")
    for name in names:  # each built on its own, so a failure names its task; the harness's dataset cache keeps it
        check_metrics(name, *yaml_metrics(getattr(manager.task_index.get(name), "yaml_path", None)))
        try:
            built = get_task_dict([name], manager)
        except Exception as e:  # the harness's and datasets' errors on a user's task: many kinds
            raise ToolkitError(f"eval --tasks: task {name!r} could not be built: {first_line(e)}") from None
        for task in leaf_tasks(built):  # with what the files they include bring
            c = task.config
            check_metrics(c.task, c.metric_list, c.process_results is not None, c.output_type)
    out = Path(args.out) if args.out else None
    if out:
        check_writable(out, "eval --out")
    beside = run_eval_file(args.model)  # after the tasks: a mistyped one leaves nothing in the run folder

    from lm_eval.models.huggingface import HFLM

    from ..model.inference import load_for_inference

    model, tokenizer = load_for_inference(args.model, args.dtype, trust_remote_code=args.trust_remote_code)
    if args.chat_template and not tokenizer.chat_template:
        raise ToolkitError(f"eval --chat-template: {args.model}'s tokenizer has no chat template; leave the flag out "
                           "(a base model's tasks are plain text)")
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=args.batch_size)
    started = time.perf_counter()
    result = simple_evaluate(model=lm, tasks=names, task_manager=manager, num_fewshot=args.num_fewshot,
                             limit=args.limit, apply_chat_template=args.chat_template, log_samples=False)
    seconds = time.perf_counter() - started
    record = written(args.model, names, result, seconds)
    text = table(result)
    for path, what in ((out, "eval --out"), (beside, "eval")):
        if path is not None:
            write_file(path, what, lambda f: f.write(json.dumps(record, indent=1, ensure_ascii=False,
                                                                default=str).encode() + b"\n"))
            text += f"\nwrote {path}"
    if args.json:
        print(text, file=sys.stderr)
        print(json.dumps(record, ensure_ascii=False, default=str))
    else:
        print(text)
    return 0


def refuse_mixed(args) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ToolkitError("eval --tasks: runs in one process (the harness is handed the loaded model); "
                           "run it without accelerate launch")
    for name in DATA_ONLY:
        if getattr(args, name, None):
            raise ToolkitError(f"eval --{name.replace('_', '-')}: reads --data rows; with --tasks each task's "
                               "YAML says how its rows are read and scored")
    if args.answers != "exact":
        raise ToolkitError("eval --answers: scores --data rows; with --tasks each task's YAML names its metrics")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ToolkitError(f"--num-fewshot: must be 0 or more, got {args.num_fewshot}")


def task_names(given: list[str], include: list[str]) -> tuple[list[str], list[str]]:
    """(task names, folders to include): names as given, task YAML files by their `task:` name with
    their folder included. A folder or file that does not exist, or a file that is not a task,
    is one line."""
    folders = []
    for folder in include:
        if not Path(folder).expanduser().is_dir():
            raise ToolkitError(f"eval --include: {folder} is not a folder")
        folders.append(str(Path(folder).expanduser().resolve()))
    names = []
    for item in (part.strip() for entry in given for part in entry.split(",")):
        if not item:
            continue
        if item.endswith((".yaml", ".yml")) or os.sep in item:
            path = Path(item).expanduser()
            if not path.is_file():
                raise ToolkitError(f"eval --tasks: {item}: no such file")
            names.append(task_file_name(path))
            if str(path.resolve().parent) not in folders:
                folders.append(str(path.resolve().parent))
        else:
            names.append(item)
    if not names:
        raise ToolkitError("eval --tasks: names no task")
    return list(dict.fromkeys(names)), folders


def read_task_file(path: Path):
    """A task YAML file's content; the harness's own tags (`!function`) read as their tag's text."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: f"!{suffix}")
    return yaml.load(path.read_text(encoding="utf-8"), Loader=Loader)  # noqa: S506 (a SafeLoader)


def task_file_name(path: Path) -> str:
    """The `task:` (or `group:`) name of a task YAML file; a file that is not one is one line."""
    import yaml

    try:
        config = read_task_file(path)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ToolkitError(f"eval --tasks: {path} is not YAML: {first_line(e)}") from None
    name = None
    if isinstance(config, dict):  # a group file has `group:` and a list under `task:`
        name = config.get("task") if isinstance(config.get("task"), str) else config.get("group")
    if not isinstance(name, str) or not name:
        raise ToolkitError(f"eval --tasks: {path} is not an lm-eval task file (it has no `task:` name)")
    return name


def yaml_metrics(path) -> tuple[list | None, bool, str | None]:
    """(metric_list, whether the task scores with its own process_results, output_type) as a task's own YAML
    file writes them, before the harness builds the task (a metric it has no aggregation for fails the build);
    no metric_list where there is no file or it says nothing of them (they come from a file it includes:
    checked once built)."""
    try:
        config = read_task_file(Path(path)) if path else None
    except Exception:  # noqa: BLE001 - unreadable: building the task says why, in one line
        config = None
    if not isinstance(config, dict) or not isinstance(config.get("metric_list"), list):
        return None, False, None
    return config["metric_list"], config.get("process_results") is not None, config.get("output_type")


def check_metrics(task: str, metrics, own_results: bool = False, output_type: str | None = None) -> None:
    """Every metric of a task's metric_list one lm-eval can compute for the task's output type (its own, or
    Hugging Face evaluate's, as lm-eval looks it up: `get_metric`), and every aggregation one it has: the harness
    finds out only after every answer is generated, or never (a metric of no value). `own_results`: the task's
    process_results computes its metrics (their names are its)."""
    from lm_eval.api import metrics as _registered  # noqa: F401 - fills the registries
    from lm_eval.api.registry import aggregation_registry, metric_agg_registry, metric_registry

    for entry in metrics or []:
        metric = entry.get("metric") if isinstance(entry, dict) else None
        if not isinstance(metric, str) or metric.startswith("!"):  # a function of the task's own
            continue
        where = f"eval --tasks: task {task!r}: metric {metric!r}"
        hf = entry.get("hf_evaluate") is True
        if not own_results and not known_metric(metric, hf):
            close = difflib.get_close_matches(metric, list(metric_registry), n=3, cutoff=0.5)
            raise ToolkitError(f"{where} is not one lm-eval knows ("
                               + (f"did you mean {', '.join(close)}?" if close else
                                  f"its own: {', '.join(sorted(metric_registry))}; or one of Hugging Face evaluate's")
                               + ")")
        if not own_results and output_type in SCORED and metric not in SCORED[output_type] | {"bypass"}:
            raise ToolkitError(f"{where}: lm-eval gives a {output_type} task no such score (it gives "
                               f"{', '.join(sorted(SCORED[output_type]))})")
        aggregation = entry.get("aggregation")
        if not own_results and not hf and output_type == "generate_until" and metric in FROM_LIKELIHOODS:
            default = metric_agg_registry.get(metric, None)  # the aggregation lm-eval uses where none is given
            if aggregation in AVERAGES or aggregation is None and any(
                    default is aggregation_registry.get(a, False) for a in AVERAGES):
                raise ToolkitError(f"{where}: lm-eval computes it from log-likelihoods, which a generate_until task "
                                   "has none of (its metrics compare the generated text with the target: "
                                   "exact_match, bleu, chrf, ter, or one of Hugging Face evaluate's)")
        if isinstance(aggregation, str) and not aggregation.startswith("!") and aggregation not in aggregation_registry:
            raise ToolkitError(f"{where}: aggregation {aggregation!r} is not one lm-eval knows "
                               f"({', '.join(sorted(aggregation_registry))})")
        if aggregation is None and metric not in metric_agg_registry:
            raise ToolkitError(f"{where}: lm-eval has no aggregation of its own for it: give one (aggregation: "
                               f"{', '.join(sorted(aggregation_registry))})")


def known_metric(name: str, hf_evaluate: bool) -> bool:
    """Whether lm-eval finds a metric function for `name` as it will when the task runs (its registry, then
    Hugging Face evaluate), its log of the search kept quiet (the refusal says it)."""
    import logging

    from lm_eval.api.registry import get_metric, metric_registry

    if not hf_evaluate and name in metric_registry:
        return True
    log = logging.getLogger("lm_eval")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        return get_metric(name, hf_evaluate) is not None
    finally:
        log.setLevel(level)


def leaf_tasks(built: dict) -> list:
    """The tasks of get_task_dict's answer, groups opened."""
    found = []
    for value in built.values():
        if isinstance(value, dict):
            found += leaf_tasks(value)
        elif hasattr(value, "config"):
            found.append(value)
    return found


def run_eval_file(model: str) -> Path | None:
    """RUN/eval/lm-eval-TIME.json when MODEL_DIR is the final/ of a run folder, else None."""
    run_dir = Path(model).expanduser().resolve().parent
    if not ((run_dir / "config.yaml").is_file() and (run_dir / "manifest.json").is_file()):
        return None
    stamp, n = time.strftime("%Y%m%d-%H%M%S"), 1
    while (path := run_dir / "eval" / f"lm-eval-{stamp}{f'-{n}' if n > 1 else ''}.json").exists():
        n += 1  # an earlier result of the same second stays
    try:
        check_writable(path, "eval")
    except ToolkitError as e:  # a run folder one may read but not write: the results go to --out and stdout only
        print(f"note: {e}; the results are not kept in the run folder", file=sys.stderr)
        return None
    return path


def written(model: str, names: list[str], result: dict, seconds: float) -> dict:
    """The JSON written: the harness's results, groups, versions, shots, metrics' directions and
    sample counts, as it returns them, with the model, the tasks asked for and the seconds taken."""
    from lm_eval.utils import handle_non_serializable

    keep = ("results", "groups", "versions", "n-shot", "higher_is_better", "n-samples", "config", "configs")
    record = {"model": str(model), "tasks": names, "seconds": round(seconds, 2),
              **{k: result[k] for k in keep if k in result}}
    import importlib.metadata

    record["lm_eval_version"] = importlib.metadata.version("lm_eval")
    return json.loads(json.dumps(record, default=handle_non_serializable))


def table(result: dict) -> str:
    """Task | metric | value | stderr | rows, one line per task and metric (groups first)."""
    rows = [("task", "metric", "value", "stderr", "rows")]
    counts = result.get("n-samples", {})
    for section in ("groups", "results"):
        for task, metrics in (result.get(section) or {}).items():
            for key, value in metrics.items():
                if "," not in key or "_stderr," in key or not isinstance(value, (int, float)):
                    continue
                metric, kind = key.split(",", 1)
                stderr = metrics.get(f"{metric}_stderr,{kind}")
                name = metric if kind == "none" else f"{metric} ({kind})"
                rows.append((task, name, f"{value:.4f}",
                             f"{stderr:.4f}" if isinstance(stderr, (int, float)) else "-",
                             str(counts.get(task, {}).get("effective", "-"))))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
