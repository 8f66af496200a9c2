"""`toolkit estimate`: the arithmetic against the ZeRO paper, against the bytes each rank really holds
after prepare() and a step (2 gloo processes), against the RSS that one forward and backward of a
real model takes, and the command line."""

import json
import sys

import pytest

from helpers import ROOT, accelerate_launch, launch_config_for, run_command, run_toolkit, write_recipe

LLAMA_7B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "intermediate_size": 11008,
            "vocab_size": 32000}


@pytest.fixture(scope="module")
def llama_7b_config(tmp_path_factory):
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("llama7b") / "config.json"
    LlamaConfig(**LLAMA_7B).to_json_file(path)
    return path


def test_llama_7b_model_states_follow_the_zero_paper(llama_7b_config):
    """Mixed-precision AdamW, full fine-tuning, 8 GPUs: 16 bytes per parameter, and ZeRO-1/2/3
    partition them as in Rajbhandari et al. (2 + 2 + 12/N, 2 + 14/N, 16/N)."""
    from toolkit.backends.model_counts import count_model, read_config
    from toolkit.backends.sizing import BY_NAME, Setup, estimate

    h, layers, i, vocab = (LLAMA_7B[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size"))
    # Embeddings and an untied head, then per layer q, k, v, o (h x h: as many KV heads as heads),
    # gate, up, down (h x i) and two RMSNorm weights, then the final norm.
    psi = 2 * vocab * h + layers * (4 * h * h + 3 * h * i + 2 * h) + h
    assert psi == pytest.approx(6.74e9, rel=1e-3)
    n = 8
    paper = {"ZeRO-1": (2 + 2 + 12 / n) * psi, "ZeRO-2": (2 + (2 + 12) / n) * psi, "ZeRO-3": 16 / n * psi,
             # DDP and FSDP here: fp32 weights under autocast, 4 + 4 + 8, also 16 bytes per parameter
             "DDP": 16 * psi, "FSDP full-shard": 16 / n * psi}
    setup = Setup(model=count_model(read_config(str(llama_7b_config)), "llama-7b"), gpus_per_node=n, precision="bf16")
    assert setup.model.params == setup.model.trainable == psi
    for name, want in paper.items():
        gpu = estimate(BY_NAME[name], setup).gpu
        got = gpu["params"] + gpu["gradients"] + gpu["optimizer"]
        assert got == pytest.approx(want, rel=0.02), (name, got / psi, want / psi)
    # The ZeRO-3 split itself: 2/N parameters, 2/N gradients, 12/N optimizer.
    gpu = estimate(BY_NAME["ZeRO-3"], setup).gpu
    assert [gpu[k] / psi for k in ("params", "gradients", "optimizer")] == pytest.approx([2 / n, 2 / n, 12 / n])


def saved_bytes_per_token_layer(shape: dict, lora: bool, regime: str, tokens: int = 128) -> float:
    """Bytes autograd saves per token in one decoder layer (a 2-layer model's minus a 1-layer one's,
    parameters left out), counted with saved_tensors_hooks on the CPU: the toolkit's LoRA (peft, all
    linear layers, adapters in fp32 as toolkit/model/load.py keeps them), the base fp32 or bf16, bf16
    compute under autocast or (regime half_plain, as DeepSpeed runs) without it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    counted = []
    for layers in (1, 2):
        config = LlamaConfig(vocab_size=262, num_hidden_layers=layers, max_position_embeddings=1024,
                             tie_word_embeddings=False, **shape)
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        if regime.startswith("half"):
            model = model.to(torch.bfloat16)
        if lora:
            model = get_peft_model(model, LoraConfig(r=shape["r"], lora_alpha=16, target_modules="all-linear",
                                                     task_type="CAUSAL_LM"))
            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.float()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        ids = torch.randint(3, 262, (1, tokens), generator=torch.Generator().manual_seed(1))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=regime in ("autocast", "half")):
            model(input_ids=ids, use_cache=False)
        counted.append(sum(seen.values()))
    return (counted[1] - counted[0]) / tokens


LORA_SHAPES = [{"hidden_size": 256, "intermediate_size": 704, "num_attention_heads": 4, "num_key_value_heads": 2,
                "r": 8},
               {"hidden_size": 384, "intermediate_size": 1024, "num_attention_heads": 6, "num_key_value_heads": 3,
                "r": 16}]


@pytest.mark.parametrize("regime", ["fp32", "autocast", "half", "half_plain"])
@pytest.mark.parametrize("shape", LORA_SHAPES, ids=["h256", "h384"])
def test_lora_changes_the_saved_activations_as_the_estimate_counts(shape, regime, tmp_path):
    """What LoRA adds to (16-bit base) or takes from (fp32 base) the tensors a decoder layer saves, per
    token: the estimate's term (sizing.lora_activation_bytes) equals what the hooks count, on two shapes
    and every regime. Without it, the estimate said 0.65 GiB for a LoRA + ZeRO-3 bf16 run that peaked at
    1.16 GiB on the H200 (2026-11-27): fp32 adapters over a bf16 base each keep an fp32 copy of their
    input. The adapters' own 16-bit copies under autocast are weights (buffers), not counted here."""
    from transformers import LlamaConfig

    from toolkit.backends import model_counts, sizing
    from toolkit.config import LoraConfig

    config = LlamaConfig(vocab_size=262, num_hidden_layers=2, **{k: v for k, v in shape.items() if k != "r"})
    m = model_counts.count_model(config, "model", LoraConfig(enabled=True, r=shape["r"], target_modules="all-linear"))
    base_regime = "half" if regime.startswith("half") else regime
    predicted = sizing.lora_activation_bytes(m, base_regime, autocast=regime != "half_plain")
    measured = saved_bytes_per_token_layer(shape, True, regime) - saved_bytes_per_token_layer(shape, False, regime)
    if regime in ("autocast", "half"):  # autocast's bf16 copies of the fp32 adapters: weights, not activations
        measured -= 2 * m.trainable / m.layers / 128
    assert measured == pytest.approx(predicted, abs=1.0), (measured, predicted)
    assert (predicted > 0) == base_regime.startswith("half")


def test_lora_trainable_parameters_match_peft():
    """The adapters are counted by arithmetic on the meta model; peft on the real preset agrees."""
    from toolkit.backends.model_counts import count_model, read_config
    from toolkit.config import LoraConfig, ModelConfig
    from toolkit.model.load import apply_lora, build_model, count_parameters

    for lora in (LoraConfig(enabled=True, r=4), LoraConfig(enabled=True, r=8, target_modules=["q_proj", "v_proj"]),
                 LoraConfig(enabled=True, r=2, use_dora=True)):
        counts = count_model(read_config("tiny-llama"), "tiny-llama", lora)
        trainable, total = count_parameters(apply_lora(build_model(ModelConfig(preset="tiny-llama")), lora))
        assert (counts.trainable, counts.params) == (trainable, total), lora


def test_sequence_parallel_splits_the_activations_not_the_model_states(llama_7b_config):
    """sp_size 2 (DeepSpeed's Ulysses): every rank holds half of each row, so the activations, the
    logits and the offloaded inputs are those of half the sequence without it; ZeRO partitions the
    model states over all 8 processes as before; DDP and FSDP cannot split a sequence and are
    neither listed nor recommended; the all-to-alls are added to the communication."""
    from dataclasses import replace

    from toolkit.backends.model_counts import count_model, read_config
    from toolkit.backends.sizing import BY_NAME, Setup, estimate, estimate_all, recommend

    model = count_model(read_config(str(llama_7b_config)), "llama-7b")
    base = Setup(model=model, gpus_per_node=8, seq_len=32768, gradient_checkpointing=True)
    split = replace(base, sequence_parallel=2)
    assert split.batch_text() == "micro-batch 1 x 32768 tokens, split across 2 ranks"
    deepspeed = [s for s in BY_NAME.values() if s.deepspeed]
    assert [r.strategy for r in estimate_all(split)] == deepspeed
    for variant in ({}, {"loss": "full"}, {"tiled_mlp": True}, {"activation_offload": True},
                    {"gradient_checkpointing": False, "precision": "fp32"}):
        whole, half, parted = (replace(s, **variant) for s in (base, replace(base, seq_len=16384), split))
        for strategy in deepspeed:
            w, h, p = (estimate(strategy, s) for s in (whole, half, parted))
            for key in ("activations", "logits"):
                assert p.gpu[key] == pytest.approx(h.gpu[key]), (variant, strategy.name, key)
            for key in ("params", "gradients", "optimizer", "buffers"):
                assert p.gpu[key] == w.gpu[key], (variant, strategy.name, key)
            assert p.host_per_node - w.host_per_node == pytest.approx(h.host_per_node - w.host_per_node)
            # sdpa, no tiled MLP: the layers' activations are all per position, so exactly half
            if not whole.tiled_mlp:
                assert p.gpu["activations"] == pytest.approx(w.gpu["activations"] / 2)
            if whole.loss == "full":
                assert p.gpu["logits"] == pytest.approx(w.gpu["logits"] / 2)
            # each pass of each layer: q, k, v (4096 each here) and the output of 16384 positions in
            # 2 bytes (bf16) or 4 (fp32), each rank sending half of it to the other
            passes = 3 if whole.gradient_checkpointing else 2
            all_to_all = 32 * passes * 16384 * 4 * 4096 * (4 if whole.precision == "fp32" else 2) / 2
            assert p.comm_per_step - w.comm_per_step == pytest.approx(all_to_all)
    # Without it FSDP shard-grad-op is the first to fit here; with it, DeepSpeed's ZeRO-2 and the sp_size to set.
    assert recommend(base).startswith("FSDP shard-grad-op")
    assert recommend(split).startswith("ZeRO-2 (accelerate_configs/zero2.yaml plus parallelism_config_sp_size: 2)")
    assert "DDP" not in recommend(split) and "FSDP" not in recommend(split)


def test_a_run_estimates_with_its_launch_sequence_parallelism(monkeypatch, tmp_path):
    """`run: estimate` takes sp_size from the environment `accelerate launch` gives its workers."""
    from types import SimpleNamespace

    import torch

    from toolkit.backends.run_sizing import estimate_for_run
    from toolkit.config import load_recipe

    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", output_dir=str(tmp_path / "run"),
                                      model={"preset": "tiny-llama"},
                                      data={"train_files": [str(tmp_path / "train.jsonl")], "max_seq_len": 4096}))
    accelerator = SimpleNamespace(device=torch.device("cpu"), num_processes=4)
    for name, value in (("ACCELERATE_USE_DEEPSPEED", "true"), ("LOCAL_WORLD_SIZE", "4"), ("WORLD_SIZE", "4")):
        monkeypatch.setenv(name, value)
    plain, _ = estimate_for_run(recipe, accelerator, {"zero_optimization": {"stage": 2}})
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    split, _ = estimate_for_run(recipe, accelerator, {"zero_optimization": {"stage": 2}})
    assert "(ZeRO-2, toolkit estimate)" in split and "x 4096 tokens, split across 2 ranks)" in split, split
    assert "split across" not in plain
    assert split.split(", activations")[0] == plain.split(", activations")[0]  # params, gradients, optimizer, buffers
    assert split != plain


