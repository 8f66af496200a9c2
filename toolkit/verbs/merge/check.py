"""The merge's check: the merged folder's logits against base + adapter under peft on a few prompts,
one model at a time, within the merged dtype's tolerance; for a QLoRA adapter also the 4-bit model
the run trained, measured and said without a tolerance."""

from __future__ import annotations

from pathlib import Path

from ...errors import ToolkitError
from .plan import TOLERANCE, Plan, loaded_base
from .write import grown

CHECK_PROMPTS = ("The quick brown fox jumps over the lazy dog.", "def fibonacci(n):\n    ")
CHECK_CHAT = [{"role": "user", "content": "What is 2 + 2? Answer briefly."}]


def tolerance_of(dtype: str) -> float:
    return TOLERANCE.get(dtype, max(TOLERANCE.values()))


def check_inputs(tokenizer) -> list:
    texts = list(CHECK_PROMPTS)
    if tokenizer.chat_template:
        texts.append(tokenizer.apply_chat_template(CHECK_CHAT, tokenize=False, add_generation_prompt=True))
    return [tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids for text in texts]


def check(plan: Plan, merged_dir: Path, tokenizer, dtype: str) -> str:
    """Logits of the merged folder against base + adapter under peft, both in fp32, one model in memory
    at a time; a ToolkitError above the tolerance for the written dtype."""
    import warnings

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    inputs = check_inputs(tokenizer)
    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()  # loading reports and progress bars would bury the one line that matters
    logging.disable_progress_bar()
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            base = loaded_base(plan)
            reference = PeftModel.from_pretrained(grown(plan, base, tokenizer), plan.adapter).eval()
            expected = [reference(ids).logits for ids in inputs]
            del base, reference
            merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32, local_files_only=True)
            got = [merged.eval()(ids).logits for ids in inputs]
            del merged
            trained = four_bit_logits(plan, tokenizer, inputs) if plan.four_bit else None
    except (OSError, ValueError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise ToolkitError(f"merge: check: cannot load the models to compare ({first}); "
                           f"{merged_dir} holds the merged files; --skip-check skips the check") from None
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()
    diff = max(float((a - b).abs().max()) for a, b in zip(expected, got))
    scale = max(1.0, max(float(a.abs().max()) for a in expected))
    tolerance = tolerance_of(dtype) * scale
    line = (f"check: merged vs base + adapter (peft), {len(inputs)} prompts in fp32: max |logit difference| "
            f"{diff:.2e} (tolerance {tolerance:.1e} for {dtype})")
    if not diff <= tolerance:  # NaN fails too
        raise ToolkitError(f"merge: {line}: too large; the merged files are left in {merged_dir} for inspection")
    if plan.four_bit:
        line += "\n" + (f"check: merged vs the adapter over the 4-bit (NF4) base it was trained on, in fp32: max "
                        f"|logit difference| {max(float((a - b).abs().max()) for a, b in zip(trained, got)):.2e}, "
                        "the base's quantization error (measured, not checked)" if trained is not None else
                        "check: trained over a 4-bit base; the merged model's difference from it (the base's "
                        "quantization error) is not measured here: no bitsandbytes that runs on this host")
    return line


def four_bit_logits(plan: Plan, tokenizer, inputs: list) -> list | None:
    """The logits of what a QLoRA run trained: the adapter over the base in 4-bit (None where this
    host cannot load it so: no bitsandbytes, or one too old for a host without CUDA)."""
    import importlib.util

    from peft import PeftModel

    if importlib.util.find_spec("bitsandbytes") is None:
        return None
    try:
        base = loaded_base(plan, four_bit=True)
    except ToolkitError:
        return None
    model = PeftModel.from_pretrained(grown(plan, base, tokenizer), plan.adapter).eval()
    device = next(model.parameters()).device
    return [model(ids.to(device)).logits.float().cpu() for ids in inputs]
