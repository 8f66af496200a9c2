"""Batching: prepared examples read from Arrow by index (`Examples`), ordered by the samplers
(`EpochSampler`, `EvalShardSampler`) and batched into tensors (`Collator`).

A packed row holds whole documents with `position_ids` that restart at each one; the model then
builds a block-diagonal causal mask, so no token attends across a document boundary (checked at
start-up by `packing_is_isolated`)."""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import Sampler

from ..config.methods import method_of
from .formats import IGNORE


class Examples(torch.utils.data.Dataset):
    """Examples read from Arrow by index: one document each, or (packed) one row of documents
    with `position_ids` restarting at each. Index None (eval padding) gives None.

    An unpaired example (KTO, data.format=unpaired: it has a `label`) comes with its mismatched
    sequence as `rejected_input_ids` / `rejected_labels`: its own prompt followed by the completion
    of the nearest example before it in this part (cyclically) whose prompt differs, as written
    (`completion_ids`: before that example was cut to max_seq_len), the whole cut to `kl_max_length`,
    as TRL pairs completions (rotated by one) for its KL estimate. Another prompt:
    a pair written as two rows, or a row repeated by a weighted mix, sits beside rows of its own
    prompt, whose completion would be no mismatch. The pairing is the prepared data's order, so it
    is the same whatever the batches, ranks or resume."""

    def __init__(self, docs, bins=None):
        self.table = docs  # every column, for counting
        columns = [c for c in ("input_ids", "labels", "rejected_input_ids", "rejected_labels", "fields", "label",
                               "margin", "completion_ids", "completion_labels")
                   if docs is not None and c in docs.column_names]
        if "fields" in columns:  # an online-RL prompt: its place (source, row) seeds its completions
            columns += ["source", "row"]
        self.docs = docs.select_columns(columns).with_format("numpy") if docs is not None else None
        self.bins = bins.with_format("numpy") if bins is not None else None
        self.unpaired = "label" in columns
        self.pairs = "rejected_input_ids" in columns or self.unpaired
        self.kl_max_length: int | None = None  # unpaired: the longest mismatched sequence (data.max_seq_len)
        self.reference = None  # pairs: each example's reference log-probabilities (chosen, rejected; KTO's: its
        # completion, its mismatched sequence)

    def __len__(self) -> int:
        if self.docs is None:
            return 0
        return len(self.bins) if self.bins is not None else len(self.docs)

    def __getitem__(self, i):
        if i is None:
            return None
        if self.bins is None:
            example = self.docs[int(i)]
            if self.unpaired:
                example.update(mismatched(example, self.docs[self.other_prompt(int(i), example)], self.kl_max_length))
                del example["completion_ids"], example["completion_labels"]
            if self.reference is not None:
                example["reference"] = self.reference[int(i)]
            return example
        rows = self.docs[self.bins[int(i)]["docs"]]
        ids = [np.asarray(x) for x in rows["input_ids"]]
        return {"input_ids": np.concatenate(ids), "labels": np.concatenate(list(rows["labels"])),
                "position_ids": np.concatenate([np.arange(len(x)) for x in ids])}

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def other_prompt(self, i: int, example: dict) -> int:
        """The nearest example before `i` (cyclically) with another prompt; looked for among the
        OTHER_PROMPT_SCAN before it, else the one just before (a part of one prompt has no other)."""
        n, prompt = len(self.docs), prompt_ids(example)
        for step in range(1, min(n, OTHER_PROMPT_SCAN + 1)):
            j = (i - step) % n
            if not np.array_equal(prompt_ids(self.docs[j]), prompt):
                return j
        return (i - 1) % n


OTHER_PROMPT_SCAN = 64  # examples looked at for another prompt (a longer run of one prompt pairs within itself)


def prompt_ids(example: dict) -> np.ndarray:
    """An example's tokens before its first target."""
    return np.asarray(example["input_ids"])[:int(np.argmax(np.asarray(example["labels"]) != IGNORE))]


def mismatched(example: dict, other: dict, max_length: int | None) -> dict:
    """`example`'s prompt (its tokens before the first target) followed by `other`'s completion as
    written (`completion_ids` / `completion_labels`: from its first target on, before `other` was cut
    to max_seq_len), cut to `max_length`: KTO's mismatched pair, as `rejected_input_ids` /
    `rejected_labels` (TRL's KL sequence: this prompt and the whole other completion, cut by its collator)."""
    prompt = prompt_ids(example)
    completion, labels = np.asarray(other["completion_ids"]), np.asarray(other["completion_labels"])
    ids = np.concatenate([prompt.astype(completion.dtype), completion])
    labels = np.concatenate([np.full(len(prompt), IGNORE, dtype=labels.dtype), labels])
    return {"rejected_input_ids": ids[:max_length], "rejected_labels": labels[:max_length]}


def bins_dataset(bins: list[np.ndarray]):
    import datasets
    import pyarrow as pa

    offsets = np.zeros(len(bins) + 1, dtype=np.int32)
    offsets[1:] = np.cumsum([len(b) for b in bins])
    values = np.concatenate(bins).astype(np.int64) if bins else np.zeros(0, dtype=np.int64)
    table = pa.table({"docs": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))})
    return datasets.Dataset(table)


