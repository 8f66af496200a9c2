"""Long context (issue 30): RoPE scaling and maximum positions from the recipe (model.rope_scaling,
model.max_position_embeddings), set in the model's config before it is built, its rope_theta kept;
carried by final/ (a full model's config.json; an adapter's toolkit_base.json), and applied by merge,
generate and eval when they load an adapter's base. The chunked output layer's gathers under FSDP2
and ZeRO-3. model.tiled_mlp and model.activation_offload: the same learning, on every backend."""

import json

import pytest
import torch

from toolkit.config import ConfigError, load_recipe

from families import build_family
from helpers import ROOT, read_metrics, run_toolkit, write_jsonl, write_recipe


def recipe_file(tmp_path, **model):
    import yaml

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "run"), "model": {"preset": "tiny-llama", **model},
                                    "data": {"train_files": ["x.jsonl"], "max_seq_len": 64}}))
    return path


@pytest.mark.parametrize("model, key, words", [
    ({"rope_scaling": {"rope_type": "yarn"}}, "model.rope_scaling.factor", "required for rope_type yarn"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4}},
     "model.rope_scaling.original_max_position_embeddings", "required for rope_type llama3"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2, "beta_fast": 32}}, "model.rope_scaling.beta_fast",
     "not a linear setting"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": -2}}, "model.rope_scaling.factor", "positive"),
    ({"rope_scaling": {"rope_type": "ntk", "factor": 2}}, "model.rope_scaling.rope_type", "must be one of"),
    ({"rope_scaling": {"rope_type": "yarn", "factr": 2}}, "model.rope_scaling.factr", "did you mean factor"),
    ({"max_position_embeddings": 32}, "model.max_position_embeddings", "shorter than data.max_seq_len=64"),
])
def test_bad_rope_settings_are_refused_naming_the_key(tmp_path, model, key, words):
    with pytest.raises(ConfigError) as e:
        load_recipe(recipe_file(tmp_path, **model))
    assert e.value.key == key and words in str(e.value), str(e.value)


def test_the_model_is_built_with_the_scaling_and_its_own_theta(tmp_path):
    from toolkit.model.load import build_model

    folder = build_family("llama3", tmp_path / "llama3")
    config = json.loads((folder / "config.json").read_text())
    theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta"))
    recipe = load_recipe(recipe_file(tmp_path, preset=None, path=str(folder), max_position_embeddings=2048,
                                     rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 512}))
    model = build_model(recipe.model)
    assert model.config.rope_parameters == {"rope_theta": theta, "rope_type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 512}
    assert model.config.max_position_embeddings == 2048
    plain = build_model(load_recipe(recipe_file(tmp_path, preset=None, path=str(folder))).model)
    rotary, plain_rotary = model.model.rotary_emb, plain.model.rotary_emb
    assert not torch.equal(rotary.inv_freq, plain_rotary.inv_freq)  # yarn interpolates the low frequencies
    assert rotary.attention_scaling != 1.0 and plain_rotary.attention_scaling == 1.0
    preset = build_model(load_recipe(recipe_file(tmp_path, rope_scaling={"rope_type": "linear", "factor": 2})).model)
    assert preset.config.rope_parameters["rope_type"] == "linear" and preset.config.rope_parameters["factor"] == 2.0


def test_a_model_with_rope_settings_per_attention_type_is_refused_in_one_line(tmp_path):
    from toolkit.errors import ToolkitError
    from toolkit.model.load import build_model

    folder = build_family("gemma3", tmp_path / "gemma3")
    recipe = load_recipe(recipe_file(tmp_path, preset=None, path=str(folder),
                                     rope_scaling={"rope_type": "linear", "factor": 2}))
    with pytest.raises(ToolkitError, match="keeps RoPE settings per attention type"):
        build_model(recipe.model)


@pytest.mark.launch
def test_lora_with_rope_scaling_merges_and_loads_with_it(tmp_path):
    """LoRA on a Llama 3 shaped base with yarn x4: the adapter records the scaling; `toolkit merge`
    writes it into the merged config.json (theta kept) and its logits check (adapter on the scaled
    base against the merged model) passes; `load_for_inference` of the adapter builds the scaled base;
    a full fine-tuning run's final/config.json carries it."""
    from toolkit.model.inference import load_for_inference

    folder = build_family("llama3", tmp_path / "llama3")
    pairs = [json.loads(x)
             for x in (ROOT / "examples" / "data" / "tasks_messages_train.jsonl").read_text().splitlines()[:16]]
    data = write_jsonl(tmp_path / "train.jsonl", pairs)
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
    for name, lora in (("lora", True), ("full", False)):
        path = write_recipe(tmp_path / f"{name}.yaml", output_dir=str(tmp_path / name), seed=3,
                            model={"path": str(folder), "rope_scaling": rope, "max_position_embeddings": 2048},
                            lora={"enabled": lora, "r": 4},
                            data={"train_files": [str(data)], "format": "messages", "max_seq_len": 256},
                            train={"micro_batch_size": 4, "max_steps": 2, "learning_rate": 1e-3})
        proc = run_toolkit("train", path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert len(read_metrics(tmp_path / name)) == 3
    expected = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
    record = json.loads((tmp_path / "lora" / "final" / "toolkit_base.json").read_text())
    assert record["config"] == {"rope_parameters": expected, "max_position_embeddings": 2048}
    full = json.loads((tmp_path / "full" / "final" / "config.json").read_text())
    theta = json.loads((folder / "config.json").read_text())["rope_parameters"]["rope_theta"]
    assert full["rope_parameters"] == {"rope_theta": theta, **expected} and full["max_position_embeddings"] == 2048

    merged = run_toolkit("merge", str(tmp_path / "lora" / "final"), "--out", str(tmp_path / "merged"))
    assert merged.returncode == 0, merged.stderr[-3000:]
    assert "max |logit difference|" in merged.stdout, merged.stdout  # the adapter on the scaled base = merged
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["rope_parameters"] == {"rope_theta": theta, **expected} and config["max_position_embeddings"] == 2048
    model, _ = load_for_inference(str(tmp_path / "lora" / "final"))
    assert model.config.rope_parameters == {"rope_theta": theta, **expected}


def head_gathers(mode: str) -> list[dict]:
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "head_gathers.py"), mode, port], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5], proc.stdout[-2000:]
    return steps


