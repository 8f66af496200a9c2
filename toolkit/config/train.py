"""The train and checkpoint sections' schema: `train` (TrainConfig) and `checkpoint` (CheckpointConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional


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
    learning_rate: float = 2e-4
    """AdamW's peak learning rate, after linear warmup, before cosine decay."""
    weight_decay: float = 0.0
    """AdamW weight decay, on matrices only (never norms or biases)."""
    adam_beta1: float = 0.9
    """AdamW's first-moment decay."""
    adam_beta2: float = 0.999
    """AdamW's second-moment decay."""
    adam_epsilon: float = 1e-8
    """AdamW's epsilon."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to learning_rate; then cosine decay to the end."""
    min_lr_ratio: float = 0.0
    """Cosine decay ends at learning_rate * min_lr_ratio."""
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