class EpochSampler(Sampler[int]):
    """A seeded permutation per epoch, cut to whole global batches so that every optimizer step
    sees exactly `global_batch` examples. Identical on every rank; the launcher's sharding
    hands each rank its micro-batches."""

    def __init__(self, n: int, global_batch: int, seed: int):
        self.n, self.global_batch, self.seed, self.epoch = n, global_batch, seed, 0
        self.steps_per_epoch = n // global_batch
        self.resume_epoch, self.resume_offset = 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resume_at(self, epoch: int, offset: int) -> None:
        """Continue from sample `offset` of `epoch`'s permutation (the samples a checkpoint had
        seen): the first epoch iterated from here on starts there, no sample repeated or skipped.
        An offset that is not a whole number of this launch's global batches (the global batch
        was changed on resume) ends that epoch at the last whole global batch."""
        self.resume_epoch, self.resume_offset = epoch, offset

    def steps_in(self, epoch: int) -> int:
        """Optimizer steps (whole global batches) this sampler yields in `epoch`."""
        start = self.resume_offset if epoch == self.resume_epoch else 0
        return max(0, self.steps_per_epoch * self.global_batch - start) // self.global_batch

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        perm = torch.randperm(self.n, generator=g)[: self.steps_per_epoch * self.global_batch]
        start = self.resume_offset if self.epoch == self.resume_epoch else 0
        return iter(perm[start: start + self.steps_in(self.epoch) * self.global_batch].tolist())

    def __len__(self) -> int:
        return self.steps_per_epoch * self.global_batch


