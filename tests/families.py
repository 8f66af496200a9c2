"""Tiny, seeded, random-initialised models of the families users fine-tune, built locally from
transformers' own config classes, each with a byte-level tokenizer that holds its family's special
tokens and its family's real chat template (tests/chat_templates/, verbatim, provenance in
INDEX.yaml). `build_family(name, folder)` writes a Hugging Face model folder that `model.path`
loads like any downloaded model."""

from pathlib import Path

from toolkit.data.formats import IGNORE

CHAT_TEMPLATES = Path(__file__).parent / "chat_templates"

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, initializer_range=0.02)
MOE = dict(num_experts_per_tok=2)
QWEN_TOKENS = dict(special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                   added=["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
                   bos=None, eos="<|im_end|>", pad="<|endoftext|>", end_of_turn="<|im_end|>")

# family: model_type, config beyond SMALL, template file, tokens (special: never split, skipped when
# decoding; added: single tokens the template writes in text), and the end of an assistant turn.
FAMILIES = {
    "llama3": dict(model_type="llama", config=dict(tie_word_embeddings=False), template="llama3.jinja",
                   special=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                            "<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>"],
                   added=[], bos="<|begin_of_text|>", eos="<|eot_id|>", pad="<|finetune_right_pad_id|>",
                   end_of_turn="<|eot_id|>"),
    "qwen2.5": dict(model_type="qwen2", config=dict(tie_word_embeddings=True), template="qwen2.5.jinja", **QWEN_TOKENS),
    "qwen3": dict(model_type="qwen3", config=dict(tie_word_embeddings=True, head_dim=16), template="qwen3.jinja",
                  **QWEN_TOKENS),
    "qwen3-moe": dict(model_type="qwen3_moe", config=dict(head_dim=16, num_experts=4, moe_intermediate_size=32, **MOE),
                      template="qwen3.jinja", **QWEN_TOKENS),
    "mixtral": dict(model_type="mixtral", config=dict(num_local_experts=4, **MOE), template="mixtral.jinja",
                    special=["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], added=[], bos="<s>", eos="</s>",
                    pad="<unk>", end_of_turn="</s>"),
    "mistral": dict(model_type="mistral", config=dict(sliding_window=None), template="mistral.jinja",
                    special=["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], added=[], bos="<s>", eos="</s>",
                    pad="<unk>", end_of_turn="</s>"),
    "gemma3": dict(model_type="gemma3_text", config=dict(head_dim=16, sliding_window=16, tie_word_embeddings=True,
                                                         query_pre_attn_scalar=16),
                   template="gemma3.jinja", special=["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
                   added=[], bos="<bos>", eos="<eos>", pad="<pad>", end_of_turn="<end_of_turn>"),
    "gemma2": dict(model_type="gemma2", config=dict(head_dim=16, sliding_window=16, tie_word_embeddings=True,
                                                    query_pre_attn_scalar=16),
                   template="gemma2.jinja", special=["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
                   added=[], bos="<bos>", eos="<eos>", pad="<pad>", end_of_turn="<end_of_turn>",
                   attn="eager"),  # its attention softcapping: transformers refuses sdpa for it
    "phi3": dict(model_type="phi3", config=dict(tie_word_embeddings=False), template="phi3.jinja",
                 special=["<unk>", "<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
                 added=[], bos="<s>", eos="<|endoftext|>", pad="<|endoftext|>", end_of_turn="<|end|>"),
}


def family_tokenizer(name: str | dict):
    """A byte-level BPE tokenizer (every byte a token, no merges) with the family's tokens and template;
    `name` may also be a token table of FAMILIES' shape for a family not listed there."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    f = FAMILIES[name] if isinstance(name, str) else name
    vocab = {tok: i for i, tok in enumerate(f["special"] + f["added"])}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in f["special"]])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in f["added"]])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=f["bos"], eos_token=f["eos"],
                                        pad_token=f["pad"])
    tokenizer.chat_template = (CHAT_TEMPLATES / f["template"]).read_text()
    return tokenizer


def family_config(name: str, vocab_size: int, tokenizer):
    from transformers import AutoConfig

    f = FAMILIES[name]
    ids = {k: tokenizer.convert_tokens_to_ids(f[k]) if f[k] else None for k in ("bos", "eos", "pad")}
    return AutoConfig.for_model(f["model_type"], vocab_size=vocab_size, **{**SMALL, **f["config"]},
                                bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"])


def build_family(name: str, folder: Path, seed: int = 0) -> Path:
    """Write a tiny random `name` model with its tokenizer to `folder` (a Hugging Face model folder)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = family_tokenizer(name)
    config = family_config(name, len(tokenizer), tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    end = tokenizer.convert_tokens_to_ids(FAMILIES[name]["end_of_turn"])
    model.generation_config = GenerationConfig(eos_token_id=sorted({end, config.eos_token_id}),
                                               pad_token_id=config.pad_token_id, bos_token_id=config.bos_token_id)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def target_runs(tokenizer, examples) -> list[str]:
    """The decoded runs of consecutive target tokens (a target predicts its token: the label at i is ids[i])."""
    runs = []
    for ex in examples:
        current = []
        for token, label in zip(ex["input_ids"], ex["labels"]):
            if label != IGNORE:
                assert label == token
                current.append(token)
            elif current:
                runs.append(tokenizer.decode(current))
                current = []
        if current:
            runs.append(tokenizer.decode(current))
    return runs


def small_student(teacher, folder, seed: int = 3):
    """A small random Llama with `teacher`'s tokenizer and vocabulary (a distillation student)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(teacher)
    big = AutoConfig.from_pretrained(teacher)
    config = LlamaConfig(vocab_size=big.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         bos_token_id=big.bos_token_id, eos_token_id=big.eos_token_id, pad_token_id=big.pad_token_id)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def token_drawer(tokenizer, seed: int = 7):
    """`draw(n)`: n random token ids of `tokenizer` that are no special token, from a generator seeded `seed`
    (prompts and completions handed alike to TRL's trainers and ours)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    special = set(tokenizer.all_special_ids)
    ordinary = [i for i in range(len(tokenizer)) if i not in special]

    def draw(n: int) -> list[int]:
        return [ordinary[int(j)] for j in torch.randint(len(ordinary), (n,), generator=g)]
    return draw
