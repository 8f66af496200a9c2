"""No loss term dropped silently: a mixture-of-experts model whose config asks for the router's
load-balancing loss (output_router_logits) gets it under supervised training, and a preference run,
whose loss has no router term, says at its start that it trains without it."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from toolkit.config import ModelConfig, load_recipe
from toolkit.model.load import build_model
from toolkit.training.objectives import for_recipe

from families import family_config, family_tokenizer
from helpers import write_recipe


def mixtral(**config):
    tokenizer = family_tokenizer("mixtral")
    cfg = family_config("mixtral", len(tokenizer), tokenizer)
    for key, value in config.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def recipe(tmp_path, **sections):
    body = {"output_dir": str(tmp_path / "run"), "model": {"preset": "tiny-llama-mini"},
            "data": {"train_files": ["t.jsonl"]}, **sections}
    return load_recipe(write_recipe(tmp_path / "r.yaml", **body))


def dpo(tmp_path):
    return recipe(tmp_path, data={"train_files": ["t.jsonl"], "format": "preference"}, preference={"method": "dpo"})


@pytest.fixture(scope="module")
def asks_for_router_loss():
    return mixtral(output_router_logits=True, router_aux_loss_coef=0.02)


def test_supervised_training_adds_the_router_loss_the_config_asks_for(tmp_path, asks_for_router_loss):
    objective = for_recipe(recipe(tmp_path), asks_for_router_loss)
    assert objective.router_aux_coef == 0.02
    assert objective.describe() == ["router: load-balancing loss x 0.02 added to the training loss (aux_loss)"]


def test_preference_training_says_it_has_no_router_loss(tmp_path, asks_for_router_loss):
    lines = for_recipe(dpo(tmp_path), asks_for_router_loss).describe()
    assert lines[1:] == ["router: no load-balancing loss: the model's config asks for one (output_router_logits, "
                         "router_aux_loss_coef 0.02) but the dpo loss has no router term yet"], lines


@pytest.mark.parametrize("model", [lambda: mixtral(),
                                   lambda: mixtral(output_router_logits=True, router_aux_loss_coef=0.0),
                                   lambda: build_model(ModelConfig(preset="tiny-llama-mini"))],
                         ids=["router loss off", "coefficient 0", "dense"])
def test_preference_training_without_a_router_loss_asked_says_nothing_of_it(tmp_path, model):
    lines = for_recipe(dpo(tmp_path), model()).describe()
    assert len(lines) == 1 and lines[0].startswith("preference: dpo") and "router" not in lines[0], lines


def test_online_rl_says_it_has_no_router_loss(tmp_path, asks_for_router_loss):
    from toolkit.backends.base import Backend
    from toolkit.training.objectives import config_router_coef
    from toolkit.training.online import GroupRL
    from toolkit.training.rewards import load_rewards

    r = recipe(tmp_path, data={"train_files": ["t.jsonl"], "format": "prompt"},
               rl={"method": "grpo", "rewards": ["exact_match"]})
    objective = GroupRL(r.rl, load_rewards(r.rl.rewards), None, Backend(), r.seed, ["t.jsonl"], ["t.jsonl"],
                        router_coef=config_router_coef(asks_for_router_loss))
    assert objective.describe()[-1] == ("router: no load-balancing loss: the model's config asks for one "
                                        "(router_aux_loss_coef 0.02) but the policy loss has no router term")
    quiet = GroupRL(r.rl, load_rewards(r.rl.rewards), None, Backend(), r.seed, ["t.jsonl"], ["t.jsonl"])
    assert not any("router" in line for line in quiet.describe())
