"""`toolkit eval MODEL_DIR --data FILE`: loss, perplexity and answer accuracy of a model on a data file.

The loss is training's eval loss: rows rendered and labelled by `toolkit.data.tokenize.tokenize_examples`
(same formats, chat template and response-only labels), batched by `Collator`, and the
token-weighted mean of next-token cross-entropy over target tokens (`toolkit.training.loss.token_loss_sum`
summed, divided by the count). So a run's final/ on its eval file gives the eval_loss the run
logged at its last step. Answers: for rows with a reference (alpaca `output`; messages: the last
assistant turn, prompted with the turns before it), a greedy answer scored by exact match after
strip, or by containment; the answer as `generate` shows it (added tokens included, padding, BOS,
eos and end of turn left out), the reference encoded and decoded the same way. Preference pairs
(`prompt`, `chosen`, `rejected`): the loss is the chosen completions', and `preference` gives the
share of pairs whose chosen completion the model finds more likely than the rejected one (summed
log-probabilities); for a LoRA adapter also the DPO reward accuracy against its base (the adapter
disabled) and the mean log-ratio margin.

Under `accelerate launch` (WORLD_SIZE > 1) the rows are split over the processes as
`EvalShardSampler` splits them (row i to rank i % world), the sums gathered, and the main process
prints and writes. Progress bars (examples measured, answers generated: the main process's share) go
to stderr; stdout holds the summary, or the JSON with --json. Light at import time.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from pathlib import Path

from ..errors import ToolkitError
from ..storage.disk import check_writable, write_file
from . import harness

FORMATS = ("alpaca", "messages", "text", "prompt_completion", "preference", "prompt")
DEFAULT_MAX_SEQ_LEN = 512  # DataConfig's default
DEFAULT_MAX_NEW_TOKENS = 128  # --max-new-tokens
EXAMPLES = 3  # right and wrong answers each, shown in the summary and kept in the JSON


def add_arguments(p) -> None:
    p.add_argument("model", metavar="MODEL_DIR",
                   help="a Hugging Face model folder, a merged model, a LoRA adapter folder (such as a run's "
                        "final/) or a Hub id (downloaded into the Hugging Face cache, or read from it)")
    p.add_argument("--data", metavar="FILE",
                   help="a .jsonl, .json, .parquet or .csv file, a folder or glob of them, or a Hub dataset id "
                        "(or --tasks)")
    p.add_argument("--format", choices=FORMATS, default=None,
                   help="default: from the first row's keys (instruction/output: alpaca, messages, text, "
                        "chosen/rejected: preference)")
    p.add_argument("--max-seq-len", type=int, default=None, metavar="N",
                   help="truncate examples to this many tokens, as training does (default: the run's "
                        f"data.max_seq_len when MODEL_DIR is a run's final/, else {DEFAULT_MAX_SEQ_LEN})")
    p.add_argument("--train-on-prompt", action="store_true",
                   help="count prompt tokens in the loss too (default: the run's data.train_on_prompt, else off)")
    p.add_argument("--batch-size", type=int, default=8, metavar="N",
                   help="rows per forward pass and per generation batch (8)")
    p.add_argument("--answers", choices=("exact", "contains", "none"), default="exact",
                   help="score generated answers by exact match after strip (default), by containing the "
                        "reference, or not at all")
    p.add_argument("--reward", action="append", default=None, metavar="FUNCTION",
                   help="prompt rows (online RL's format): score each greedy answer with this reward function, as "
                        "rl.rewards names one (path/to/file.py:name, module:name, exact_match, numeric_match); "
                        "repeat for several. Default: the run's rl.rewards when MODEL_DIR is a run's final/")
    p.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help="at most this many tokens per answer (128)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N rows")
    p.add_argument("--out", metavar="FILE", help="write the results as JSON to FILE")
    p.add_argument("--json", action="store_true", help="print the results as JSON (the summary goes to stderr)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="weights' dtype (fp32)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the Python code a model ships with (only for sources you trust)")
    harness.add_arguments(p)


def run(args) -> int:
    from ..model.inference import locate_model

    if bool(args.data) == bool(args.tasks):
        raise ToolkitError("eval: give --data FILE (loss and answers on rows) or --tasks NAME (lm-eval tasks), "
                           "not both" if args.data else "eval: give --data FILE or --tasks NAME")
    for name in ("batch_size", "max_new_tokens", "limit"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ToolkitError(f"--{name.replace('_', '-')}: must be positive, got {value}")
    if args.tasks:
        return harness.run(args)
    for name in ("include", "num_fewshot", "chat_template"):
        if getattr(args, name) not in (None, False):
            raise ToolkitError(f"eval --{name.replace('_', '-')}: only with --tasks")
    args.max_new_tokens = args.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    if args.max_seq_len is not None and args.max_seq_len < 2:
        raise ToolkitError(f"--max-seq-len: must be at least 2, got {args.max_seq_len}")
    locate_model(args.model)  # a wrong path fails here, before torch is imported
    if args.out and int(os.environ.get("RANK", "0")) == 0:
        check_writable(Path(args.out), "eval --out")  # before the model loads, not after the rows are scored
    from ..config import DataConfig
    from ..data.sources import resolve_sources

    source = resolve_sources([args.data], DataConfig(format=args.format or "text"), "--data")[0]
    source.format = args.format or infer_format(source)
    max_seq_len, train_on_prompt, origin = run_settings(args.model)
    rewards = prompt_rewards(args) if source.format == "prompt" else None  # imported before the model loads
    if args.max_seq_len is not None:
        max_seq_len, origin = args.max_seq_len, None
    train_on_prompt = args.train_on_prompt or train_on_prompt

    state = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under `accelerate launch`: one share of the rows each
        import torch
        from accelerate import PartialState

        state = PartialState(cpu=not torch.cuda.is_available())
    try:
        with tempfile.TemporaryDirectory(prefix="toolkit-eval-") as cache:  # datasets' Arrow copy of the file
            rows, where = read_rows(source, Path(cache), args.limit)
        parts = measure(args, state, rows, where, source.format, max_seq_len, train_on_prompt)
    finally:
        if state is not None:
            from ..backends import end_process_group

            end_process_group()
    if parts is None:  # not the main process
        return 0
    result = results(args, parts, rows, source.format, max_seq_len, train_on_prompt)
    if rewards is not None:
        result["rewards"] = scored(rewards, [r for p in parts for r in p["records"]], rows, where)
    text = summary(result, origin)
    if args.out:
        out = Path(args.out)
        write_file(out, "eval --out", lambda f: f.write((json.dumps(result, indent=1, ensure_ascii=False) + "\n")
                                                      .encode()))
        text += f"\nwrote {out}"
    if args.json:
        print(text, file=sys.stderr)
        print(json.dumps(result, ensure_ascii=False))
    else:
        print(text)
    return 0


def measure(args, state, rows: list[dict], where, fmt: str, max_seq_len: int, train_on_prompt: bool) -> list | None:
    """This process's share of the rows measured: loss sums and scored answers. The main process
    gets every process's share (a list of dicts), the others None."""
    from ..model.inference import framing_token_ids, generate_texts, load_for_inference, shown_text

    rank, world = (state.process_index, state.num_processes) if state else (0, 1)
    bars = rank == 0  # the main process's bars only, on stderr
    model, tokenizer = load_for_inference(args.model, args.dtype, device=state.device if state else None,
                                          trust_remote_code=args.trust_remote_code)
    error, examples, questions = None, [], []
    try:
        if fmt == "prompt":
            questions = prompt_questions(rows, range(rank, len(rows), world), where, tokenizer)
        else:  # EvalShardSampler's split
            examples, questions = prepare_rows(rows, range(rank, len(rows), world), where, fmt, tokenizer,
                                               max_seq_len, train_on_prompt, args.answers != "none")
    except ToolkitError as e:
        error = str(e)
    if state:  # every process stops on the first one's error, so none waits in a collective below
        from accelerate.utils import gather_object

        error = next((e for e in gather_object([error]) if e is not None), None)
    if error is not None:
        raise ToolkitError(error)

    if fmt == "prompt":  # no targets: a greedy answer per prompt, scored by the reward functions on the main process
        answers = generate_texts(model, tokenizer, [q["text"] for q in questions],
                                 add_bos=[not q["chat"] for q in questions], max_new_tokens=args.max_new_tokens,
                                 batch_size=args.batch_size, progress="eval answers" if bars and questions else None)
        part = {"loss_sum": 0.0, "targets": 0, "truncated": 0,
                "records": [{"row": q["row"], "answer": answer} for q, (answer, _) in zip(questions, answers)]}
        if state is None:
            return [part]
        from accelerate.utils import gather_object

        parts = gather_object([part])
        return parts if state.is_main_process else None
    if fmt == "preference":
        part = pair_sums(model, tokenizer, examples, args.batch_size, bars)
        part["truncated"] = sum(e["full_length"] > max_seq_len for e in examples[::2])
        if state is None:
            return [part]
        from accelerate.utils import gather_object

        parts = gather_object([part])
        return parts if state.is_main_process else None
    loss_sum, n_targets = loss_sums(model, tokenizer, examples, args.batch_size, bars)
    answers = generate_texts(model, tokenizer, [q["text"] for q in questions], add_bos=False,
                             max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                             progress="eval answers" if bars and questions else None)
    framing = framing_token_ids(model, tokenizer)

    def as_answer(reference: str) -> str:  # the reference as an answer is shown (its eos or end of turn left out)
        return shown_text(tokenizer, tokenizer(reference, add_special_tokens=False)["input_ids"], framing)

    records = [{"row": q["row"], "prompt": q["prompt"], "reference": q["reference"], "answer": answer,
                "correct": is_correct(answer, as_answer(q["reference"]), args.answers)}
               for q, (answer, _) in zip(questions, answers)]
    part = {"loss_sum": loss_sum, "targets": n_targets, "records": records,
            "truncated": sum(e["full_length"] > max_seq_len for e in examples)}
    if state is None:
        return [part]
    from accelerate.utils import gather_object

    parts = gather_object([part])
    return parts if state.is_main_process else None


