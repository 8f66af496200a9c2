"""The memory and communication model behind `toolkit estimate` and the run's `run: estimate` line:
which strategy fits a model on given GPUs, counted before anything is launched.

Nothing is loaded: the model is built on the meta device from its config.json (a local folder, a
bare config.json, a Hub id's cached config or a preset) to count parameters; everything else is
arithmetic. Bytes are per GPU (one process per GPU). N = GPUs per node x nodes; T = trainable and
F = frozen parameters; e = bytes of the compute dtype (2 for bf16/fp16, 4 for fp32).

**Model states.** The ZeRO paper (Rajbhandari et al. 2020, sec. 3) counts mixed-precision AdamW
as 2 (16-bit params) + 2 (16-bit grads) + 12 (fp32 master params, momentum, variance) = 16 bytes
per parameter; ZeRO-1 divides the 12 by N, ZeRO-2 also the 2 of the gradients, ZeRO-3 also the 2
of the parameters. That is what DeepSpeed holds here under bf16/fp16 full fine-tuning: the engine
casts the module to 16 bits and its ZeRO optimizer keeps fp32 master partitions. Elsewhere this
toolkit holds something else, and the estimate follows the toolkit:

- DDP and FSDP keep the model as `model.build_model` made it (fp32; autocast computes in bf16/fp16):
  4 (params) + 4 (grads) + 8 (AdamW moments) = 16 bytes per trainable parameter, with no separate
  master copy, in every precision. FSDP divides all three by N.
- DeepSpeed in fp32: params and grads are 4 bytes, and every stage still clones an fp32 master
  partition (4T/N): ZeRO-1/2 always do; ZeRO-3 (DeepSpeed 0.19.8) means to reuse its fp32 parameter
  partition but compares the partition's torch.device with a device name string, which never
  matches, so it clones too (measured by tests/test_estimate.py).
- LoRA: frozen base weights are stored in `model.dtype` (DeepSpeed casts them to the compute
  dtype), adapters in fp32; gradients and optimizer states exist for the adapters only. ZeRO-1/2 do
  not partition frozen weights; ZeRO-3 and FSDP do.
- QLoRA (model.load_in_4bit): the linear layers but the output layer hold NF4 weights, 0.5 bytes each
  (packed two to a byte), and a quantization state that is no parameter: with double quantization an
  8-bit absmax per block of 64 weights and an fp32 one per 256 blocks (1/64 + 4/16384 bytes a weight),
  plus per layer bitsandbytes' copies of the two code books and an offset (1092 bytes). ZeRO-3 and
  FSDP divide the packed weights by N like the rest (FSDP2 shards them as `compute dtype` elements);
  the quantization state is whole on every rank. peft's `prepare_model_for_kbit_training` casts the
  other frozen weights (embeddings, norms, the output layer) to fp32 whatever `model.dtype` says, so
  DDP and FSDP hold them in 4 bytes; about 0.52 bytes a quantized weight in all (the base's own
  bytes, checked by tests/test_estimate.py against a model loaded in 4-bit).
- Offload: optimizer states, fp32 master weights and their gradients (and the parameters, where
  they are offloaded too) live in host RAM or on NVMe instead of the GPU; the host RAM column is per
  node (N / nodes processes). NVMe still needs host RAM for DeepSpeed's swap buffers: counted as
  one `sub_group_size` (1e9, as shipped) of fp32 master, moments and gradient, or the whole
  partition where that is smaller.

**Buffers**, working memory beside the model states (approximate): DDP's gradient buckets, a second
copy of the gradients (accelerate leaves `gradient_as_bucket_view` off); under bf16/fp16 DDP,
autocast's 16-bit copies of the fp32 matmul weights, which backward keeps (not of 4-bit ones); the
largest 4-bit weight dequantized in the compute dtype (bitsandbytes dequantizes one layer's weight
at a time, in forward and again in backward); the parameters gathered
to compute: two decoder layers in flight for ZeRO-3 and FSDP full-shard, the whole model from
forward to backward for FSDP shard-grad-op; DeepSpeed's fp32 copy of its gradient partition during
a bf16/fp16 optimizer step. DeepSpeed's fixed-size buckets and the CUDA context are not counted;
a strategy fits when its total is at most 90% of the GPU's memory.

**Activations** per decoder layer and token, from the tensors autograd saves in transformers'
Llama-style layer (RMSNorm, rotary, GQA, SwiGLU; counted with `torch.autograd.graph.saved_tensors_hooks`),
with h hidden size, kv = key/value heads x head dim, i MLP size, a heads, s sequence length:
the 2 RMSNorms keep their input and normalized output, q/k/v and the MLP keep their inputs, SwiGLU
keeps gate, SiLU(gate), up and their product, SDPA/flash keep q, k, v, the output and a
log-sum-exp (no s x s matrix):
    fp32:                       4 * (8h + 2kv + 4i + a)
    bf16/fp16 autocast over fp32 weights (DDP, QLoRA's fp32 rest of the base): the residual stream and
    norms stay fp32 and each of q/k/v and gate/up casts its own input: 4 * (4h + a) + 2 * (7h + 2kv + 4i)
    bf16/fp16 weights (DeepSpeed, FSDP's 16-bit gathers, a 16-bit LoRA base): HF's RMSNorm still
    upcasts its input: 4 * (2h + a) + 2 * (6h + 2kv + 4i)
LoRA (adapters in fp32, the base frozen; r the rank, I the adapted layers' input widths summed per
layer, n their count per layer), added per token and layer, counted with the same hooks on three
shapes for `all-linear` (two of them in tests/test_estimate.py; QLoRA's 4-bit layers not yet
measured, left out):
    fp32: 4 * n * r - 8h;   bf16/fp16 autocast over fp32 weights: 2 * n * r - 6h
    16-bit base: c * (I + n * r) - (8h + 2i), c = 2 under autocast, 4 without it (DeepSpeed: each
    adapter keeps its own fp32 copy of its input). This was the gap found on the H200 (2026-11-27):
    LoRA + ZeRO-3 in bf16 peaked at 1.16 GiB where the estimate without this term said 0.65.
Eager attention also keeps the s x s probabilities (4 bytes, plus a 16-bit copy in bf16/fp16)
and repeated k/v: the SDPA part e * (2h + 2kv) + 4a becomes e * 4h + a * s * (4 or 6). This is
Korthikanti et al.'s ("Reducing Activation Recomputation", 2022) 34sbh + 5as^2b per layer, redone
for this layer. With gradient checkpointing each layer keeps only its input (h in the stream
dtype) and one layer is recomputed at a time. model.tiled_mlp keeps the MLP's input only
and its 4i intermediates for one tile (hidden_size positions of each row) at a time;
model.activation_offload moves the checkpointed inputs to host RAM (counted there, per node),
two layers' worth staying on the GPU (the one in backward, the next copied back). Sequence
parallelism (`parallelism_config_sp_size` S, DeepSpeed's Ulysses) splits every row into S equal parts,
one per rank of a group of S (rows padded to a multiple of S); attention gathers the whole sequence
for a/S of the heads (key/value heads repeated up to S where a model has fewer), so every term here,
the logits, the MLP tile (min(h, s/S) positions) and the offloaded inputs are counted for s/S
positions; ZeRO still partitions the model states over all N processes, so those terms do not
change, and DDP and FSDP, which cannot split a sequence, are not offered. Logits are a separate term, `logits`: the fp32
log-probabilities, their gradient and the logits' gradient are alive together, 3 * t * vocab * 4
bytes, where t is b * s with train.loss=full (at the start of backward) and at most
train.loss_chunk_tokens with the chunked loss (one chunk recomputed at a time); over several
chunks a trainable output layer's weight gradient is summed across them, two such tensors alive
(2 * vocab * h * gradient bytes; found measuring, not in the first version of this model).

**Online RL** (rl.method): a micro-batch trains on micro_batch_size x rl.num_generations prompt +
completion sequences of up to data.max_seq_len + rl.max_new_tokens tokens, so the activations and
logits above are counted for those. Before that, each rank samples the completions of all its
prompts of the step at once (micro_batch_size x gradient_accumulation_steps x num_generations
sequences), token by token with a KV cache: 2 (keys, values) x layers x key/value heads x head dim x
sequences x (prompt + new tokens) x e bytes, `kv_cache`. ZeRO-3 and FSDP full-shard gather the whole
weights (e bytes each, TRL's ds3_gather_for_generation) for the sampling beside it, `sampling`, unless
rl.gather_for_sampling is false (a layer at a time, as training's forward). The cache and the gathered
weights are freed before the step's forwards, so the total holds the larger of them and activations +
logits. The reference's log-probabilities (rl.beta > 0) come from the same model with its LoRA adapter
disabled (no second model), or with full fine-tuning from a frozen copy of the base, held and counted as
distillation's teacher below (`teacher`, shown as the frozen column) but in model.dtype, the policy's, as
TRL's ref_model: one more forward without gradient per generated batch, as the old policy's
log-probabilities where rl.num_iterations > 1 (`rl_forwards`); the log-probabilities they keep (4 bytes
a token) are not counted. A reward model of rl.rewards is loaded whole on every GPU in
its folder's dtype, by no strategy sharded: `reward_models`, its weight files' size (its scoring
forward, without gradient, one batch of the step's completions, is not counted). Distillation's
teacher (rl.method=distill) is held in train.precision's dtype (e), sharded over the GPUs by ZeRO-3
and FSDP, whole under DDP and ZeRO-1/2: `teacher`, its weights, plus its fp32 log-probabilities at
a micro-batch's completion tokens (micro-batch x new tokens x vocab x 4; its output layer runs on
those only), plus two of its layers gathered where sharded; its forward counts in the forward passes
said below.

**Communication** per optimizer step, bytes each process sends over ring collectives (an
all-reduce sends 2(N-1)/N of its buffer, an all-gather or reduce-scatter (N-1)/N), once per
optimizer step without gradient accumulation: DDP all-reduces the fp32 gradients (~2 x 4T);
ZeRO-1/2 reduce-scatter the gradients and all-gather the updated parameters (~2 x eT); ZeRO-3 and
FSDP full-shard all-gather the parameters in forward and again in backward and reduce-scatter the
gradients (~3 x e(T+F), a 4-bit weight moving as its packed half byte); FSDP shard-grad-op gathers
once (~2x). Offload adds host<->GPU copies of the same size, not counted. With accumulation the
parameter gathers (ZeRO-3, FSDP) and ZeRO-2's reduce-scatter repeat for every micro-batch. Sequence
parallelism adds, per micro-batch, layer and pass (forward, backward, and the recomputed forward under
checkpointing), all-to-alls within the group of S of q, k, v and the attention output (or their
gradients): (2 query + 2kv) x e per local position, each sending (S-1)/S.

**Approximate**: peak memory is taken as the sum of all terms, an upper bound (activations peak
when backward starts, gradients when it ends); the activation formulas are Llama-style layers
(other architectures, MoE, sliding windows and bias terms are not modelled); allocator
fragmentation is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GIB = 1024**3
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
USABLE_FRACTION = 0.9  # of the GPU's memory; the rest: CUDA context, fragmentation, workspaces
NVME_SUB_GROUP = 1_000_000_000  # deepspeed_configs/zero3_offload_nvme.json's sub_group_size
# QLoRA's NF4 with double quantization (bitsandbytes, blocksize 64): packed values, then per weight an
# 8-bit absmax per 64 and an fp32 second-level absmax per 256 blocks, then per layer the 256-entry
# dynamic code book (fp32), the 16 NF4 values (fp32) and the absmax offset that each layer copies.
NF4_BYTES = 0.5
NF4_STATE_BYTES = 1 / 64 + 4 / (64 * 256)
NF4_LAYER_BYTES = 256 * 4 + 16 * 4 + 4


@dataclass
class ModelCounts:
    """What the arithmetic needs from a model's config, counted on the meta device."""
    name: str
    params: int  # distinct parameters, LoRA adapters included
    trainable: int
    matmul: int  # weights of the base's linear layers (autocast copies these)
    layer: int  # parameters of one decoder layer (what ZeRO-3 / FSDP gather at a time)
    layers: int
    hidden: int
    heads: int
    kv: int  # key/value heads x head dim
    intermediate: int
    vocab: int
    head: int = 0  # trainable weights of the output layer (full fine-tuning: vocab x hidden)
    query: int = 0  # attention heads x head dim (the width attention's matrix products run over)
    kv_heads: int = 0  # key/value heads (0: as many as attention heads)
    quantized: int = 0  # weights of the linear layers a 4-bit load quantizes (all but the output layer)
    quantized_layers: int = 0  # those layers
    widest: int = 0  # the largest of those weights (dequantized one at a time)
    lora_r: int = 0  # LoRA's rank (0: full fine-tuning)
    adapted: int = 0  # linear layers with an adapter, over all decoder layers
    adapted_inputs: int = 0  # the sum of their input widths


