"""The objectives' registry: what each training method is, keyed by the name a recipe gives it
(`preference.method`, `rl.method`, or none: supervised fine-tuning). The rest of the toolkit asks
`method_of(recipe)` what it needs (does it train on pairs, sample completions, hold a teacher,
score with a head; its plan and card lines; its TRL trainer) and never compares a method's name:
tests/test_layout.py fails on a comparison outside the objectives' own modules and this one.

Adding an objective: its module (what a batch is trained to do, `training/objectives.Objective`),
its entry here (`objective` names its builder, imported when a run builds it, so loading a recipe
imports no torch), and its keys in the recipe section it belongs to (config/objectives.py and its
validation). docs/development.md walks through one.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Method:
    """One training method. `key`: the recipe key that selects it (None: supervised, selected by no key);
    `trains_on`: the data.format it trains on (None: text, chat or prompt-completion rows); `unit`: what the
    start-of-run batch line counts; `trl`/`trl_learning_rate`: TRL's trainer and its default learning rate
    (None where it is the toolkit's own); `pairs`: a row is a chosen and a rejected sequence run in one
    forward; `scorer`: a sequence-classification head of one score is trained (a reward model); `online`:
    completions are sampled for the prompts each step; `rewards`: scored by rl.rewards; `teacher`: a frozen
    rl.teacher beside the model; `old_logps`: the sampling policy's log-probabilities are taken even with
    rl.num_iterations 1 and rl.beta > 0 (RLOO's KL in the reward); `overlong`: data.overlong's default;
    `objective`: "module:function" building its `Objective` (training/build.setup_objective passes the run);
    `data_warnings`: "module:function" of the prepared train rows and the recipe, giving lines to warn of;
    `extra_forwards(recipe, params, teacher)`: the forwards without gradient per trained token besides
    training's own, for MFU, of a model of `params` parameters beside a teacher of `teacher`;
    `plan`/`card`: its `config show` line and its model card's words."""
    name: str
    key: str | None
    trains_on: str | None
    unit: str
    trl: str | None
    trl_learning_rate: str | None
    objective: str
    plan: Callable
    card: Callable
    extra_forwards: Callable
    pairs: bool = False
    scorer: bool = False
    online: bool = False
    rewards: bool = False
    teacher: bool = False
    old_logps: bool = False
    overlong: str = "truncate"
    data_warnings: str | None = None

    def build(self, *args, **kwargs):
        """This method's Objective, from its builder (imported now: the objective modules import torch)."""
        return _imported(self.objective)(*args, **kwargs)

    def warnings(self, table, recipe) -> list[str]:
        return _imported(self.data_warnings)(table, recipe) if self.data_warnings else []


def _imported(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def method_of(recipe) -> Method:
    """The recipe's training method: rl.method, else preference.method, else supervised fine-tuning."""
    return METHODS[recipe.rl.method or recipe.preference.method or "sft"]


def trained_by(data_format: str) -> str:
    """The words naming the methods that train on `data_format` (a recipe's key and value):
    `preference.method=kto`, or `a preference.method (dpo, orpo, simpo or reward)`."""
    names = [m.name for m in METHODS.values() if m.trains_on == data_format]
    key = next(m.key for m in METHODS.values() if m.trains_on == data_format)
    if len(names) == 1:
        return f"{key}={names[0]}"
    article = "a " if key.startswith("preference") else ""
    return f"{article}{key} ({', '.join(names[:-1])} or {names[-1]})"


# ------------------------------------------------------------------ what each says of itself

def _rewards(recipe) -> str:
    return ", ".join(r if isinstance(r, str) else r.function for r in recipe.rl.rewards)


def divergence_name(beta: float) -> str:
    """Distillation's divergence (rl.beta), in words."""
    return {0.0: "forward KL(teacher || student)", 1.0: "reverse KL(student || teacher)"}.get(
        float(beta), f"generalized JSD (beta {beta:g}: mixture {1 - beta:g} x student + {beta:g} x teacher)")


def _divergence(recipe) -> str:
    return divergence_name(recipe.rl.beta)


def _sft_plan(recipe) -> str:
    on = "every token" if recipe.data.format == "text" or recipe.data.train_on_prompt else "the responses only"
    return f"supervised fine-tuning, the loss on {on}"


def _pairs_plan(recipe) -> str:
    p = recipe.preference
    return f"preference, {p.method} (beta {p.beta:g}) on chosen and rejected answers"


def _pairs_card(recipe) -> str:
    return f"preference training ({recipe.preference.method}, beta {recipe.preference.beta:g})"


def _kto_plan(recipe) -> str:
    p = recipe.preference
    return f"preference, kto ({p.loss_type}, beta {p.beta:g}) on answers labelled desirable or undesirable"


def _rl_plan(recipe) -> str:
    rl = recipe.rl
    tools = [str(t) for t in rl.tools] + ([f"the environment {rl.environment}"] if rl.environment else [])
    return (f"online RL, {rl.method} ({rl.loss_type} loss): {rl.num_generations} completions per prompt of at most "
            f"{rl.max_new_tokens} tokens at temperature {rl.temperature:g}, scored by {_rewards(recipe)}"
            + (f"; calling {', '.join(tools)}" if tools else ""))


def _rl_card(recipe) -> str:
    return f"online RL ({recipe.rl.method}, {recipe.rl.loss_type} loss) rewarded by {_rewards(recipe)}"


def _distill_plan(recipe) -> str:
    rl = recipe.rl
    return (f"on-policy distillation: {rl.num_generations} completion{'s' if rl.num_generations > 1 else ''} per "
            f"prompt of at most {rl.max_new_tokens} tokens at temperature {rl.temperature:g}, sampled by the "
            f"model; the loss is the {_divergence(recipe)} to the teacher {rl.teacher} on their tokens")


def _distill_card(recipe) -> str:
    return (f"on-policy distillation from {recipe.rl.teacher} ({_divergence(recipe)}, temperature "
            f"{recipe.rl.temperature:g})")


def _reference_forwards(recipe, params: int = 0, teacher: int = 0) -> float:
    """DPO's reference through the disabled adapter (precomputed or reference-free: none)."""
    return float(recipe.preference.reference == "adapter")


def _kto_forwards(recipe, params: int = 0, teacher: int = 0) -> float:
    """KTO's pass over the mismatched sequences for the KL estimate, and the reference of both through the
    disabled adapter."""
    p = recipe.preference
    kl = p.loss_type == "kto"
    return kl + (p.reference == "adapter") * (1 + kl)


def _rl_forwards(recipe, params: int = 0, teacher: int = 0) -> float:
    """Sampling (about one forward over the prompt and its completion, with the KV cache), the reference
    (rl.beta) and the old log-probabilities (rl.num_iterations > 1, or the method's own), once per generated
    batch; rl.top_entropy_quantile's entropy pass every step."""
    rl = recipe.rl
    old = rl.num_iterations > 1 or (method_of(recipe).old_logps and rl.beta > 0)
    return (1 + (rl.beta > 0) + old) / rl.num_iterations + (rl.top_entropy_quantile < 1)


def _distill_forwards(recipe, params: int = 0, teacher: int = 0) -> float:
    """Sampling and the teacher's forward, counted as forwards of this model (of `params` parameters) by the
    ratio of the teacher's (`teacher`) to them."""
    return 1 + teacher / max(params, 1)


def _none(recipe, params: int = 0, teacher: int = 0) -> float:
    return 0.0


_PAIRS = dict(key="preference.method", trains_on="preference", unit="preference pairs", pairs=True,
              objective="toolkit.training.objectives:for_recipe", plan=_pairs_plan, card=_pairs_card,
              extra_forwards=_reference_forwards)
_RL = dict(key="rl.method", trains_on="prompt", unit="prompts", trl_learning_rate="1e-6", online=True, rewards=True,
           objective="toolkit.training.online_setup:group_rl", plan=_rl_plan, card=_rl_card,
           extra_forwards=_rl_forwards)

METHODS: dict[str, Method] = {m.name: m for m in [
    Method("sft", key=None, trains_on=None, unit="sequences", trl=None, trl_learning_rate=None,
           objective="toolkit.training.objectives:for_recipe", plan=_sft_plan,
           card=lambda recipe: "supervised fine-tuning", extra_forwards=_none),
    Method("dpo", trl="DPO", trl_learning_rate="1e-6", **_PAIRS),
    Method("orpo", trl="ORPO", trl_learning_rate="1e-6", **_PAIRS),
    Method("simpo", trl="CPO (SimPO)", trl_learning_rate="1e-6", **_PAIRS),
    Method("kto", key="preference.method", trains_on="unpaired", unit="completions (desirable or not)", trl="KTO",
           trl_learning_rate="1e-6", objective="toolkit.training.kto:for_recipe", plan=_kto_plan, card=_pairs_card,
           extra_forwards=_kto_forwards, data_warnings="toolkit.training.kto:data_warnings"),
    Method("reward", key="preference.method", trains_on="preference", unit="preference pairs", trl="RewardTrainer",
           trl_learning_rate="1e-4", pairs=True, scorer=True, overlong="drop",
           objective="toolkit.training.reward_training:for_recipe",
           plan=lambda recipe: "a reward model: a score head trained on chosen and rejected answers (Bradley-Terry)",
           card=lambda recipe: "reward modelling (a sequence-classification head of one score, Bradley-Terry on "
                               "preference pairs)", extra_forwards=_none),
    Method("grpo", trl="GRPO", **_RL),
    Method("rloo", trl="RLOO", old_logps=True, **_RL),
    Method("distill", key="rl.method", trains_on="prompt", unit="prompts", trl="DistillationTrainer",
           trl_learning_rate="1e-6", online=True, teacher=True, objective="toolkit.training.online_setup:distillation",
           plan=_distill_plan, card=_distill_card, extra_forwards=_distill_forwards),
]}
