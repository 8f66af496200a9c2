"""`toolkit generate MODEL_DIR`: answer prompts with a model folder, a merged model or a LoRA adapter.

Prompts go through the tokenizer's chat template, as training's `messages` format renders them
(`--no-chat-template`: raw text, with BOS put before it as training's `text` format does). An
answer ends at the tokenizer's eos token, at the template's end-of-turn token (`<|im_end|>`,
`<|eot_id|>`, ...) and at the model's generation_config eos ids, whichever comes first.

`load_for_inference` and `generate_answers` are shared with `toolkit eval` and the quickstart.
Light at import time: torch, transformers and peft are imported where they are used.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .config import ToolkitError

DTYPE_NAMES = ("fp32", "bf16", "fp16")
MARKER = "TOOLKIT-ANSWER-MARKER"  # assistant text whose end shows where a template closes a turn


def add_arguments(p) -> None:
    p.add_argument("model", metavar="MODEL_DIR",
                   help="a Hugging Face model folder, a merged model, a LoRA adapter folder (such as a run's "
                        "final/) or a Hub id in the Hugging Face cache")
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
    results = generate_with_counts(model, tokenizer, prompts, **options)
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


def locate_model(path: str) -> tuple[str, str | None]:
    """(the folder of the model to load, the LoRA adapter folder to put on it or None). A folder
    with adapter_config.json is an adapter on its `base_model_name_or_path` (a folder or Hub id)."""
    from .hub import is_hub_id, resolve_model

    def resolved(name: str, what: str) -> str:
        try:
            return resolve_model(name)
        except ToolkitError as e:
            raise ToolkitError(f"{path}: {what}{str(e).removeprefix('model.path: ')}") from None

    p = Path(path).expanduser()
    if p.is_dir():
        adapter_config = p / "adapter_config.json"
        if adapter_config.is_file():
            try:
                base = json.loads(adapter_config.read_text()).get("base_model_name_or_path")
            except (ValueError, AttributeError, OSError):
                base = None
            if not base or not isinstance(base, str):
                raise ToolkitError(f"{path}: adapter_config.json names no base_model_name_or_path")
            from .base_identity import check

            folder = resolved(base, "the adapter's base model: ")
            check(p, folder, str(path))
            return folder, str(p)
        if not (p / "config.json").is_file():
            raise ToolkitError(f"{path}: neither a Hugging Face model folder (no config.json) nor a LoRA adapter "
                               "(no adapter_config.json)")
        return str(p), None
    if p.exists():
        raise ToolkitError(f"{path}: is a file; expected a model folder")
    if is_hub_id(path):
        return resolved(path, ""), None
    raise ToolkitError(f"{path}: model folder not found")


def load_for_inference(path: str, dtype="fp32", device=None, trust_remote_code: bool = False):
    """(model, tokenizer) from a model folder, a merged model or a LoRA adapter folder (peft's
    PeftModel on its base), in eval mode, on CUDA when there is one (or on `device`). `dtype`:
    "fp32", "bf16", "fp16" or a torch dtype. The tokenizer is the adapter folder's when it has
    one, else the base's; a missing pad token is the eos token, as in training."""
    import torch
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a bar per load would be most of what a short answer prints
    try:
        model, tokenizer = _load(path, dtype, trust_remote_code)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return model.to(device).eval(), tokenizer


def _load(path: str, dtype, trust_remote_code: bool):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, dtype)
    folder, adapter = locate_model(path)
    tokenizer, error = None, None
    for source in ([adapter] if adapter else []) + [folder]:
        try:
            tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True,
                                                      trust_remote_code=trust_remote_code)
            break
        except Exception as e:  # library errors on a user's files: OSError, ValueError, JSON and others
            error = error or e
    if tokenizer is None:
        raise _load_error(path, "a tokenizer", error)
    if tokenizer.pad_token is None:  # many base models ship without one; padding is masked anyway
        tokenizer.pad_token = tokenizer.eos_token
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch_dtype,
                                                     trust_remote_code=trust_remote_code)
    except Exception as e:
        raise _load_error(path if folder == path else f"{path} ({folder})", "a causal LM", e) from None
    if adapter:
        from peft import PeftModel

        try:
            model = PeftModel.from_pretrained(model, adapter, is_trainable=False)
        except Exception as e:
            raise _load_error(path, "the LoRA adapter", e) from None
    return model, tokenizer


def _load_error(where: str, what: str, e: Exception) -> ToolkitError:
    if "trust_remote_code" in str(e):
        return ToolkitError(f"{where}: needs its own Python code to load {what}; pass --trust-remote-code if you "
                            "trust its source")
    first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return ToolkitError(f"{where}: cannot load {what}: {first_line[:300]}")


# ----------------------------------------------------------------------------- generating