def results(args, parts: list[dict], rows: list, fmt: str, max_seq_len: int, train_on_prompt: bool) -> dict:
    """The processes' shares summed into the results written as JSON."""
    targets = sum(p["targets"] for p in parts)
    loss = sum(p["loss_sum"] for p in parts) / targets if targets else None
    result = {"model": args.model, "data": args.data, "format": fmt, "max_seq_len": max_seq_len,
              "train_on_prompt": train_on_prompt, "rows": len(rows),
              "truncated_rows": sum(p["truncated"] for p in parts),
              "target_tokens": targets, "loss": loss, "perplexity": perplexity(loss), "processes": len(parts),
              "answers": None}
    if fmt == "preference":
        pairs = sum(p["pairs"] for p in parts)
        with_reference = parts[0]["reward_preferred"] is not None
        result["preference"] = {
            "pairs": pairs, "accuracy": sum(p["preferred"] for p in parts) / pairs if pairs else None,
            "reward_accuracy": sum(p["reward_preferred"] for p in parts) / pairs if pairs and with_reference else None,
            "mean_log_ratio_margin": sum(p["margin_sum"] for p in parts) / pairs if pairs and with_reference else None}
        return result
    if args.answers != "none" and fmt != "prompt":
        records = sorted((r for p in parts for r in p["records"]), key=lambda r: r["row"])
        correct = sum(r["correct"] for r in records)
        shown = [r for r in records if r["correct"]][:EXAMPLES] + [r for r in records if not r["correct"]][:EXAMPLES]
        result["answers"] = {"mode": args.answers, "max_new_tokens": args.max_new_tokens, "scored": len(records),
                             "correct": correct, "accuracy": correct / len(records) if records else None,
                             "examples": sorted(shown, key=lambda r: r["row"]), "records": records}
    return result