@pytest.mark.launch
def test_fsdp_gathers_the_chunked_output_layer_once_per_pass():
    """Issue 30, item 3: the chunked loss calls the output layer once per chunk (8 or 6 here, as each
    micro-batch's targets decide) and again in each chunk's recompute in backward. Under FSDP2 the
    root group that holds it is unsharded once in forward and once in backward, whatever the chunks."""
    steps = head_gathers("fsdp")
    assert all(s["forward_gathers"] == 1 and s["backward_gathers"] == 1 for s in steps), steps


@pytest.mark.launch
def test_zero3_gathers_the_chunked_output_layer_once_per_micro_batch():
    """The same under DeepSpeed ZeRO-3 (every tensor partitioned). Its trace of module calls,
    complete from step 2, keeps the weight gathered only while every forward calls the output layer
    equally often; with the chunk count following each micro-batch's targets (8, 6, 8, ...) it
    gathered per chunk and per recompute (measured 2026-11-26: 8 forward and 16 backward gathers at
    8 chunks, 1 and 11 at 6). Now each forward calls it the run's bound of times (10 here; the
    extra calls see no rows): 1 gather in forward, none in backward."""
    steps = head_gathers("zero3")
    assert all(s["forward_gathers"] == 1 and s["backward_gathers"] == 0 for s in steps[1:]), steps


# -- model.tiled_mlp and model.activation_offload (item 2) ---------------------------------------


def tiny(tmp_path, **model):
    from toolkit.model.load import build_model

    torch.manual_seed(0)
    recipe = load_recipe(recipe_file(tmp_path, preset="tiny-llama-mini", gradient_checkpointing=True, **model))
    return build_model(recipe.model)


