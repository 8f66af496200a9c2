"""`toolkit merge`: LoRA, DoRA and rsLoRA adapters folded into their base, shard by shard, checked against
peft (base + adapter, and peft's own merge_and_unload) on real files; refusals are one line, exit code 2."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from toolkit.cli import main
from toolkit.config import load_recipe
from toolkit.errors import ToolkitError
from toolkit.model.load import CHAT_TEMPLATE, apply_lora, build_byte_tokenizer, build_model

from helpers import alpaca_rows, load_weights, run_toolkit, write_jsonl, write_recipe

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Reverse abc"},
        {"role": "assistant", "content": "cba"}]
PROMPTS = ["Reverse the letters. abcdef", "Add the numbers. 17+96"]


# ----------------------------------------------------------------------------- builders


@pytest.fixture(scope="module")
def preset_run(tmp_path_factory) -> Path:
    """A real LoRA run on the tiny preset, DoRA and rsLoRA on: final/ (adapter + tokenizer) and base-model/."""
    d = tmp_path_factory.mktemp("merge_run")
    train = write_jsonl(d / "train.jsonl", alpaca_rows(16, seed=5))
    recipe = {"output_dir": str(d / "run"), "seed": 3, "model": {"preset": "tiny-llama-mini"},
              "lora": {"enabled": True, "r": 4, "alpha": 8, "use_dora": True, "use_rslora": True},
              "data": {"train_files": [str(train)], "format": "alpaca", "max_seq_len": 96},
              "train": {"micro_batch_size": 4, "max_steps": 3, "learning_rate": 1e-2, "log_every_steps": 1}}
    proc = run_toolkit("train", write_recipe(d / "run.yaml", **recipe), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return d / "run"


@pytest.fixture(scope="module")
def local_base(tmp_path_factory) -> Path:
    """A local Hugging Face folder in several safetensors shards with an index, a chat template, no
    generation_config.json, and a config eos (3) that is not the tokenizer's (`</s>`, 2)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("local") / "tiny-chat"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=262, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=3, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="150KB")
    (folder / "generation_config.json").unlink(missing_ok=True)
    build_byte_tokenizer().save_pretrained(folder)
    assert len(list(folder.glob("model-*.safetensors"))) >= 3 and (folder / "model.safetensors.index.json").is_file()
    return folder


def make_adapter(base: Path, out: Path, seed: int, **lora) -> Path:
    """A peft adapter over `base` whose every trainable tensor is moved off its initial value (B is no
    longer zero, DoRA's magnitude no longer the weight norm, modules_to_save no longer the base's)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(task_type="CAUSAL_LM", **lora))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out)
    return out


def merge(*args, capsys=None) -> tuple[int, str, str]:
    code = main(["merge", *map(str, args)])
    if capsys is None:
        return code, "", ""
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: merge: "), err
    return lines[0]


# ----------------------------------------------------------------------------- what a merged folder must be


def logits(model, tokenizer) -> list[torch.Tensor]:
    texts = PROMPTS + [tokenizer.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)]
    with torch.no_grad():
        return [model(tokenizer(t, return_tensors="pt").input_ids).logits for t in texts]


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def assert_merged(out: Path, base: Path, adapter: Path, tolerance: float = 1e-5) -> None:
    """Loads with transformers alone; equals base + adapter under peft and peft's merge_and_unload;
    the tokenizer renders the chat template as the source does; generation stops at its eos."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(out)
    source = AutoTokenizer.from_pretrained(adapter if (adapter / "tokenizer_config.json").is_file() else base)
    assert tokenizer.apply_chat_template(CHAT, tokenize=False) == source.apply_chat_template(CHAT, tokenize=False)
    assert tokenizer.chat_template == source.chat_template == CHAT_TEMPLATE
    assert tokenizer.eos_token == source.eos_token and tokenizer.eos_token_id == source.eos_token_id
    assert tokenizer.all_special_tokens == source.all_special_tokens
    eos = GenerationConfig.from_pretrained(out).eos_token_id
    assert tokenizer.eos_token_id in (eos if isinstance(eos, list) else [eos])

    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                          adapter).eval()
    want = logits(reference, tokenizer)
    assert max_difference(logits(merged, tokenizer), want) <= tolerance
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    assert max_difference(logits(plain, tokenizer), want) > 1e-3  # the adapter does change the model
    peft_merged = reference.merge_and_unload()
    assert max_difference(logits(peft_merged, tokenizer), want) <= 1e-5
    if tolerance <= 1e-5:
        theirs = peft_merged.state_dict()
        for name, tensor in merged.state_dict().items():
            torch.testing.assert_close(tensor, theirs[name], rtol=1e-5, atol=1e-6, msg=name)


