"""Launched by tests/test_estimate.py under `accelerate launch` with 2 processes: builds and prepares
the recipe's model and optimizer exactly as `toolkit train` does, runs one micro-batch and one
optimizer step, and writes the bytes this rank holds to OUT_DIR/rank{N}.json:

- params: the module's parameters as this rank stores them (ZeRO-3: each `ds_tensor` partition;
  FSDP: each DTensor's local shard; otherwise the whole tensor),
- gradients: after backward, before the step: every `.grad` (local shards under FSDP) and
  DeepSpeed's partitioned gradient buffers,
- optimizer: after the step: DeepSpeed's fp32 master partitions and every optimizer state tensor.

Tensors are counted by their storage, once, so a view of a flat buffer counts the buffer, and a
master partition that is the parameter partition itself (ZeRO-3 in fp32) is not counted twice.

Usage: accelerate launch ... tests/estimate_probe.py RECIPE.yaml OUT_DIR
"""

import json
import os
import sys
from pathlib import Path

import torch

from toolkit import backends
from toolkit.config import load_recipe
from toolkit.model.load import DTYPES, apply_lora, build_model
from toolkit.training.loss import token_loss_sum, use_token_loss


class Ledger:
    """Bytes of distinct storages, each counted once across every category."""

    def __init__(self):
        self.seen: set[int] = set()

    def bytes_of(self, tensors) -> int:
        total = 0
        for t in tensors:
            if t is None or not isinstance(t, torch.Tensor):
                continue
            if hasattr(t, "to_local"):  # DTensor: this rank's shard
                t = t.to_local()
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in self.seen:
                continue
            self.seen.add(storage.data_ptr())
            total += storage.nbytes()
        return total


def flat(x):
    """Every tensor inside nested lists, tuples and dicts."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from flat(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from flat(v)


def main(recipe_path: str, out_dir: str) -> None:
    from accelerate.utils import set_seed

    recipe = load_recipe(recipe_path)
    backend = backends.for_launch()
    accelerator = backend.make_accelerator(recipe)
    set_seed(recipe.seed)
    model = build_model(recipe.model, DTYPES[recipe.model.dtype])
    if recipe.lora.enabled:
        model = apply_lora(model, recipe.lora)
    use_token_loss(model, recipe.train.loss, recipe.train.loss_chunk_tokens, backend)
    optimizer = backend.make_optimizer(backend.param_groups(model, recipe.train.weight_decay), recipe)
    backend.finalize_config(model, recipe, total_steps=1)
    model, optimizer = accelerator.prepare(model, optimizer)
    backend.check_prepared(model)

    t = recipe.train
    ids = torch.randint(3, 200, (t.micro_batch_size, recipe.data.max_seq_len),
                        generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids.to(accelerator.device), "labels": ids.to(accelerator.device)}
    engine = model if hasattr(model, "zero_optimization_stage") else None  # DeepSpeed
    ledger = Ledger()
    module = engine.module if engine else model
    params = list({id(p): p for p in module.parameters()}.values())
    held = {"params": ledger.bytes_of(getattr(p, "ds_tensor", p) for p in params)}

    loss = token_loss_sum(model, batch)
    if engine:  # the engine's own backward: accelerate's would also step (and clear the gradients)
        engine.backward(loss)
        zero = engine.optimizer
        buffers = [getattr(zero, "grads_in_partition", None), getattr(zero, "averaged_gradients", None),
                   getattr(zero, "grad_partitions_flat_buffer", None)]
        held["gradients"] = ledger.bytes_of([p.grad for p in params] + list(flat(buffers)))
        engine.step()
        masters = getattr(zero, "single_partition_of_fp32_groups", None) or zero.fp32_partitioned_groups_flat
        held["optimizer"] = ledger.bytes_of(list(masters) + list(flat(list(zero.optimizer.state.values()))))
    else:
        accelerator.backward(loss)
        held["gradients"] = ledger.bytes_of(p.grad for p in params)
        optimizer.step()
        held["optimizer"] = ledger.bytes_of(flat(list(optimizer.optimizer.state.values())))
    held["world_size"] = accelerator.num_processes
    Path(out_dir, f"rank{os.environ['RANK']}.json").write_text(json.dumps(held))
    backend.teardown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