# ------------------------------------------------------------------ estimate vs bytes held per rank


@pytest.mark.launch
@pytest.mark.parametrize("backend", ["ddp", "fsdp", pytest.param("zero2", marks=pytest.mark.slow), "zero3"])  # ZeRO-2:
def test_estimate_matches_bytes_each_rank_holds(backend, matrix_dir, tmp_path):  # by hand, between DDP and ZeRO-3
    """2 gloo processes, fp32 (what runs on a CPU host), full fine-tuning: the parameters, gradients
    and optimizer states each rank holds after prepare(), a backward and a step (measured by
    tests/estimate_probe.py) are what `toolkit estimate --recipe --config_file` says, within 5%."""
    recipe = write_recipe(tmp_path / "recipe.yaml", output_dir=str(tmp_path / "run"), seed=3,
                          model={"preset": "tiny-llama"},
                          data={"train_files": [str(matrix_dir / "train.jsonl")], "max_seq_len": 64},
                          train={"micro_batch_size": 2, "precision": "fp32"})
    launch = launch_config_for(backend, matrix_dir)  # ZeRO-3: every tensor partitioned (threshold 0)
    proc = run_command(accelerate_launch(launch)[:-1] + [str(ROOT / "tests" / "estimate_probe.py"), str(recipe),
                                                          str(tmp_path)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    held = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(h["world_size"] == 2 for h in held)

    # --gpus 2: the launch ran with --num_processes 2 (the shipped YAMLs say 8)
    out = run_toolkit("estimate", "--recipe", recipe, "--config_file", launch, "--gpus", "2", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    row = next(r for r in report["strategies"] if r["strategy"] == report["launched"])
    names = {"ddp": "DDP", "fsdp": "FSDP full-shard", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}
    assert report["launched"] == names[backend]
    assert report["setup"]["gpus"] == 2 and report["setup"]["precision"] == "fp32"
    for rank, h in enumerate(held):
        for key in ("params", "gradients", "optimizer"):
            want = row["gpu_bytes"][key]
            print(f"{backend} rank {rank} {key}: held {h[key]:,} estimated {want:,}")
            assert h[key] == pytest.approx(want, rel=0.05), (backend, rank, key, h[key], want)


# ------------------------------------------------------------------ activations vs RSS


RSS_SCRIPT = """
import json, resource, sys, torch
from toolkit.config import ModelConfig
from toolkit.model.load import build_model
from toolkit.training.loss import token_loss_sum, use_token_loss

model = build_model(ModelConfig(path=sys.argv[1]))  # fp32, sdpa, as training builds it
use_token_loss(model, sys.argv[3], int(sys.argv[4]))
model.train()
torch.manual_seed(0)

def forward_backward(seq_len):
    ids = torch.randint(0, model.config.vocab_size, (1, seq_len))
    token_loss_sum(model, {"input_ids": ids, "labels": ids}).backward()

forward_backward(8)  # the gradients exist from here on; the measured pass accumulates into them
before = int(open("/proc/self/statm").read().split()[1]) * 4096
forward_backward(int(sys.argv[2]))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"growth": peak - before}))
"""


RSS_CASES = [(512, "full", 0), (1024, "full", 0), (1024, "chunked", 128)]


@pytest.fixture(scope="module")
def rss_growth(real_model_dir):
    """{case: bytes} for RSS_CASES, each measured in a fresh single-threaded process; the three run
    at once (each process's own peak RSS is what is measured, so they do not disturb each other)."""
    from helpers import finish, start

    env = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    procs = {case: start([sys.executable, "-c", RSS_SCRIPT, str(real_model_dir), str(case[0]), case[1],
                          str(case[2] or 1024)], env=env) for case in RSS_CASES}
    growth = {}
    for case, proc in procs.items():
        code, out, err = finish(proc, timeout=600)
        assert code == 0, err[-3000:]
        growth[case] = json.loads(out.strip().splitlines()[-1])["growth"]
    return growth


@pytest.mark.launch
@pytest.mark.real_model
@pytest.mark.parametrize("seq_len,loss,chunk", RSS_CASES)
def test_activation_estimate_matches_rss_of_a_real_model(seq_len, loss, chunk, real_model_dir, rss_growth):
    """SmolLM2-135M in fp32 on the CPU: the peak RSS growth of one forward and backward (a fresh
    process; every freed tensor goes back to the system) is the estimate's activations + logits,
    within 10%, with the full loss and with the chunked one (its logits term 1/8 of the full one's
    here). Gradients are allocated by a small pass first, so the growth is what autograd keeps."""
    growth = rss_growth[(seq_len, loss, chunk)]
    chunk = chunk or 1024
    out = run_toolkit("estimate", "--model", real_model_dir, "--precision", "fp32", "--seq-len", seq_len,
                      "--loss", loss, "--loss-chunk-tokens", chunk, "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    gpu = next(r for r in json.loads(out.stdout)["strategies"] if r["strategy"] == "DDP")["gpu_bytes"]
    estimated = gpu["activations"] + gpu["logits"]
    print(f"\nseq {seq_len}: RSS growth {growth / 2**20:.0f} MiB, estimated {estimated / 2**20:.0f} MiB "
          f"(activations {gpu['activations'] / 2**20:.0f} + logits {gpu['logits'] / 2**20:.0f})")
    assert growth == pytest.approx(estimated, rel=0.10)


# ------------------------------------------------------------------ the command


@pytest.mark.launch
def test_table_and_json_on_a_preset_and_a_config(llama_7b_config):
    table = run_toolkit("estimate", "--model", "tiny-llama", "--gpus", "2", "--throughput", "1000", "--tokens", "1e6",
                        "--price", "2.5")
    assert table.returncode == 0, table.stderr[-3000:]
    lines = table.stdout.splitlines()
    assert lines[0].startswith("model: tiny-llama: 0.81M parameters (full fine-tuning)")
    for name in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP full-shard", "FSDP shard-grad-op", "ZeRO-2 + CPU optimizer",
                 "ZeRO-3 + CPU optimizer", "ZeRO-3 + CPU params+optimizer", "ZeRO-3 + NVMe params+optimizer"):
        assert any(line[1:].startswith(name + " ") for line in lines), name
    assert "recommendation: DDP (accelerate_configs/ddp.yaml)" in table.stdout
    # 1e6 tokens at 1000 tokens/s on each of 2 GPUs: 500 s, 0.28 GPU-hours at 2.5 = 0.69
    assert ("epoch: 1e+06 tokens at 1,000 tokens/s per GPU on 2 GPUs: 0.14 h (0.3 GPU-hours), 0.69 at 2.5"
            in table.stdout)

    out = run_toolkit("estimate", "--model", llama_7b_config, "--gpus", "8", "--seq-len", "4096", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["model"]["params"] == 6738415616 and report["setup"]["gpus"] == 8
    rows = {r["strategy"]: r for r in report["strategies"]}
    assert not rows["DDP"]["fits"] and rows["ZeRO-3"]["fits"]
    assert rows["ZeRO-3 + CPU params+optimizer"]["host_bytes_per_node"] > 0
    assert rows["DDP"]["comm_bytes_per_step"] == pytest.approx(2 * 7 / 8 * 4 * 6738415616)
    assert report["recommendation"].startswith("FSDP shard-grad-op") and report["epoch"] is None


@pytest.mark.launch
def test_sp_size_on_the_command_line(llama_7b_config, capsys):
    """--sp-size 2: the header says so, DDP and FSDP are left out, the activations (full loss: the
    logits too) are those of half the sequence and the model states those of all 8 GPUs."""
    args = ["estimate", "--model", llama_7b_config, "--gpus", "8", "--gradient-checkpointing", "--loss", "full"]
    table = run_toolkit(*args, "--seq-len", "32768", "--sp-size", "2")
    assert table.returncode == 0, table.stderr[-3000:]
    lines = table.stdout.splitlines()
    assert "micro-batch 1 x 32768 tokens, split across 2 ranks" in lines[1] and "; sequence parallel 2" in lines[1]
    assert not any(line[1:].startswith(("DDP", "FSDP")) for line in lines)
    assert any(line.startswith("sequence parallel 2: DeepSpeed only") for line in lines)
    assert "recommendation: ZeRO-" in table.stdout and "parallelism_config_sp_size: 2" in table.stdout

    reports = {}
    for seq_len, sp in (("32768", "2"), ("32768", "1"), ("16384", "1")):  # in this process (a launch each: 60 s)
        reports[seq_len, sp] = estimate_json(capsys, *args[1:], "--seq-len", seq_len, "--sp-size", sp)
    split = reports["32768", "2"]
    assert split["setup"]["sequence_parallel"] == 2 and split["setup"]["gpus"] == 8
    rows = [{r["strategy"]: r["gpu_bytes"] for r in reports[k]["strategies"]} for k in reports]
    assert set(rows[0]) == {"ZeRO-1", "ZeRO-2", "ZeRO-3", "ZeRO-2 + CPU optimizer", "ZeRO-3 + CPU optimizer",
                            "ZeRO-3 + CPU params+optimizer", "ZeRO-3 + NVMe params+optimizer"}
    assert "DDP" in rows[1] and "FSDP full-shard" in rows[1]
    for name, parted in rows[0].items():
        whole, half = rows[1][name], rows[2][name]
        for key in ("activations", "logits"):
            assert parted[key] == pytest.approx(half[key], abs=1), (name, key)
            assert parted[key] == pytest.approx(whole[key] / 2, abs=1), (name, key)
        for key in ("params", "gradients", "optimizer", "buffers"):
            assert parted[key] == whole[key], (name, key)


@pytest.mark.launch
@pytest.mark.parametrize("args, message", [
    (["--model", "/no/such/model"], "error: --model: not found: /no/such/model"),
    (["--model", "tiny-llama", "--gpus", "0"], "error: --gpus: must be at least 1, got 0"),
    (["--model", "tiny-llama", "--gpu-memory", "-8"], "error: --gpu-memory: must be positive, got -8.0"),
    (["--recipe", "/no/such/recipe.yaml"], "error: /no/such/recipe.yaml: recipe file not found"),
    (["--model", "tiny-llama", "--config_file", "accelerate_configs/zero3.yaml"],
     "error: --config_file: only with --recipe"),
    (["--model", "tiny-llama", "--sp-size", "0"], "error: --sp-size: must be at least 1, got 0"),
    (["--model", "tiny-llama", "--gpus", "3", "--sp-size", "2"],
     "error: --sp-size is 2 but 3 GPUs do not divide into groups of 2"),
    (["--model", "tiny-llama", "--gpus", "2", "--nodes", "3", "--sp-size", "4"],
     "error: --sp-size is 4 but 6 GPUs do not divide into groups of 4"),
])
def test_mistakes_are_one_line(args, message):
    from helpers import user_error_line

    assert user_error_line(run_toolkit("estimate", *args)).startswith(message)


@pytest.mark.launch
def test_a_hub_id_without_a_network_is_one_line_at_once_and_a_cached_one_is_read(tmp_path):
    """The Hub is asked once (huggingface_hub's downloads retry five times over half a minute, a line
    each): with nowhere to connect to, one line naming the cache and the Hub's answer, no retries;
    the same id's config.json in the cache is read offline."""
    from helpers import user_error_line

    cache = tmp_path / "hub"
    nowhere = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "0"}
    result = run_toolkit("estimate", "--model", "org/tiny", env=nowhere)
    assert "Retry" not in result.stderr, result.stderr
    assert user_error_line(result).startswith(f"error: --model: cannot read the config.json of org/tiny: not in the "
                                              f"Hugging Face cache ({cache}) and Hub: ")
    snapshot = cache / "models--org--tiny" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((ROOT / "toolkit/model/presets/tiny-llama.json").read_text())
    (cache / "models--org--tiny" / "refs").mkdir()
    (cache / "models--org--tiny" / "refs" / "main").write_text("0" * 40)
    for env in (nowhere, {**nowhere, "HF_HUB_OFFLINE": "1"}):
        result = run_toolkit("estimate", "--model", "org/tiny", "--json", env=env)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["model"]["params"] > 0


@pytest.mark.launch
def test_bad_launch_config_is_one_line(tmp_path, matrix_dir):
    recipe = write_recipe(tmp_path / "r.yaml", output_dir=str(tmp_path / "run"), model={"preset": "tiny-llama"},
                          data={"train_files": [str(matrix_dir / "train.jsonl")]})
    from helpers import user_error_line

    line = user_error_line(run_toolkit("estimate", "--recipe", recipe, "--config_file", tmp_path / "missing.yaml"))
    assert line == f"error: accelerate config not found: {tmp_path / 'missing.yaml'}"


@pytest.mark.launch
def test_a_run_logs_its_estimate(tmp_path, data_files):
    """The start of every run prints the same estimate for its launch (here one CPU process: the
    per-process bytes, no memory limit to judge against)."""
    from helpers import base_recipe

    recipe = write_recipe(tmp_path / "r.yaml", **base_recipe(tmp_path, *data_files, train__max_steps=2))
    proc = run_toolkit("train", recipe)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stderr.splitlines() if line.startswith("run: estimate"))
    # tiny-llama-mini: 126,016 fp32 parameters (0.48 MiB), gradients as many, AdamW twice that
    assert line.startswith("run: estimate per process (one process, toolkit estimate): params 0.5 MiB, gradients "
                           "0.5 MiB, optimizer 1.0 MiB, buffers 0.0 MiB, activations "), line
    assert line.endswith("; no memory limit known on cpu"), line


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": 100, "num_attention_heads": 3},
     "is not a model config: The hidden size (100) is not a multiple of the number of "
     "attention heads (3)."),
    ({"hidden_size": -100, "num_attention_heads": 4}, ": hidden_size is -100; it must be a positive whole number"),
    ({"num_hidden_layers": 0}, ": num_hidden_layers is 0; it must be a positive whole number"),
    ({"hidden_size": "100"}, "is not a model config: Field 'hidden_size' expected int, got str"),
])
def test_a_config_transformers_rejects_is_one_line(tmp_path, change, message):
    """A model config that transformers rejects, or whose sizes cannot build a model (negative, zero,
    quoted), is refused naming the file (it used to end in a traceback from the meta-device build)."""
    from toolkit.backends.model_counts import read_config
    from toolkit.errors import ToolkitError

    data = {"model_type": "llama", "hidden_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
            "intermediate_size": 200, "vocab_size": 1000, **change}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ToolkitError) as e:
        read_config(str(tmp_path))
    assert str(e.value).startswith(f"--model: {path}") and message in str(e.value), str(e.value)