# ----------------------------------------------------------------------------- rows


def infer_format(source) -> str:
    """alpaca, messages or text, from the first row's keys (or the file's columns)."""
    import csv

    from ..data.sources import check_json_lines, is_saved_dataset, load_saved_dataset

    if source.hub_id:
        from ..model.hub import load_hub_dataset

        columns = load_hub_dataset(source.hub_id, source.split, source.revision, "--data").column_names
    else:
        first = source.files[0]
        suffix = Path(first).suffix.lower()
        columns = []
        if is_saved_dataset(Path(first)):
            columns = load_saved_dataset(source).column_names
        else:
            check_json_lines(source.files[:1])  # malformed JSON named by file and line
        if suffix == ".jsonl":
            with open(first, encoding="utf-8") as f:
                line = next((line for line in f if line.strip()), "{}")
            columns = list(json.loads(line))
        elif suffix == ".json":
            data = json.loads(Path(first).read_text(encoding="utf-8"))
            row = data[0] if isinstance(data, list) and data else data
            columns = list(row) if isinstance(row, dict) else []
        elif suffix == ".csv":
            with open(first, newline="", encoding="utf-8") as f:
                columns = next(csv.reader(f), [])
        elif suffix == ".parquet":
            import pyarrow.parquet as pq

            columns = pq.read_schema(first).names
    keys = set(columns)
    if {"instruction", "output"} <= keys:
        return "alpaca"
    if "messages" in keys or "conversations" in keys:
        return "messages"
    if "text" in keys:
        return "text"
    if {"chosen", "rejected"} <= keys:
        return "preference"
    if {"completion", "label"} <= keys:  # KTO's: measured by the run itself (eval_kl, eval_rewards_*)
        raise ToolkitError(f"{source.name}: unpaired rows (prompt, completion, label: KTO's format) are not measured "
                           "by toolkit eval; a KTO run's metrics.jsonl has them (eval_loss, eval_kl, "
                           "eval_reward_margin), or give --format text or messages rows")
    if {"prompt", "completion"} <= keys:
        return "prompt_completion"
    if "prompt" in keys:
        return "prompt"
    raise ToolkitError(f"{source.name}: cannot tell the format from the first row's keys "
                       f"({', '.join(map(str, columns)) or 'none'}); give --format alpaca, messages, text, "
                       "prompt_completion, preference or prompt")


