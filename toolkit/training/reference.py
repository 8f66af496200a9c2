"""DPO's and KTO's reference log-probabilities, computed once before training (preference.reference=precomputed).

One pass over the train and eval pairs with the starting weights, on the model as the launch
prepared it (DDP, FSDP, ZeRO-3: each rank its share, as `EvalShardSampler` splits the eval set, so
no second sharded model is ever built), gathered to every rank and kept beside the prepared data
as `reference-KEY-train.npy` / `-eval.npy`: each example's (chosen, rejected) summed log-probability.
KEY (`weights_key`) names the starting weights and everything that changes their numbers, so a
resume, a second run on the same data and base, or a run on another backend reads them back instead
of computing them again, and a run whose numbers differ computes its own. The forwards run in
batches of train.eval_batch_size (or micro_batch_size): a no-gradient forward, as evaluation's.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from tqdm.auto import tqdm

from ..data.batching import Collator, EvalShardSampler, Examples
from ..errors import ToolkitError
from ..model import base_identity
from ..model.hub import resolve_model
from ..model.load import config_overrides
from ..storage import disk
from .kto import completion_part, mismatched_part
from .loss import token_logps


def weights_key(recipe) -> str:
    """What the reference log-probabilities depend on (tests/test_cache_keys.py changes each one):
    the starting weights (a preset and the seed it is drawn from, or the base folder's content and,
    under trust_remote_code, its Python code), what the recipe changes in them (model.config_overrides:
    RoPE scaling, maximum positions; 4-bit quantization; the rows model.add_special_tokens adds, drawn
    from the seed; DoRA's magnitudes), and how they compute (dtypes, attention, padding-free rows, the
    loss, the libraries' versions). The data is the folder's: its own fingerprint."""
    m, t = recipe.model, recipe.train
    if m.preset is not None:
        weights = ["preset", m.preset, recipe.seed]
    else:
        folder = Path(resolve_model(m.path, m.revision))
        code = [f.read_text() for f in sorted(folder.glob("*.py"))] if m.trust_remote_code else []
        weights = [base_identity.fingerprint(folder), code]
    inputs = {"weights": weights, "config": config_overrides(m), "4-bit": m.load_in_4bit,
              "added rows": [m.add_special_tokens, recipe.seed if m.add_special_tokens else None],
              "dora": recipe.lora.enabled and recipe.lora.use_dora,
              "compute": [m.dtype, t.precision, m.attn_implementation, recipe.data.padding_free, t.loss,
                          t.loss_chunk_tokens],
              "libraries": [torch.__version__, transformers.__version__]}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def precompute(accelerator, model, parts: dict[str, Examples], folder: Path, recipe, collate: Collator) -> list[str]:
    """Set each part's `reference` (read from `folder` or computed with `model` as it is now, then
    written there by each node's main process); returns the start-of-run lines saying which."""
    key, batch_size = weights_key(recipe), recipe.train.eval_batch_size or recipe.train.micro_batch_size
    lines = []
    for name, part in parts.items():
        if len(part) == 0:
            continue
        path = folder / f"reference-{key}-{name}.npy"
        if path.is_file():
            part.reference = np.load(path)
            lines.append(f"{name}: read from {path}")
            continue
        part.reference = compute(accelerator, model, part, batch_size, collate, name)
        if accelerator.is_local_main_process:
            tmp = path.with_name(f"{path.stem}.tmp-{os.getpid()}.npy")
            with disk.writing("data: the reference log-probabilities (HF_DATASETS_CACHE)", tmp, error=ToolkitError):
                np.save(tmp, part.reference)
                tmp.rename(path)
        what = "completions (each with its mismatched sequence)" if part.unpaired else "pairs"  # KTO's rows: one each
        lines.append(f"{name}: computed for {len(part):,} {what} with the starting weights, kept in {path}")
    return lines


@torch.no_grad()
def compute(accelerator, model, part: Examples, batch_size: int, collate: Collator, name: str) -> np.ndarray:
    """(examples, 2): each example's chosen and rejected (KTO: completion and mismatched) summed target
    log-probability under `model`
    in eval mode, in training's batches (`collate`: padded or padding-free) of `batch_size` pairs (at
    most a rank's share), every rank computing its share with the same number of forwards."""
    rank, world = accelerator.process_index, accelerator.num_processes
    batch_size = min(batch_size, math.ceil(len(part) / world))
    indices = EvalShardSampler(len(part), batch_size, rank, world).indices
    was_training = model.training
    model.eval()
    mine = []
    try:
        for start in tqdm(range(0, len(indices), batch_size), desc=f"reference log-probabilities ({name})",
                          disable=not accelerator.is_main_process, dynamic_ncols=True,
                          mininterval=0.5 if sys.stderr.isatty() else 30):  # logs that are files get few updates
            chunk = indices[start:start + batch_size]
            batch = {k: v.to(accelerator.device) if isinstance(v, torch.Tensor) else v
                     for k, v in collate([part[i] for i in chunk]).items()}
            if "kl_input_ids" in batch:  # unpaired (KTO): the completions, then the mismatched sequences
                logps = torch.cat([token_logps(model, completion_part(batch))[0],
                                   token_logps(model, mismatched_part(batch))[0]])
            else:
                logps, _ = token_logps(model, batch)
            mine.append(torch.stack([logps[:len(chunk)], logps[len(chunk):]], 1).double())
    finally:
        model.train(was_training)
    where = torch.tensor([-1 if i is None else i for i in indices], dtype=torch.float64, device=accelerator.device)
    gathered = accelerator.gather(torch.cat([where[:, None], torch.cat(mine)], 1)).cpu().numpy()
    kept = gathered[gathered[:, 0] >= 0]
    values = np.zeros((len(part), 2))
    values[kept[:, 0].astype(np.int64)] = kept[:, 1:]
    return values