# ------------------------------------------------------------------ LoRA bytes, overrides, the shipped 8B recipes


def estimate_json(capsys, *args) -> dict:
    """`toolkit estimate ... --json` in this process (it starts none)."""
    from toolkit.cli import main

    code = main(["estimate", *map(str, args), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def run_estimate_text(capsys, *args) -> str:
    """`toolkit estimate ...`'s table and lines, in this process."""
    from toolkit.cli import main

    code = main(["estimate", *map(str, args)])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def held_bytes(precision: str, model_dtype: str) -> int:
    """The parameter bytes of tiny-llama with LoRA (r 8, every linear layer) as training builds it:
    the base in model.dtype, the adapters in fp32."""
    from toolkit.config import LoraConfig, ModelConfig
    from toolkit.model.load import DTYPES, apply_lora, build_model

    model = apply_lora(build_model(ModelConfig(preset="tiny-llama", dtype=model_dtype), DTYPES[model_dtype],
                                   DTYPES[precision]), LoraConfig(enabled=True, r=8))
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_lora_parameter_bytes_are_those_of_the_built_model(precision, capsys):
    """`--model ... --lora`: the frozen base stored as the shipped LoRA recipes store it (model.dtype
    = train.precision), the adapters in fp32, so one GPU holds what training builds. It counted the
    base in fp32 under bf16: 1.9 MB estimated for 1.1 MB held here, 32 GB for 16 GB at 8B."""
    report = estimate_json(capsys, "--model", "tiny-llama", "--lora", "--precision", precision)
    params = next(r for r in report["strategies"] if r["strategy"] == "DDP")["gpu_bytes"]["params"]
    assert report["setup"]["base_dtype"] == precision
    assert params == held_bytes(precision, precision)


def test_recipe_takes_dotted_overrides(capsys, tmp_path):
    """`--recipe RECIPE.yaml key=value ...`, as `toolkit train` takes them: a LoRA recipe over an fp32
    base (quickstart_lora.yaml) turned into a bf16 one, its micro-batch changed; the base bytes
    follow model.dtype. Overrides without a recipe, or of a key no recipe has, are one line."""
    from toolkit.cli import main

    recipe = ROOT / "examples" / "recipes" / "quickstart_lora.yaml"
    preset = ["model.path=null", "model.preset=tiny-llama"]  # the recipe's base is the SFT quickstart's result
    as_shipped = estimate_json(capsys, "--recipe", recipe, *preset)
    changed = estimate_json(capsys, "--recipe", recipe, *preset, "model.dtype=bf16", "train.precision=bf16",
                            "train.micro_batch_size=4", "lora.r=8")
    assert (as_shipped["setup"]["precision"], as_shipped["setup"]["base_dtype"]) == ("fp32", "fp32")
    assert (changed["setup"]["precision"], changed["setup"]["base_dtype"]) == ("bf16", "bf16")
    assert (as_shipped["setup"]["micro_batch"], changed["setup"]["micro_batch"]) == (16, 4)
    params = {r["strategy"]: r["gpu_bytes"]["params"] for r in changed["strategies"]}
    assert params["DDP"] == held_bytes("bf16", "bf16")
    for args, message in ((["--model", "tiny-llama", "train.micro_batch_size=4"],
                           "error: train.micro_batch_size=4: key=value overrides change a recipe's keys"),
                          (["--recipe", recipe, "train.no_such_key=1"],
                           "error: command line (train.no_such_key=1): train.no_such_key: unknown key")):
        assert main(["estimate", *map(str, args)]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.strip().splitlines()[-1].startswith(message), err


# ------------------------------------------------------------------ QLoRA: a 4-bit base


@pytest.fixture(scope="module")
def full_precision_folder(tmp_path_factory):
    """A local folder of the tiny-llama preset (4 layers, 28 linear layers but the output layer):
    what model.load_in_4bit quantizes while loading it."""
    from toolkit.config import ModelConfig
    from toolkit.model.load import build_model

    folder = tmp_path_factory.mktemp("base")
    build_model(ModelConfig(preset="tiny-llama")).save_pretrained(folder)
    return folder


def qlora_recipe(tmp_path, folder, precision: str, load_in_4bit: bool = True):
    name = f"{precision}-{'4bit' if load_in_4bit else 'full'}.yaml"
    return write_recipe(tmp_path / name, output_dir=str(tmp_path / "run"),
                        model={"path": str(folder), "load_in_4bit": load_in_4bit, "dtype": precision},
                        lora={"enabled": True, "r": 8}, data={"train_files": [str(tmp_path / "train.jsonl")]},
                        train={"precision": precision})


def held_4bit_bytes(recipe) -> int:
    """Every distinct tensor of the model as training builds it (build_model, then apply_lora): its
    parameters (a Params4bit's packed storage), buffers and each 4-bit weight's quantization state."""
    from toolkit.model.load import DTYPES, apply_lora, build_model

    model = apply_lora(build_model(recipe.model, DTYPES[recipe.model.dtype], DTYPES[recipe.train.precision]),
                       recipe.lora)
    held = {}
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        tensors = [p] if state is None else [p, state.absmax, state.code, state.offset, state.state2.absmax,
                                             state.state2.code]
        held.update({t.data_ptr(): t.numel() * t.element_size() for t in tensors})
    held.update({b.data_ptr(): b.numel() * b.element_size() for b in model.buffers()})
    return sum(held.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_4bit_base_is_counted_as_loaded(precision, full_precision_folder, tmp_path, capsys):
    """model.load_in_4bit: the estimate's parameter bytes are what the model built as training builds
    it holds (tiny-llama, NF4 with double quantization, LoRA r 8): 982,976 bytes held, 982,820
    estimated, in fp32 and bf16 alike, since peft casts the rest of the base to fp32 whatever
    model.dtype says. It counted the whole base in model.dtype: 1.9 MB in bf16 (+94%). ZeRO-3 and FSDP
    divide the packed weights by N, not the quantization state; autocast copies no 4-bit weight."""
    pytest.importorskip("bitsandbytes")
    from toolkit.backends.sizing import NF4_BYTES, NF4_LAYER_BYTES, NF4_STATE_BYTES
    from toolkit.config import load_recipe

    recipe = qlora_recipe(tmp_path, full_precision_folder, precision)
    held = held_4bit_bytes(load_recipe(recipe))
    report = estimate_json(capsys, "--recipe", recipe)
    m, rows = report["model"], {r["strategy"]: r["gpu_bytes"] for r in report["strategies"]}
    assert report["setup"]["four_bit"] and (m["quantized"], m["quantized_layers"]) == (737_280, 28)
    with capsys.disabled():
        print(f"\n{precision}: held {held:,} bytes, estimated {rows['DDP']['params']:,}")
    assert rows["DDP"]["params"] == pytest.approx(held, rel=0.01)
    plain = estimate_json(capsys, "--recipe", qlora_recipe(tmp_path, full_precision_folder, precision, False))
    assert {r["strategy"]: r["gpu_bytes"] for r in plain["strategies"]}["DDP"]["params"] > 1.3 * held

    two = estimate_json(capsys, "--recipe", recipe, "--gpus", "2")
    two = {r["strategy"]: r["gpu_bytes"] for r in two["strategies"]}
    q = m["quantized"]
    state = NF4_STATE_BYTES * q + NF4_LAYER_BYTES * m["quantized_layers"]
    rest = m["params"] - q  # the adapters and the fp32 rest of the base
    e = 4 if precision == "fp32" else 2
    assert two["DDP"]["params"] == rows["DDP"]["params"]  # DDP and ZeRO-1/2: the 4-bit weights whole on each rank
    assert two["ZeRO-2"]["params"] == pytest.approx(e * rest + NF4_BYTES * q + state, abs=1)
    assert two["FSDP full-shard"]["params"] == pytest.approx((4 * rest + NF4_BYTES * q) / 2 + state, abs=1)
    assert two["ZeRO-3"]["params"] == pytest.approx((e * rest + NF4_BYTES * q) / 2 + state, abs=1)
    # one process: no gradient buckets; under bf16 autocast's copies of the output layer and the
    # adapters, and one 4-bit weight (the MLP's 128 x 352) dequantized in the compute dtype
    copies = 2 * (m["matmul"] - q + m["trainable"]) if precision == "bf16" else 0
    assert rows["DDP"]["buffers"] == copies + e * 128 * 352


def test_load_in_4bit_on_the_command_line(full_precision_folder, tmp_path, capsys):
    """--load-in-4bit implies --lora and says so in the table and the JSON; with --recipe it is the
    recipe's model.load_in_4bit. A preset cannot be loaded in 4-bit: refused in one line, as training
    refuses it."""
    import importlib.util

    from toolkit.cli import main

    config = full_precision_folder / "config.json"
    report = estimate_json(capsys, "--model", config, "--load-in-4bit", "--precision", "bf16")
    assert report["setup"]["four_bit"] and report["model"]["trainable"] < report["model"]["params"]
    lora = estimate_json(capsys, "--model", config, "--lora", "--precision", "bf16")
    assert not lora["setup"]["four_bit"] and lora["model"] == report["model"]
    params = [{r["strategy"]: r["gpu_bytes"]["params"] for r in x["strategies"]} for x in (report, lora)]
    assert params[0]["DDP"] < params[1]["DDP"] and params[0]["ZeRO-3"] < params[1]["ZeRO-3"]
    if importlib.util.find_spec("bitsandbytes"):  # a recipe with load_in_4bit needs it installed
        recipe = estimate_json(capsys, "--recipe", qlora_recipe(tmp_path, full_precision_folder, "bf16", False),
                               "--load-in-4bit")
        assert recipe["setup"]["four_bit"] and recipe["strategies"] == report["strategies"]

    assert main(["estimate", "--model", str(config), "--load-in-4bit"]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].endswith("(QLoRA: 0.74M of the base's weights in 4-bit NF4, 0.07M trainable); "
                                          "4 layers, hidden 128, vocab 262"), table.splitlines()[0]
    assert main(["estimate", "--model", "tiny-llama", "--load-in-4bit"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --load-in-4bit: tiny-llama is a preset, built in full precision; QLoRA quantizes a model folder "
        "while loading it (give its folder or config.json)")
    preset = write_recipe(tmp_path / "preset.yaml", output_dir=str(tmp_path / "run"), model={"preset": "tiny-llama"},
                          data={"train_files": [str(tmp_path / "train.jsonl")]})
    assert main(["estimate", "--recipe", str(preset), "--load-in-4bit"]) == 2
    assert "model.load_in_4bit: QLoRA quantizes a model.path base" in capsys.readouterr().err


# The real configs' shapes (config.json of meta-llama/Llama-3.1-8B-Instruct and Qwen/Qwen3-8B).
FULL_8B = {"llama3.1-8b-full": ("llama", {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                                          "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
                                          "max_position_embeddings": 131072, "tie_word_embeddings": False}),
           "qwen3-8b-full": ("qwen3", {"hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
                                       "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288,
                                       "vocab_size": 151936, "max_position_embeddings": 40960,
                                       "tie_word_embeddings": False})}


@pytest.mark.parametrize("name", sorted(FULL_8B))
def test_the_full_8b_recipes_launch_what_estimate_recommends(name, capsys, tmp_path):
    """The shipped full-fine-tuning 8B recipes, as shipped, on the 8 x 80 GiB their header names: the
    launch config in the header is the recommendation (or fits at the same step of the path, the
    "also fits"). llama3.1-8b-full launched ZeRO-3 where ZeRO-2 holds 39 of 80 GiB per GPU and sends
    26 GiB per step to ZeRO-3's 39 (its parameters gathered twice per micro-batch): the recipe moved
    to ZeRO-2, and qwen3-8b-full from FSDP full-shard to shard-grad-op."""
    import re

    model_type, config = FULL_8B[name]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, **config}))
    recipe = ROOT / "examples" / "recipes" / "models" / f"{name}.yaml"
    launch = re.search(r"^# launch: (?:\.venv/bin/)?accelerate launch --config_file (\S+)", recipe.read_text(), re.M)
    report = estimate_json(capsys, "--recipe", recipe, f"model.path={tmp_path}", "--config_file",
                           ROOT / launch.group(1))
    assert report["setup"]["gpus"] == 8 and report["setup"]["gpu_memory_gib"] == 80
    recommended = report["recommendation"]
    also = re.search(r"\(also fits: ([^)]*)\)$", recommended)
    fitting = [recommended.split(" (accelerate_configs/")[0]] + (also.group(1).split(", ") if also else [])
    assert report["launched"] in fitting, (report["launched"], recommended)


# ------------------------------------------------------------------ online RL


def rl_recipe(tmp_path, **rl):
    """tiny-llama (4 layers, 2 KV heads of 32) with LoRA, GRPO: 2 prompts x 8 completions a micro-batch,
    4 accumulation steps, prompts up to 256 tokens and completions up to 128."""
    return write_recipe(tmp_path / "rl.yaml", output_dir=str(tmp_path / "run"), model={"preset": "tiny-llama"},
                        lora={"enabled": True, "r": 8},
                        data={"train_files": [str(tmp_path / "prompts.jsonl")], "format": "prompt",
                              "max_seq_len": 256},
                        rl={"method": "grpo", "num_generations": 8, "max_new_tokens": 128, "rewards": ["exact_match"],
                            **rl},
                        train={"micro_batch_size": 2, "gradient_accumulation_steps": 4, "max_steps": 10,
                               "precision": "bf16"})


def test_online_rl_counts_its_sequences_kv_cache_and_forwards(tmp_path, capsys):
    """rl.method: a micro-batch trains on micro_batch_size x num_generations sequences of max_seq_len +
    max_new_tokens tokens (the activations and logits of a supervised micro-batch of that shape); each
    rank first samples all its prompts of the step at once, whose KV cache is 2 x layers x kv_heads x
    head_dim x sequences x tokens x dtype bytes, freed before training (the total holds the larger);
    the reference (rl.beta > 0: the adapter disabled) and the old log-probabilities (rl.num_iterations
    > 1) are forwards, not a second model."""
    from dataclasses import replace

    from toolkit.backends.run_sizing import setup_from_recipe
    from toolkit.backends.sizing import BY_NAME, Setup, estimate, kv_cache_bytes, rl_forwards
    from toolkit.config import load_recipe
    from toolkit.verbs.estimate import render

    rl = setup_from_recipe(load_recipe(rl_recipe(tmp_path, beta=0.04, num_iterations=2)))
    assert (rl.micro_batch, rl.seq_len, rl.accumulation, rl.sampled) == (16, 384, 4, 64)
    assert rl.batch_text() == ("micro-batch 16 sequences (2 prompts x 8 completions) x 384 tokens "
                               "(prompt + up to 128 new)")
    kv = 2 * 4 * 2 * 32 * 64 * 384 * 2  # layers, KV heads, head dim, 2 x 4 x 8 sequences, 256 + 128 tokens, bf16
    assert kv_cache_bytes(rl.model, rl) == kv
    assert rl_forwards(rl) == (1 + 1 + 1) / 2  # sampling, reference, old log-probabilities: once per 2 steps
    assert rl_forwards(replace(rl, reference_forward=False, iterations=1)) == 1
    supervised = Setup(model=rl.model, precision="bf16", base_dtype=rl.base_dtype, micro_batch=16, seq_len=384)
    assert kv_cache_bytes(rl.model, supervised) == 0 and rl_forwards(supervised) == 0
    for strategy in (BY_NAME["DDP"], BY_NAME["ZeRO-3"]):
        got, plain = estimate(strategy, rl).gpu, estimate(strategy, supervised).gpu
        assert got["kv_cache"] == kv and plain["kv_cache"] == 0
        for key in ("params", "gradients", "optimizer", "buffers", "activations", "logits"):
            assert got[key] == plain[key], (strategy.name, key)  # the reference is no second model
        # ZeRO-3 gathers the whole weights (bf16) for the sampling, beside the cache (rl.gather_for_sampling)
        gathered = 2 * rl.model.params if strategy.shards == "parameters" else 0
        assert got["sampling"] == gathered and plain["sampling"] == 0
        states = sum(got[k] for k in ("params", "gradients", "optimizer", "buffers"))
        assert got["total"] == states + max(got["activations"] + got["logits"], kv + gathered)
        long = estimate(strategy, replace(rl, accumulation=400)).gpu  # a cache larger than the activations
        assert long["kv_cache"] == 100 * kv and long["total"] == states + 100 * kv + gathered

    table = render(rl, [estimate(BY_NAME["DDP"], rl)], {"recommendation": "-", "epoch": None}, None)
    assert "  kv cache   total  fits" in table
    assert ("every GPU samples 64 completions at once (2 prompts x 4 accumulation steps x 8 generations), token by "
            "token up to 128 new tokens; kv cache: 2 x 4 layers x 2 KV heads x 32 head dim x 64 sequences x 384 "
            "tokens x 2 bytes = 24.0 MiB") in table
    assert ("training 2 (forward and backward, LoRA), sampling 0.5, reference log-probabilities 0.5 (rl.beta > 0: "
            "this model with its LoRA adapter disabled, no second model), old log-probabilities 0.5 "
            "(rl.num_iterations 2); all but training once per generated batch of 2 steps") in table
    plain_table = render(supervised, [estimate(BY_NAME["DDP"], supervised)], {"recommendation": "-", "epoch": None},
                         None)
    assert "kv cache" not in plain_table and "rl:" not in plain_table

    report = estimate_json(capsys, "--recipe", rl_recipe(tmp_path), "--gpus", "2")
    assert report["rl"] == {"completions_sampled_per_gpu": 64, "forwards_without_gradient_per_step": 1.0,
                            "gather_for_sampling": True, "server_sampling": False,
                            "server_gpu_share": 0.0}
    assert report["setup"]["micro_batch"] == 16 and report["setup"]["seq_len"] == 384
    assert all(r["gpu_bytes"]["kv_cache"] == kv for r in report["strategies"])
    supervised_report = estimate_json(capsys, "--model", "tiny-llama")
    assert supervised_report["rl"] is None


def test_sampling_from_sharded_weights_is_counted_and_recommended_when_gathering_does_not_fit(
        llama_7b_config, tmp_path, capsys):
    """Online RL under ZeRO-3 / FSDP full-shard gathers the whole weights for the sampling (rl.gather_for_sampling,
    TRL's ds3_gather_for_generation), beside the KV cache; false samples a layer at a time. On 8 GPUs a 7B full
    fine-tuning whose gathered copy does not fit is recommended ZeRO-3 with rl.gather_for_sampling=false before
    any offload; a recipe with the key false has no gathered column."""
    from dataclasses import replace

    from toolkit.backends.model_counts import count_model, read_config
    from toolkit.backends.sizing import BY_NAME, GIB, USABLE_FRACTION, Setup, estimate, recommend
    from toolkit.verbs.estimate import render

    setup = Setup(model=count_model(read_config(str(llama_7b_config)), "llama-7b"), gpus_per_node=8, precision="bf16",
                  gradient_checkpointing=True, micro_batch=8, seq_len=1024, generations=8, new_tokens=512)
    sharded = replace(setup, gathered_sampling=False)
    gathered, layered = estimate(BY_NAME["ZeRO-3"], setup).gpu, estimate(BY_NAME["ZeRO-3"], sharded).gpu
    assert gathered["sampling"] == 2 * setup.model.params and layered["sampling"] == 0  # bf16, the whole model
    assert gathered["total"] > layered["total"] + GIB
    memory = (gathered["total"] + layered["total"]) / 2 / USABLE_FRACTION / GIB
    setup, sharded = replace(setup, gpu_memory_gib=memory), replace(sharded, gpu_memory_gib=memory)
    for name in ("DDP", "ZeRO-2", "FSDP shard-grad-op", "ZeRO-3", "FSDP full-shard"):
        assert not estimate(BY_NAME[name], setup).fits, name  # nothing fits with the gathered copy
    said = recommend(setup)  # the smaller of the two sharding strategies, the other also fitting; no offload
    assert said == "FSDP full-shard (accelerate_configs/fsdp.yaml), with rl.gather_for_sampling=false (also fits: " \
                   "ZeRO-3)", said
    assert recommend(sharded) == "FSDP full-shard (accelerate_configs/fsdp.yaml) (also fits: ZeRO-3)"
    assert "gathered" in render(setup, [estimate(BY_NAME["ZeRO-3"], setup)], {"recommendation": "-", "epoch": None},
                                None)

    report = estimate_json(capsys, "--recipe", rl_recipe(tmp_path, gather_for_sampling=False), "--gpus", "2")
    assert report["rl"]["gather_for_sampling"] is False
    assert all(r["gpu_bytes"]["sampling"] == 0 for r in report["strategies"])
    text = run_estimate_text(capsys, "--recipe", str(rl_recipe(tmp_path, gather_for_sampling=False)), "--gpus", "2")
    assert "gathered" not in text.split("\n\n")[1].splitlines()[0]  # the table's head
    assert "rl.gather_for_sampling false: ZeRO-3 and FSDP full-shard sample gathering a layer at a time" in text


def test_sampling_on_a_vllm_server_counts_neither_its_cache_nor_a_gathered_copy(llama_7b_config):
    """rl.sampler: vllm: the server samples in its own memory: no KV cache and no gathered copy on the training
    GPUs, no rl.gather_for_sampling recommended, no sampling forward but the correction's old log-probabilities;
    the lines below the table say where the sampling is."""
    from dataclasses import replace

    from toolkit.backends.model_counts import count_model, read_config
    from toolkit.backends.sizing import BY_NAME, GIB, Setup, estimate, recommend, rl_forwards
    from toolkit.verbs.estimate import rl_lines

    setup = Setup(model=count_model(read_config(str(llama_7b_config)), "llama-7b"), gpus_per_node=8, precision="bf16",
                  gradient_checkpointing=True, micro_batch=8, seq_len=1024, generations=8, new_tokens=512,
                  gpu_memory_gib=80)
    served = replace(setup, server_sampling=True)
    for name in ("ZeRO-3", "FSDP full-shard", "DDP"):
        own, theirs = estimate(BY_NAME[name], setup).gpu, estimate(BY_NAME[name], served).gpu
        assert own["kv_cache"] > 0 and theirs["kv_cache"] == 0 and theirs["sampling"] == 0, name
        assert theirs["total"] <= own["total"], name
    assert rl_forwards(setup) == 1 and rl_forwards(served) == 1  # sampling here, or the correction's forward
    assert "gather_for_sampling" not in recommend(served)
    text = "\n".join(rl_lines(served))
    assert "a vLLM server (rl.sampler) samples the 8 completions" in text and "kv cache:" not in text, text
    assert "sampling 0 (on the vLLM server)" in text and "old log-probabilities 1 (the vLLM sampler's correction)" \
        in text
    assert rl_forwards(replace(served, server_correction=False)) == 0  # the correction off: no forward at all
    assert rl_forwards(replace(served, server_correction=False, rloo=True)) == 1  # rloo's own old log-probabilities
    # a server the run starts on the first GPU takes its share: a total that fits 90% of 80 GiB does not fit 60%
    row = estimate(BY_NAME["ZeRO-3"], replace(served, gpu_memory_gib=None))
    memory = row.gpu["total"] / GIB / 0.75
    assert estimate(BY_NAME["ZeRO-3"], replace(served, gpu_memory_gib=memory)).fits
    shared = replace(served, gpu_memory_gib=memory, server_gpu_share=0.3)
    assert not estimate(BY_NAME["ZeRO-3"], shared).fits
    assert "takes 30% of the first GPU (--gpu-memory-utilization): fits is judged against 60% of each GPU" in \
        "\n".join(rl_lines(shared))


def test_a_reward_model_counts_whole_on_every_gpu(tmp_path, capsys):
    """rl.rewards with a reward model folder: its weight files' bytes are held by every GPU under every
    strategy (the loader keeps a whole copy per rank), added to the total, a column of the table, a line
    below it and the run's estimate line; a Hub id that is no local folder is named as not counted."""
    from dataclasses import replace

    from transformers import LlamaConfig, LlamaForSequenceClassification

    from toolkit.backends.run_sizing import setup_from_recipe
    from toolkit.backends.sizing import BY_NAME, estimate
    from toolkit.config import load_recipe
    from toolkit.verbs.estimate import render

    LlamaForSequenceClassification(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               num_labels=1)).save_pretrained(tmp_path / "rm")
    size = (tmp_path / "rm" / "model.safetensors").stat().st_size
    setup = setup_from_recipe(load_recipe(rl_recipe(tmp_path, rewards=[{"model": str(tmp_path / "rm")},
                                                                       {"model": "someone/remote-rm"}])))
    assert setup.reward_model_bytes == size and setup.reward_models_uncounted == ("someone/remote-rm",)
    without = replace(setup, reward_model_bytes=0.0)
    for name in ("DDP", "ZeRO-3", "FSDP full-shard", "ZeRO-3 + CPU params+optimizer"):
        got, plain = estimate(BY_NAME[name], setup).gpu, estimate(BY_NAME[name], without).gpu
        assert got["reward_models"] == size and got["total"] == plain["total"] + size, name
    table = render(setup, [estimate(BY_NAME["ZeRO-3"], setup)], {"recommendation": "-", "epoch": None}, None)
    assert "reward m." in table and "whole on every GPU" in table
    assert "rl: reward models not counted (not a local folder): someone/remote-rm" in table


def test_online_rl_refusals_and_the_run_line(monkeypatch, tmp_path, capsys):
    """Sequence parallelism cannot split an RL run's completions: refused as a launch would. The run's
    `estimate` line gives the KV cache beside the activations."""
    from types import SimpleNamespace

    import torch

    from toolkit.backends.run_sizing import estimate_for_run
    from toolkit.cli import main
    from toolkit.config import load_recipe

    path = rl_recipe(tmp_path)
    assert main(["estimate", "--recipe", str(path), "--gpus", "2", "--sp-size", "2"]) == 2
    assert "--sp-size is 2: online RL (rl.method) samples and scores whole completions" in capsys.readouterr().err
    accelerator = SimpleNamespace(device=torch.device("cpu"), num_processes=1)
    for name in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "PARALLELISM_CONFIG_SP_SIZE"):
        monkeypatch.delenv(name, raising=False)
    line, warning = estimate_for_run(load_recipe(path), accelerator, None)
    assert ("(micro-batch 16 sequences (2 prompts x 8 completions) x 384 tokens (prompt + up to 128 new)), KV cache "
            "24.0 MiB (64 completions sampled at once; freed before training: the larger counts) = ") in line, line
    assert warning is None