def read_rows(source, cache: Path, limit: int | None):
    """The rows as dicts, and a function naming row i by file and line (JSON lines) or by number."""
    from ..data.sources import load_rows

    ds = load_rows(source, cache_dir=cache)
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    rows = ds.to_list()
    lines = None
    if len(source.files) == 1 and source.files[0].lower().endswith(".jsonl"):
        with open(source.files[0], encoding="utf-8") as f:  # datasets skips blank lines
            lines = [n for n, line in enumerate(f, 1) if line.strip()]

    def where(i: int) -> str:
        if lines is not None and i < len(lines):
            return f"{source.name}: line {lines[i]}"
        return f"{source.name}: row {i + 1}"

    return rows, where


def prepare_rows(rows: list[dict], indices, where, fmt: str, tokenizer, max_seq_len: int,
                 train_on_prompt: bool, answers: bool) -> tuple[list[dict], list[dict]]:
    """This rank's rows as training examples, and the questions of those with a reference answer."""
    from jinja2 import TemplateError

    from ..data.tokenize import render, tokenize_examples

    examples, questions = [], []
    for i in indices:
        row = rows[i]
        try:
            examples.extend(tokenize_examples(row, fmt, tokenizer, max_seq_len, train_on_prompt))
            question = reference_question(row, fmt, tokenizer, render) if answers else None
        except ToolkitError as e:
            raise ToolkitError(f"{where(i)}: {e}") from None
        except (KeyError, TypeError, AttributeError, ValueError, IndexError, TemplateError) as e:
            # TemplateError: a chat template that reads a key the row lacks (jinja's UndefinedError)
            raise ToolkitError(f"{where(i)}: the row does not fit --format={fmt} ({type(e).__name__}: {e})") from None
        if question is not None:
            questions.append({"row": i + 1, **question})
    return examples, questions


