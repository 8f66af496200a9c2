"""Reward models as rewards of online RL (rl.rewards entries with `model:`): a sequence-classification model
scores each prompt + completion as TRL 1.16's GRPOTrainer scores with one (`_calculate_rewards`): a chat prompt
and its completion, as messages, rendered by the reward model's own chat template, a text prompt joined to its
completion; tokenized by the reward model's tokenizer in one right-padded batch without special tokens added;
the reward is the first logit. Loaded as TRL loads one (`num_labels=1`, the folder's dtype, the tokenizer's eos
as padding where it has none), on this process's device at the first call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import ToolkitError


class ModelReward:
    """A reward function over a reward model, called as TRL calls reward functions."""

    def __init__(self, source: str, folder: Path, model, tokenizer):
        self.source, self.folder, self.model, self.tokenizer = source, folder, model, tokenizer
        self.__name__ = Path(source.rstrip("/")).name  # TRL names a reward model by its id's last part

    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float]:
        from accelerate import PartialState

        if prompts and isinstance(prompts[0], list):  # chat: the reward model's template over prompt + answer
            texts = [self.tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        inputs = self.tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right",
                                add_special_tokens=False)
        device = PartialState().device
        if self.model.device != device:
            self.model.to(device)
        with torch.inference_mode():
            return self.model(**inputs.to(device)).logits[:, 0].float().cpu().tolist()


def load_reward_model(key: str, source: str) -> ModelReward:
    """The reward model at `source` (a folder or a Hub id); anything that is not a one-label sequence-classification
    model is refused in one line naming `key`."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from ..model.hub import resolve_model

    try:
        folder = Path(resolve_model(source))
    except ToolkitError as err:
        raise ToolkitError(f"{key}: {str(err).removeprefix('model.path: ')}") from None
    config = AutoConfig.from_pretrained(folder)
    heads = [a for a in config.architectures or [] if a.endswith("ForSequenceClassification")]
    if not heads:
        raise ToolkitError(f"{key}: {source} is a {', '.join(config.architectures or ['model without a head'])}, "
                           "not a sequence-classification reward model (a causal LM would score with a random head)")
    if config.num_labels != 1:
        raise ToolkitError(f"{key}: {source} has {config.num_labels} labels; a reward model has one (its first "
                           "logit is the reward, as TRL's)")
    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1, dtype="auto").eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.get_text_config().pad_token_id = tokenizer.pad_token_id  # the last real token is scored
    return ModelReward(source, folder, model, tokenizer)


def describe(reward: Any) -> str | None:
    """The folder of a reward model's reward, else None."""
    return str(reward.folder) if isinstance(reward, ModelReward) else None
