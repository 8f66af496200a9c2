"""The train and checkpoint sections' schema: `train` (TrainConfig) and `checkpoint` (CheckpointConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union


@dataclass
class TrainConfig:
    micro_batch_size: int = 4
    """Examples per device per forward pass."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step; the global batch is micro_batch_size x this x processes."""
    max_steps: Optional[int] = None
    """Optimizer steps; when unset, `epochs` passes over the data decide."""
    epochs: int = 1
    """Passes over the training data when max_steps is unset."""
    optim: Literal["adamw_torch", "adamw_torch_fused", "sgd", "adafactor", "muon", "adamw_8bit", "paged_adamw_8bit",
                   "paged_adamw_32bit", "lion_8bit", "lion_32bit"] = "adamw_torch"
    """The optimizer, by transformers' `optim` names and with the arguments its Trainer gives each:
    `adamw_torch` (fused on CUDA), `adamw_torch_fused` (fused wherever torch has the kernel, the CPU
    included), `sgd`, `adafactor` (transformers', factored second moment, fixed lr), `muon` (torch's Muon
    on the hidden 2-D matrices, AdamW on embeddings, output layer, norms and biases, as Moonlight), and
    bitsandbytes' `adamw_8bit`, `paged_adamw_8bit`, `paged_adamw_32bit`, `lion_8bit`, `lion_32bit`
    (8-bit states: about 2 bytes a parameter for AdamW instead of 8; embeddings keep 32-bit states, as
    transformers does). Every one trains on one process and DDP; under FSDP and DeepSpeed ZeRO only
    those whose state is elementwise (`adamw_torch`, `adamw_torch_fused`, `sgd`): the others need each
    parameter whole and are refused there before the model loads. A DeepSpeed JSON's own `optimizer`
    block is used as before; beside it only the default (or an AdamW of the same type) is accepted."""
    optim_args: dict[str, Union[bool, int, float, str]] = field(default_factory=dict)
    """Extra keyword arguments of the optimizer's constructor (e.g. `{momentum: 0.9}` for sgd,
    `{momentum: 0.95, ns_steps: 5}` for muon), checked against it when the recipe loads."""
    learning_rate: float = 2e-4
    """The peak learning rate (after warmup, before decay)."""
    embedding_learning_rate: Optional[float] = None
    """The peak learning rate of the input and output embeddings' trained weights (full fine-tuning, or
    new tokens' rows), where it should differ from learning_rate; the same schedule."""
    weight_decay: float = 0.0
    """Weight decay, on matrices only (never norms or biases)."""
    adam_beta1: float = 0.9
    """AdamW's (and Lion's) first-moment decay."""
    adam_beta2: float = 0.999
    """AdamW's second-moment decay (Lion's second beta)."""
    adam_epsilon: float = 1e-8
    """AdamW's epsilon."""
    lr_scheduler_type: Literal["warmup_cosine", "linear", "cosine", "cosine_with_restarts", "cosine_with_min_lr",
                               "constant", "constant_with_warmup", "polynomial", "inverse_sqrt",
                               "warmup_stable_decay"] = "warmup_cosine"
    """The learning-rate schedule. `warmup_cosine` (the default): linear warmup whose first step already
    trains at learning_rate / warmup_steps, then cosine decay to learning_rate x min_lr_ratio. The
    others are transformers' schedules by their `lr_scheduler_type` names, built by
    `transformers.get_scheduler` itself: the learning rate of every step is a Trainer's or TRL's for the
    same settings (their warmups start at 0)."""
    lr_scheduler_kwargs: dict[str, Union[bool, int, float, str]] = field(default_factory=dict)
    """Extra arguments of a transformers schedule (e.g. `{min_lr_rate: 0.1}` for cosine_with_min_lr,
    `{power: 2.0, lr_end: 1e-7}` for polynomial, `{num_decay_steps: 100}` for warmup_stable_decay),
    checked against its signature when the recipe loads."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to learning_rate. Longer than the run: cut to the run,
    with a note."""
    warmup_ratio: float = 0.0
    """Warmup as a share of the run's optimizer steps, ceil(ratio x steps) as transformers counts it; used
    when warmup_steps is 0."""
    min_lr_ratio: float = 0.0
    """warmup_cosine (and cosine_with_min_lr without min_lr in its kwargs): the decay ends at
    learning_rate x this."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute precision: `fp32`, `bf16` or `fp16` (fp16 only where a backend scales the loss: CUDA).
    Sets accelerate's autocast and DeepSpeed's bf16/fp16 sections alike."""
    initial_loss_scale: float = 65536.0
    """fp16 only: the dynamic loss scale's starting value, a power of two (accelerate's GradScaler
    init_scale; DeepSpeed's fp16.initial_scale_power is filled from it). A step whose gradients
    overflow is skipped and the scale halved."""
    compile: bool = False
    """torch.compile each decoder layer (dynamic shapes: packed and padding-free batches change
    length every step without recompiling). The first steps are slower while it compiles; the
    state dict and checkpoints are unchanged. Not with DeepSpeed ZeRO-3."""
    loss: Literal["chunked", "full"] = "chunked"
    """How the loss is computed (the same value either way). `chunked`: the output layer runs on
    loss_chunk_tokens target positions at a time and their logits are recomputed in backward, so
    the micro-batch's full-vocabulary logits are never held at once; `full`: all positions' logits
    at once, as the model's own forward gives them."""
    loss_type: Literal["nll", "dft"] = "nll"
    """Supervised fine-tuning's loss (TRL 1.16's SFTConfig.loss_type): `nll`, each target token's
    cross-entropy; `dft` (Dynamic Fine-Tuning), each token's cross-entropy times its probability under
    the model, detached (p x -log p), on either train.loss; the eval loss is the same loss, as TRL's.
    Not with preference.method or rl.method, whose losses are their own."""
    loss_chunk_tokens: int = 1024
    """train.loss=chunked: target positions per chunk (one chunk's logits are this x vocabulary floats)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping (the norm is still logged)."""
    eval_every_steps: int = 0
    """0: evaluate only before training and at the end."""
    eval_batch_size: Optional[int] = None
    """Examples per device per eval forward (default: micro_batch_size; at most one rank's share)."""
    sample_prompts: list[str] = field(default_factory=list)
    """Prompts answered (greedily) at every evaluation, rendered as the data format renders a
    prompt; the answers are printed and kept in metrics.jsonl (`samples`)."""
    sample_max_new_tokens: int = 32
    """Longest answer to a sample prompt, in tokens."""
    log_every_steps: int = 10
    """Print a step line every N optimizer steps (metrics.jsonl gets every step)."""
    report_to: list[Literal["tensorboard", "wandb", "mlflow", "trackio"]] = field(default_factory=list)
    """Trackers besides metrics.jsonl (always written), through accelerate, each getting every metrics row
    and the recipe as hyperparameters: `tensorboard` (event files in output_dir/tensorboard/; `pip install
    tensorboard`, which `make setup` installs), `wandb` (`pip install wandb`; a login, or WANDB_MODE=offline
    for a run folder under output_dir/wandb/), `mlflow` (`pip install mlflow-skinny`; MLFLOW_TRACKING_URI,
    else a file store in output_dir/mlruns/), `trackio` (`pip install trackio`; its local store, TRACKIO_DIR,
    or TRACKIO_SPACE_ID). A tracker that is not installed is refused when the recipe loads, one that does
    not start (no login, a server out of reach) before step 1, each in one line."""
    project: Optional[str] = None
    """The trackers' project (W&B and trackio project, MLflow experiment, TensorBoard folder). Unset: the
    team's WANDB_PROJECT when reporting to W&B, else the run folder's name. MLFLOW_EXPERIMENT_NAME, where
    set, names MLflow's experiment whatever this says; WANDB_ENTITY the W&B team."""
    run_name: Optional[str] = None
    """The run's name in the trackers (TRL's run_name; W&B's and trackio's run name, MLflow's run_name).
    Unset: the run folder's name."""
    peak_tflops: Optional[float] = None
    """The device's dense peak TFLOP/s for MFU, when the GPU is not one the toolkit knows (H100, H200,
    A100, L40S, L4, B200); on a CPU host there is no MFU unless this is set."""
    profile_steps: Optional[list[int]] = None
    """[first, last]: write a torch profiler trace of these optimizer steps (output_dir/profile/)."""
    watchdog: bool = True
    """Every rank writes its Python stacks and the main process names the rank(s) not where the others
    are when a step, eval or save runs far longer than recent ones (20x their median, at least 120 s;
    600 s for the first of each kind)."""
    watchdog_seconds: Optional[float] = None
    """A fixed watchdog limit in seconds instead of the one derived from recent steps."""
    max_nonfinite_steps: int = 3
    """Stop after this many optimizer steps in a row with a non-finite loss or gradient (each one
    is skipped, never applied to the weights). Under fp16 a gradient overflow that leaves the loss
    scale at 1 or more is loss scaling at work and does not count."""


@dataclass
class CheckpointConfig:
    every_steps: int = 0
    """Save the full training state every N optimizer steps and at the end (0: no checkpoints,
    except one on preemption)."""
    keep_last: int = 2
    """Keep the newest N complete checkpoints."""
    portable: bool = True
    """Also write the training state any backend and process count can resume from (`portable/`:
    fp32 trainable weights and AdamW moments by name); off saves that space and time, and a resume
    must then use the launch that wrote the checkpoint."""