def test_the_optimizer_state_is_counted_and_an_8bit_one_recommended_where_adamw_does_not_fit():
    """Issue 65: train.optim's state per trained parameter (optim.optimizers.OPTIMIZERS' state_bytes, each checked
    against the bytes the optimizer allocates in tests/test_optim.py) is what estimate counts; a full fine-tune that
    AdamW keeps off one GPU is recommended the 8-bit AdamW first, before offloading."""
    from dataclasses import replace

    from transformers import LlamaConfig

    from toolkit.backends.model_counts import count_model
    from toolkit.backends.sizing import BY_NAME, Setup, estimate, recommend
    from toolkit.optim.optimizers import OPTIMIZERS

    model = count_model(LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                    num_attention_heads=32, num_key_value_heads=4, vocab_size=32000), "llama-1b")
    adamw = Setup(model=model, gpus_per_node=1, gpu_memory_gib=16.0, precision="bf16", gradient_checkpointing=True,
                  seq_len=512)
    for name, spec in OPTIMIZERS.items():
        setup = replace(adamw, optimizer_bytes=spec.state_bytes)
        assert estimate(BY_NAME["DDP"], setup).gpu["optimizer"] == spec.state_bytes * model.trainable, name
        assert estimate(BY_NAME["ZeRO-3"], setup).gpu["optimizer"] == (4 + spec.state_bytes) * model.trainable, name
    assert not estimate(BY_NAME["DDP"], adamw).fits
    assert estimate(BY_NAME["DDP"], replace(adamw, optimizer_bytes=2)).fits
    line = recommend(adamw)
    assert line.startswith("one GPU, without distribution (accelerate_configs/single.yaml) with "
                           "train.optim=adamw_8bit"), line
    assert "or, keeping the optimizer, ZeRO-" in line, line
    assert "adamw_8bit" not in recommend(replace(adamw, optimizer_bytes=2))  # already small: nothing to suggest
