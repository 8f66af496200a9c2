"""`python tests/zero3_head_gathers.py PORT`: how often DeepSpeed ZeRO-3 (one process, gloo, every
tensor partitioned) all-gathers the output layer's weight per micro-batch when the chunked loss calls
it once per chunk (8 chunks) and again in each chunk's recompute in backward. Prints one JSON line
per step. It counts the coordinator's gathers that include that weight (a wrapper that calls
DeepSpeed's own method; nothing else changes)."""

import json
import os
import sys

import torch


def main(port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as Coordinator
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.loss import use_token_loss

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    use_token_loss(model, "chunked", 8)
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
    ids = torch.randint(1, 300, (2, 40))
    labels = ids.clone()
    labels[:, :8] = -100  # 64 targets: 8 chunks of 8
    for step in range(1, 4):
        gathers.clear()
        loss = engine(input_ids=ids, attention_mask=torch.ones_like(ids), token_loss_labels=labels)
        forward = len(gathers)
        engine.backward(loss)
        backward = len(gathers) - forward
        engine.step()
        print(json.dumps({"step": step, "chunks": 8, "forward_gathers": forward, "backward_gathers": backward}))


if __name__ == "__main__":
    main(sys.argv[1])
