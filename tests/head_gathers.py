"""`python tests/head_gathers.py zero3|fsdp PORT`: how often the output layer's weight is gathered per
micro-batch when the chunked loss calls it once per chunk (8 or 6 chunks of targets; ZeRO-3: the
run's bound, 10, every time) and again in each chunk's recompute in backward, one process on gloo:
- zero3: DeepSpeed ZeRO-3, every tensor partitioned; the coordinator's all-gathers that include that
  weight are counted;
- fsdp: FSDP2 as accelerate's transformer-based wrap lays it out (each decoder layer, then the
  root, which holds the output layer); the root group's unshards are counted.
Each count is a wrapper that calls the library's own method; nothing else changes. Prints one JSON
line per step: {"step", "forward_gathers", "backward_gathers"}."""

import json
import os
import sys

import torch


def tiny_model(backend):
    """The chunked loss as a run sets it up: the backend's call count, bounded by the run's largest
    batch (2 rows of 40 positions: at most 10 chunks of 8)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.training.loss import use_token_loss

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    use_token_loss(model, "chunked", 8, backend, most_positions=2 * 40)
    return model


def batch(step: int):
    """64 targets (8 chunks of 8) at odd steps, 48 (6 chunks) at even ones: as in training, where the
    number of chunks follows each micro-batch's targets."""
    ids = torch.randint(1, 300, (2, 40), generator=torch.Generator().manual_seed(step))
    labels = ids.clone()
    labels[:, :8 if step % 2 else 16] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_loss_labels": labels}


def fsdp() -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from toolkit.backends.fsdp import FSDP

    dist.init_process_group("gloo")
    model = tiny_model(FSDP("fsdp"))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    root = model._get_fsdp_state()._fsdp_param_group
    gathers = []
    original = FSDPParamGroup.unshard

    def counting(self, *args, **kwargs):
        if self is root:
            gathers.append(1)
        return original(self, *args, **kwargs)

    FSDPParamGroup.unshard = counting
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(1, 6):
        gathers.clear()
        loss = model(**batch(step))
        forward = len(gathers)
        loss.backward()
        print(json.dumps({"step": step, "forward_gathers": forward, "backward_gathers": len(gathers) - forward}))
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()


def zero3() -> None:
    import deepspeed
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as Coordinator

    from toolkit.backends.deepspeed import DeepSpeed

    deepspeed.init_distributed(dist_backend="gloo")
    model = tiny_model(DeepSpeed("deepspeed"))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    head = engine.module.lm_head.weight
    gathers = []
    original = Coordinator._PartitionedParameterCoordinator__all_gather_params

    def counting(self, params, *args, **kwargs):
        gathers.extend(1 for p in params if p is head)
        return original(self, params, *args, **kwargs)

    Coordinator._PartitionedParameterCoordinator__all_gather_params = counting
    for step in range(1, 6):
        gathers.clear()
        loss = engine(**batch(step))
        forward = len(gathers)
        engine.backward(loss)
        backward = len(gathers) - forward
        engine.step()
        print(json.dumps({"step": step, "forward_gathers": forward, "backward_gathers": backward}))


if __name__ == "__main__":
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    {"zero3": zero3, "fsdp": fsdp}[sys.argv[1]]()