def prompt_questions(rows: list[dict], indices, where, tokenizer) -> list[dict]:
    """This rank's prompt rows rendered as online RL renders them (data.tokenize.prompt_example)."""
    from ..data.tokenize import prompt_example

    questions = []
    for i in indices:
        try:
            text, _, chat = prompt_example(rows[i], tokenizer)
        except ToolkitError as e:
            raise ToolkitError(f"{where(i)}: {e}") from None
        questions.append({"row": i + 1, "text": text, "chat": chat})
    return questions


def reference_question(row: dict, fmt: str, tokenizer, render) -> dict | None:
    """{text: what to generate from (specials written out, as training renders it), prompt: the
    question in short, reference: the expected answer}, or None for a row without a reference."""
    from ..data.tokenize import text_value

    if fmt == "alpaca":
        reference = text_value(row, "output")
        if not reference.strip():
            return None
        [(text, spans, _)] = render(row, fmt, tokenizer)
        prompt = " ".join(text_value(row, k, required=False) for k in ("instruction", "input")).strip()
        return {"text": text[:spans[0][0]], "prompt": prompt, "reference": reference}
    if fmt == "messages":
        from ..data.tokenize import chat_messages, template_fields

        messages = template_fields(chat_messages(row), tokenizer)  # as training renders them
        if len(messages) < 2 or messages[-1]["role"] != "assistant" or not isinstance(messages[-1]["content"], str) \
                or not messages[-1]["content"].strip():
            return None
        text = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        prompt = next((m["content"] for m in reversed(messages[:-1]) if m["role"] == "user"), "")
        return {"text": text, "prompt": prompt, "reference": messages[-1]["content"]}
    if fmt == "prompt_completion":
        from ..data.tokenize import adds_bos

        [(text, spans, chat)] = render(row, fmt, tokenizer)
        prompt, completion = row.get("prompt"), row.get("completion")
        if isinstance(completion, list):
            completion = next((m.get("content") for m in completion if m.get("role") == "assistant"), None)
        if not isinstance(completion, str) or not completion.strip() or not spans:
            return None
        if isinstance(prompt, list):
            prompt = next((m.get("content") for m in reversed(prompt) if m.get("role") == "user"), "")
        bos = tokenizer.bos_token if not chat and adds_bos(tokenizer) else ""  # as training adds it
        return {"text": (bos or "") + text[:spans[0][0]], "prompt": prompt, "reference": completion.strip()}
    return None


def prompt_rewards(args) -> list:
    """The reward functions prompt rows are scored with: --reward, else the run's rl.rewards (MODEL_DIR a run's
    final/), imported now; none is one line."""
    from ..config import RewardConfig, load_recipe
    from ..training.rewards import load_rewards

    entries = [RewardConfig(function=f) for f in args.reward or []]
    config = Path(args.model).expanduser().resolve().parent / "config.yaml"
    if not entries and config.is_file():
        try:
            entries = load_recipe(config).rl.rewards
        except ToolkitError:
            pass
    if not entries:
        raise ToolkitError(f"--data {args.data}: prompt rows are scored by reward functions; give --reward FUNCTION "
                           "(path/to/file.py:name, module:name, exact_match or numeric_match), or evaluate the "
                           "final/ of a run that has rl.rewards")
    return load_rewards(entries)


def scored(rewards: list, records: list[dict], rows: list[dict], where) -> dict:
    """Each greedy answer scored as training scores a completion (rewards.score: TRL's call, None as no opinion):
    the mean total over the scored answers and each function's mean, with the best and worst answers."""
    from ..training.rewards import score

    records = sorted(records, key=lambda r: r["row"])
    picked = [rows[r["row"] - 1] for r in records]
    total, per_function = score(rewards, [row["prompt"] for row in picked], [r["answer"] for r in records],
                                [{k: v for k, v in row.items() if k != "prompt"} for row in picked], step=0,
                                rows=[where(r["row"] - 1) for r in records])
    for r, value in zip(records, total.tolist()):
        r["reward"] = None if math.isnan(value) else value
        prompt = rows[r["row"] - 1]["prompt"]
        r["prompt"] = prompt if isinstance(prompt, str) else next(
            (m.get("content", "") for m in reversed(prompt) if m.get("role") == "user"), "")
    ok = ~total.isnan()
    ranked = sorted((r for r in records if r["reward"] is not None), key=lambda r: -r["reward"])
    return {"functions": [r.name for r in rewards], "answers": len(records), "scored": int(ok.sum()),
            "mean": float(total[ok].mean()) if ok.any() else None,
            "per_function": {name: float(v[~v.isnan()].mean()) if (~v.isnan()).any() else None
                             for name, v in per_function.items()},
            "examples": ranked[:EXAMPLES] + ranked[EXAMPLES:][-EXAMPLES:], "records": records}


