"""The recipe: the top-level keys and one section of each kind."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from .data import DataConfig
from .model import LoraConfig, ModelConfig
from .objectives import PreferenceConfig, RLConfig
from .train import CheckpointConfig, TrainConfig

# What a run learns from besides its data, each recorded by content in every checkpoint (model/base_identity.py)
# and compared on resume (storage/inputs.py): {name: what it is}. The one list of them: the names a resume
# refusal suggests for resume_accept_changed are the names that key accepts.
CHANGEABLE_INPUTS = {"model": "the base model (model.path: its weights and config)",
                     "rewards": "the reward functions' code (rl.rewards)",
                     "reward_models": "the reward models' weights and config (rl.rewards' model entries)",
                     "teacher": "the distillation teacher's weights and config (rl.teacher)",
                     "tools": "the tools' code (rl.tools)"}


@dataclass
class Recipe:
    output_dir: str = ""
    """The run folder (`~` is your home folder): metrics, checkpoints, final/. A non-empty one is
    refused unless overwrite=true; a run holds its lock (.toolkit.lock) while it writes."""
    seed: int = 42
    """Same seed and global batch: the same run, on every backend and process count."""
    overwrite: bool = False
    """Let this run replace an earlier toolkit run in output_dir. The old run is removed only once
    this one has passed every check, just before step 1; a folder holding anything else is refused."""
    resume: Optional[str] = None
    """`auto`: continue from the latest complete checkpoint in output_dir (start fresh if none);
    or the path of a checkpoint (or of a run folder) to continue from."""
    resume_new_global_batch: bool = False
    """Let a resume change the global batch (micro_batch_size x gradient_accumulation_steps x
    processes): the data continues at the samples the checkpoint had seen, the schedule at its
    optimizer step (its length from this recipe). Off: another global batch is refused."""
    resume_accept_changed: list[str] = field(default_factory=list)
    """Inputs a resume may find changed since its checkpoint: `model` (the base model's weights and
    config, at model.path), `rewards` (the code of rl.rewards' functions), `reward_models` (the
    weights and config of rl.rewards' reward models), `teacher` (the distillation teacher's weights
    and config, at rl.teacher) and `tools` (the code of rl.tools' functions). Each is recorded by
    content in every checkpoint; a resume that finds one changed is refused, naming it, unless
    listed here. The same content at another path is no change."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model and its tokenizer."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA through peft; enabled: false is full fine-tuning."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training and eval data, how it is rendered, labelled and batched."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimization, precision, evaluation, logging and what watches the run."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints of the full training state."""
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    """Preference training (DPO, ORPO, SimPO) on data.format=preference pairs; unset: supervised."""
    rl: RLConfig = field(default_factory=RLConfig)
    """Online reinforcement learning (GRPO and its variants) on data.format=prompt rows; unset: none."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
