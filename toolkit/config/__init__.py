"""Recipes: one YAML file per run, loaded into a small tree of typed dataclasses.

Every field is typed; unknown keys, wrong types and contradictions raise `ConfigError`
naming the file and the dotted key. Command-line overrides use the same dotted keys
(`train.max_steps=20`) and are validated the same way.

The schema by section: `recipe` (the top-level keys), `model` (model, lora, chat templates), `data`,
`train` (train, checkpoint), `objectives` (preference, rl, rewards); `methods`, the objectives' registry (what each
method is, for the rest of the toolkit to ask). `loading` reads, overrides and
coerces; `validate` checks the run's keys, data and training in order and hands the model to
`validate_model` and the objectives to `validate_objectives`; `reference` writes the key reference.
"""

from ..errors import ConfigError
from .data import DataConfig, DataSource
from .loading import PEER_NAMES, dump_recipe, load_recipe
from .model import CHAT_TEMPLATES, ROPE_KEYS, LoraConfig, ModelConfig, RopeScaling, chat_template_text
from .objectives import BUILT_IN_REWARDS, PreferenceConfig, RewardConfig, RLConfig
from .recipe import CHANGEABLE_INPUTS, Recipe
from .reference import docs_of, key_reference
from .train import CheckpointConfig, TrainConfig
from .validate import validate

__all__ = ["BUILT_IN_REWARDS", "CHANGEABLE_INPUTS", "CHAT_TEMPLATES", "PEER_NAMES", "ROPE_KEYS", "CheckpointConfig",
           "ConfigError", "DataConfig", "DataSource", "LoraConfig", "ModelConfig", "PreferenceConfig", "Recipe",
           "RewardConfig", "RLConfig", "RopeScaling", "TrainConfig", "chat_template_text", "docs_of", "dump_recipe",
           "key_reference", "load_recipe", "validate"]
