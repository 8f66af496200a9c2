"""Peak memory of one training step with train.loss=full against train.loss=chunked.

    python benchmarks/loss_memory.py           # vocab 49,152, micro-batch 8 x 2,048 tokens (a few GB, ~1 min per loss)
    python benchmarks/loss_memory.py --tiny    # seconds: the script's own check

One forward and backward (the loss summed over target tokens and divided by their count, as the
loop does) of a Llama-architecture model built from a config with random weights, fp32 on the
CPU: a small hidden size and few layers with a real vocabulary, so the logits weigh what they
weigh in real fine-tunes. Every position but the first is a target (the chunked loss's worst
case: a response-only batch has fewer). Each loss runs in a fresh process. Memory: the process's
peak resident set size (`resource.getrusage(...).ru_maxrss`) after the step minus its resident
set just before the step (model built, batch made, no gradients yet), so it is what the step
itself added: activations, logits and gradients.

The two processes also save their loss and gradients; the parent compares them (they must agree
within 1e-5, or the script exits 1) and prints a table and the ratio chunked / full.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-5
GOAL = 1 / 3  # issue 14: the chunked step at most a third of the full one


def rss_mb() -> float:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(a) -> None:
    """One step with loss `a.child`; prints a JSON line, saves the loss and gradients to `a.out`."""
    import resource

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT))
    from toolkit.training.loss import token_loss_sum, use_token_loss

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.hidden * 3,
                         num_hidden_layers=a.layers, num_attention_heads=max(1, a.hidden // 64),
                         num_key_value_heads=max(1, a.hidden // 128), max_position_embeddings=a.seq,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    use_token_loss(model, a.child, a.chunk)
    ids = torch.randint(0, a.vocab, (a.micro, a.seq))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    targets = a.micro * (a.seq - 1)
    before = rss_mb()
    loss = token_loss_sum(model, batch) / targets
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    torch.save({"loss": loss.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}}, a.out)
    print(json.dumps({"loss": a.child, "rss_before_mb": before, "step_peak_mb": peak - before,
                      "targets": targets, "parameters": sum(p.numel() for p in model.parameters())}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--micro", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--chunk", type=int, default=1024, help="train.loss_chunk_tokens")
    p.add_argument("--tiny", action="store_true", help="vocab 512, hidden 32, 2 x 64 tokens, chunk 24: seconds")
    p.add_argument("--child", choices=("full", "chunked"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.tiny:
        a.vocab, a.hidden, a.micro, a.seq, a.chunk = 512, 32, 2, 64, 24
    if a.child:
        child(a)
        return 0

    import torch
    import transformers

    sizes = ["--vocab", a.vocab, "--hidden", a.hidden, "--layers", a.layers, "--micro", a.micro, "--seq", a.seq,
             "--chunk", a.chunk]
    results = {}
    with tempfile.TemporaryDirectory(prefix="loss-memory-") as work:
        for kind in ("full", "chunked"):
            out = Path(work) / f"{kind}.pt"
            proc = subprocess.run([sys.executable, __file__, "--child", kind, "--out", str(out), *map(str, sizes)],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{kind}: exit {proc.returncode}\n{proc.stderr[-3000:]}", file=sys.stderr)
                return 1
            results[kind] = json.loads(proc.stdout.strip().splitlines()[-1])
            results[kind]["saved"] = torch.load(out)
    full, chunked = results["full"], results["chunked"]
    loss_diff = (full["saved"]["loss"] - chunked["saved"]["loss"]).abs().item()
    grad_diff = max((full["saved"]["grads"][n] - g).abs().max().item() for n, g in chunked["saved"]["grads"].items())
    ratio = chunked["step_peak_mb"] / full["step_peak_mb"]
    same = loss_diff <= TOLERANCE and grad_diff <= TOLERANCE

    print(f"Llama vocab {a.vocab:,}, hidden {a.hidden}, {a.layers} layers, intermediate {a.hidden * 3} "
          f"({full['parameters']:,} parameters), micro-batch {a.micro} x {a.seq} tokens ({full['targets']:,} targets), "
          f"fp32 on CPU, chunk {a.chunk}; torch {torch.__version__}, transformers {transformers.__version__}")
    print("| loss | step peak MB (peak RSS - RSS before the step) | RSS before the step MB | loss value |")
    print("|---|---|---|---|")
    for kind in ("full", "chunked"):
        r = results[kind]
        print(f"| {kind} | {r['step_peak_mb']:,.1f} | {r['rss_before_mb']:,.1f} | {r['saved']['loss'].item():.7f} |")
    print(f"ratio chunked/full: {ratio:.3f} (goal <= {GOAL:.3f}: {'met' if ratio <= GOAL else 'not met'})")
    print(f"loss |full - chunked| {loss_diff:.2e}, max |gradient difference| {grad_diff:.2e} "
          f"(tolerance {TOLERANCE:g}: {'within' if same else 'EXCEEDED'})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
