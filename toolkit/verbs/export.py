"""`toolkit export MODEL_DIR --gguf OUT.gguf [--type f16]`: a model as one GGUF file for llama.cpp,
Ollama and LM Studio, written with the `gguf` package (llama.cpp's own Python library: its writer,
tensor names, vocabularies and quantizers), then read back before it counts.

MODEL_DIR is a run's final/ (full, or a LoRA adapter, merged in memory), a merged folder, or any
Hugging Face folder of a family llama.cpp runs and transformers reads back: Llama (and SmolLM),
Mistral (written as llama, as llama.cpp's converter does), Qwen2 and Qwen3. Others are refused in
one line before anything loads. The tensors are laid out as llama.cpp's converter lays them out
(Llama's query and key rows permuted to its rotary layout; norms and biases kept in f32; a tied
output layer left out). The tokenizer (GPT-2 style BPE, or a Llama/Mistral sentencepiece-style
one), its special tokens, its chat template and its stop token go into the metadata.

`--type`: f32, f16, bf16, q8_0 or q4_0 (gguf's quantizers; the k-quants such as q4_k_m are
llama.cpp's `llama-quantize OUT.gguf q4_k_m` from an f16 export). The read-back loads the file with
transformers' GGUF loader (which de-quantizes) and compares its logits on a few prompts with the
folder's, against the bound of each type (TOLERANCE); the file is renamed into place only when it
holds (exit 4 otherwise, OUT.gguf never half-written). torch, transformers and gguf are imported
inside the functions: `toolkit --help` stays fast.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from .. import faults
from ..errors import EXIT_SAVE_MISMATCH, ToolkitError, command
from ..stops import TrainingStopped
from ..storage import disk

# HF architecture -> llama.cpp's (general.architecture); whether its q/k rows are permuted (llama.cpp's
# llama runs rotary embeddings on interleaved pairs, transformers on halves).
FAMILIES = {"LlamaForCausalLM": ("llama", True), "MistralForCausalLM": ("llama", True),
            "Qwen2ForCausalLM": ("qwen2", False), "Qwen3ForCausalLM": ("qwen3", False)}
TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
# The read-back's bound on max |logit difference| / max(1, max |logit|) per type: set from the
# measured differences on the tiny model and SmolLM2-135M (benchmarks/NOTES.md, "GGUF export"), with
# room for other models: f32 is exact up to summation order; f16 and bf16 round every weight once;
# q8_0 and q4_0 quantize blocks of 32 weights to 8 and 4 bits.
TOLERANCE = {"f32": 1e-5, "f16": 1e-2, "bf16": 5e-2, "q8_0": 1e-1, "q4_0": 0.5}
# Pre-tokenizers llama.cpp knows by name, for the tokenizers of the families above (llama.cpp's converter
# tells them apart by a hash of a test string's tokens; here by vocabulary size, which differs for each).
PRE_TOKENIZERS = {("llama", 128256): "llama-bpe", ("llama", 49152): "smollm", ("qwen2", None): "qwen2",
                  ("qwen3", None): "qwen2"}
CHECK_PROMPTS = ("The quick brown fox jumps over the lazy dog.", "def fibonacci(n):\n    ")


def add_arguments(p) -> None:
    p.add_argument("model", metavar="MODEL_DIR",
                   help="a run's final/ (a LoRA adapter is merged in memory), a merged folder or a Hugging Face "
                        "folder: Llama, SmolLM, Mistral, Qwen2 or Qwen3")
    p.add_argument("--gguf", required=True, metavar="OUT.gguf", help="the GGUF file to write; must not exist")
    p.add_argument("--type", default="f16", metavar="TYPE",
                   help="weights' type: f32, f16 (default), bf16, q8_0 or q4_0; norms and biases stay f32")
    p.add_argument("--skip-check", action="store_true",
                   help="skip reading the file back and comparing its logits with the folder's")


def run(args) -> int:
    if args.type not in TYPES:
        kquant = args.type.lower().startswith(("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq"))
        raise ToolkitError(f"--type {args.type}: " + (
            "gguf's writer has no quantizer for the k-quants; export f16, then run llama.cpp's "
            f"`llama-quantize OUT.gguf OUT-{args.type.lower()}.gguf {args.type.lower()}`" if kquant
            else f"not a type this export writes: one of {', '.join(TYPES)}"))
    out = Path(args.gguf).expanduser()
    if out.suffix != ".gguf":
        raise ToolkitError(f"--gguf: {out} should end in .gguf")
    if out.exists():
        raise ToolkitError(f"--gguf: {out} exists; give a new file (an export never overwrites one)")
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ToolkitError(f"--gguf: needs the gguf package: {command('python -m pip install gguf')}") from None
    from ..model.inference import locate_model

    folder, adapter = locate_model(args.model)
    config = json.loads((Path(folder) / "config.json").read_text())
    arch, permute = family(config, args.model)
    disk.check_writable(out, "--gguf")
    model, tokenizer = load_merged(args.model, adapter is not None)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with disk.writing("--gguf", tmp, error=ToolkitError):
            tensors = write_gguf(tmp, model, tokenizer, model_name(Path(args.model)), arch, permute, args.type)
        print(f"wrote {tensors} tensors ({args.type}) to {out.name}: {disk.human(tmp.stat().st_size)}")
        faults.at("export")
        if not args.skip_check:
            check(tmp, model, tokenizer, args.type)
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    print(f"wrote {out}")
    return 0


def family(config: dict, where: str) -> tuple[str, bool]:
    """(llama.cpp's architecture, whether q/k are permuted), or the one line refusing the model."""
    name = (config.get("architectures") or ["?"])[0]
    if name not in FAMILIES:
        raise ToolkitError(f"{where}: {name} is not a family this export writes (Llama, SmolLM, Mistral, Qwen2, "
                           "Qwen3); llama.cpp's convert_hf_to_gguf.py converts many others")
    scaling = config.get("rope_scaling") or (config.get("rope_parameters") or {})
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind not in ("default", None):
        raise ToolkitError(f"{where}: rope scaling {kind!r} is not written by this export (llama.cpp's "
                           "convert_hf_to_gguf.py writes it)")
    if config.get("sliding_window") and config.get("use_sliding_window", name == "MistralForCausalLM"):
        raise ToolkitError(f"{where}: sliding-window attention is not written by this export")
    return FAMILIES[name][0], FAMILIES[name][1]


def load_merged(path: str, is_adapter: bool):
    """The model in fp32 on the CPU (an adapter merged into its base) and its tokenizer."""
    from ..model.inference import load_for_inference

    model, tokenizer = load_for_inference(path, "fp32", device="cpu")
    if is_adapter:
        model = model.merge_and_unload()
    return model.eval(), tokenizer


def model_name(path: Path) -> str:
    """general.name: the folder's name, or the run's for a run's final/ (or a merged/ folder in it)."""
    path = path.expanduser().resolve()
    return path.parent.name if path.name in ("final", "merged") else path.name


def write_gguf(path: Path, model, tokenizer, name: str, arch: str, permute: bool, kind: str) -> int:
    """Metadata, vocabulary and tensors into `path`; returns the number of tensors written."""
    import gguf
    import numpy as np

    c = model.config
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    if arch == "qwen3" or head_dim != c.hidden_size // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    theta = getattr(c, "rope_theta", None) or (getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    w.add_rope_freq_base(float(theta))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    qtype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
             "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[kind]
    w.add_file_type(qtype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_vocabulary(w, tokenizer, arch, c.vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    count = 0
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue  # tied: llama.cpp reads the token embedding
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ToolkitError(f"--gguf: no GGUF name for the tensor {hf_name}")
        data = t.detach().float().numpy()
        if permute and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            n = heads if hf_name.endswith("q_proj.weight") else kv_heads
            data = data.reshape(n, 2, data.shape[0] // n // 2, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)
        data, raw = stored(np.ascontiguousarray(data), name, kind)
        w.add_tensor(name, data, raw_dtype=raw)
        count += 1
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return count


def stored(data, name: str, kind: str):
    """(the array to write, its GGML type) for one tensor: 1-D tensors (norms, biases) in f32, as
    llama.cpp keeps them; under q4_0 the token embedding and output layer in q8_0 (llama.cpp keeps
    them finer); a tensor whose rows do not split into blocks of 32 in f16."""
    import gguf
    import numpy as np

    T = gguf.GGMLQuantizationType
    if data.ndim == 1 or kind == "f32":
        return data.astype(np.float32), T.F32
    if kind == "q4_0" and name in ("token_embd.weight", "output.weight"):
        kind = "q8_0"
    if kind in ("q8_0", "q4_0") and data.shape[-1] % 32:
        kind = "f16"
    if kind == "f16":
        return data.astype(np.float16), T.F16
    qtype = {"bf16": T.BF16, "q8_0": T.Q8_0, "q4_0": T.Q4_0}[kind]
    return gguf.quants.quantize(data, qtype), qtype


def add_vocabulary(w, tokenizer, arch: str, vocab_size: int) -> None:
    """The tokenizer as llama.cpp reads it: tokens, their types (special ones `control`, other added ones
    `user defined`), scores, merges, special token ids, and the chat template (gguf's SpecialVocab)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="toolkit-export-") as saved:  # the tokenizer as loaded (an adapter's
        tokenizer.save_pretrained(saved)                                  # own, or its base's), in its files
        add_vocabulary_from(w, tokenizer, Path(saved), arch, vocab_size)


def add_vocabulary_from(w, tokenizer, folder: Path, arch: str, vocab_size: int) -> None:
    import gguf

    try:
        vocab = gguf.vocab.BpeVocab(folder)
        model_kind = "gpt2"
    except (FileNotFoundError, ValueError):
        try:
            vocab = gguf.vocab.LlamaHfVocab(folder)
            model_kind = "llama"
        except (FileNotFoundError, ValueError, TypeError):
            raise ToolkitError("--gguf: the model's tokenizer is neither a GPT-2 style BPE nor a Llama/Mistral "
                               "sentencepiece-style one") from None
    tokens, scores, types = [], [], []
    for text, score, kind in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(kind)
    added = {t.content: t.special for t in tokenizer.added_tokens_decoder.values()}
    for i, text in enumerate(tokens):
        s = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        if s in added:
            types[i] = gguf.TokenType.CONTROL if added[s] else gguf.TokenType.USER_DEFINED
    for i in range(len(tokens), vocab_size):  # the embedding has rows past the vocabulary (padding)
        tokens.append(f"[PAD{i}]".encode())
        scores.append(-1000.0)
        types.append(gguf.TokenType.UNUSED)
    w.add_tokenizer_model(model_kind)
    if model_kind == "gpt2":
        w.add_tokenizer_pre(PRE_TOKENIZERS.get((arch, vocab_size)) or PRE_TOKENIZERS.get((arch, None)) or "default")
    w.add_token_list(tokens)
    if model_kind == "llama":
        w.add_token_scores(scores)
    w.add_token_types(types)
    first = tokenizer("a").input_ids[:1]  # llama.cpp adds BOS where the tokenizer does
    w.add_add_bos_token(tokenizer.bos_token_id is not None and first == [tokenizer.bos_token_id])
    special = gguf.SpecialVocab(folder, load_merges=model_kind == "gpt2", n_vocab=len(tokens))
    if tokenizer.chat_template and not special.chat_template:
        special.chat_template = tokenizer.chat_template
    special.add_to_gguf(w, quiet=True)


def check(path: Path, model, tokenizer, kind: str) -> None:
    """Load `path` with transformers' GGUF loader and compare its logits with the model's on
    CHECK_PROMPTS; above TOLERANCE[kind] (relative to the logits' scale) the export fails (exit 4)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    import gguf
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    fields = gguf.GGUFReader(path).fields
    key_length = fields.get(f"{fields['general.architecture'].contents()}.attention.key_length")
    if key_length is not None:  # transformers' loader leaves Qwen3's head_dim at its default (128)
        config.head_dim = key_length.contents()
    back = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=config,
                                                dtype=torch.float32).eval()
    worst, greedy_same = 0.0, True
    with torch.no_grad():
        for prompt in CHECK_PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            a, b = model(ids).logits, back(ids).logits
            worst = max(worst, float((a - b).abs().max() / max(1.0, float(a.abs().max()))))
            greedy_same &= bool((a.argmax(-1) == b.argmax(-1)).all())
    line = (f"read back with transformers' GGUF loader: max logit difference {worst:.2e} of the logits' scale "
            f"(bound for {kind}: {TOLERANCE[kind]:.0e}); greedy next tokens {'the same' if greedy_same else 'differ'}")
    if worst > TOLERANCE[kind]:
        raise TrainingStopped(f"export: {line}; {path.name} not kept", EXIT_SAVE_MISMATCH)
    print(line)
