"""`toolkit merge ADAPTER_DIR --out DIR`: fold a LoRA adapter (plain, DoRA or rsLoRA) into its base and
write a plain Hugging Face folder that loads with `AutoModelForCausalLM.from_pretrained` alone.

The base's safetensors are read one tensor at a time and each output shard is written as soon as it
is complete, so memory holds about one shard (plus the adapter), never the whole model. Then a check
(on by default) runs a few prompts through the merged folder and through base + adapter under peft,
one model at a time, and compares the logits. Everything is written into DIR.tmp and renamed, so DIR
is either complete or absent; an existing non-empty DIR is refused.

A QLoRA adapter (trained over its base loaded in 4-bit, model.load_in_4bit) merges into the
full-precision base like any other: the check compares against the adapter on that same base, which
is what the merged weights are. The model the run trained differs from both by the base's NF4
quantization error; for the final/ of such a run the check also measures that difference, and says
it, without a tolerance (docs/models.md).

torch, transformers and peft are imported inside the functions: `toolkit --help` stays fast.

The parts: `plan.py` reads and validates the adapter and its base into a Plan, `write.py` merges and
writes the folder, `check.py` compares its logits with base + adapter.
"""

from __future__ import annotations

from pathlib import Path

from ...errors import ToolkitError
from ...storage import disk
from .check import check, tolerance_of
from .plan import DTYPE_NAMES, base_dtype, plan_merge
from .write import write_configs, write_tokenizer, write_weights, write_whole


def add_arguments(p) -> None:
    p.add_argument("adapter", metavar="ADAPTER_DIR", help="a peft LoRA adapter folder (e.g. RUN/final of a LoRA run)")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write; must not exist or be empty")
    p.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default=None,
                   help="dtype of the merged weights (default: the base's, from its config.json)")
    p.add_argument("--base", default=None, metavar="PATH",
                   help="the base model folder or Hub id (default: the adapter's base_model_name_or_path)")
    p.add_argument("--skip-check", action="store_true",
                   help="skip comparing the merged model's logits with base + adapter (for models too big to load)")


def run(args) -> int:
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ToolkitError(f"merge: --out {out} exists and is not empty; choose another folder "
                           "(earlier results are never overwritten)")
    plan = plan_merge(Path(args.adapter), args.base)
    dtype = DTYPE_NAMES[args.dtype] if args.dtype else base_dtype(plan.config)
    print(f"merge: {plan.description} from {plan.adapter}, onto {plan.base}")
    with disk.renamed_into_place(out, "merge") as tmp:  # a failed check or a signal leaves no partial folder
        try:
            tmp.mkdir(parents=True)
            tokenizer = write_tokenizer(plan, tmp)
            merged, replaced, written = (write_whole(plan, tmp, dtype, tokenizer) if plan.whole else
                                         write_weights(plan, tmp, dtype))
            write_configs(plan, tmp, dtype, tokenizer)
        except OSError as e:
            raise ToolkitError(f"merge: cannot write {tmp}: {e.strerror or e}") from None
        shards = len(plan.shards)
        print(f"merge: {merged} weights merged, {replaced} replaced (modules_to_save), {shards} shard"
              f"{'s' if shards > 1 else ''} written ({', '.join(sorted(written))})")
        if not args.skip_check:
            # The loosest tolerance among the dtypes written (several only when the base mixes them).
            print(check(plan, tmp, tokenizer, max(written, key=tolerance_of, default="float32")))
    print(f"merged: {out}")
    return 0
