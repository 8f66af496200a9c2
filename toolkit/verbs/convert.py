"""`toolkit checkpoint convert CHECKPOINT --out DIR`: the weights of a training checkpoint at its
step, for use outside the toolkit, whatever backend and process count wrote it.

It reads the checkpoint's portable state (`portable/weights.safetensors`: the full fp32 trainable
weights by name) and the run's recipe (`RUN/config.yaml`), builds the model the recipe builds
(its frozen weights from the base, as a resumed run does) and writes:
- full fine-tuning: a plain Hugging Face folder (safetensors, config, generation config, tokenizer);
- LoRA: the adapter merged into its base (through `toolkit merge`, logits checked), or with
  `--adapter` the adapter folder itself, as `final/` holds it.
What is written is read back and compared with the checkpoint's tensors before DIR appears; DIR is
complete or absent, and a non-empty DIR is refused.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from ..errors import ToolkitError
from ..storage import disk

DTYPES = ("fp32", "bf16", "fp16")


def add_arguments(p) -> None:
    p.add_argument("action", choices=["convert"], help="convert: the checkpoint's weights as a Hugging Face folder")
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="a complete checkpoint folder (RUN/checkpoints/step-N)")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write; must not exist or be empty")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="dtype of the written weights (default: the recipe's model.dtype)")
    p.add_argument("--adapter", action="store_true",
                   help="LoRA runs: write the adapter folder instead of merging it into its base")


def run(args) -> int:
    from ..config import load_recipe
    from ..storage import checkpoint

    source, out = Path(args.checkpoint), Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ToolkitError(f"checkpoint convert: --out {out} exists and is not empty; choose another folder "
                           "(earlier results are never overwritten)")
    if not source.is_dir():
        raise ToolkitError(f"checkpoint convert: {source}: "
                           + ("a file, not a checkpoint folder" if source.exists() else "folder not found"))
    if not checkpoint.is_complete(source) and (source / "config.yaml").is_file():  # a run folder given
        done = checkpoint.complete_checkpoints(source)
        raise ToolkitError(f"checkpoint convert: {source} is a run folder, not a checkpoint; give one of its "
                           + (f"checkpoints (the latest complete one: {done[-1]})" if done else
                              "checkpoints (it has no complete one)")
                           + (", or use its final/ as it is (a Hugging Face folder already)"
                              if (source / "final").is_dir() else ""))
    if not checkpoint.is_complete(source):
        raise ToolkitError(f"checkpoint convert: {source} is not a complete checkpoint (no {checkpoint.MARKER} marker)")
    portable = source / "portable" / "weights.safetensors"
    if not portable.is_file():
        raise ToolkitError(f"checkpoint convert: {source} has no portable state (written with "
                           "checkpoint.portable=false or by an older toolkit); resume it with the launch that wrote it "
                           "and let it checkpoint again, or use its final/")
    run_dir = source.resolve().parent.parent
    recipe = load_recipe(run_dir / "config.yaml")
    dtype = args.dtype or recipe.model.dtype
    if args.adapter and not recipe.lora.enabled:
        raise ToolkitError(f"checkpoint convert: --adapter is for LoRA runs; {run_dir} fine-tunes the full model")
    saved = checkpoint.read_state(source)
    step = saved.step
    if saved.inputs and "model" in saved.inputs:  # the base it trained on, by content, wherever it lives now
        from ..model import base_identity
        from ..storage import inputs

        inputs.check_unchanged({"model": saved.inputs["model"]}, base_identity.identities(recipe), source,
                               verb="checkpoint convert")
    print(f"checkpoint convert: step {step} of {run_dir} ({'LoRA' if recipe.lora.enabled else 'full'}), "
          f"from {portable.relative_to(source)}")
    if recipe.lora.enabled and not args.adapter:
        from . import merge

        adapter = out.with_name(out.name + ".adapter.tmp")  # merge writes DIR.tmp itself
        shutil.rmtree(adapter, ignore_errors=True)
        write(recipe, run_dir, portable, adapter, dtype)
        try:
            merge.run(argparse.Namespace(adapter=str(adapter), out=str(out), dtype=args.dtype, base=None,
                                         skip_check=False))
        finally:
            shutil.rmtree(adapter, ignore_errors=True)
        return 0
    with disk.renamed_into_place(out, "convert") as tmp:  # however this ends, no partial folder is left
        write(recipe, run_dir, portable, tmp, dtype)
    print(f"converted: {out}")
    return 0


def write(recipe, run_dir: Path, portable: Path, folder: Path, dtype: str) -> None:
    """The recipe's model with the checkpoint's trainable weights, saved to `folder` and read back."""
    import torch

    from ..config.methods import method_of
    from ..model import base_identity
    from ..model.hub import resolve_model
    from ..model.load import DTYPES as TORCH_DTYPES
    from ..model.load import (
        apply_lora,
        build_model,
        build_tokenizer,
        config_overrides,
        fit_vocabulary,
        mark_scorer,
        token_rows,
    )
    from ..storage.portable import read_tensors
    from ..storage.verify import first_mismatch

    weights = read_tensors(portable, "checkpoint convert")
    tokenizer = build_tokenizer(recipe.model)
    scorer = method_of(recipe).scorer  # a reward model: its score head, as training built it
    model = build_model(recipe.model, TORCH_DTYPES[recipe.model.dtype], TORCH_DTYPES[recipe.train.precision],
                        scorer=scorer)
    if scorer:
        mark_scorer(model, tokenizer)
    added = fit_vocabulary(model, tokenizer)  # model.add_special_tokens: the shapes the run trained
    if recipe.lora.enabled:
        model = apply_lora(model, recipe.lora, token_rows(model, tokenizer, recipe.model.add_special_tokens, added))
        base = run_dir / "base-model" if recipe.model.preset is not None else None
        if base is not None:
            if not (base / "config.json").is_file():
                raise ToolkitError(f"checkpoint convert: {base} is missing; a preset LoRA run keeps its base there")
            model.peft_config["default"].base_model_name_or_path = str(base)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    if sorted(trainable) != sorted(weights):
        missing, extra = sorted(set(trainable) - set(weights)), sorted(set(weights) - set(trainable))
        raise ToolkitError(f"checkpoint convert: {portable} holds other weights than {run_dir / 'config.yaml'} builds "
                           f"(missing {missing[:3]}, unexpected {extra[:3]})")
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, value in weights.items():
            params[name].copy_(value)
    model.config.use_cache = True  # gradient checkpointing turned it off for training only
    try:
        if recipe.lora.enabled:
            from peft.utils import get_peft_model_state_dict

            model.save_pretrained(folder, safe_serialization=True)
            expected = get_peft_model_state_dict(model)
            # As final/: which base it belongs to, and the run's changes to its config (RoPE scaling).
            source = base if base is not None else resolve_model(recipe.model.path, recipe.model.revision)
            (folder / base_identity.RECORD).write_text(base_identity.record(source, config_overrides(recipe.model)))
        else:
            model = model.to(TORCH_DTYPES[dtype])
            model.save_pretrained(folder, safe_serialization=True)
            expected = {k: v.to(TORCH_DTYPES[dtype]) for k, v in weights.items()}
        tokenizer.save_pretrained(folder)
    except OSError as e:
        raise ToolkitError(f"checkpoint convert: cannot write {folder}: {e.strerror or e}") from None
    problem = first_mismatch(folder, expected)
    if problem:
        raise ToolkitError(f"checkpoint convert: {problem}; {folder} was not moved into place")