class EvalShardSampler(Sampler):
    """This rank's share of the eval set, padded with None to the same number of batches on every
    rank (sharded backends need every rank to run the same number of forward passes)."""

    def __init__(self, n: int, batch_size: int, rank: int, world: int):
        per_rank = math.ceil(n / world)
        per_rank = math.ceil(per_rank / batch_size) * batch_size
        mine = list(range(rank, n, world))
        self.indices = mine + [None] * (per_rank - len(mine))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class Collator:
    """Batches a list of examples into tensors.

    - Unpacked examples are right-padded and get an attention mask.
    - Packed rows are right-padded and get `position_ids` instead (padding is one more document,
      which the real ones never see).
    - `padding_free`: the micro-batch's examples (rows or documents) are concatenated into one row
      with `position_ids` restarting at each document: no padding at all.
    - `bounds`: packed and padding-free batches also carry the documents' bounds for varlen
      attention (`cu_seq_lens_q/k`, `max_length_q/k`), computed here on the host.
    - `multiple`: rows are padded to a multiple of it (sequence parallelism splits each row into
      that many equal parts); a padding-free row gets one more document of padding.

    - `pairs` (preference pairs): the chosen sequences are the batch's first rows (padding-free:
      documents) and the rejected ones those after them, in the same order, so both go through one
      forward; `reference_logps` holds their reference log-probabilities where the examples carry them.
    - `unpaired` (KTO's examples): two batches in one, the completions' under the usual keys, the
      mismatched sequences' under the same keys prefixed `kl_` (they are taken without gradient,
      apart), and `kto_labels` (desirable or not); `reference_logps` as for pairs.

    An example of None (eval padding, see EvalShardSampler) becomes a row (padding-free: a document)
    without targets; a batch of nothing but None (a rank whose eval share ran out) is one such row
    per example."""

    def __init__(self, pad_token_id: int, packed: bool = False, padding_free: bool = False, bounds: bool = False,
                 pairs: bool = False, multiple: int = 1, prompts: bool = False, unpaired: bool = False):
        self.pad_token_id, self.packed, self.padding_free, self.bounds = pad_token_id, packed, padding_free, bounds
        self.pairs, self.multiple, self.prompts, self.unpaired = pairs or unpaired, multiple, prompts, unpaired

    def __call__(self, examples: list[dict | None]) -> dict:
        if self.pairs:
            return self.pair_batch(examples)
        if any(e is not None and "fields" in e for e in examples) or (self.prompts and examples):
            return self.prompt_batch(examples)
        real = [e for e in examples if e is not None]
        packed = "position_ids" in real[0] if real else self.packed
        examples = [e if e is not None else {"input_ids": [self.pad_token_id], "labels": [IGNORE],
                                             **({"position_ids": [0]} if packed else {})}
                    for e in examples]
        if self.padding_free and (short := -sum(len(e["input_ids"]) for e in examples) % self.multiple):
            examples = [*examples, {"input_ids": [self.pad_token_id] * short, "labels": [IGNORE] * short,
                                    **({"position_ids": list(range(short))} if packed else {})}]
        if self.padding_free:
            def row(parts):
                return torch.as_tensor(np.concatenate(parts), dtype=torch.long)[None]

            batch = {"input_ids": row([e["input_ids"] for e in examples]),
                     "labels": row([e["labels"] for e in examples]),
                     "position_ids": row([e["position_ids"] if packed else np.arange(len(e["input_ids"]))
                                          for e in examples])}
            return self.with_bounds(batch)
        width = max(len(e["input_ids"]) for e in examples)
        width += -width % self.multiple
        ids = torch.full((len(examples), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
        for i, e in enumerate(examples):
            n = len(e["input_ids"])
            ids[i, :n] = torch.as_tensor(e["input_ids"])
            labels[i, :n] = torch.as_tensor(e["labels"])
        batch = {"input_ids": ids, "labels": labels}
        if packed:
            pos = torch.zeros((len(examples), width), dtype=torch.long)
            for i, e in enumerate(examples):
                n = len(e["position_ids"])
                pos[i, :n] = torch.as_tensor(e["position_ids"])
                pos[i, n:] = torch.arange(width - n)
            batch["position_ids"] = pos
            return self.with_bounds(batch)
        mask = torch.zeros((len(examples), width), dtype=torch.long)
        for i, e in enumerate(examples):
            mask[i, : len(e["input_ids"])] = 1
        batch["attention_mask"] = mask
        return batch

    @staticmethod
    def prompt_batch(examples: list[dict | None]) -> dict:
        """Prompts (online RL) as they are: their token ids, their rows' columns, and (source, row)
        for each, which seeds its completions; an example of None (eval padding) is `valid` False."""
        import json

        real = [e for e in examples if e is not None]
        filler = real[0] if real else {"input_ids": [0], "fields": "{}", "source": 0, "row": -1}
        return {"prompt_ids": [np.asarray((e or filler)["input_ids"]).tolist() for e in examples],
                "fields": [json.loads(str((e or filler)["fields"])) for e in examples],
                "keys": torch.as_tensor([[int((e or filler)["source"]), int((e or filler)["row"])] for e in examples],
                                        dtype=torch.long).reshape(-1, 2),
                "valid": torch.as_tensor([e is not None for e in examples])}

    def pair_batch(self, examples: list[dict | None]) -> dict:
        # Two positions: a batch of nothing but padding still has a position a target could sit at.
        none = {"input_ids": [self.pad_token_id] * 2, "labels": [IGNORE] * 2}
        first = [e or none for e in examples]
        second = [{"input_ids": e["rejected_input_ids"], "labels": e["rejected_labels"]} if e else none
                  for e in examples]
        collate = Collator(self.pad_token_id, padding_free=self.padding_free, bounds=self.bounds)
        if self.unpaired:  # two batches, the mismatched one as kl_* (a batch of padding only too: the same layout)
            batch = {**collate(first), **{f"kl_{k}": v for k, v in collate(second).items()},
                     "kto_labels": torch.as_tensor([int(e["label"]) if e is not None else 0 for e in examples],
                                                   dtype=torch.bool)}
        else:
            batch = collate(first + second)
            if any(e is not None and "margin" in e for e in examples):  # a reward model's margins (0 for padding)
                batch["margins"] = torch.as_tensor([float(e["margin"]) if e is not None else 0.0 for e in examples],
                                                   dtype=torch.float32)
        if any(e is not None and "reference" in e for e in examples):
            reference = np.zeros((len(examples), 2))
            for i, e in enumerate(examples):
                if e is not None:
                    reference[i] = e["reference"]
            batch["reference_logps"] = torch.as_tensor(np.concatenate([reference[:, 0], reference[:, 1]]),
                                                       dtype=torch.float32)
        return batch

    def with_bounds(self, batch: dict) -> dict:
        if self.bounds:
            from ..model.varlen import document_bounds

            cu, longest = document_bounds(batch["position_ids"].numpy())
            batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        return batch


def most_positions(recipe) -> int:
    """The most positions one training or eval batch can hold: its rows (the larger of the train
    and eval micro-batch; a preference pair is two sequences) of at most max_seq_len."""
    t = recipe.train
    pairs = method_of(recipe).pairs  # KTO's completions and mismatched sequences run apart
    sequences = max(t.micro_batch_size, t.eval_batch_size or 0) * (2 if pairs else 1)
    return recipe.data.max_seq_len * sequences


def longest_row(recipe) -> int:
    """The most positions one row of a batch can hold: max_seq_len, or with data.padding_free the
    whole batch in one row."""
    return most_positions(recipe) if recipe.data.padding_free else recipe.data.max_seq_len


def packing_is_isolated(model: torch.nn.Module, tol: float = 1e-4) -> bool:
    """Does this model keep packed documents apart? Compares a document's logits packed behind
    another with its logits alone."""
    vocab = model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(3, vocab, (1, 7), generator=g), torch.randint(3, vocab, (1, 5), generator=g)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    with torch.no_grad():
        alone = model(input_ids=b.to(device), use_cache=False).logits.float()
        pos = torch.cat([torch.arange(7), torch.arange(5)]).unsqueeze(0)
        packed = model(input_ids=torch.cat([a, b], 1).to(device), position_ids=pos.to(device),
                       use_cache=False).logits.float()[:, 7:]
    model.train(was_training)
    return bool(((packed - alone).abs().max() <= tol * max(1.0, alone.abs().max().item())).item())