def loss_and_grads(model, ids, context=None):
    import contextlib

    model.zero_grad(set_to_none=True)
    with (context or contextlib.nullcontext)():
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_tiled_mlp_runs_each_mlp_in_tiles_and_learns_the_same(tmp_path):
    """tiny-llama-mini (hidden 64), rows of up to 150 positions: every MLP call runs as 3 tiles
    (ceil(150 / 64)), in forward and in backward's recomputes, also for a shorter batch (the count
    is the run's, not the batch's: ZeRO-3 ranks must call alike); loss and every gradient equal the
    untiled model's (same weights) within float rounding."""
    from toolkit.model.activations import tile_mlps

    plain, tiled = tiny(tmp_path), tiny(tmp_path)
    tiled.load_state_dict(plain.state_dict())
    assert tile_mlps(tiled, 150) == (3, tiled.config.num_hidden_layers)
    widths = []
    tiled.model.layers[0].mlp.gate_proj.register_forward_hook(lambda m, i, o: widths.append(i[0].shape[-2]))
    ids = torch.randint(0, tiled.config.vocab_size, (2, 150))
    want, want_grads = loss_and_grads(plain, ids)
    have, have_grads = loss_and_grads(tiled, ids)
    # forward's 3 tiles, then backward's recomputes (the layer's, each tile's; torch stops a
    # recompute early once it has what backward needs): never the whole 150 positions at once
    assert widths[:3] == [50, 50, 50] and len(widths) > 3 and set(widths) == {50}, widths
    torch.testing.assert_close(have, want, rtol=1e-6, atol=0)
    for name, grad in want_grads.items():
        torch.testing.assert_close(have_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    widths.clear()
    with torch.no_grad():
        tiled(input_ids=ids[:, :10])
    assert widths == [4, 3, 3]


def test_activation_offload_keeps_the_checkpointed_inputs_in_host_copies_and_learns_the_same(tmp_path):
    """With gradient checkpointing the tensors saved outside the checkpointed layers are each layer's
    inputs (and the final norm's and the rotary tables): all of them pass through the offload hooks,
    the rotary tables once although every layer saves them; loss and gradients are bitwise those of
    the plain run (the copies are exact)."""
    from toolkit.model.activations import Offload

    model = tiny(tmp_path)
    ids = torch.randint(0, model.config.vocab_size, (2, 100))
    want, want_grads = loss_and_grads(model, ids)
    offload = Offload(min_bytes=0)
    packed = []
    pack = offload.pack
    offload.pack = lambda t: packed.append(t.shape) or pack(t)
    have, have_grads = loss_and_grads(model, ids, offload)
    hidden = torch.Size([2, 100, 64])
    layers = model.config.num_hidden_layers
    assert packed.count(hidden) >= layers, packed  # each layer's input, and the final norm's
    assert offload.bytes >= layers * hidden.numel() * 4
    assert offload.bytes < sum(torch.Size(s).numel() * 4 for s in packed)  # the rotary tables were copied once
    assert torch.equal(have, want)
    for name, grad in want_grads.items():
        assert torch.equal(have_grads[name], grad), name


def test_activation_offload_needs_checkpointing_and_tiling_needs_a_dense_model(tmp_path):
    import yaml

    from toolkit.errors import ToolkitError
    from toolkit.model.load import build_model

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "run"), "model": {"preset": "tiny-llama",
                                    "activation_offload": True}, "data": {"train_files": ["x.jsonl"]}}))
    with pytest.raises(ConfigError) as e:
        load_recipe(path)
    assert e.value.key == "model.activation_offload" and "gradient_checkpointing=true" in str(e.value)
    from toolkit.model.activations import tile_mlps

    folder = build_family("mixtral", tmp_path / "mixtral")
    moe = build_model(load_recipe(recipe_file(tmp_path, preset=None, path=str(folder))).model)
    with pytest.raises(ToolkitError, match="model.tiled_mlp: for dense models"):
        tile_mlps(moe, 128)