# ----------------------------------------------------------------------------- merges


def test_dora_and_rslora_options_reach_peft(tmp_path):
    recipe_path = write_recipe(tmp_path / "r.yaml", output_dir="x", model={"preset": "tiny-llama-mini"},
                               data={"train_files": ["t.jsonl"]})
    recipe = load_recipe(recipe_path, ["lora.enabled=true", "lora.use_dora=true", "lora.use_rslora=true"])
    model = apply_lora(build_model(recipe.model), recipe.lora)
    config = model.peft_config["default"]
    assert config.use_dora and config.use_rslora
    assert any("lora_magnitude_vector" in n for n, _ in model.named_parameters())
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.scaling["default"] == pytest.approx(recipe.lora.alpha / recipe.lora.r ** 0.5)
    assert not load_recipe(recipe_path).lora.use_dora  # off by default
    with pytest.raises(ToolkitError, match=r"lora.use_dorra: unknown key; did you mean use_dora\?"):
        load_recipe(recipe_path, ["lora.use_dorra=true"])


@pytest.mark.launch
def test_preset_run_dora_rslora(preset_run, tmp_path, capsys):
    adapter = preset_run / "final"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["use_dora"] and config["use_rslora"]
    assert Path(config["base_model_name_or_path"]) == (preset_run / "base-model").resolve()
    out = tmp_path / "merged"
    code, stdout, err = merge(adapter, "--out", out, capsys=capsys)
    assert code == 0, err
    assert "DoRA, rsLoRA" in stdout and "14 weights merged" in stdout and "check: " in stdout
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "merged.tmp").exists()
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert_merged(out, preset_run / "base-model", adapter)
    card = (out / "README.md").read_text()  # the run's model card, now of a plain model
    assert card.startswith("---\nlibrary_name: transformers\n") and "Merged into its base by `toolkit merge`." in card
    meta = yaml.safe_load(card.split("---\n")[1])
    assert "lora" not in meta["tags"] and "merged" in meta["tags"], meta
    assert "AutoPeftModelForCausalLM" not in card and "AutoModelForCausalLM.from_pretrained(FOLDER)" in card
    adapter_card = (adapter / "README.md").read_text()
    assert "AutoPeftModelForCausalLM" in adapter_card
    for part in ("## Data", "## Results", "## Recipe"):  # the rest of the run's card as it was
        assert card[card.index(part):].split("\n## ")[0] == adapter_card[adapter_card.index(part):].split("\n## ")[0]


def test_sharded_local_base_lora_with_patterns_and_modules_to_save(local_base, tmp_path, capsys):
    adapter = make_adapter(local_base, tmp_path / "adapter", seed=1, r=4, lora_alpha=8, target_modules="all-linear",
                           rank_pattern={"q_proj": 2}, alpha_pattern={"down_proj": 3.0}, modules_to_save=["lm_head"])
    out = tmp_path / "merged"
    code, stdout, err = merge(adapter, "--out", out, capsys=capsys)
    assert code == 0, err
    assert "1 replaced (modules_to_save)" in stdout and "check: " in stdout
    base_index = json.loads((local_base / "model.safetensors.index.json").read_text())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == base_index["weight_map"]
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(set(base_index["weight_map"].values()))
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in load_weights(out).values())
    generation = json.loads((out / "generation_config.json").read_text())  # created: the base has none
    assert generation["eos_token_id"] == [3, 2]  # the config's, and the tokenizer's </s>
    assert_merged(out, local_base, adapter)


