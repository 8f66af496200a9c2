"""`model/sampling.py` in one process: the logits stay on the model's device (no per-token host copy
of a (rows, vocabulary) tensor: at a 151k vocabulary and 64 rows that copy and a host softmax took
0.27 s a token, with a GPU idle), and each completion depends only on its own seed and prompt, not
on the rows sampled beside it. The backends, ranks and resumes that must sample alike are in
test_rl_train.py; on CUDA, test_gpu.py samples during GRPO."""

import torch
from torch.overrides import TorchFunctionMode

from toolkit.config import ModelConfig
from toolkit.model.load import build_model
from toolkit.model.sampling import completion_seed, sample

VOCAB = 262  # the tiny preset's


class HostCopies(TorchFunctionMode):
    """Records every call that brings a tensor of `width` columns to the host or to Python."""

    def __init__(self, width: int):
        super().__init__()
        self.width, self.seen = width, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
        to_host = name in ("cpu", "tolist", "numpy", "item") or (
            name == "to" and any(str(a).startswith("cpu") for a in [*args[1:], kwargs.get("device")] if a is not None))
        if to_host and tensor is not None and tensor.dim() and tensor.shape[-1] == self.width:
            self.seen.append((name, tuple(tensor.shape)))
        return func(*args, **kwargs)


def model_and_prompts():
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="tiny-llama-mini")).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 3, 7)]
    return model, prompts


def test_the_logits_never_come_back_to_the_host_token_by_token():
    model, prompts = model_and_prompts()
    seeds = [completion_seed(5, 1, 0, row, 0) for row in range(len(prompts))]
    with HostCopies(VOCAB) as copies:
        out = sample(model, prompts, seeds, max_new_tokens=8, stop_ids=[2], pad_id=0, temperature=0.7, top_p=0.9)
    assert copies.seen == [], copies.seen[:5]
    assert len(out) == len(prompts) and all(1 <= len(c) <= 8 for c in out)
    # the check can fail: a host copy of the logits is seen
    with HostCopies(VOCAB) as copies:
        model(input_ids=torch.tensor([prompts[0]])).logits[:, -1].float().cpu()
    assert copies.seen == [("cpu", (1, VOCAB))]


def test_a_completion_depends_on_its_seed_and_prompt_only():
    model, prompts = model_and_prompts()
    seeds = [completion_seed(5, 1, 0, row, 0) for row in range(len(prompts))]
    together = sample(model, prompts, seeds, max_new_tokens=8, stop_ids=[2], pad_id=0, temperature=0.7, top_p=0.9)
    for prompt, seed, completion in zip(prompts, seeds, together):
        alone = sample(model, [prompt], [seed], max_new_tokens=8, stop_ids=[2], pad_id=0, temperature=0.7, top_p=0.9)
        assert alone == [completion]
    other = sample(model, prompts[:1], [seeds[0] + 1], max_new_tokens=8, stop_ids=[2], pad_id=0, temperature=0.7,
                   top_p=0.9)
    assert other != together[:1]  # the seed matters (these two differ for this model and prompt)