@pytest.mark.launch
def test_tiled_mlp_and_activation_offload_learn_the_same_on_every_backend(matrix_dir):
    """Packed rows of 128 tokens on tiny-llama-mini (hidden 64: two MLP tiles per row), gradient
    checkpointing on; 4 steps. DDP, FSDP and ZeRO-3 on 2 processes with model.tiled_mlp and
    model.activation_offload equal one process without them (losses, final weights within 1e-5):
    the tiles' gradients reach each backend's hooks once per step, as DeepSpeed's own TiledMLP would
    not under DDP."""
    from helpers import accelerate_launch, launch_config_for, load_weights, recipe_for, train_losses

    runs = {}
    for name, backend in (("single", None), ("ddp", "ddp"), ("fsdp", "fsdp"), ("zero3", "zero3")):
        recipe = recipe_for(matrix_dir, "full", f"long_{name}", micro=4 if backend is None else 2)
        recipe["model"]["gradient_checkpointing"] = True
        if backend is not None:
            recipe["model"].update(tiled_mlp=True, activation_offload=True)
            recipe["train"]["gradient_accumulation_steps"] = 2
        recipe["data"].update(packing=True, max_seq_len=128)
        recipe["train"].update(max_steps=4, eval_every_steps=0)
        path = write_recipe(matrix_dir / f"long_{name}_recipe.yaml", **recipe)
        launcher = None if backend is None else accelerate_launch(launch_config_for(backend, matrix_dir))
        proc = run_toolkit("train", path, launcher=launcher, env={"PYTHONWARNINGS": "ignore"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        if backend is not None:
            assert "activations: gradient checkpointing, tiled MLP" in proc.stderr
            assert "tiled MLP: each of 2 MLPs runs as 2 tiles of at most 64 positions" in proc.stdout
        runs[name] = matrix_dir / f"long_{name}"
    want, weights = train_losses(runs["single"]), load_weights(runs["single"] / "final")
    assert len(want) == 4
    for name in ("ddp", "fsdp", "zero3"):
        assert train_losses(runs[name]) == pytest.approx(want, rel=1e-5), name
        have = load_weights(runs[name] / "final")
        assert have.keys() == weights.keys()
        for key, w in weights.items():
            torch.testing.assert_close(have[key], w, rtol=0, atol=1e-5, msg=f"{name} {key}")


def test_activation_offload_never_hands_one_tensor_the_copy_of_another_at_the_same_address():
    """The GPU's caching allocator gives a freed activation's memory to the next tensor of its size;
    an offload index by address then returned the earlier tensor's copy for the later one (losses
    off by 16% at step 2 on an H100, 2026-11-26). Here the same memory holds two tensors in turn,
    each new to torch (version 0), as the allocator would hand it out: each gets its own copy."""
    import array

    from toolkit.model.activations import Offload

    memory = bytearray(array.array("f", [1.0] * 1024).tobytes())
    offload = Offload(min_bytes=0)
    first = torch.frombuffer(memory, dtype=torch.float32)
    packed_first = offload.pack(first)
    del first
    memory[:] = bytes(4 * 1024)  # written outside torch: no version change
    second = torch.frombuffer(memory, dtype=torch.float32)
    assert offload.unpack(offload.pack(second)).sum() == 0
    assert offload.unpack(packed_first).sum() == 1024
    assert offload.pack(second) is offload.pack(second)  # the same tensor saved twice: one copy


def test_the_estimate_counts_tiling_and_offload():
    """toolkit estimate's arithmetic for the two keys (one GPU, bf16 autocast over fp32 weights, a
    0.99B Llama shape at 32,768 tokens with checkpointing): the tiled MLP removes the MLP's 4i
    intermediates (2 bytes each) of all but one tile of hidden_size positions; offload moves all but
    two layers' checkpointed inputs (fp32 residual stream) to the host column, all of them counted there."""
    from dataclasses import replace

    from toolkit.backends.sizing import BY_NAME, ModelCounts, Setup, estimate

    h, i, layers, s = 2048, 5632, 22, 32768
    m = ModelCounts(name="1b", params=993_118_208, trainable=993_118_208, matmul=992_000_000, layer=45_000_000,
                    layers=layers, hidden=h, heads=32, kv=512, intermediate=i, vocab=262, head=262 * h, query=h)
    base = Setup(model=m, precision="bf16", seq_len=s, gradient_checkpointing=True)
    ddp = BY_NAME["DDP"]
    plain, tiled = estimate(ddp, base), estimate(ddp, replace(base, tiled_mlp=True))
    offload = estimate(ddp, replace(base, activation_offload=True))
    assert plain.gpu["activations"] - tiled.gpu["activations"] == (s - h) * 4 * i * 2
    assert plain.gpu["activations"] - offload.gpu["activations"] == (layers - 2) * s * h * 4
    assert offload.host_per_node == layers * s * h * 4 and plain.host_per_node == 0
