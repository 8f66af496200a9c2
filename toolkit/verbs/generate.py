"""`toolkit generate MODEL_DIR`: answer prompts with a model folder, a merged model or a LoRA adapter.

Prompts go through the tokenizer's chat template, as training's `messages` format renders them
(`--no-chat-template`: raw text, with BOS put before it as training's `text` format does). An
answer ends at the tokenizer's eos token, at the template's end-of-turn token (`<|im_end|>`,
`<|eot_id|>`, ...) and at the model's generation_config eos ids, whichever comes first. An answer
shows every token the model produced before that, added special tokens included (a tool-call token
of model.add_special_tokens), and leaves out only padding and BOS. stdout holds the answers alone;
a progress bar over the prompts goes to stderr (none in the interactive loop).

Loading and generation live in `inference.py`, shared with `toolkit eval`, the quickstart and
the samples a run prints while it trains.
Light at import time: torch, transformers and peft are imported where they are used.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import ToolkitError
from ..model.inference import generate_with_counts, load_for_inference, locate_model

DTYPE_NAMES = ("fp32", "bf16", "fp16")


def add_arguments(p) -> None:
    p.add_argument("model", metavar="MODEL_DIR",
                   help="a Hugging Face model folder, a merged model, a LoRA adapter folder (such as a run's "
                        "final/) or a Hub id (downloaded into the Hugging Face cache, or read from it)")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt (repeatable)")
    p.add_argument("--prompts", metavar="FILE",
                   help="a text file of prompts, one per line; or a .jsonl file with a `prompt` string or a "
                        "`messages` list of {role, content} per line")
    p.add_argument("--system", metavar="TEXT", help="a system message put before every prompt")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                   help="at most this many tokens per answer (128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy decoding (default); above 0: sampling")
    p.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling's cumulative probability (with --temperature)")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling")
    p.add_argument("--no-chat-template", action="store_true", help="send prompts as raw text, not as a chat turn")
    p.add_argument("--batch-size", type=int, default=8, metavar="N", help="prompts generated together, left-padded (8)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="fp32", help="weights' dtype for inference (fp32)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the Python code a model ships with (only for sources you trust)")
    p.add_argument("--json", action="store_true", help="one JSON line per prompt: prompt, answer, tokens")


def run(args) -> int:
    check_generation_options(args.max_new_tokens, args.temperature, args.top_p, args.batch_size)
    prompts: list = list(args.prompt)
    if args.prompts:
        prompts += read_prompts(args.prompts)
    locate_model(args.model)  # a wrong path fails here, before torch is imported
    model, tokenizer = load_for_inference(args.model, args.dtype, trust_remote_code=args.trust_remote_code)
    if args.seed is not None:
        from transformers import set_seed

        set_seed(args.seed)
    options = dict(system=args.system, chat_template=not args.no_chat_template, max_new_tokens=args.max_new_tokens,
                   temperature=args.temperature, top_p=args.top_p, batch_size=args.batch_size)
    if not prompts:
        return interactive(model, tokenizer, options, args.json)
    results = generate_with_counts(model, tokenizer, prompts, progress="generate", **options)  # the bar: stderr
    for i, (prompt, (answer, tokens)) in enumerate(zip(prompts, results)):
        if args.json:
            print(json.dumps({"prompt": prompt, "answer": answer, "tokens": tokens}, ensure_ascii=False))
        else:
            print(("\n" if i else "") + answer)
    return 0


def interactive(model, tokenizer, options: dict, as_json: bool) -> int:
    """A line in, an answer out. In a terminal with a `> ` prompt, until an empty line or Ctrl-D;
    from a pipe, each non-blank line of stdin is a prompt, until its end."""
    tty = sys.stdin.isatty()
    if tty:
        print("one prompt per line; an empty line or Ctrl-D ends", file=sys.stderr)
    try:
        while True:
            if tty:
                print("> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            if line == "":  # end of input
                break
            if not line.strip():  # an empty line ends a terminal session; a pipe's blank lines are skipped
                if tty:
                    break
                continue
            prompt = line.rstrip("\r\n")
            answer, tokens = generate_with_counts(model, tokenizer, [prompt], **options)[0]
            print(json.dumps({"prompt": prompt, "answer": answer, "tokens": tokens}, ensure_ascii=False)
                  if as_json else answer, flush=True)
    except KeyboardInterrupt:
        print(file=sys.stderr)
    return 0


def check_generation_options(max_new_tokens: int, temperature: float, top_p: float | None, batch_size: int) -> None:
    if max_new_tokens < 1:
        raise ToolkitError(f"--max-new-tokens: must be positive, got {max_new_tokens}")
    if not temperature >= 0:
        raise ToolkitError(f"--temperature: must be 0 (greedy) or positive, got {temperature}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ToolkitError(f"--top-p: must be in (0, 1], got {top_p}")
    if top_p is not None and temperature == 0:
        raise ToolkitError("--top-p: applies to sampling; give a --temperature above 0 as well")
    if batch_size < 1:
        raise ToolkitError(f"--batch-size: must be positive, got {batch_size}")


def read_prompts(path: str) -> list[str | list[dict]]:
    """Prompts from a file: one per line (blank lines skipped), or for .jsonl one JSON object per
    line with a `prompt` string or a `messages` list."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ToolkitError(f"--prompts: file not found: {path}")
    if p.suffix.lower() == ".json":
        raise ToolkitError(f"--prompts: {path}: give prompts as .jsonl (one JSON object per line) or as text, "
                           "one per line")
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ToolkitError(f"--prompts: cannot read {path} as UTF-8 text ({e})") from None
    if p.suffix.lower() != ".jsonl":
        prompts: list = [line for line in lines if line.strip()]
    else:
        prompts = []
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ToolkitError(f"{path}: line {lineno}: malformed JSON ({e.msg})") from None
            prompts.append(prompt_from_row(row, f"{path}: line {lineno}"))
    if not prompts:
        raise ToolkitError(f"--prompts: {path} holds no prompts")
    return prompts


def prompt_from_row(row, where: str) -> str | list[dict]:
    if isinstance(row, dict) and isinstance(row.get("prompt"), str):
        return row["prompt"]
    messages = row.get("messages") if isinstance(row, dict) else None
    if (isinstance(messages, list) and messages
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages)):
        return messages
    raise ToolkitError(f"{where}: expected an object with a `prompt` string or a `messages` list of "
                       "{role, content} strings")


# ----------------------------------------------------------------------------- loading