def run_settings(model: str) -> tuple[int, bool, str | None]:
    """(max_seq_len, train_on_prompt, where they came from): the run's recipe when MODEL_DIR is
    the final/ of a run folder (config.yaml and manifest.json beside it), else the defaults."""
    from ..config import load_recipe

    run_dir = Path(model).expanduser().resolve().parent
    config = run_dir / "config.yaml"
    if config.is_file() and (run_dir / "manifest.json").is_file():
        try:
            recipe = load_recipe(config)
        except ToolkitError:
            pass
        else:
            return recipe.data.max_seq_len, recipe.data.train_on_prompt, str(config)
    return DEFAULT_MAX_SEQ_LEN, False, None


# ----------------------------------------------------------------------------- measuring


def loss_sums(model, tokenizer, examples: list[dict], batch_size: int, bar: bool = False) -> tuple[float, int]:
    """(sum of next-token cross-entropies over target tokens, number of target tokens), in
    training's batches (right-padded, unpacked) and training's loss function. `bar`: a progress
    bar over the examples on stderr."""
    import torch

    from ..data.batching import Collator
    from ..data.formats import IGNORE
    from ..model.inference import progress_bar
    from ..training.loss import token_loss_sum, use_token_loss

    try:
        use_token_loss(model)  # training's default, train.loss=chunked
    except ToolkitError:  # a model the chunked loss does not know: its own logits, as train.loss=full
        use_token_loss(model, "full")
    collate = Collator(tokenizer.pad_token_id, packed=False)
    device = next(model.parameters()).device
    by_length = sorted(examples, key=lambda e: -len(e["input_ids"]))  # little padding per batch
    total, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad(), progress_bar(len(by_length), "eval loss", "example", enabled=bar) as progress:
        for start in range(0, len(by_length), batch_size):
            batch = collate(by_length[start:start + batch_size])
            count += int((batch["labels"][:, 1:] != IGNORE).sum())
            batch = {k: v.to(device) for k, v in batch.items()}
            total += token_loss_sum(model, batch).double().cpu()
            progress.update(len(batch["input_ids"]))
    return total.item(), count


def pair_sums(model, tokenizer, examples: list[dict], batch_size: int, bar: bool = False) -> dict:
    """Preference pairs (`examples`: chosen, rejected, chosen, ...; pairs without targets on both
    sides left out): how many, how many the model prefers the chosen completion of (summed
    log-probabilities), the chosen completions' loss sum and targets; for a peft adapter also the
    pairs whose log-ratio to the base (the adapter disabled) is higher for the chosen, and the sum of
    those margins. In training's pair batches and its log-probabilities (`loss.token_logps`). `bar`:
    a progress bar over the pairs on stderr."""
    import torch

    from ..data.batching import Collator
    from ..model.inference import progress_bar
    from ..training.loss import token_logps, use_token_loss

    try:
        use_token_loss(model)
    except ToolkitError:
        use_token_loss(model, "full")
    pairs = [{"input_ids": c["input_ids"], "labels": c["labels"], "rejected_input_ids": r["input_ids"],
              "rejected_labels": r["labels"]}
             for c, r in zip(examples[::2], examples[1::2]) if c["n_targets"] and r["n_targets"]]
    collate = Collator(tokenizer.pad_token_id, pairs=True)
    device = next(model.parameters()).device
    adapter = hasattr(model, "disable_adapter")
    sums = {"pairs": len(pairs), "preferred": 0, "loss_sum": 0.0, "targets": 0,
            "reward_preferred": 0 if adapter else None, "margin_sum": 0.0 if adapter else None}
    with torch.no_grad(), progress_bar(len(pairs), "eval pairs", "pair", enabled=bar) as progress:
        for start in range(0, len(pairs), batch_size):
            batch = {k: v.to(device) for k, v in collate(pairs[start:start + batch_size]).items()}
            logps, counts = token_logps(model, batch)
            n = len(logps) // 2
            progress.update(n)
            sums["preferred"] += int((logps[:n] > logps[n:]).sum())
            sums["loss_sum"] += -float(logps[:n].double().sum())
            sums["targets"] += int(counts[:n].sum())
            if adapter:
                with model.disable_adapter():
                    reference, _ = token_logps(model, batch)
                margin = (logps[:n] - reference[:n]) - (logps[n:] - reference[n:])
                sums["reward_preferred"] += int((margin > 0).sum())
                sums["margin_sum"] += float(margin.double().sum())
    return sums


