"""`model/sampling.py` in one process: the logits stay on the model's device (no per-token host copy
of a (rows, vocabulary) tensor: at a 151k vocabulary and 64 rows that copy and a host softmax took
0.27 s a token, with a GPU idle), and each completion depends only on its own seed and prompt, not
on the rows sampled beside it. The backends, ranks and resumes that must sample alike are in
test_rl_train.py; on CUDA, test_gpu.py samples during GRPO."""

import pytest
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


def test_mask_truncated_completions_leaves_them_out_of_the_loss_only():
    """rl.mask_truncated_completions (TRL's): a completion cut at max_new_tokens without a stop token gets a zero
    completion mask (its reward still counted in its group); the other rows' log-probabilities are those of the
    same batch unmasked (the scatter follows the labels, not the mask); dapo counts the kept tokens, grpo every
    completion, as TRL's normalisers do."""
    from accelerate import Accelerator

    from toolkit.backends import Backend
    from toolkit.config import RLConfig
    from toolkit.model.load import build_byte_tokenizer
    from toolkit.training.loss import use_token_loss
    from toolkit.training.online import GroupRL

    model, prompts = model_and_prompts()
    use_token_loss(model, "chunked")
    backend = Backend()
    backend.accelerator = Accelerator(cpu=True)
    completions = [[5, 6, 2], [7, 8, 9, 10], [11, 2], [12, 13, 14, 15]]  # 2 stops at 3 and 2 tokens; 2 cut at 4
    advantages = torch.tensor([0.5, -0.5, 1.0, -1.0])
    made = {}
    for masked in (False, True):
        cfg = RLConfig(method="grpo", max_new_tokens=4, mask_truncated_completions=masked, loss_type="dapo")
        objective = GroupRL(cfg, [], build_byte_tokenizer(), backend, 5, ["train"], [])
        objective.stops = [2]
        left_out = [objective.truncated(c) for c in completions] if masked else None
        made[masked] = (objective, objective.sequences(prompts, completions, advantages, left_out=left_out))
    assert [made[True][0].truncated(c) for c in completions] == [False, True, False, True]
    plain, cut = made[False][1], made[True][1]
    assert torch.equal(cut["completion_mask"].sum(-1), torch.tensor([3.0, 0.0, 2.0, 0.0]))
    assert torch.equal(plain["completion_mask"].sum(-1), torch.tensor([3.0, 4.0, 2.0, 4.0]))
    with torch.no_grad():
        a, _ = made[False][0].per_token(model, plain)
        b, _ = made[True][0].per_token(model, cut)
    torch.testing.assert_close(b, a, rtol=0, atol=0)  # the same log-probabilities; only the mask differs
    assert made[True][0].units(cut) == 5 and made[False][0].units(plain) == 13
    grpo = GroupRL(RLConfig(method="grpo", max_new_tokens=4, mask_truncated_completions=True, loss_type="grpo"), [],
                   build_byte_tokenizer(), backend, 5, ["train"], [])
    assert grpo.units(cut) == 4  # TRL's grpo: the mean over every completion, a left-out one counting 0


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, 0, 1.0, None), (0.7, 0, 0.95, None), (0.7, 20, 1.0, None), (1.3, 50, 0.9, 0.05), (0.8, 0, 1.0, 0.1)])
def test_the_cuts_are_transformers_warpers_in_their_order(temperature, top_k, top_p, min_p):
    """rl.temperature, top_k, top_p, min_p: the logits completions are drawn from equal those of
    transformers' Temperature, TopK, TopP and MinP warpers in the order its generate (TRL's, without vLLM)
    applies them, -inf where they cut."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from toolkit.model.sampling import warped

    logits = 3 * torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(7))
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature)]
                                     + ([TopKLogitsWarper(top_k)] if top_k else [])
                                     + ([TopPLogitsWarper(top_p)] if top_p < 1 else [])
                                     + ([MinPLogitsWarper(min_p)] if min_p is not None else []))
    want = processors(torch.zeros(6, 1, dtype=torch.long), logits.clone())
    got = warped(logits, temperature, top_p, top_k, min_p)
    assert torch.equal(got.isinf(), want.isinf())
    torch.testing.assert_close(got.softmax(-1), want.softmax(-1))
    if top_k or top_p < 1 or min_p:
        assert got.isinf().any()  # the cuts cut something here


@pytest.mark.parametrize("penalty", [1.0, 1.3, 0.8])
def test_repetition_penalty_is_transformers_processor_and_generate_greedy_agrees(penalty):
    """rl.repetition_penalty (TRL's): the penalised logits equal transformers' RepetitionPenaltyLogitsProcessor over
    the tokens a row holds, and greedy sampling with it gives the tokens transformers' generate gives with it, prompt
    by prompt (no padding there), while the batch here is left-padded: padding is never penalised."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from toolkit.model.sampling import penalised

    logits = 3 * torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    held = torch.tensor([[5, 9, 9, 40], [7, 7, 7, 7]])
    want = RepetitionPenaltyLogitsProcessor(penalty)(held, logits.clone()) if penalty != 1.0 else logits
    seen = torch.zeros(2, VOCAB, dtype=torch.bool).scatter_(1, held, True)
    torch.testing.assert_close(penalised(logits, seen, penalty), want, rtol=0, atol=0)

    model, prompts = model_and_prompts()
    got = sample(model, prompts, None, max_new_tokens=12, stop_ids=[2], pad_id=0, repetition_penalty=penalty)
    for prompt, completion in zip(prompts, got):
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=12, do_sample=False, repetition_penalty=penalty, eos_token_id=2,
                             pad_token_id=0)
        assert out[0, len(prompt):].tolist()[:len(completion)] == completion
    if penalty > 1:  # the penalty changes what is drawn here (the check can fail)
        assert got != sample(model, prompts, None, max_new_tokens=12, stop_ids=[2], pad_id=0)
