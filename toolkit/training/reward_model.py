"""Reward models as rewards of online RL (rl.rewards entries with `model:`): a sequence-classification model
scores each prompt + completion as TRL 1.16's GRPOTrainer scores with one (`_calculate_rewards`): a chat prompt
and its completion, as messages, rendered by the reward model's own chat template, a text prompt joined to its
completion; tokenized by the reward model's tokenizer in one right-padded batch without special tokens added;
the reward is the first logit. Loaded as TRL loads one (`num_labels=1`, the folder's dtype, the tokenizer's eos
as padding where it has none), on this process's device at the first call."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ToolkitError, first_line


class ModelReward:
    """A reward function over a reward model, called as TRL calls reward functions."""

    def __init__(self, source: str, folder: Path, model, tokenizer, template_kwargs: dict | None = None):
        self.source, self.folder, self.model, self.tokenizer = source, folder, model, tokenizer
        self.template_kwargs = dict(template_kwargs or {})  # model.chat_template_kwargs, as TRL passes its own
        self.__name__ = Path(source.rstrip("/")).name  # TRL names a reward model by its id's last part

    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float]:
        from accelerate import PartialState

        if prompts and isinstance(prompts[0], list):  # chat: the reward model's template over prompt + answer
            texts = [self.tokenizer.apply_chat_template(p + c, tokenize=False, **self.template_kwargs)
                     for p, c in zip(prompts, completions)]
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        inputs = self.tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right",
                                add_special_tokens=False)
        device = PartialState().device
        if self.model.device != device:
            self.model.to(device)
        with torch.inference_mode():
            return self.model(**inputs.to(device)).logits[:, 0].float().cpu().tolist()


def load_reward_model(key: str, source: str, template_kwargs: dict | None = None) -> ModelReward:
    """The reward model at `source` (a folder or a Hub id); anything that is not a one-label sequence-classification
    model with a tokenizer is refused in one line naming `key`. `template_kwargs` (model.chat_template_kwargs)
    reach its chat template too, as TRL's chat_template_kwargs reach every reward model's. Loaded whole, outside
    ZeRO-3's partitioned loading (accelerate's ZeRO-3 plugin makes transformers build every model under
    zero.Init, with empty weights that only a prepared engine fills: this model is never prepared)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from ..model.heads import MISFIT, misfit, one_label_problem
    from ..model.hub import resolve_model
    from ..model.load import not_partitioned

    try:
        folder = Path(resolve_model(source))
    except ToolkitError as err:
        raise ToolkitError(f"{key}: {str(err).removeprefix('model.path: ')}") from None
    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as err:
        raise ToolkitError(f"{key}: {source}: its config cannot be read: {first_line(err)}") from None
    if not any(a.endswith("ForSequenceClassification") for a in config.architectures or []):
        raise ToolkitError(f"{key}: {source} is a {', '.join(config.architectures or ['model without a head'])}, "
                           "not a sequence-classification reward model (a causal LM would score with a random head)")
    # from config.json and the weights' headers, before loading: as one label, a head of two would not fit
    problem = one_label_problem(folder) or (f"{config.num_labels} labels" if config.num_labels != 1 else None)
    if problem:
        raise ToolkitError(f"{key}: {source} has {problem}; a reward model has one (its first logit is the reward, "
                           "as TRL's)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        with not_partitioned():
            model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1, dtype="auto").eval()
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        if isinstance(err, RuntimeError) and not misfit(err):
            raise
        raise ToolkitError(f"{key}: {source} cannot be loaded: {MISFIT if misfit(err) else first_line(err)}") from None
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ToolkitError(f"{key}: {source}'s tokenizer has neither a padding nor an end-of-text token: a batch "
                               "of answers cannot be padded")
        tokenizer.pad_token = tokenizer.eos_token
    model.config.get_text_config().pad_token_id = tokenizer.pad_token_id  # the last real token is scored
    return ModelReward(source, folder, model, tokenizer, template_kwargs)