def is_correct(answer: str, reference: str, mode: str) -> bool:
    a, r = answer.strip(), reference.strip()
    return a == r if mode == "exact" else bool(r) and r in a


def perplexity(loss: float | None) -> float | None:
    if loss is None:
        return None
    return math.exp(loss) if loss < 700 else float("inf")


def summary(result: dict, origin: str | None) -> str:
    settings = f"max_seq_len {result['max_seq_len']}" + (f" (from {origin})" if origin else "")
    lines = [f"model    {result['model']}",
             f"data     {result['data']}: {result['rows']:,} rows, {result['format']}, {settings}"
             + (f", {result['truncated_rows']:,} truncated" if result["truncated_rows"] else "")
             + (f", {result['processes']} processes" if result["processes"] > 1 else "")]
    if result["loss"] is None:
        lines.append("loss     none: no target tokens")
    else:
        lines.append(f"loss     {result['loss']:.4f} | perplexity {result['perplexity']:.3f} | "
                     f"{result['target_tokens']:,} target tokens")
    pref = result.get("preference")
    if pref is not None:
        if not pref["pairs"]:
            lines.append("pairs    none: no pair has targets on both sides")
        else:
            line = f"pairs    {pref['pairs']:,}: the chosen completion more likely in {pref['accuracy']:.1%}"
            if pref["reward_accuracy"] is not None:
                line += (f" | reward accuracy against the base {pref['reward_accuracy']:.1%}, mean log-ratio margin "
                         f"{pref['mean_log_ratio_margin']:.4f}")
            lines.append(line)
    rewards = result.get("rewards")
    if rewards is not None:
        if rewards["mean"] is None:
            lines.append(f"reward   none: {', '.join(rewards['functions'])} scored none of {rewards['answers']:,} "
                         "answers (None for every one)")
        else:
            each = ", ".join(f"{name} {v:.4f}" if v is not None else f"{name} none"
                             for name, v in rewards["per_function"].items())
            lines.append(f"reward   {rewards['mean']:.4f}: the mean over {rewards['scored']:,} of "
                         f"{rewards['answers']:,} greedy answers ({each})")
            for r in rewards["examples"]:
                lines.append(f"  {r['reward']:+.3f} row {r['row']}: {r['prompt'][:60]!r} -> {r['answer'][:60]!r}")
    answers = result["answers"]
    if answers is not None:
        if not answers["scored"]:
            lines.append("answers  none: no row has a reference answer")
        else:
            how = "exact match" if answers["mode"] == "exact" else "containing the reference"
            lines.append(f"answers  {answers['correct']:,} of {answers['scored']:,} correct ({how}): "
                         f"{answers['accuracy']:.1%}")
            for r in answers["examples"]:
                mark = "ok   " if r["correct"] else "wrong"
                expected = "" if r["correct"] else f" (expected {r['reference']!r})"
                lines.append(f"  {mark} row {r['row']}: {r['prompt'][:60]!r} -> {r['answer'][:60]!r}{expected}")
    return "\n".join(lines)
