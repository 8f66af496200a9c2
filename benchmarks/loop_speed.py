"""Useful-token throughput and peak memory of `toolkit train` against a hand-written PyTorch loop,
the Hugging Face Trainer and TRL's SFTTrainer, measured in the same run on the same machine, model,
documents and number of optimizer steps, reported as ratios.

    python benchmarks/loop_speed.py                                  # CPU-sized defaults
    python benchmarks/loop_speed.py --hidden 1024 --layers 8 --seq 1024 --micro 8 --precision bf16   # a GPU
    python benchmarks/loop_speed.py --hidden 64 --layers 2 --seq 64 --micro 2 --steps 6 --warmup 2 --repeats 1  # CI
    python benchmarks/loop_speed.py --model $(bash tests/fetch_real_model.sh) [--lora] --seq 128 --micro 2 \
        --steps 6 --warmup 2 --threads 1 --only toolkit plain_pytorch trl        # the real SmolLM2-135M

Model. The random Llama of --hidden x --layers with a byte tokenizer, or with --model a local Hugging
Face folder (its config and weights linked, its tokenizer saved with a padding token other than the
end-of-turn one where they coincide, as in SmolLM2, because the counts read padding as "not a
document token"; the documents are then made of words that are one token each, so their token counts
come out as planned, the chat template's own tokens measured from the tokenizer). --lora: the same
LoRA adapter (LORA below) in every contender: the toolkit's recipe `lora`, TRL's peft_config, peft on
the hand-written loop and the Trainer. --threads N: N torch threads in every contender's process
(on this shared 2-core host, 1 keeps the CPU seconds per step, reported beside wall time, clean).

Data. Chat documents (`messages`: one user turn, one assistant turn, byte tokenizer and chat
template of toolkit/model/load.py) whose token lengths are uniform between seq/8 and seq, seeded; only
the assistant's reply and its end-of-turn tokens are targets, so useful tokens = target tokens.
The number of documents is chosen so that best-fit-decreasing packing fills exactly
steps x micro x accumulation rows of --seq tokens (TRL's packing, when it runs, is checked to give
the same count), so every contender trains on every document exactly once in --steps steps.

What each contender consumes per optimizer step (global batch = --micro x --accumulation rows):
- toolkit: `data.packing: true` (its best): its own packed rows, --micro rows per micro-batch,
  --accumulation micro-batches, in its own seeded order; loss on the reply only (the default).
- plain_pytorch: a hand-written loop (AdamW, warmup + cosine, clipping, exact accumulation: the
  loss is the sum over the step's target tokens divided by their count) fed the toolkit's rows in
  the toolkit's order, built with the toolkit's data code, packed the same way (position_ids, no
  padding between documents), called with use_cache=False (with the default KV cache, transformers
  5 does not read document bounds from position_ids, so packed documents would attend to each
  other: faster and wrong). Same documents, same rows, same tokens in every step: the ratio
  toolkit / plain_pytorch is the cost of the toolkit's loop alone (with `--toolkit
  data.padding_free=true` the toolkit's micro-batches are unpadded and the ratio includes that).
- hf_trainer: transformers' Trainer with the same documents in every micro-batch as the toolkit
  (the documents of the toolkit's packed rows), padded to the longest (the Trainer has no packing
  of its own): the ratio to it is what packing and the loop together buy over the stock Trainer.
- trl: TRL's SFTTrainer with its best packing, `packing=True, packing_strategy="bfd"` (which
  turns on its padding-free collator: each micro-batch is flattened into one row with
  position_ids), `completion_only_loss=True` on prompt/completion rows of the same documents,
  `max_length=--seq`, gradient checkpointing off (its default is on), the same precision. It packs
  and shuffles itself, so its steps hold other documents than the toolkit's; it sees the same set
  of documents in the same number of steps of the same number of rows. With the `sdpa` kernel
  (CPU, or a GPU without `--attn flash_attention_2`) a flattened micro-batch attends over
  micro x seq positions under a block-diagonal mask, which is TRL's cost, not the benchmark's;
  `--micro 1` takes it out.

Same tokens. Each contender counts, from the batches it trains on, the target tokens (labels other
than -100 after the first position) and the document tokens (input ids other than padding) of each
optimizer step: the hand-written loop from its host batches, the Trainer and TRL in `compute_loss`
(counts kept on the device, read at the end, so no extra synchronisation), the toolkit from its
metrics.jsonl (`target_tokens_per_second / samples_per_second x rows` per step, and its cumulative
`tokens`, which counts the packed rows' padding too). The script asserts that the toolkit, the
hand-written loop and the Trainer agree step by step with the toolkit's rows, and that TRL's
totals over the run equal theirs, exactly.

Time. Each contender runs as its own process and records the wall-clock time at the end of every
optimizer step (on CUDA after a synchronisation). The first --warmup steps are left out; over the
rest (the steady state: forward, backward, clipping, optimizer and scheduler, logging, metrics,
data loading; not imports, model loading or data preparation) it reports the median step time and
target (and document) tokens per second = the window's tokens / the window's seconds (per-step
token counts vary with packing, so tokens/s is taken over the whole window, not from the median).
Memory: the peak RSS of the contender's process (ru_maxrss; the toolkit's own process), or on
CUDA torch.cuda.max_memory_allocated. Model TFLOP/s per contender: the window's FLOPs as the toolkit counts
them for its own MFU (6 per weight per document token, attention per document; `step_flops`) over the
window's seconds; on a GPU the table of toolkit/observe/measure.py gives the dense peak and so the MFU
(`mfu`). Medians over --repeats processes are reported, with the
best; contenders are interleaved so drift in the machine's speed hits all alike. Results go to
stdout as one JSON line and a Markdown row for benchmarks/NOTES.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONTENDERS = ("toolkit", "plain_pytorch", "hf_trainer", "trl")
SAME_ROWS = ("toolkit", "plain_pytorch", "hf_trainer")  # consume the toolkit's documents step by step
TEMPLATE_TOKENS = 9  # <s> <|user|> \n ... </s> \n <|assistant|> \n ... </s> \n around the two contents
TARGETS_AFTER_REPLY = 2  # the reply's </s> and \n are targets too
IGNORE = -100
SEED = 0
LORA = {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}  # --lora, every contender


# ----------------------------------------------------------------------------- data


def document_lengths(a, rows: int, with_trl: bool, template: int = TEMPLATE_TOKENS) -> list[tuple[int, int]]:
    """(user, reply) content lengths in tokens (bytes, or --model's one-token words) of documents of
    seq/8..seq tokens, `template` of them the chat template's, seeded, as many as best-fit-decreasing
    packs into exactly `rows` rows of a.seq tokens (the most such)."""
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from toolkit.data.packing import best_fit_decreasing

    rng = random.Random(SEED)
    shortest = max(a.seq // 8, template + 3)
    pool = []
    for _ in range(int(rows * a.seq / ((shortest + a.seq) / 2) * 1.5) + 20):
        content = rng.randint(shortest, a.seq) - template
        user = rng.randint(1, content // 2)
        pool.append((user, content - user))
    lengths = np.array([u + r + template for u, r in pool])

    def packed_rows(n: int) -> int:
        return len(best_fit_decreasing(lengths[:n], a.seq, SEED))

    lo, hi = 1, len(pool)  # smallest n that needs more than `rows` rows, by bisection
    if packed_rows(hi) <= rows:
        sys.exit("internal: the document pool is too small")
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if packed_rows(mid) <= rows else (lo, mid)
    for n in range(lo - 1, max(0, lo - 200), -1):  # any best-fit-decreasing gives the same count of rows,
        if packed_rows(n) == rows and (not with_trl or trl_rows(lengths[:n], a.seq) == rows):  # TRL's
            return pool[:n]  # packs each 1,000-row map batch on its own
    sys.exit(f"no number of documents packs into exactly {rows} rows of {a.seq} for every contender; "
             "change --steps or --micro")


def trl_rows(lengths, seq: int) -> int:
    """Rows TRL's own packing (pack_dataset, bfd) makes of documents of these lengths."""
    import datasets
    from trl import pack_dataset

    datasets.disable_progress_bars()
    return len(pack_dataset(datasets.Dataset.from_dict({"input_ids": [[3] * int(n) for n in lengths]}), seq, "bfd"))


def real_model(work: Path, a) -> tuple[list[str], int]:
    """--model: its config and weights linked into work/model, its tokenizer saved there with
    <|endoftext|> (or <unk>) as padding where padding is the end-of-turn token (SmolLM2: the counts
    read document tokens as non-padding ids, and padding is masked for every contender alike).
    Returns one-token words (" word" is one token after any other) and the chat template's tokens
    around a user and an assistant turn (a default system prompt included)."""
    from transformers import AutoTokenizer

    (work / "model").mkdir()
    for f in Path(a.model).iterdir():
        if f.name == "config.json" or f.name == "generation_config.json" or f.suffix == ".safetensors" or (
                f.name.endswith(".safetensors.index.json")):
            (work / "model" / f.name).symlink_to(f.resolve())
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    if tokenizer.pad_token is None or tokenizer.pad_token == tokenizer.eos_token:
        tokenizer.pad_token = next(t for t in ("<|endoftext|>", "<unk>") if t in tokenizer.get_vocab())
    tokenizer.save_pretrained(work / "model")
    vocab = [w[1:] for w in tokenizer.get_vocab() if w.startswith("\u0120") and w[1:].isalpha() and w[1:].islower()
             and 3 <= len(w) - 1 <= 6]
    words = [w for w in sorted(vocab)[::10] if len(tokenizer.encode(" " + w, add_special_tokens=False)) == 1][:300]
    assert len(words) >= 50, "no one-token words found in --model's vocabulary (expected a byte-level BPE)"

    def tokens(user: int, reply: int) -> int:
        text = tokenizer.apply_chat_template([{"role": "user", "content": " " + " ".join(words[:user])},
                                              {"role": "assistant", "content": " " + " ".join(words[:reply])}],
                                             tokenize=False)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    template = tokens(3, 5) - 8
    assert tokens(11, 2) - 13 == template, "the chat template's length depends on the contents"
    return words, template


def random_model(work: Path, a) -> None:
    """The random Llama of --hidden x --layers (--intermediate, --heads, --kv-heads where given) with the
    toolkit's byte tokenizer (vocabulary 262), built (on the GPU where there is one: an 8B model's
    random init takes minutes on a host) and saved in --model-dtype."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.model.load import build_byte_tokenizer

    torch.manual_seed(SEED)
    config = LlamaConfig(vocab_size=262, hidden_size=a.hidden,
                         intermediate_size=a.intermediate or int(a.hidden * 2.75) // 8 * 8,
                         num_hidden_layers=a.layers, num_attention_heads=a.heads or max(1, a.hidden // 64),
                         num_key_value_heads=a.kv_heads or max(1, a.hidden // 128), max_position_embeddings=a.seq,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.model_dtype]
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(work / "model")
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    build_byte_tokenizer().save_pretrained(work / "model")


def prepare(work: Path, a) -> dict:
    """Model folder, tokenizer, documents, the toolkit's recipe and its prepared data; returns the
    plan: the toolkit's per-step counts that every contender is checked against."""
    import yaml

    sys.path.insert(0, str(ROOT))
    rows = a.steps * a.micro * a.accumulation
    rng = random.Random(SEED + 1)
    if a.model:  # words of one token each, so a document's token count is set exactly as with bytes
        words, template = real_model(work, a)
        content = lambda n: "".join(" " + rng.choice(words) for _ in range(n))  # noqa: E731
    else:
        random_model(work, a)
        template, alphabet = TEMPLATE_TOKENS, "abcdefghijklmnopqrstuvwxyz ,."
        content = lambda n: "".join(rng.choice(alphabet) for _ in range(n))  # noqa: E731
    with open(work / "train.jsonl", "w") as f:
        for user, reply in document_lengths(a, rows, "trl" in a.only, template):
            f.write(json.dumps({"messages": [{"role": "user", "content": content(user)},
                                             {"role": "assistant", "content": content(reply)}]}) + "\n")
    recipe = {
        "output_dir": str(work / "toolkit_run"), "overwrite": True, "seed": SEED,
        "model": {"path": str(work / "model"), "attn_implementation": a.attn},
        "data": {"train_files": [str(work / "train.jsonl")], "format": "messages", "max_seq_len": a.seq,
                 "packing": True, "eval_fraction": 0.0},
        "train": {"micro_batch_size": a.micro, "gradient_accumulation_steps": a.accumulation,
                  "learning_rate": 1e-4, "warmup_steps": 2, "precision": a.precision, "max_grad_norm": 1.0,
                  "log_every_steps": 10},
    }
    if a.lora:
        recipe["lora"] = {"enabled": True, **LORA}
    (work / "recipe.yaml").write_text(yaml.safe_dump(recipe))

    examples, steps, tokenizer = toolkit_steps(work, a)  # prepares the toolkit's data once, here
    plan = {"documents": len(examples.table), "steps": []}
    for step in steps:
        rows_of_step = [examples[i] for micro in step for i in micro]
        plan["steps"].append(
            {"targets": sum(int((r["labels"][1:] != IGNORE).sum()) for r in rows_of_step),  # [1:] per row: a row
             "tokens": sum(len(r["input_ids"]) for r in rows_of_step),  # starts a document (never a target)
             "padded_tokens": sum(len(micro) * max(len(examples[i]["input_ids"]) for i in micro) for micro in step),
             "squared": sum(len(d["input_ids"]) ** 2 for i in (j for micro in step for j in micro)
                            for d in row_documents(examples, i))})  # attention's share of the step's FLOPs
    lengths = examples.table.select_columns(["length"]).with_format("numpy")[:]["length"]
    assert sum(s["tokens"] for s in plan["steps"]) == int(lengths.sum()), "not every document is in a step"
    assert set(lengths.tolist()) <= set(range(a.seq // 8, a.seq + 1)), "documents did not tokenize as intended"
    plan["flops"] = step_flops(work, a, plan["steps"])
    (work / "plan.json").write_text(json.dumps(plan))
    return plan


def step_flops(work: Path, a, steps: list[dict]) -> list[float]:
    """Each step's model FLOPs as the toolkit counts them for its MFU (observe/measure.Flops: 6 per
    weight per document token, 4 + 6 per adapter weight under LoRA, causal attention per document)."""
    from transformers import AutoConfig

    from toolkit.backends.model_counts import count_model
    from toolkit.config import LoraConfig
    from toolkit.observe.measure import Flops

    lora = LoraConfig(enabled=True, **LORA) if a.lora else None
    flops = Flops.of(count_model(AutoConfig.from_pretrained(work / "model"), "model", lora), a.lora)
    return [flops.of_batch(s["tokens"], s["squared"]) for s in steps]


def toolkit_steps(work: Path, a):
    """The toolkit's training rows in its order, built with its own data code as `toolkit train`
    builds them: (examples, steps, tokenizer), steps[k][i] = the row numbers of micro-batch i of
    optimizer step k. (The toolkit's metrics are checked against these counts.)"""
    sys.path.insert(0, str(ROOT))
    from toolkit.config import load_recipe
    from toolkit.data.batching import EpochSampler
    from toolkit.data.prepare import build_datasets
    from toolkit.model.load import build_tokenizer

    recipe = load_recipe(work / "recipe.yaml")
    tokenizer = build_tokenizer(recipe.model)
    data = build_datasets(recipe.data, tokenizer, recipe.seed, packing=True)
    global_batch = a.micro * a.accumulation
    order = list(EpochSampler(len(data.train), global_batch, recipe.seed))
    assert len(order) == a.steps * global_batch == len(data.train), (len(order), len(data.train))
    steps = [[order[k * global_batch + i * a.micro: k * global_batch + (i + 1) * a.micro]
              for i in range(a.accumulation)] for k in range(a.steps)]
    return data.train, steps, tokenizer


def row_documents(examples, row: int) -> list[dict]:
    """The documents (input_ids, labels) packed into one of the toolkit's rows."""
    return [examples.docs[int(j)] for j in examples.bins[int(row)]["docs"]]


def pad(docs: list[dict], pad_id: int) -> dict:
    """Documents right-padded to the longest, with an attention mask (the Trainer's batches)."""
    import torch

    width = max(len(d["input_ids"]) for d in docs)
    batch = {"input_ids": torch.full((len(docs), width), pad_id), "labels": torch.full((len(docs), width), IGNORE),
             "attention_mask": torch.zeros((len(docs), width), dtype=torch.long)}
    for i, d in enumerate(docs):
        n = len(d["input_ids"])
        batch["input_ids"][i, :n] = torch.as_tensor(d["input_ids"])
        batch["labels"][i, :n] = torch.as_tensor(d["labels"])
        batch["attention_mask"][i, :n] = 1
    return batch


def counts(batch: dict, pad_id: int):
    """(document tokens, target tokens) of a batch, as tensors on its device (no synchronisation).
    <pad> never occurs inside a document, and the first position of a row is never a target."""
    import torch

    return torch.stack([(batch["input_ids"] != pad_id).sum(), (batch["labels"][:, 1:] != IGNORE).sum()])


# ----------------------------------------------------------------------------- contenders


def device_and_dtype(a):
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return device, {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.precision)


def peak_memory(device: str) -> tuple[int, str]:
    """This process's peak: CUDA allocator bytes on a GPU, else resident set bytes."""
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated(), "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss"


def stamp(device: str) -> float:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
    return time.time()


def peft_config():
    """--lora's adapter as a peft config (the toolkit builds the same from its recipe's `lora`)."""
    from peft import LoraConfig

    return LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                      target_modules=LORA["target_modules"], task_type="CAUSAL_LM", bias="none")


def load_model(work: Path, a):
    """The contender's model from work/model, with --lora's adapter for the hand-written loop and the Trainer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(work / "model", attn_implementation=a.attn)
    if a.lora:
        from peft import get_peft_model

        model = get_peft_model(model, peft_config())
    return model


def write_result(work: Path, who: str, stamps: list[float], per_micro: list, accumulation: int, device: str,
                 cpu: list[float]) -> None:
    """Per optimizer step: end time, CPU seconds of the process so far, document tokens, target tokens;
    and the process's peak memory."""
    import torch

    flat = torch.stack([c.cpu() for c in per_micro]).view(-1, accumulation, 2).sum(1).tolist() if per_micro else []
    peak, kind = peak_memory(device)
    (work / f"result_{who}.json").write_text(json.dumps({
        "stamps": stamps, "cpu": cpu, "tokens": [int(t) for t, _ in flat], "targets": [int(g) for _, g in flat],
        "peak_bytes": peak, "memory": kind}))


def run_toolkit(work: Path, a) -> None:
    cmd = [sys.executable, "-m", "toolkit", "train", str(work / "recipe.yaml"), f"train.max_steps={a.steps}",
           f"train.optim={a.optim}", *a.toolkit]
    from grpo_speed import launch  # polls the process's CPU time as each metrics row appears

    (work / "toolkit_run" / "metrics.jsonl").unlink(missing_ok=True)  # an earlier repeat's
    code, _, child_peak, cpu = launch(cmd, work / "toolkit.log", work / "toolkit_run" / "metrics.jsonl")
    if code != 0:
        sys.exit(f"toolkit train failed:\n{(work / 'toolkit.log').read_text()[-3000:]}")
    rows = [json.loads(line) for line in (work / "toolkit_run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    plan = json.loads((work / "plan.json").read_text())["steps"]
    global_batch = a.micro * a.accumulation
    targets = [round(r["target_tokens_per_second"] / r["samples_per_second"] * global_batch) for r in rows]
    processed = [b["tokens"] - a_["tokens"] for a_, b in zip([{"tokens": 0}] + rows, rows)]
    # What the toolkit reports it trained on must be the rows the others are fed, step by step.
    assert targets == [s["targets"] for s in plan], ("toolkit targets differ from its rows", targets)
    # Packed rows count their padding as processed tokens; padding-free micro-batches have none.
    expected = [s["tokens" if "data.padding_free=true" in a.toolkit else "padded_tokens"] for s in plan]
    assert processed == expected, ("toolkit tokens differ from its rows", processed)
    if rows and max(rows[-1]["peak_memory_gib"]) and device_and_dtype(a)[0] == "cuda":
        peak, kind = int(max(max(r["peak_memory_gib"]) for r in rows) * 2**30), "cuda_max_allocated"
    else:  # the toolkit's own process, from start to exit
        peak, kind = child_peak, "rss"
    profile = next((line for line in (work / "toolkit.log").read_text().splitlines()
                    if line.startswith("step profile")), "")
    (work / "result_toolkit.json").write_text(json.dumps({
        "stamps": [r["time"] for r in rows], "cpu": cpu, "tokens": [s["tokens"] for s in plan], "targets": targets,
        "peak_bytes": peak, "memory": kind, "profile": profile}))


def run_plain_pytorch(work: Path, a) -> None:
    """What a careful engineer writes by hand: AdamW, warmup + cosine, clipping, exact accumulation
    over the step's target tokens, the loss read back every step; fed the toolkit's packed rows."""
    import math

    import torch

    from toolkit.data.batching import Collator

    torch.manual_seed(SEED)
    device, dtype = device_and_dtype(a)
    examples, steps, tokenizer = toolkit_steps(work, a)
    collate = Collator(tokenizer.pad_token_id, packed=True)
    model = load_model(work, a).to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]  # all, or --lora's adapters
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / 2 if s < 2 else 0.5 * (1 + math.cos(math.pi * (s - 2) / max(1, a.steps - 2))))
    stamps, cpu, per_micro = [], [], []
    for step in steps:
        micro_batches = [collate([examples[i] for i in rows]) for rows in step]
        micro_counts = [counts(b, tokenizer.pad_token_id) for b in micro_batches]  # on the host
        step_targets = int(sum(c[1] for c in micro_counts))
        for batch, c in zip(micro_batches, micro_counts):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
                # use_cache=False: with a KV cache (the config's default) transformers skips reading
                # document bounds from position_ids and packed documents would attend to each other.
                loss = model(**batch, use_cache=False).loss  # mean over this micro-batch's targets
            (loss * (int(c[1]) / step_targets)).backward()  # -> sum over the step's targets / their count
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        per_micro += micro_counts
        stamps.append(stamp(device))
        cpu.append(time.process_time())  # this process's CPU seconds, every thread
    write_result(work, "plain_pytorch", stamps, per_micro, a.accumulation, device, cpu)


def counting(trainer_class, pad_id: int):
    """`trainer_class` that counts the tokens of every micro-batch it trains on, in compute_loss."""

    class Counting(trainer_class):
        counted: list = []

        def compute_loss(self, model, inputs, *args, **kwargs):
            if model.training:
                self.counted.append(counts(inputs, pad_id))
            return super().compute_loss(model, inputs, *args, **kwargs)

    return Counting


def trainer_arguments(a, device: str) -> dict:
    """The settings the Trainer and TRL share with the other contenders."""
    return dict(per_device_train_batch_size=a.micro, gradient_accumulation_steps=a.accumulation, max_steps=a.steps,
                learning_rate=1e-4, warmup_steps=2, lr_scheduler_type="cosine", weight_decay=0.0, max_grad_norm=1.0,
                logging_steps=10, save_strategy="no", report_to="none", use_cpu=device == "cpu",
                bf16=a.precision == "bf16", fp16=a.precision == "fp16", gradient_checkpointing=False,
                dataloader_num_workers=0, disable_tqdm=True, seed=SEED, optim=a.optim)


def stamp_callback(stamps: list, cpu: list, device: str):
    from transformers import TrainerCallback

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(stamp(device))
            cpu.append(time.process_time())

    return Stamp()


def run_hf_trainer(work: Path, a) -> None:
    """The stock Trainer: each micro-batch holds the documents of the toolkit's micro-batch, padded."""
    from transformers import Trainer, TrainingArguments

    device, _ = device_and_dtype(a)
    examples, steps, tokenizer = toolkit_steps(work, a)
    pad_id = tokenizer.pad_token_id
    # One item per micro-batch (batch size 1 below), in the toolkit's order.
    items = [{"docs": [d for i in rows for d in row_documents(examples, i)]} for step in steps for rows in step]
    args = TrainingArguments(output_dir=str(work / "trainer_run"), remove_unused_columns=False,
                             train_sampling_strategy="sequential",
                             **{**trainer_arguments(a, device), "per_device_train_batch_size": 1})
    model = load_model(work, a)
    stamps, cpu = [], []
    trainer = counting(Trainer, pad_id)(model=model, args=args, train_dataset=items,
                                        data_collator=lambda batch: pad(batch[0]["docs"], pad_id),
                                        callbacks=[stamp_callback(stamps, cpu, device)])
    trainer.train()
    write_result(work, "hf_trainer", stamps, trainer.counted, a.accumulation, device, cpu)


def run_trl(work: Path, a) -> None:
    """TRL's SFTTrainer with its best packing (bfd, padding-free) and completion-only loss."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    device, _ = device_and_dtype(a)
    rows = [json.loads(line)["messages"] for line in (work / "train.jsonl").read_text().splitlines()]
    ds = datasets.Dataset.from_list([{"prompt": [m[0]], "completion": [m[1]]} for m in rows])
    tokenizer = AutoTokenizer.from_pretrained(work / "model")
    args = SFTConfig(output_dir=str(work / "trl_run"), max_length=a.seq, packing=True, packing_strategy="bfd",
                     padding_free=True, completion_only_loss=True, **trainer_arguments(a, device))
    model = AutoModelForCausalLM.from_pretrained(work / "model", attn_implementation=a.attn)
    stamps, cpu = [], []
    trainer = counting(SFTTrainer, tokenizer.pad_token_id)(model=model, args=args, train_dataset=ds,
                                                           processing_class=tokenizer,
                                                           peft_config=peft_config() if a.lora else None,
                                                           callbacks=[stamp_callback(stamps, cpu, device)])
    assert len(trainer.train_dataset) == a.steps * a.micro * a.accumulation, len(trainer.train_dataset)
    trainer.train()
    write_result(work, "trl", stamps, trainer.counted, a.accumulation, device, cpu)


RUNNERS = {"toolkit": run_toolkit, "plain_pytorch": run_plain_pytorch, "hf_trainer": run_hf_trainer, "trl": run_trl}


# ----------------------------------------------------------------------------- measuring


def measure(work: Path, a, who: str, plan: dict) -> dict:
    """One process of one contender: its steady-state figures, its counts checked against the plan."""
    cmd = [sys.executable, __file__, "--_run", who, "--_work", str(work)] + forwarded(a)
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"{who} failed:\n{proc.stderr[-3000:]}")
    r = json.loads((work / f"result_{who}.json").read_text())
    (work / f"result_{who}.json").unlink()
    stamps, targets, tokens = r["stamps"], r["targets"], r["tokens"]
    assert len(stamps) == len(targets) == len(tokens) == a.steps, (who, len(stamps), len(targets), len(tokens))
    if who in SAME_ROWS:
        wrong = [k + 1 for k, s in enumerate(plan["steps"]) if (s["targets"], s["tokens"]) != (targets[k], tokens[k])]
        if wrong:
            sys.exit(f"same-tokens check failed: {who} trained on other tokens than the toolkit's rows "
                     f"in steps {wrong[:10]}")
    if (sum(targets), sum(tokens)) != (plan["targets"], plan["tokens"]):
        sys.exit(f"same-tokens check failed: {who} trained on {sum(targets):,} target / {sum(tokens):,} document "
                 f"tokens, the toolkit's rows hold {plan['targets']:,} / {plan['tokens']:,}")
    window = stamps[-1] - stamps[a.warmup - 1]  # steps warmup+1 .. steps
    cpu = r["cpu"]  # CPU seconds at each step's end (the toolkit's: polled, may miss a step on a fast run)
    cpu_s = statistics.median(b - a_ for a_, b in zip(cpu[a.warmup - 1:], cpu[a.warmup:])) if len(
        cpu) == a.steps else None
    return {"step_s": statistics.median(b - a_ for a_, b in zip(stamps[a.warmup - 1:], stamps[a.warmup:])),
            "cpu_step_s": cpu_s, "profile": r.get("profile", ""),
            "target_tps": sum(targets[a.warmup:]) / window, "tps": sum(tokens[a.warmup:]) / window,
            "peak_mib": r["peak_bytes"] / 2**20, "memory": r["memory"], "wall": wall,
            # TRL trains other rows in each step: the plan's FLOPs over the same steps stand in for its own
            "tflops": sum(plan["flops"][a.warmup:]) / window / 1e12}


def forwarded(a) -> list[str]:
    return ["--model", a.model or "", *(["--lora"] if a.lora else []), "--threads", str(a.threads or 0),
            "--hidden", str(a.hidden), "--layers", str(a.layers), "--intermediate", str(a.intermediate),
            "--heads", str(a.heads), "--kv-heads", str(a.kv_heads), "--model-dtype", a.model_dtype,
            "--seq", str(a.seq), "--micro", str(a.micro),
            "--accumulation", str(a.accumulation), "--precision", a.precision, "--attn", a.attn,
            "--steps", str(a.steps), "--warmup", str(a.warmup), "--optim", a.optim, "--toolkit", *a.toolkit]


def summarize(a, plan: dict, runs: dict) -> dict:
    import torch
    import transformers

    def med(who, key):
        return statistics.median(r[key] for r in runs[who])

    def best(who, key, pick):
        return pick(r[key] for r in runs[who])

    try:
        import trl

        trl_version = trl.__version__
    except ImportError:
        trl_version = None
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)",
        "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl_version,
        "precision": a.precision, "attn": a.attn, "optim": a.optim, "toolkit_overrides": a.toolkit,
        "model": a.model or f"llama hidden {a.hidden} x {a.layers} layers", "model_dtype": a.model_dtype,
        "lora": LORA if a.lora else None,
        "threads": a.threads or "default", "load_average": [round(x, 2) for x in os.getloadavg()],
        "seq": a.seq, "micro": a.micro, "accumulation": a.accumulation, "rows_per_step": a.micro * a.accumulation,
        "steps": a.steps, "warmup": a.warmup, "repeats": a.repeats,
        "same_tokens": {"check": "passed", "documents": plan["documents"], "target_tokens": plan["targets"],
                        "document_tokens": plan["tokens"], "identical_per_step": [w for w in SAME_ROWS if w in runs],
                        "identical_in_total": sorted(runs)},
        "ms_per_step": {w: round(med(w, "step_s") * 1000, 1) for w in runs},
        "ms_per_step_best": {w: round(best(w, "step_s", min) * 1000, 1) for w in runs},
        "cpu_ms_per_step": {w: round(statistics.median(c) * 1000, 1) if (
            c := [r["cpu_step_s"] for r in runs[w] if r["cpu_step_s"] is not None]) else None for w in runs},
        "target_tokens_per_second": {w: round(med(w, "target_tps")) for w in runs},
        "target_tokens_per_second_best": {w: round(best(w, "target_tps", max)) for w in runs},
        "target_tokens_per_second_all_repeats": {w: [round(r["target_tps"]) for r in runs[w]] for w in runs},
        "tokens_per_second": {w: round(med(w, "tps")) for w in runs},
        "tflops": {w: float(f"{med(w, 'tflops'):.4g}") for w in runs},
        "peak_memory_mib": {w: round(med(w, "peak_mib"), 1) for w in runs},
        "peak_memory_kind": runs[next(iter(runs))][0]["memory"],
        "process_seconds": {w: round(med(w, "wall"), 1) for w in runs},
    }
    from toolkit.observe.measure import peak_tflops

    if peak := peak_tflops(a.precision, None):  # model FLOPs utilisation against the GPU's dense datasheet peak
        result["peak_tflops"] = peak
        result["mfu"] = {w: round(t / peak, 3) for w, t in result["tflops"].items()}
    if "toolkit" in runs:  # the toolkit's step profile of its fastest repeat
        result["toolkit_step_profile"] = min(runs["toolkit"], key=lambda r: r["step_s"])["profile"]
    if "toolkit" in runs:  # > 1: the toolkit trains more useful tokens per second; memory < 1: it needs less
        for other in [w for w in CONTENDERS if w in runs and w != "toolkit"]:
            tps, tps_best = result["target_tokens_per_second"], result["target_tokens_per_second_best"]
            result[f"speed_vs_{other}"] = round(tps["toolkit"] / tps[other], 3)
            result[f"speed_vs_{other}_best"] = round(tps_best["toolkit"] / tps_best[other], 3)
            mem = result["peak_memory_mib"]
            result[f"memory_vs_{other}"] = round(mem["toolkit"] / mem[other], 3)
            cpu = result["cpu_ms_per_step"]
            if cpu["toolkit"] and cpu[other]:  # < 1: the toolkit spends less CPU time per step
                result[f"cpu_per_step_vs_{other}"] = round(cpu["toolkit"] / cpu[other], 3)
    return result


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (benchmarks/gpu_check.py checks its pieces' arguments with this)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="", help="a local Hugging Face model folder (config, tokenizer, weights) "
                                                "for every contender, instead of the random --hidden x --layers one")
    p.add_argument("--lora", action="store_true", help=f"train a LoRA adapter ({LORA}) in every contender "
                                                        "(TRL via peft_config, the loop and the Trainer via peft)")
    p.add_argument("--threads", type=int, default=0, help="torch threads in each contender's process (default: "
                                                          "torch's, one per core); 1 on a shared, loaded host")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=0, help="MLP width (default hidden x 2.75)")
    p.add_argument("--heads", type=int, default=0, help="attention heads (default hidden / 64)")
    p.add_argument("--kv-heads", type=int, default=0, help="key/value heads (default hidden / 128)")
    p.add_argument("--model-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="the random model's saved dtype, which the hand-written loop, the Trainer and TRL load "
                        "(transformers' dtype=auto); the toolkit's is model.dtype (--toolkit model.dtype=bf16)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro", type=int, default=8, help="rows per micro-batch")
    p.add_argument("--accumulation", type=int, default=1)
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--attn", choices=["sdpa", "eager", "flash_attention_2"], default="sdpa",
                   help="attention kernel, the same for every contender")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the steady state (at least 1)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", choices=CONTENDERS, nargs="*", default=list(CONTENDERS))
    p.add_argument("--optim", default="adamw_torch",
                   help="the optimizer, by transformers' `optim` name, of the toolkit (train.optim), the Trainer and "
                        "TRL; the hand-written loop is AdamW's and runs only with adamw_torch")
    p.add_argument("--toolkit", nargs="*", default=[], metavar="KEY=VALUE",
                   help="recipe overrides for the toolkit only, e.g. data.padding_free=true train.compile=true")
    p.add_argument("--_run", choices=CONTENDERS, help=argparse.SUPPRESS)
    p.add_argument("--_work", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if not 1 <= a.warmup <= a.steps - 2:
        p.error("--warmup must be at least 1 and leave at least 2 steps")
    return a


def main() -> None:
    a = parse()
    if a.threads:  # read by torch (OpenMP) at the start of every process started from here, the toolkit's too
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(a.threads)
    if a._run:
        if a.threads:
            import torch

            torch.set_num_threads(a.threads)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        sys.path.insert(0, str(ROOT))
        RUNNERS[a._run](Path(a._work), a)
        return

    if a.optim != "adamw_torch" and "plain_pytorch" in a.only:
        a.only.remove("plain_pytorch")
        print(f"plain_pytorch left out: its loop is AdamW's, not {a.optim}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="loop_speed_") as tmp:
        work = Path(tmp)
        # Every process (this one first) prepares into and reads from a cache of this run's own.
        os.environ["HF_DATASETS_CACHE"] = str(work / "datasets_cache")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        plan = prepare(work, a)
        plan["targets"] = sum(s["targets"] for s in plan["steps"])
        plan["tokens"] = sum(s["tokens"] for s in plan["steps"])
        print(f"{plan['documents']} documents, {plan['tokens']:,} tokens ({plan['targets']:,} targets) in "
              f"{a.steps} steps of {a.micro * a.accumulation} rows of {a.seq}", file=sys.stderr)
        runs = {who: [] for who in a.only}
        for r in range(a.repeats):  # interleaved, so drift in the machine's speed hits all alike
            for who in a.only:
                m = measure(work, a, who, plan)
                runs[who].append(m)
                print(f"repeat {r + 1}/{a.repeats} {who}: {m['step_s'] * 1000:.1f} ms/step, "
                      f"CPU {round(m['cpu_step_s'] * 1000) if m['cpu_step_s'] else '-'} ms/step, "
                      f"{m['target_tps']:,.0f} target tok/s, peak {m['peak_mib']:,.0f} MiB, process {m['wall']:.1f} s",
                      file=sys.stderr)
    result = summarize(a, plan, runs)
    if result.get("toolkit_step_profile"):
        print(result["toolkit_step_profile"], file=sys.stderr)
    print(json.dumps(result))
    tps, mem = result["target_tokens_per_second"], result["peak_memory_mib"]
    print(f"| {result['date']} | {result['device']} | {result['model']}, seq {a.seq}, {a.micro} x {a.accumulation} "
          f"rows, {a.precision}, {a.attn}{''.join(' ' + o for o in a.toolkit)} | "
          + " | ".join(f"{tps.get(w, '-')}" for w in CONTENDERS) + " | "
          + " | ".join(f"{result.get(f'speed_vs_{w}', '-')} ({result.get(f'speed_vs_{w}_best', '-')})"
                       for w in CONTENDERS[1:]) + " | "
          + " | ".join(f"{mem.get(w, '-')}" for w in CONTENDERS) + f" | {result.get('memory_vs_trl', '-')} |")


if __name__ == "__main__":
    main()