@dataclass
class Setup:
    model: ModelCounts
    gpus_per_node: int = 1
    nodes: int = 1
    gpu_memory_gib: float | None = 80.0  # None: unknown (a CPU run)
    precision: str = "bf16"
    base_dtype: str = "fp32"  # storage of frozen LoRA base weights (model.dtype)
    four_bit: bool = False  # model.load_in_4bit (QLoRA): the base's linear layers but the output layer in NF4
    micro_batch: int = 1
    seq_len: int = 2048
    gradient_checkpointing: bool = False
    optimizer_bytes: float = 8.0  # optimizer state per trained parameter (train.optim; AdamW's two fp32 moments: 8)
    tiled_mlp: bool = False  # model.tiled_mlp: the MLP's intermediates for one tile of hidden positions
    activation_offload: bool = False  # model.activation_offload: the checkpointed inputs in host RAM
    attention: str = "sdpa"
    loss: str = "chunked"  # train.loss
    loss_chunk_tokens: int = 1024
    pairs: bool = False  # preference pairs: micro_batch counts their sequences, two per pair
    sequence_parallel: int = 1  # parallelism_config_sp_size: the ranks each row is split across (Ulysses)
    # Online RL (rl.method): micro_batch counts prompt + completion sequences (micro_batch_size x
    # num_generations) and seq_len their prompt and new tokens (data.max_seq_len + rl.max_new_tokens).
    generations: int = 0  # rl.num_generations (0: no online RL)
    new_tokens: int = 0  # rl.max_new_tokens
    accumulation: int = 1  # train.gradient_accumulation_steps: online RL samples all of a step's prompts at once
    reference_forward: bool = False  # rl.beta > 0: the reference's log-probabilities (the adapter disabled)
    iterations: int = 1  # rl.num_iterations: optimizer steps per generated batch (> 1: the old log-probabilities)
    reward_model_bytes: float = 0.0  # rl.rewards models: whole on every GPU, their weights as their folders store them
    reward_models_uncounted: tuple = ()  # rl.rewards models not in a local folder: their size is not known here
    teacher: ModelCounts | None = None  # rl.teacher (rl.method=distill): a frozen model beside this one
    teacher_dtype: str = ""  # its weights' dtype; "": train.precision's (the RL reference: model.dtype, the policy's)
    gathered_sampling: bool = True  # rl.gather_for_sampling: ZeRO-3 / FSDP full-shard sample from whole weights
    rloo: bool = False  # rl.method rloo: the old log-probabilities are taken (its KL in the reward is the sampler's)
    server_sampling: bool = False  # rl.sampler vllm: a server samples, its cache and weights in its own memory
    server_correction: bool = True  # rl.vllm_importance_sampling_correction: the old log-probabilities' forward
    server_gpu_share: float = 0.0  # a server the run starts: --gpu-memory-utilization of the (first) GPU it shares

    def batch_text(self) -> str:
        pairs = f" sequences ({self.micro_batch // 2} preference pairs)" if self.pairs else ""
        if self.generations:
            pairs = (f" sequences ({self.micro_batch // self.generations} prompts x {self.generations} "
                     f"completions)")
        split = f", split across {self.sequence_parallel} ranks" if self.sequence_parallel > 1 else ""
        new = f" (prompt + up to {self.new_tokens} new)" if self.generations else ""
        return f"micro-batch {self.micro_batch}{pairs} x {self.seq_len} tokens{new}{split}"

    @property
    def sampled(self) -> int:
        """Online RL: the completions one rank samples at once (all of its prompts of a step x num_generations)."""
        return self.micro_batch * self.accumulation if self.generations else 0

    @property
    def local_seq_len(self) -> int:
        """Positions of a row on one rank: its part under sequence parallelism (rows padded to a multiple)."""
        return -(-self.seq_len // self.sequence_parallel)

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class Strategy:
    name: str
    launch_config: str  # the shipped accelerate config that runs it
    deepspeed: bool
    shards: str  # "" (replicated), "optimizer", "gradients" (and optimizer), "parameters" (all three)
    offload: str = ""  # "", "optimizer", "parameters" (and optimizer)
    device: str = "cpu"  # where offloaded states go: cpu or nvme
    gathers_all: bool = False  # FSDP shard-grad-op: parameters stay gathered from forward to backward


STRATEGIES = [
    Strategy("DDP", "ddp.yaml", False, ""),
    Strategy("ZeRO-1", "zero1.yaml", True, "optimizer"),
    Strategy("ZeRO-2", "zero2.yaml", True, "gradients"),
    Strategy("FSDP shard-grad-op", "fsdp_shard_grad_op.yaml", False, "gradients", gathers_all=True),
    Strategy("ZeRO-3", "zero3.yaml", True, "parameters"),
    Strategy("FSDP full-shard", "fsdp.yaml", False, "parameters"),
    Strategy("ZeRO-2 + CPU optimizer", "zero2_offload.yaml", True, "gradients", "optimizer"),
    Strategy("ZeRO-3 + CPU optimizer", "zero3_offload.yaml without offload_param", True, "parameters", "optimizer"),
    Strategy("FSDP full-shard + CPU offload", "fsdp_offload.yaml", False, "parameters", "parameters"),
    Strategy("ZeRO-3 + CPU params+optimizer", "zero3_offload.yaml", True, "parameters", "parameters"),
    Strategy("ZeRO-3 + NVMe params+optimizer", "zero3_nvme.yaml", True, "parameters", "parameters", "nvme"),
]
BY_NAME = {s.name: s for s in STRATEGIES}


def runnable(strategy: Strategy, setup: Setup) -> bool:
    """Sequence parallelism runs on DeepSpeed only (Ulysses); DDP and FSDP cannot split a sequence."""
    return strategy.deepspeed or setup.sequence_parallel == 1


@dataclass
class Row:
    strategy: Strategy
    gpu: dict[str, float]  # params, gradients, optimizer, buffers, activations, logits, total
    host_per_node: float
    nvme_per_node: float
    comm_per_step: float
    fits: bool | None  # None: no GPU memory known

    def as_json(self) -> dict:
        return {"strategy": self.strategy.name, "launch_config": self.strategy.launch_config,
                "gpu_bytes": {k: round(v) for k, v in self.gpu.items()}, "fits": self.fits,
                "host_bytes_per_node": round(self.host_per_node), "nvme_bytes_per_node": round(self.nvme_per_node),
                "comm_bytes_per_step": round(self.comm_per_step)}


# ----------------------------------------------------------------------------- the arithmetic


def lora_activation_bytes(m: ModelCounts, regime: str, autocast: bool) -> float:
    """What LoRA changes in a decoder layer's saved tensors per token (see the module docstring): the
    adapters (fp32 in every regime, toolkit/model/load.py) keep their input and their rank-r middle,
    in fp32 over a 16-bit base without autocast (DeepSpeed: each adapter casts its own copy), in 16
    bits under autocast; the frozen base no longer keeps what only its weight gradients needed."""
    if not m.lora_r or not m.layers:
        return 0.0
    h, i = m.hidden, m.intermediate
    inputs, middles = m.adapted_inputs / m.layers, m.adapted * m.lora_r / m.layers
    if regime == "half":
        return (2 if autocast else 4) * (inputs + middles) - (8 * h + 2 * i)
    if regime == "autocast":
        return 2 * middles - 6 * h
    return 4 * middles - 8 * h


def activation_bytes(m: ModelCounts, setup: Setup, regime: str, autocast: bool = True) -> float:
    """Bytes autograd keeps for backward in the decoder layers (see the module docstring).
    regime: "fp32", "autocast" (16-bit compute over fp32 weights) or "half" (16-bit weights);
    autocast: whether 16-bit compute runs under torch.autocast (DeepSpeed's does not)."""
    h, kv, i, a, s = m.hidden, m.kv, m.intermediate, m.heads, setup.local_seq_len
    # Ulysses gives each rank a/S heads of the whole sequence: per local position as many as without
    # it, but key/value heads are repeated up to S where there are fewer
    kv = max(kv, setup.sequence_parallel * (m.query or h) // a)
    e = 4 if regime == "fp32" else 2
    stream = 2 if regime == "half" else 4  # the residual stream's dtype
    mlp = (4 if regime == "fp32" else 2) * 4 * i  # SwiGLU's gate, SiLU(gate), up and product
    if regime == "fp32":
        rest = 4 * 6 * h
    elif regime == "autocast":
        rest = 4 * 4 * h + 2 * 5 * h
    else:
        rest = 4 * 2 * h + 2 * 4 * h
    tokens = setup.micro_batch * s
    tile = setup.micro_batch * min(h, s)  # model.tiled_mlp: hidden_size positions of every row
    if setup.tiled_mlp:  # each layer keeps the MLP's input only (counted in rest); one tile's intermediates
        tile_bytes = tile * mlp
    else:
        rest, tile_bytes = rest + mlp, 0
    if setup.attention == "eager":
        attention = e * 4 * h + a * setup.seq_len * (4 + (2 if e == 2 else 0))  # a/S heads x the whole s
    else:
        attention = e * (2 * h + 2 * kv) + 4 * a
    per_token_layer = rest + attention + (0.0 if setup.four_bit else lora_activation_bytes(m, regime, autocast))
    head = 3 * h * stream  # final norm and the lm_head's input
    if setup.gradient_checkpointing:
        kept = 2 if setup.activation_offload else m.layers  # offloaded: the layer in backward and the next one
        return tokens * (min(kept, m.layers) * h * stream + per_token_layer + head) + tile_bytes
    return tokens * (m.layers * per_token_layer + head) + tile_bytes


def offloaded_activation_bytes(m: ModelCounts, setup: Setup, regime: str) -> float:
    """Host memory of model.activation_offload: every decoder layer's checkpointed input, in the
    residual stream's dtype (fp32 but under 16-bit weights)."""
    if not (setup.activation_offload and setup.gradient_checkpointing):
        return 0.0
    return setup.micro_batch * setup.local_seq_len * m.layers * m.hidden * (2 if regime == "half" else 4)


def logits_bytes(m: ModelCounts, setup: Setup, grad_bytes: int) -> float:
    """fp32 log-probabilities, their gradient and the logits' gradient, alive together: for the
    whole micro-batch at the start of backward (train.loss=full), or for one chunk (chunked).
    Over several chunks autograd sums a trainable output layer's weight gradient: the running sum
    and the new chunk's (`grad_bytes` each) are alive too. Per rank: its part of each row."""
    tokens = setup.micro_batch * setup.local_seq_len
    if setup.loss == "full" or tokens <= setup.loss_chunk_tokens:
        return 3 * tokens * m.vocab * 4
    return 3 * setup.loss_chunk_tokens * m.vocab * 4 + 2 * m.head * grad_bytes


def kv_cache_bytes(m: ModelCounts, setup: Setup) -> float:
    """Online RL's generation: keys and values of every layer for each completion a rank samples at
    once (`Setup.sampled`), over its prompt and new tokens, in the compute dtype; 0 without online RL, or with a
    vLLM server sampling (rl.sampler vllm: its cache is in its own memory)."""
    if setup.server_sampling:
        return 0.0
    return 2 * m.layers * m.kv * setup.sampled * setup.seq_len * BYTES[setup.precision]


def gathered_sampling_bytes(strategy: Strategy, setup: Setup, whole: float) -> float:
    """Online RL under a strategy that shards the parameters (ZeRO-3, FSDP full-shard) with
    rl.gather_for_sampling: the whole weights (`whole`, in the compute dtype, 4-bit ones packed) gathered on
    every GPU for the sampling, beside the KV cache; 0 otherwise (rl.gather_for_sampling false gathers a layer
    at a time, as training's forward: the buffers count it)."""
    if not setup.generations or not setup.gathered_sampling or setup.server_sampling or \
            strategy.shards != "parameters":
        return 0.0
    return whole


def rl_forwards(setup: Setup) -> float:
    """Online RL's forwards without gradient per trained token and optimizer step, besides training's
    own: sampling (about one forward over each prompt and completion token, run token by token), the
    reference's log-probabilities (rl.beta > 0) and the old policy's (rl.num_iterations > 1, and always
    under rloo), all once per generated batch of rl.num_iterations steps; 0 without online RL. With a vLLM
    server sampling there is no sampling forward here, and the old log-probabilities are taken for its
    correction (when on) whatever rl.num_iterations."""
    if not setup.generations:
        return 0.0
    sampling = 0 if setup.server_sampling else 1
    old = setup.iterations > 1 or setup.rloo or (setup.server_sampling and setup.server_correction)
    return (sampling + setup.reference_forward + old) / setup.iterations


def estimate(strategy: Strategy, setup: Setup) -> Row:
    """Per-GPU bytes, host RAM and NVMe per node, and communication of one strategy."""
    m, n = setup.model, setup.gpus
    T, F = m.trainable, m.params - m.trainable
    Q = m.quantized if setup.four_bit else 0  # NF4 weights, frozen: counted in F at their full size
    assert Q <= F, "a 4-bit base is frozen: model.load_in_4bit goes with LoRA"
    state = NF4_STATE_BYTES * Q + NF4_LAYER_BYTES * m.quantized_layers if Q else 0.0  # no parameter: never sharded
    half = setup.precision != "fp32"
    e = BYTES[setup.precision]
    layer = (m.layer - Q / m.layers) * e + NF4_BYTES * Q / m.layers  # one decoder layer gathered
    sharded = {"": 0, "optimizer": 1, "gradients": 2, "parameters": 3}[strategy.shards]
    per = {k: 1 / n if sharded >= level else 1 for k, level in (("optimizer", 1), ("gradients", 2), ("parameters", 3))}
    if strategy.deepspeed:
        params = (e * (T + F - Q) + NF4_BYTES * Q) * per["parameters"]
        grads = e * T * per["gradients"]
        optimizer = 4 * T / n + setup.optimizer_bytes * T / n  # fp32 master partition, the optimizer's states
        buffers = 4 * T / n if half else 0  # the fp32 gradient partition of the step
        if strategy.shards == "parameters":
            buffers += 2 * layer
        regime = "half" if half else "fp32"
    else:  # DDP, FSDP: the model as built, fp32 trainable weights; FSDP shards all of it
        div = n if strategy.shards else 1
        frozen = 4 if setup.four_bit else BYTES[setup.base_dtype]  # QLoRA: peft casts the rest of the base to fp32
        params = (4 * T + frozen * (F - Q) + NF4_BYTES * Q) / div
        grads = 4 * T / div
        optimizer = setup.optimizer_bytes * T / div
        if not strategy.shards:
            buffers = 4 * T if n > 1 else 0  # DDP's gradient buckets
            if setup.four_bit:  # the fp32 output layer and the adapters; 4-bit weights are dequantized instead
                fp32_weights = m.matmul - Q + T
            else:
                fp32_weights = m.matmul if setup.base_dtype == "fp32" else T
            buffers += 2 * fp32_weights if half else 0  # autocast's 16-bit weight copies
            regime = "fp32" if not half else ("half" if frozen != 4 else "autocast")
        else:
            buffers = e * (T + F - Q) + NF4_BYTES * Q if strategy.gathers_all else 2 * layer
            regime = "half" if half else "fp32"
    buffers += e * m.widest if Q else 0  # one 4-bit weight dequantized in the compute dtype
    host = nvme = 0.0
    if strategy.offload:
        if strategy.deepspeed:  # fp32 masters, moments and gradient, and the 16-bit gradient partition
            host = 16 * T / n + e * T / n
            buffers -= 4 * T / n if half else 0  # the step's fp32 gradient is on the host
        else:
            host = grads + optimizer
        if strategy.offload == "parameters":
            host, params = host + params, 0.0
        grads = optimizer = 0.0
        if strategy.device == "nvme":  # parameters and optimizer states on NVMe, swapped in by sub-group
            nvme = host - 4 * T / n - e * T / n
            host = e * T / n + 16 * min(T / n, NVME_SUB_GROUP)
    params += state  # the quantization state stays with the layers, on the GPU
    activations = activation_bytes(m, setup, regime, autocast=not strategy.deepspeed)
    logits = logits_bytes(m, setup, e if strategy.deepspeed else 4)
    kv_cache = kv_cache_bytes(m, setup)
    sampling = gathered_sampling_bytes(strategy, setup, e * (T + F - Q) + NF4_BYTES * Q)
    rewards = setup.reward_model_bytes  # not sharded by any strategy: each rank scores with a whole copy
    teacher = teacher_bytes(strategy, setup)
    gpu = {"params": params, "gradients": grads, "optimizer": optimizer, "buffers": buffers,
           "activations": activations, "logits": logits, "kv_cache": kv_cache, "reward_models": rewards,
           "teacher": teacher, "sampling": sampling}
    # Online RL samples, and frees its cache (and the weights gathered for it), before the step's forwards: the
    # larger of the two is held.
    gpu["total"] = (params + grads + optimizer + buffers + rewards + teacher
                    + max(activations + logits, kv_cache + sampling))
    fits = None if setup.gpu_memory_gib is None else \
        gpu["total"] <= (USABLE_FRACTION - setup.server_gpu_share) * setup.gpu_memory_gib * GIB
    per_node = n / setup.nodes
    host += offloaded_activation_bytes(m, setup, regime)
    return Row(strategy, gpu, host * per_node, nvme * per_node, communication(strategy, setup), fits)


def teacher_sharded(strategy: Strategy) -> bool:
    """Whether `Backend.prepare_frozen` shards a frozen model under this strategy: ZeRO-3 and every FSDP."""
    return strategy.shards == "parameters" or (not strategy.deepspeed and bool(strategy.shards))


def teacher_bytes(strategy: Strategy, setup: Setup) -> float:
    """Distillation's teacher per GPU: its weights in train.precision's dtype (sharded or whole), its fp32
    log-probabilities at a micro-batch's completion tokens (its output layer runs on those only, a chunk at a
    time), and two of its layers gathered where sharded; 0 without one."""
    t = setup.teacher
    if t is None:
        return 0.0
    e, sharded = BYTES[setup.teacher_dtype or setup.precision], teacher_sharded(strategy)
    weights = t.params * e / (setup.gpus if sharded else 1)
    logits = setup.micro_batch * setup.new_tokens * t.vocab * 4  # its fp32 log-probabilities at the targets
    return weights + logits + (2 * t.layer * e if sharded else 0)


def communication(strategy: Strategy, setup: Setup) -> float:
    """Bytes one process sends per optimizer step (ring collectives; see the module docstring)."""
    m, n = setup.model, setup.gpus
    if n == 1:
        return 0.0
    ring = (n - 1) / n
    T, P, e = m.trainable, m.params, BYTES[setup.precision]
    Q = m.quantized if setup.four_bit else 0
    weights = e * (P - Q) + NF4_BYTES * Q  # what a gather of all parameters moves (4-bit ones packed)
    if not strategy.deepspeed and strategy.shards == "":
        return 2 * ring * 4 * T  # DDP: all-reduce of the fp32 gradients
    if strategy.shards == "parameters":
        states = ring * (2 * weights + e * T)  # gather in forward, gather in backward, reduce-scatter
    elif strategy.gathers_all:
        states = ring * (weights + e * T)
    else:
        states = ring * 2 * e * T  # ZeRO-1/2: reduce-scatter gradients, all-gather updated parameters
    return states + ulysses_bytes(setup)


def ulysses_bytes(setup: Setup) -> float:
    """Bytes one process sends in sequence parallelism's all-to-alls for one micro-batch: per layer and
    pass, q, k, v and the attention output, or their gradients (k/v repeated up to S heads)."""
    m, sp = setup.model, setup.sequence_parallel
    if sp == 1:
        return 0.0
    query = m.query or m.hidden
    kv = max(m.kv, sp * query // m.heads)
    passes = 3 if setup.gradient_checkpointing else 2  # forward, backward, the recomputed forward
    positions = setup.micro_batch * setup.local_seq_len
    return (sp - 1) / sp * m.layers * passes * positions * 2 * (query + kv) * BYTES[setup.precision]


def estimate_all(setup: Setup) -> list[Row]:
    """Every strategy that can run `setup` (see `runnable`)."""
    return [estimate(s, setup) for s in STRATEGIES if runnable(s, setup)]


def recommend(setup: Setup) -> str:
    """The first step along the usual path that fits: one GPU / DDP, then bf16 and activation
    checkpointing, then sharding (ZeRO-2 / FSDP shard-grad-op), ZeRO-3 / FSDP full-shard, offload.
    At each sharding step the settings as given come first, then with bf16 and checkpointing, then (online RL)
    each of those sampling a layer at a time (rl.gather_for_sampling false).
    Under sequence parallelism only the DeepSpeed steps are taken (`runnable`)."""
    if setup.gpu_memory_gib is None:
        return "no GPU memory given"
    sp = setup.sequence_parallel
    with_sp = f" plus parallelism_config_sp_size: {sp}" if sp > 1 else ""
    changes = (["train.precision=bf16"] if setup.precision == "fp32" else []) + \
              ([] if setup.gradient_checkpointing else ["model.gradient_checkpointing=true"])
    changed = replace(setup, precision="bf16" if setup.precision == "fp32" else setup.precision,
                      gradient_checkpointing=True)
    tries = [(setup, "")] + ([(changed, f", with {' and '.join(changes)}")] if changes else [])
    if setup.generations and setup.gathered_sampling and not setup.server_sampling:  # a layer at a time, first
        tries += [(replace(s, gathered_sampling=False), (text or ", with") + (" and " if text else " ")
                   + "rl.gather_for_sampling=false") for s, text in tries]
    rows = [({r.strategy.name: r for r in estimate_all(s)}, text) for s, text in tries]
    for by_name, text in rows:
        if "DDP" in by_name and by_name["DDP"].fits:
            if setup.gpus == 1:
                return f"one GPU is enough: train without distribution (accelerate_configs/single.yaml){text}"
            return f"DDP (accelerate_configs/ddp.yaml){text}: every GPU holds the whole model; the fastest when it fits"
    found, eight_bit = _sharded(rows, with_sp, setup), _with_8bit_optimizer(setup, tries)
    if not eight_bit:
        return found
    if found.startswith("nothing fits"):
        return f"{eight_bit}; with the recipe's optimizer {found}"
    if setup.gpus == 1:  # one GPU: before offloading to the host (slow), a smaller optimizer state
        return f"{eight_bit}; or, keeping the optimizer, {found}"
    return found  # several GPUs: sharding keeps the optimizer exact


def _with_8bit_optimizer(setup: Setup, tries: list) -> str:
    """Where the optimizer's state keeps a full fine-tune off one GPU or DDP: the first of `tries` that fits there
    with bitsandbytes' 8-bit AdamW (2 bytes of state a trained parameter instead of AdamW's 8), as a line; ""."""
    if setup.optimizer_bytes <= 2 or setup.sequence_parallel > 1:  # 8-bit states: whole parameters only
        return ""
    for s, text in tries:
        ddp = {r.strategy.name: r for r in estimate_all(replace(s, optimizer_bytes=2))}.get("DDP")
        if ddp is not None and ddp.fits:
            where = ("one GPU, without distribution (accelerate_configs/single.yaml)" if setup.gpus == 1
                     else "DDP (accelerate_configs/ddp.yaml)")
            return (f"{where} with train.optim=adamw_8bit{text.replace(', with', ' and')}: bitsandbytes' 8-bit "
                    "AdamW keeps 2 bytes of state a trained parameter instead of 8 (whole parameters: not under "
                    "ZeRO or FSDP)")
    return ""


def _sharded(rows: list, with_sp: str, setup: Setup) -> str:
    """The first sharding step of `recommend` that fits."""
    for group in (["ZeRO-2", "FSDP shard-grad-op"], ["ZeRO-3", "FSDP full-shard"],
                  ["ZeRO-2 + CPU optimizer", "ZeRO-3 + CPU optimizer", "ZeRO-3 + CPU params+optimizer",
                   "ZeRO-3 + NVMe params+optimizer"]):
        for by_name, text in rows:
            fitting = [by_name[name] for name in group if name in by_name and by_name[name].fits]
            if fitting:
                best = min(fitting, key=lambda r: r.gpu["total"])
                also = [r.strategy.name for r in fitting if r is not best]
                found = f"{best.strategy.name} (accelerate_configs/{best.strategy.launch_config}{with_sp}){text}"
                if best.host_per_node:
                    found += f"; needs {best.host_per_node / GIB:.0f} GiB of host RAM per node"
                return found + (f" (also fits: {', '.join(also)})" if also else "")
    return (f"nothing fits {setup.gpus} x {setup.gpu_memory_gib:g} GiB{rows[-1][1]}: use more GPUs, LoRA, "
            "or fewer tokens per micro-batch")