def end_of_turn_id(tokenizer) -> int | None:
    """The special token the chat template closes an assistant turn with (`<|im_end|>`,
    `<|eot_id|>`, `<end_of_turn>`, or eos itself), found by rendering a turn; None without one."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": MARKER}], tokenize=False)
    except Exception:  # a template that refuses this conversation: no end token learned from it
        return None
    if MARKER not in text:
        return None
    tail = text[text.rindex(MARKER) + len(MARKER):]
    special = set(tokenizer.all_special_ids)
    special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    for i in tokenizer(tail, add_special_tokens=False)["input_ids"]:
        if i in special:
            return i
        if tokenizer.decode([i]).strip():  # visible text closes the turn: no end token
            return None
    return None


def stop_token_ids(model, tokenizer) -> list[int]:
    """Where an answer ends: eos, the template's end of turn, the generation_config's eos ids."""
    ids = [tokenizer.eos_token_id, end_of_turn_id(tokenizer)]
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += configured if isinstance(configured, (list, tuple)) else [configured]
    return list(dict.fromkeys(i for i in ids if i is not None))


def prompt_text(tokenizer, prompt: str | list[dict], system: str | None = None,
                chat_template: bool = True) -> tuple[str, bool]:
    """The text generated from, and whether BOS still goes before it: a chat turn through the
    tokenizer's template (which writes its own specials), or raw text (BOS added, as for training's
    `text` format)."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        if system is not None and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": system})
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), False
        except Exception as e:  # jinja's TemplateError, or a template's own raise_exception
            raise ToolkitError(f"the tokenizer's chat template refused a prompt: {str(e).splitlines()[0]}") from None
    if not isinstance(prompt, str):
        why = "with --no-chat-template" if not chat_template else "and this tokenizer has no chat template"
        raise ToolkitError(f"a `messages` prompt needs a chat template {why}; give plain `prompt` text")
    return (f"{system}\n\n{prompt}" if system else prompt), True


def generate_answers(model, tokenizer, prompts: list[str | list[dict]], *, system: str | None = None,
                     chat_template: bool = True, max_new_tokens: int = 128, temperature: float = 0.0,
                     top_p: float | None = None, batch_size: int = 8) -> list[str]:
    """The answer to each prompt (a user message, or a list of chat messages), generated in
    left-padded batches; greedy at temperature 0."""
    return [answer for answer, _ in generate_with_counts(
        model, tokenizer, prompts, system=system, chat_template=chat_template, max_new_tokens=max_new_tokens,
        temperature=temperature, top_p=top_p, batch_size=batch_size)]


def generate_with_counts(model, tokenizer, prompts: list, *, system: str | None = None, chat_template: bool = True,
                         **options) -> list[tuple[str, int]]:
    """As generate_answers, with the number of tokens generated for each (its stop token included)."""
    rendered = [prompt_text(tokenizer, p, system, chat_template) for p in prompts]
    return generate_texts(model, tokenizer, [t for t, _ in rendered], add_bos=[b for _, b in rendered], **options)


def generate_texts(model, tokenizer, texts: list[str], *, add_bos: bool | list[bool] = False, max_new_tokens: int = 128,
                   temperature: float = 0.0, top_p: float | None = None,
                   batch_size: int = 8, synced: bool = False) -> list[tuple[str, int]]:
    """(answer, tokens generated) for each prompt text, rendered already (specials written out).
    `add_bos`: put the tokenizer's BOS before a text that does not start with it. `synced`: every
    process runs this with the same texts and steps until all are done (sharded weights)."""
    import torch

    stops = stop_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    bos = tokenizer.bos_token_id
    flags = add_bos if isinstance(add_bos, list) else [add_bos] * len(texts)
    encoded = []
    for text, flag in zip(texts, flags):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if flag and bos is not None and ids[:1] != [bos]:
            ids = [bos] + ids
        if not ids:
            raise ToolkitError("a prompt is empty: nothing to generate from")
        encoded.append(ids)
    sampling = {"do_sample": False}
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature, **({"top_p": top_p} if top_p is not None else {})}
    device = next(model.parameters()).device
    # Longest first, so that prompts of similar length share a batch and little is padded.
    order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i]))
    results: list = [None] * len(encoded)
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        width = max(len(encoded[i]) for i in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, i in enumerate(chunk):  # left padding: every prompt ends where generation starts
            ids[row, width - len(encoded[i]):] = torch.tensor(encoded[i])
            mask[row, width - len(encoded[i]):] = 1
        with torch.no_grad():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 max_new_tokens=max_new_tokens, eos_token_id=stops, pad_token_id=pad,
                                 synced_gpus=synced, **sampling)
        for row, i in enumerate(chunk):
            new = out[row, width:].tolist()
            end = next((k for k, t in enumerate(new) if t in stops), None)
            answer_ids = new if end is None else new[:end]
            results[i] = (tokenizer.decode(answer_ids, skip_special_tokens=True),
                          len(new) if end is None else end + 1)
    return results
