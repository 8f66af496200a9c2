"""Inference with a trained model, a merged model or an adapter folder: locating and loading it,
rendering prompts as training rendered them, and batched generation that stops at the end of the
turn. Used by `toolkit generate`, `toolkit eval` and the samples a run prints while it trains."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tqdm.auto import tqdm

from ..errors import ToolkitError

MARKER = "TOOLKIT-ANSWER-MARKER"  # assistant text whose end shows where a template closes a turn


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


def refuse_scorer(path: str, folder: str, adapter: str | None) -> None:
    """A reward model (a sequence-classification folder, or an adapter of one: preference.method=reward)
    has no output layer to generate or score text with: refused in one line."""
    def read(file: Path) -> dict:
        try:
            return json.loads(file.read_text())
        except (OSError, ValueError):
            return {}

    config = read(Path(folder) / "config.json")
    scorer = any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or [])
    if adapter:
        scorer = read(Path(adapter) / "adapter_config.json").get("task_type") == "SEQ_CLS"
    if scorer:
        raise ToolkitError(f"{path}: a reward model (sequence classification: a score, no output layer); generate "
                           "and eval take a causal LM. Use it as an rl.rewards model ({model: FOLDER}), or load it "
                           "with transformers' AutoModelForSequenceClassification")


def _load(path: str, dtype, trust_remote_code: bool):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, dtype)
    folder, adapter = locate_model(path)
    refuse_scorer(path, folder, adapter)
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
        overrides = {"config": base_config(folder, adapter, trust_remote_code)} if adapter else {}
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch_dtype,
                                                     trust_remote_code=trust_remote_code,
                                                     **{k: v for k, v in overrides.items() if v is not None})
    except ToolkitError:
        raise
    except Exception as e:
        raise _load_error(path if folder == path else f"{path} ({folder})", "a causal LM", e) from None
    if adapter:
        from peft import PeftModel

        from .load import fit_vocabulary

        fit_vocabulary(model, tokenizer, mean=False)  # model.add_special_tokens: the adapter brings the new rows
        try:
            model = PeftModel.from_pretrained(model, adapter, is_trainable=False)
        except Exception as e:
            raise _load_error(path, "the LoRA adapter", e) from None
    return model, tokenizer


def base_config(folder: str, adapter: str, trust_remote_code: bool = False):
    """The base's config as the adapter's run changed it (model.rope_scaling, max_position_embeddings:
    recorded beside the adapter), or None when the run changed nothing."""
    from transformers import AutoConfig

    from .base_identity import config_overrides
    from .load import apply_config_overrides

    overrides = config_overrides(adapter)
    if not overrides:
        return None
    config = AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=trust_remote_code)
    apply_config_overrides(config, overrides, where=f"{adapter}: the recorded model.rope_scaling")
    return config


def _load_error(where: str, what: str, e: Exception) -> ToolkitError:
    if "trust_remote_code" in str(e):
        return ToolkitError(f"{where}: needs its own Python code to load {what}; pass --trust-remote-code if you "
                            "trust its source")
    from .heads import MISFIT, misfit

    first_line = MISFIT if misfit(e) else (str(e).strip().splitlines() or [type(e).__name__])[0]
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


def framing_token_ids(model, tokenizer) -> set[int]:
    """The tokens an answer is shown without: the tokenizer's padding and BOS, and where an answer
    ends (eos, the template's end of turn: stop_token_ids). Every other token the model produced is
    shown, an added special token included (model.add_special_tokens: a tool-call token), which
    decoding with skip_special_tokens hid (tests/test_answers_as_generated.py)."""
    return {i for i in (tokenizer.pad_token_id, tokenizer.bos_token_id, *stop_token_ids(model, tokenizer))
            if i is not None}


def shown_text(tokenizer, ids: list[int], framing: set[int]) -> str:
    """Token ids as an answer is shown: decoded with every special token but the `framing` ones."""
    return tokenizer.decode([i for i in ids if i not in framing], skip_special_tokens=False)


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
                   temperature: float = 0.0, top_p: float | None = None, batch_size: int = 8, synced: bool = False,
                   progress: str | None = None) -> list[tuple[str, int]]:
    """(answer, tokens generated) for each prompt text, rendered already (specials written out); an
    answer is every token generated before the stop, but for padding and BOS (shown_text).
    `add_bos`: put the tokenizer's BOS before a text that does not start with it. `synced`: every
    process runs this with the same texts and steps until all are done (sharded weights).
    `progress`: the name of a progress bar over the prompts (`progress_bar`), or None for none."""
    import torch

    stops = stop_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    framing = framing_token_ids(model, tokenizer) | {pad}
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
    bar = progress_bar(len(order), progress, "prompt", enabled=progress is not None)
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
            results[i] = (shown_text(tokenizer, answer_ids, framing), len(new) if end is None else end + 1)
        bar.update(len(chunk))
    bar.close()
    return results


def progress_bar(total: int, name: str | None, unit: str, enabled: bool = True):
    """A tqdm bar on stderr, set up as training's (`training/loop.py`): a 60-prompt eval was silent
    for minutes before. stdout stays the answers and results alone (tests/test_generate.py's
    test_progress_on_stderr_answers_alone_on_stdout); a log that is a file gets a line per 30 s."""
    return tqdm(total=total, desc=name, unit=unit, disable=not enabled, file=sys.stderr, dynamic_ncols=True,
                mininterval=0.5 if sys.stderr.isatty() else 30)
