"""train.loss=chunked gives the loss and gradients of train.loss=full: real models, real peft."""

import copy
import json
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from toolkit.config import ConfigError, LoraConfig, ModelConfig, load_recipe
from toolkit.data.formats import IGNORE
from toolkit.errors import ToolkitError
from toolkit.model.load import PRESETS, apply_lora, build_model
from toolkit.storage.run_folder import learning_relevant
from toolkit.training.loss import token_loss_sum, use_token_loss

from helpers import ROOT

TOL = 1e-5


def tiny_llama(tied: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    if not tied:
        return build_model(ModelConfig(preset="tiny-llama-mini"))
    config = LlamaConfig(**{**json.loads((PRESETS / "tiny-llama-mini.json").read_text()), "tie_word_embeddings": True})
    model = LlamaForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def lora(model, targets) -> torch.nn.Module:
    model = apply_lora(model, LoraConfig(enabled=True, r=4, target_modules=targets))
    with torch.no_grad():  # peft starts B at zero, which would leave A's gradient zero: nothing to compare
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    return model


def batch(vocab: int = 262, packed: bool = False) -> dict[str, torch.Tensor]:
    """4 rows: a prompt without targets then a response; a shorter, padded one; one whose only
    target is its last token; one with no targets at all."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (4, 40), generator=g)
    labels = ids.clone()
    labels[:, :12] = IGNORE
    labels[1, 26:] = IGNORE
    labels[2, :-1] = IGNORE
    labels[3] = IGNORE
    b = {"input_ids": ids, "labels": labels}
    if packed:  # two documents in each row
        b["position_ids"] = torch.cat([torch.arange(15), torch.arange(25)]).repeat(4, 1)
    else:
        b["attention_mask"] = torch.ones_like(ids)
        b["attention_mask"][1, 26:] = 0
    return b


def loss_and_grads(model, kind: str, b: dict, chunk: int = 1024):
    model = copy.deepcopy(model)
    use_token_loss(model, kind, chunk)
    loss = token_loss_sum(model, b)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def assert_same(model, b, chunk: int):
    full, full_grads = loss_and_grads(model, "full", b)
    chunked, grads = loss_and_grads(model, "chunked", b, chunk)
    assert torch.isfinite(full) and full > 0
    torch.testing.assert_close(chunked, full, rtol=TOL, atol=TOL)
    assert grads.keys() == full_grads.keys() and grads
    for name, g in grads.items():
        assert g is not None and torch.isfinite(g).all(), name
        torch.testing.assert_close(g, full_grads[name], rtol=TOL, atol=TOL, msg=name)
    return grads


def n_targets(b) -> int:
    return int((b["labels"][:, 1:] != IGNORE).sum())


@pytest.mark.parametrize("chunk", [1, 7, 1024])
def test_full_fine_tuning(chunk):
    b = batch()
    assert n_targets(b) % 7 and n_targets(b) > 7  # several chunks, the last one short
    grads = assert_same(tiny_llama(), b, chunk)
    assert grads["lm_head.weight"].abs().sum() > 0 and grads["model.embed_tokens.weight"].abs().sum() > 0


def test_packed_rows():
    assert_same(tiny_llama(), batch(packed=True), 7)


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "lm_head"]])
def test_lora(targets):
    model = lora(tiny_llama(), targets)
    grads = assert_same(model, batch(), 7)
    assert all("lora_" in n for n in grads)
    if "lm_head" in targets:
        assert any("lm_head.lora_B" in n for n in grads)


def test_tied_embeddings():
    grads = assert_same(tiny_llama(tied=True), batch(), 7)
    assert "lm_head.weight" not in grads  # one parameter, both uses' gradients in it
    assert grads["model.embed_tokens.weight"].abs().sum() > 0


def test_tied_embeddings_with_lora():
    assert_same(lora(tiny_llama(tied=True), "all-linear"), batch(), 7)


def test_a_micro_batch_without_targets():
    b = batch()
    b["labels"][:] = IGNORE
    for kind in ("chunked", "full"):
        loss, grads = loss_and_grads(tiny_llama(), kind, b, 7)
        assert loss.item() == 0.0, kind
        assert grads["lm_head.weight"] is not None, kind  # the output layer took part (DDP waits for every gradient)
        assert all(torch.equal(g, torch.zeros_like(g)) for g in grads.values()), kind


def test_one_chunk_of_logits_at_a_time():
    """The output layer sees only target positions, at most `chunk` at once, and each chunk is
    recomputed once in backward."""
    model = tiny_llama()
    use_token_loss(model, "chunked", 7)
    rows = []
    model.lm_head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
    b = batch()
    token_loss_sum(model, b).backward()
    chunks = -(-n_targets(b) // 7)
    assert rows[:chunks] == [7] * (chunks - 1) + [n_targets(b) % 7]
    assert sorted(rows[chunks:]) == sorted(rows[:chunks])


def test_the_model_is_unchanged_otherwise():
    """State-dict keys, plain calls (generation, the packing check) and the forward's signature,
    which generation reads, stay as they were."""
    import inspect

    plain, model = tiny_llama(), tiny_llama()
    use_token_loss(model)
    assert model.state_dict().keys() == plain.state_dict().keys()
    assert inspect.signature(model.forward) == inspect.signature(plain.forward)
    b = batch()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=b["input_ids"]).logits, plain(input_ids=b["input_ids"]).logits,
                                   rtol=0, atol=0)
    prompt = b["input_ids"][:1, :8]
    assert torch.equal(model.eval().generate(prompt, max_new_tokens=5, do_sample=False),
                       plain.eval().generate(prompt, max_new_tokens=5, do_sample=False))


def test_final_logit_softcapping():
    """Gemma 2 caps its logits after the output layer; the chunked loss does the same."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=262, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, final_logit_softcapping=2.0)
    assert_same(Gemma2ForCausalLM(config), batch(), 7)


def test_a_model_that_scales_its_logits_is_refused():
    """Granite divides its logits by config.logits_scaling after the output layer, which the
    chunked loss does not know: refused in one line, pointing at train.loss=full."""
    from transformers import GraniteConfig, GraniteForCausalLM

    torch.manual_seed(0)
    config = GraniteConfig(vocab_size=262, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, logits_scaling=4.0)
    model = GraniteForCausalLM(config)
    with pytest.raises(ToolkitError, match="set train.loss=full"):
        use_token_loss(model, "chunked")
    use_token_loss(model, "full")


def write(tmp_path, *overrides):
    path = tmp_path / "r.yaml"
    path.write_text(f"output_dir: {tmp_path / 'out'}\nmodel: {{preset: tiny-llama-mini}}\n"
                    f"data: {{train_files: [{tmp_path / 'x.jsonl'}]}}\n")
    return load_recipe(path, list(overrides))


def test_recipe_options(tmp_path):
    r = write(tmp_path)
    assert (r.train.loss, r.train.loss_chunk_tokens) == ("chunked", 1024)
    assert write(tmp_path, "train.loss=full", "train.loss_chunk_tokens=64").train.loss_chunk_tokens == 64
    with pytest.raises(ConfigError, match="train.loss_chunk_tokens: must be positive, got 0"):
        write(tmp_path, "train.loss_chunk_tokens=0")
    with pytest.raises(ConfigError, match="train.loss: must be one of chunked, full"):
        write(tmp_path, "train.loss=fused")
    # Same value either way: a run may resume with the other one.
    assert learning_relevant(r) == learning_relevant(write(tmp_path, "train.loss=full", "train.loss_chunk_tokens=8"))


@pytest.mark.launch
def test_memory_benchmark_runs():
    """benchmarks/loss_memory.py --tiny: both losses in their own processes, the same values."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "loss_memory.py"), "--tiny"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "ratio chunked/full: " in proc.stdout and "(tolerance 1e-05: within)" in proc.stdout, proc.stdout
    assert [line.split("|")[1].strip() for line in proc.stdout.splitlines() if line.startswith("| f") or
            line.startswith("| c")] == ["full", "chunked"], proc.stdout


@pytest.mark.parametrize("chunk", [1, 7, 1024])
@pytest.mark.parametrize("variant", ["full_ft", "lora", "tied"])
def test_per_row_log_probabilities(chunk, variant):
    """`token_logps`: each row's sum of target log-probabilities and its target count, chunked as
    full, both equal to the log-softmax of the model's own logits, gradients included; a row without
    targets gives 0 of 0."""
    from toolkit.training.loss import token_logps

    model = {"full_ft": lambda: tiny_llama(), "lora": lambda: lora(tiny_llama(), "all-linear"),
             "tied": lambda: tiny_llama(tied=True)}[variant]()
    b = batch()
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1)
    targets = b["labels"][:, 1:]
    mask = targets != IGNORE
    want = (logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0] * mask).sum(1)
    results = {}
    for kind in ("full", "chunked"):
        m = copy.deepcopy(model)
        use_token_loss(m, kind, chunk)
        sums, counts = token_logps(m, b)
        assert counts.tolist() == mask.sum(1).tolist() and counts[3] == 0 and sums[3] == 0
        torch.testing.assert_close(sums.detach(), want, rtol=TOL, atol=TOL)
        (sums * torch.tensor([1.0, -2.0, 0.5, 3.0])).sum().backward()  # unequal weights: rows stay apart
        results[kind] = {n: p.grad for n, p in m.named_parameters() if p.requires_grad}
    assert results["full"].keys() == results["chunked"].keys()
    for name, g in results["chunked"].items():
        torch.testing.assert_close(g, results["full"][name], rtol=TOL, atol=TOL, msg=name)


@pytest.mark.parametrize("kind", ["full", "chunked"])
def test_per_document_log_probabilities_in_a_padding_free_row(kind):
    """The rows of `batch()` without their padding, concatenated into one padding-free row with
    `position_ids` restarting at each: `token_logps` gives each document what it gave each padded
    row (sums within 1e-5, the same counts), so a preference pair may sit in one row."""
    from toolkit.data.batching import Collator
    from toolkit.training.loss import token_logps

    model = tiny_llama()
    use_token_loss(model, kind, 7)
    b = batch()
    padded, padded_n = token_logps(model, b)
    lengths = b["attention_mask"].sum(1).tolist()
    examples = [{"input_ids": b["input_ids"][i, :n].numpy(), "labels": b["labels"][i, :n].numpy()}
                for i, n in enumerate(lengths)]
    row = Collator(0, padding_free=True)(examples)
    assert row["input_ids"].shape == (1, sum(lengths))
    sums, counts = token_logps(model, row)
    assert counts.tolist() == padded_n.tolist()
    torch.testing.assert_close(sums, padded, rtol=TOL, atol=TOL)
