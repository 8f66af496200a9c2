"""LoRA targeting through peft."""

import pytest
import torch

from toolkit.config import LoraConfig, ModelConfig
from toolkit.errors import ToolkitError
from toolkit.model.load import apply_lora, build_model, count_parameters, linear_module_names


def fresh():
    torch.manual_seed(0)
    return build_model(ModelConfig(preset="tiny-llama-mini"))


def adapted_leaves(model) -> set[str]:
    return {name.split(".lora_A")[0].rsplit(".", 1)[-1] for name, _ in model.named_parameters() if ".lora_A" in name}


def test_named_targets_only():
    model = apply_lora(fresh(), LoraConfig(enabled=True, r=4, target_modules=["q_proj", "v_proj"]))
    assert adapted_leaves(model) == {"q_proj", "v_proj"}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    # 2 layers x (q: 64->64, v: 64->32), A is r x in, B is out x r
    assert count_parameters(model)[0] == 2 * (4 * 64 + 64 * 4 + 4 * 64 + 32 * 4)


def test_all_linear_skips_the_output_head():
    model = apply_lora(fresh(), LoraConfig(enabled=True, r=4, target_modules="all-linear"))
    assert adapted_leaves(model) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert not any("lm_head.lora" in n for n, _ in model.named_parameters())


def test_unknown_target_lists_the_available_ones():
    with pytest.raises(ToolkitError) as e:
        apply_lora(fresh(), LoraConfig(enabled=True, target_modules=["query_key_value"]))
    msg = str(e.value)
    assert "query_key_value" in msg and "q_proj" in msg and "down_proj" in msg
    assert linear_module_names(fresh()) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj", "lm_head"])


def test_adapters_stay_fp32_over_a_bf16_base():
    base = fresh().to(torch.bfloat16)
    model = apply_lora(base, LoraConfig(enabled=True, r=4))
    for n, p in model.named_parameters():
        assert p.dtype == (torch.float32 if p.requires_grad else torch.bfloat16), n


def test_disable_dropout_zeroes_every_dropout_layer_lora_included():
    """rl.disable_dropout (TRL's disable_dropout_in_model): every nn.Dropout's rate 0, LoRA's too; the
    network then gives the same output in training mode twice (it did not before)."""
    import torch
    from peft import LoraConfig as PeftLora
    from peft import get_peft_model

    from toolkit.config import ModelConfig
    from toolkit.model.load import build_model, disable_dropout

    torch.manual_seed(0)
    model = get_peft_model(build_model(ModelConfig(preset="tiny-llama-mini")),
                           PeftLora(r=4, lora_alpha=8, lora_dropout=0.5, target_modules=["q_proj", "v_proj"],
                                    init_lora_weights=False)).train()
    ids = torch.randint(3, 200, (2, 12))
    assert not torch.equal(model(ids).logits, model(ids).logits)  # dropout draws differ
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert disable_dropout(model) == len(layers) > 0 and all(m.p == 0.0 for m in layers)
    assert torch.equal(model(ids).logits, model(ids).logits)