def test_local_base_dora_rslora_into_bf16(local_base, tmp_path, capsys):
    adapter = make_adapter(local_base, tmp_path / "adapter", seed=2, r=8, lora_alpha=4, use_dora=True,
                           use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"])
    out = tmp_path / "merged"
    code, stdout, err = merge(adapter, "--out", out, "--dtype", "bf16", capsys=capsys)
    assert code == 0, err
    assert "6 weights merged" in stdout and "for bfloat16" in stdout
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert {t.dtype for t in load_weights(out).values()} == {torch.bfloat16}
    assert_merged(out, local_base, adapter, tolerance=2e-2)


def test_rslora_skip_check(local_base, tmp_path, capsys):
    adapter = make_adapter(local_base, tmp_path / "adapter", seed=3, r=16, lora_alpha=2, use_rslora=True,
                           target_modules=["o_proj", "gate_proj"])
    code, stdout, err = merge(adapter, "--out", tmp_path / "merged", "--skip-check", capsys=capsys)
    assert code == 0, err
    assert "check: " not in stdout and "4 weights merged" in stdout
    assert_merged(tmp_path / "merged", local_base, adapter)


# ----------------------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def small_adapter(local_base, tmp_path_factory) -> Path:
    return make_adapter(local_base, tmp_path_factory.mktemp("small") / "adapter", seed=4, r=2, lora_alpha=4,
                        target_modules=["q_proj"])


def test_non_empty_out_is_refused_and_untouched(small_adapter, tmp_path, capsys):
    out = tmp_path / "merged"
    out.mkdir()
    (out / "precious.txt").write_text("earlier results")
    code, _, err = merge(small_adapter, "--out", out, capsys=capsys)
    assert code == 2
    assert "not empty" in one_error_line(err) and str(out) in err
    assert ([p.name for p in out.iterdir()] == ["precious.txt"]
            and (out / "precious.txt").read_text() == "earlier results")
    assert not (tmp_path / "merged.tmp").exists()


def test_quantized_base_is_refused(local_base, small_adapter, tmp_path, capsys):
    base = tmp_path / "quantized"
    shutil.copytree(local_base, base)
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (base / "config.json").write_text(json.dumps(config))
    adapter = tmp_path / "adapter"
    shutil.copytree(small_adapter, adapter)
    adapter_config = json.loads((adapter / "adapter_config.json").read_text())
    adapter_config["base_model_name_or_path"] = str(base)
    (adapter / "adapter_config.json").write_text(json.dumps(adapter_config))
    code, _, err = merge(adapter, "--out", tmp_path / "merged", capsys=capsys)
    assert code == 2
    assert "quantized (bitsandbytes)" in one_error_line(err) and "loses quality" in err
    assert not (tmp_path / "merged").exists() and not (tmp_path / "merged.tmp").exists()


@pytest.mark.launch
def test_full_model_folder_is_refused_by_the_cli(local_base, tmp_path):
    proc = run_toolkit("merge", local_base, "--out", tmp_path / "merged", timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "already a full model" in one_error_line(proc.stderr)
    assert not (tmp_path / "merged").exists()


@pytest.mark.launch
def test_run_folder_points_at_its_adapter(preset_run, tmp_path, capsys):
    code, _, err = merge(preset_run, "--out", tmp_path / "merged", capsys=capsys)
    assert code == 2 and f"its adapter is {preset_run / 'final'}" in one_error_line(err)


def test_adapter_of_another_model_names_the_tensor(small_adapter, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    adapter = tmp_path / "adapter"
    shutil.copytree(small_adapter, adapter)
    tensors = load_file(adapter / "adapter_model.safetensors")
    tensors = {k.replace("layers.1.self_attn.q_proj", "layers.1.self_attn.qkv_proj"): v for k, v in tensors.items()}
    save_file(tensors, adapter / "adapter_model.safetensors")
    code, _, err = merge(adapter, "--out", tmp_path / "merged", capsys=capsys)
    assert code == 2 and "model.layers.1.self_attn.qkv_proj.weight" in one_error_line(err)
    assert not (tmp_path / "merged").exists() and not (tmp_path / "merged.tmp").exists()
