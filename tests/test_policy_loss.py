"""policy_loss.py against TRL 1.16's own code: `GRPOTrainer._compute_loss`, called unbound on a stub trainer
whose model part (`_get_per_token_logps_and_entropies`) hands back our log-probabilities, must give the same
loss, gradient and clip/KL metrics; `group_advantages` must give the advantages of TRL's
`_generate_and_score_completions`."""

import itertools
import types
from collections import defaultdict

import pytest
import torch

from toolkit.training.policy_loss import group_advantages, policy_loss

grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
trl_utils = pytest.importorskip("trl.trainer.utils")
# TrainingArguments' own default (gradient_checkpointing) warns on every GRPOConfig
pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")

B, T = 6, 12
LENGTHS = [12, 3, 7, 1, 12, 5]  # completions of varied lengths, two of them full, one of a single token
EPSILON, EPSILON_HIGH = 0.2, 0.28


def batch(seed: int) -> dict[str, torch.Tensor]:
    """Random float64 tensors: ratios far enough from 1 to be clipped on both sides, advantages of both signs."""
    generator = torch.Generator().manual_seed(seed)
    logps = -3 * torch.rand(B, T, generator=generator, dtype=torch.float64)
    mask = (torch.arange(T) < torch.tensor(LENGTHS).unsqueeze(1)).double()
    return {
        "logps": logps,
        "old_logps": logps + 0.3 * torch.randn(B, T, generator=generator, dtype=torch.float64),
        "ref_logps": logps + 0.5 * torch.randn(B, T, generator=generator, dtype=torch.float64),
        "advantages": torch.randn(B, generator=generator, dtype=torch.float64),
        "mask": mask,
    }


def trl_loss(tmp_path, data, logps, *, loss_type, importance_sampling, beta, old, processes=1, accumulation=1,
             num_items=None, delta=None, top_entropy_quantile=1.0, entropies=None, is_ratio=None):
    """TRL's `_compute_loss` of one micro-batch, on a stub trainer set up as `GRPOTrainer.__init__` sets itself up
    from a real GRPOConfig (TRL's defaults for everything not named); `num_items`: the completion tokens of the
    whole generation batch, over every process (TRL gathers it; default: this micro-batch's).
    Returns (loss, the stub's metrics)."""
    args = grpo_trainer.GRPOConfig(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, loss_type=loss_type, beta=beta,
        epsilon=EPSILON, epsilon_high=high_of(loss_type), importance_sampling_level=importance_sampling, delta=delta,
        max_completion_length=T, per_device_train_batch_size=B, num_generations=3,
        gradient_accumulation_steps=accumulation, top_entropy_quantile=top_entropy_quantile,
    )
    entropies = torch.rand(B, T, dtype=torch.float64) if entropies is None else entropies
    stub = types.SimpleNamespace(
        args=args, loss_type=args.loss_type, beta=args.beta, epsilon_low=args.epsilon, epsilon_high=args.epsilon_high,
        importance_sampling_level=args.importance_sampling_level, max_completion_length=args.max_completion_length,
        top_entropy_quantile=args.top_entropy_quantile, off_policy_mask_threshold=args.off_policy_mask_threshold,
        use_vllm=args.use_vllm, vllm_importance_sampling_correction=args.vllm_importance_sampling_correction,
        _entropy_bonus_enabled=args.entropy_coef != 0.0 or args.use_adaptive_entropy, aux_loss_enabled=False,
        model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=accumulation,
        accelerator=types.SimpleNamespace(num_processes=processes, reduce=lambda x, reduction: x, gather=lambda x: x,
                                          pad_across_processes=lambda x, dim, pad_index: x),
        _metrics={"train": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logps, entropies, None),
    )
    stub.get_high_entropy_mask = types.MethodType(grpo_trainer.GRPOTrainer.get_high_entropy_mask, stub)
    mask = data["mask"].long()
    inputs = {
        "prompt_ids": torch.ones(B, 4, dtype=torch.long), "prompt_mask": torch.ones(B, 4, dtype=torch.long),
        "completion_ids": torch.ones(B, T, dtype=torch.long), "completion_mask": mask,
        "advantages": data["advantages"],
        "old_per_token_logps": data["old_logps"] if old else None,
        "ref_per_token_logps": data["ref_logps"] if beta else None,
        "num_items_in_batch": mask.sum() if num_items is None else torch.tensor(num_items),
    }
    if is_ratio is not None:  # completions from vLLM: TRL's correction, the ratio as TRL made it (trl_is_ratio)
        stub.use_vllm = stub.vllm_importance_sampling_correction = True
        inputs["importance_sampling_ratio"] = is_ratio
    return grpo_trainer.GRPOTrainer._compute_loss(stub, None, inputs), stub._metrics["train"]


def high_of(loss_type: str) -> float:
    """cispo caps the weight at epsilon_high itself: 1.2 caps some of these ratios (ScaleRL's 5.0 none)."""
    return 1.2 if loss_type == "cispo" else EPSILON_HIGH


def ours(data, logps, *, loss_type, importance_sampling, beta, old, delta=None):
    return policy_loss(
        logps, data["old_logps"] if old else None, data["ref_logps"] if beta else None, data["advantages"],
        data["mask"], loss_type=loss_type, importance_sampling=importance_sampling, epsilon=EPSILON,
        epsilon_high=high_of(loss_type), beta=beta, max_completion_length=T, delta=delta,
    )


CASES = list(itertools.product(["grpo", "dapo", "dr_grpo", "cispo"], ["token", "sequence"], [0.0, 0.04],
                               [False, True]))
DELTA = 1.25  # two-sided clipping: batch(40) has ratios above it with negative advantages, at both levels


@pytest.mark.parametrize("loss_type, importance_sampling, beta, old", CASES)
def test_loss_gradient_and_metrics_equal_trl(tmp_path, loss_type, importance_sampling, beta, old):
    data = batch(seed=CASES.index((loss_type, importance_sampling, beta, old)))
    config = dict(loss_type=loss_type, importance_sampling=importance_sampling, beta=beta, old=old)
    theirs_logps = data["logps"].clone().requires_grad_()
    theirs, metrics = trl_loss(tmp_path, data, theirs_logps, **config)
    our_logps = data["logps"].clone().requires_grad_()
    loss_sum, units, sums = ours(data, our_logps, **config)
    assert units == (sum(LENGTHS) if loss_type in ("dapo", "cispo") else B)
    torch.testing.assert_close(loss_sum / units, theirs, rtol=1e-5, atol=1e-5)
    (their_grad,) = torch.autograd.grad(theirs, theirs_logps)
    (our_grad,) = torch.autograd.grad(loss_sum / units, our_logps)
    assert our_grad.abs().sum() > 0
    torch.testing.assert_close(our_grad, their_grad, rtol=1e-5, atol=1e-5)

    clip_units = sums["clip_units"].item()
    assert clip_units == (sum(LENGTHS) if importance_sampling == "token" else B)
    # TRL divides by a float32 count (global_masked_mean: mask.sum().float()), hence rel=1e-6
    if loss_type == "cispo":  # TRL logs the weights capped (with a positive advantage) as cispo_clip_ratio
        for name in ("clip_ratio_high", "clip_ratio"):
            assert sums[name].item() / clip_units == pytest.approx(metrics["cispo_clip_ratio"][0], rel=1e-6)
        assert sums["clip_ratio_low"] == 0
        if importance_sampling == "token" and old:
            assert sums["clip_ratio_high"] > 0
    else:
        for ours_name, trl_name in [("clip_ratio_low", "low_mean"), ("clip_ratio_high", "high_mean"),
                                    ("clip_ratio", "region_mean")]:
            assert sums[ours_name].item() / clip_units == pytest.approx(metrics[f"clip_ratio/{trl_name}"][0],
                                                                        rel=1e-6)
        if importance_sampling == "token" and old:  # the data are made to clip, on both sides
            assert sums["clip_ratio_low"] > 0 and sums["clip_ratio_high"] > 0
    assert sums["tokens"].item() == sum(LENGTHS)
    if beta:
        assert sums["kl"].item() / sums["tokens"].item() == pytest.approx(metrics["kl"][0], rel=1e-6)
    else:
        assert "kl" not in sums and "kl" not in metrics
    assert all(value.dtype == torch.float64 and not value.requires_grad for value in sums.values())


def same_loss_and_gradient_not_without(theirs, theirs_logps, mine, our_logps, data, config):
    """Our loss and its gradient equal TRL's within 1e-5, and differ from ours without the setting under test."""
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    (their_grad,) = torch.autograd.grad(theirs, theirs_logps)
    (our_grad,) = torch.autograd.grad(mine, our_logps)
    torch.testing.assert_close(our_grad, their_grad, rtol=1e-5, atol=1e-5)
    without, units_without, _ = ours(data, data["logps"], **config)
    assert abs(float(without / units_without - mine)) > 1e-4


@pytest.mark.parametrize("loss_type, importance_sampling", list(itertools.product(["grpo", "dapo", "dr_grpo"],
                                                                                ["token", "sequence"])))
def test_two_sided_clipping_by_delta_equals_trl(tmp_path, loss_type, importance_sampling):
    """TRL's `delta` (INTELLECT-2): the unclipped ratio capped at delta; loss and gradient as TRL's, and not
    those without it (the data hold ratios above delta with negative advantages)."""
    data = batch(seed=40)
    config = dict(loss_type=loss_type, importance_sampling=importance_sampling, beta=0.04, old=True)
    theirs_logps = data["logps"].clone().requires_grad_()
    theirs, _ = trl_loss(tmp_path, data, theirs_logps, delta=DELTA, **config)
    our_logps = data["logps"].clone().requires_grad_()
    loss_sum, units, _ = ours(data, our_logps, delta=DELTA, **config)
    same_loss_and_gradient_not_without(theirs, theirs_logps, loss_sum / units, our_logps, data, config)


@pytest.mark.parametrize("importance_sampling", ["token", "sequence"])
def test_clip_metrics_with_delta_below_the_high_clip_equal_trl(tmp_path, importance_sampling):
    """Issue 67.5: with 1 < delta < 1 + epsilon_high, TRL counts clipping on the ratio after the delta clamp, so no
    token counts as clipped high; ours counted the ratio before it (clip_ratio_high and clip_ratio differed)."""
    data = batch(seed=40)
    config = dict(loss_type="dapo", importance_sampling=importance_sampling, beta=0.0, old=True)
    delta = 1.1  # below 1 + EPSILON_HIGH = 1.28
    _, metrics = trl_loss(tmp_path, data, data["logps"], delta=delta, **config)
    _, _, sums = ours(data, data["logps"], delta=delta, **config)
    _, _, undelta = ours(data, data["logps"], **config)
    assert undelta["clip_ratio_high"] > 0 or importance_sampling == "sequence"  # without delta, tokens clip high
    for ours_name, trl_name in [("clip_ratio_low", "low_mean"), ("clip_ratio_high", "high_mean"),
                                ("clip_ratio", "region_mean")]:
        assert sums[ours_name].item() / sums["clip_units"].item() == pytest.approx(
            metrics[f"clip_ratio/{trl_name}"][0], rel=1e-6, abs=1e-12)
    assert sums["clip_ratio_high"] == 0


@pytest.mark.parametrize("loss_type, beta", [("grpo", 0.0), ("dapo", 0.04), ("dr_grpo", 0.0), ("cispo", 0.04)])
@pytest.mark.parametrize("quantile", [0.2, 0.5])
def test_top_entropy_quantile_equals_trl(tmp_path, loss_type, beta, quantile):
    """TRL's top_entropy_quantile ("Beyond the 80/20 Rule"): the policy term only on the completion tokens whose
    entropy is in the top share (TRL's get_high_entropy_mask threshold, called on the stub), the KL term on every
    token; loss and gradient as TRL's, and not those without the mask."""
    from toolkit.training.policy_loss import entropy_threshold, high_entropy_mask

    data = batch(seed=50)
    entropies = torch.rand(B, T, generator=torch.Generator().manual_seed(51), dtype=torch.float64)
    config = dict(loss_type=loss_type, importance_sampling="token", beta=beta, old=True)
    theirs_logps = data["logps"].clone().requires_grad_()
    theirs, _ = trl_loss(tmp_path, data, theirs_logps, top_entropy_quantile=quantile, entropies=entropies, **config)
    threshold = entropy_threshold(entropies[data["mask"].bool()], quantile)
    kept = high_entropy_mask(entropies, data["mask"], threshold)
    assert 0 < kept.sum() < data["mask"].sum()
    assert kept.sum() == pytest.approx(quantile * data["mask"].sum(), abs=1)
    our_logps = data["logps"].clone().requires_grad_()
    loss_sum, units, _ = policy_loss(
        our_logps, data["old_logps"], data["ref_logps"] if beta else None, data["advantages"], data["mask"],
        loss_type=loss_type, importance_sampling="token", epsilon=EPSILON, epsilon_high=high_of(loss_type),
        beta=beta, max_completion_length=T, entropy_mask=kept)
    same_loss_and_gradient_not_without(theirs, theirs_logps, loss_sum / units, our_logps, data, config)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "cispo"])
def test_global_division_equals_trl_over_ranks_and_accumulation(tmp_path, loss_type):
    """Two ranks x two accumulated micro-batches: TRL's losses, averaged over the ranks as DDP averages gradients,
    summed over the micro-batches, equal our sums over all four divided by the global count of units."""
    config = dict(loss_type=loss_type, importance_sampling="token", beta=0.04, old=True)
    parts = [batch(seed=10 + i) for i in range(4)]
    for i, data in enumerate(parts):  # each micro-batch with its own lengths
        data["mask"] = data["mask"].roll(i, dims=0)
    total_tokens = int(sum(data["mask"].sum() for data in parts))
    theirs = 0.0
    for data in parts:
        loss, _ = trl_loss(tmp_path, data, data["logps"], processes=2, accumulation=2, num_items=total_tokens, **config)
        theirs = theirs + loss / 2
    results = [ours(data, data["logps"], **config) for data in parts]
    global_units = sum(units for _, units, _ in results)
    torch.testing.assert_close(sum(loss_sum for loss_sum, _, _ in results) / global_units, theirs)


def trl_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> torch.Tensor:
    """TRL 1.16's advantages, trl/trainer/grpo_trainer.py lines 2765-2787 and 2810 (multi_objective_aggregation
    "sum_then_normalize", the default), with TRL's own nanstd (trl/trainer/utils.py: Bessel-corrected)."""
    nanstd = trl_utils.nanstd
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    if scale_rewards in ["group", "none"]:
        std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
        std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
    else:
        std_rewards = nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_equal_trl(scale):
    # float32, as TRL's rewards are: its nanstd applies Bessel's factor as a float32 (count / (count - 1) of
    # integer counts), so on float64 rewards it differs from an exact std by ~1e-8, relative
    rewards = torch.randn(24, generator=torch.Generator().manual_seed(0))
    rewards[4:8] = 0.5  # one group of equal rewards
    advantages = group_advantages(rewards, 4, scale)
    torch.testing.assert_close(advantages, trl_advantages(rewards, 4, scale))
    assert torch.equal(advantages[4:8], torch.zeros(4))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_an_unscorable_completion_gets_advantage_zero_as_in_trl(scale):
    """A completion every reward function said None for (reward NaN) is left out of its group's mean and std
    and gets advantage 0 under every scale_rewards, as TRL's nan_to_num after all three; under `none` ours
    returned NaN before (issue 49), which made the loss NaN and skipped the step."""
    rewards = torch.randn(12, generator=torch.Generator().manual_seed(2))
    rewards[1] = rewards[7] = float("nan")
    advantages = group_advantages(rewards, 4, scale)
    assert not advantages.isnan().any() and advantages[1] == 0 and advantages[7] == 0
    torch.testing.assert_close(advantages, trl_advantages(rewards, 4, scale))


def test_batch_scale_over_ranks_uses_the_global_std():
    """Each rank holds whole groups; with the std of every rank's rewards passed in, the ranks' advantages
    together are those of the whole batch."""
    rewards = torch.rand(16, generator=torch.Generator().manual_seed(1))
    per_rank = [group_advantages(part, 4, "batch", batch_std=rewards.std()) for part in rewards.split(8)]
    torch.testing.assert_close(torch.cat(per_rank), group_advantages(rewards, 4, "batch"))
    torch.testing.assert_close(torch.cat(per_rank), trl_advantages(rewards, 4, "batch"))


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("kind", ["chunked", "full"])
def test_token_logps_and_entropies_equal_trls_fused_head(kind, temperature):
    """The model side, which the loss tests above hand over: TRL 1.16's `_get_per_token_logps_and_entropies`
    (called unbound) over a model patched with its own `add_fused_lm_head(temperature=T)`, and ours
    (`token_logps_each` through train.loss's head) on the same tiny Llama, prompts and right-padded
    completions: the completion tokens' log-probabilities, the entropies there and the gradient of a
    weighted sum of the log-probabilities, within 1e-5. Ours left the temperature out before (issue 49)."""
    import contextlib
    import copy

    from toolkit.config import ModelConfig
    from toolkit.data.formats import IGNORE
    from toolkit.model.load import build_model
    from toolkit.training.loss import token_logps_each, use_token_loss

    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="tiny-llama-mini"))
    theirs = copy.deepcopy(model)
    trl_utils.add_fused_lm_head(theirs, temperature=temperature, outputs=("log_probs", "entropy"))
    use_token_loss(model, kind, chunk_tokens=5)
    g = torch.Generator().manual_seed(4)
    prompt, width = 6, 7
    lengths = torch.tensor([7, 3, 5, 1])
    ids = torch.randint(3, 262, (4, prompt + width), generator=g)
    mask = (torch.arange(prompt + width) < prompt + lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0)
    stub = types.SimpleNamespace(accelerator=types.SimpleNamespace(autocast=contextlib.nullcontext))
    method = grpo_trainer.GRPOTrainer._get_per_token_logps_and_entropies
    method = getattr(method, "__wrapped__", method)  # inside TRL's profiling decorator, which times and logs only
    want, want_entropy, _ = method(stub, theirs, ids, mask, width, compute_entropy=True)
    completion = mask[:, prompt:] > 0
    labels = ids.masked_fill(mask == 0, IGNORE)
    labels[:, :prompt] = IGNORE
    got, got_entropy = token_logps_each(model, {"input_ids": ids, "attention_mask": mask, "labels": labels},
                                        temperature)
    torch.testing.assert_close(got, want[completion], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_entropy, want_entropy[completion], rtol=1e-5, atol=1e-5)
    weights = torch.randn(len(got), generator=g)
    (got * weights).sum().backward()
    (want[completion] * weights).sum().backward()
    theirs_grads = dict(theirs.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, theirs_grads[name].grad, rtol=1e-5, atol=1e-6, msg=name)
    if temperature != 1.0:  # the check can fail: at T = 1 the two differ
        plain, _ = token_logps_each(model, {"input_ids": ids, "attention_mask": mask, "labels": labels})
        assert (plain - want[completion]).abs().max() > 1e-2


def test_the_entropy_threshold_above_torch_quantiles_limit_is_its_interpolation(monkeypatch):
    """More completion tokens than torch.quantile takes (2^24) in a global batch: the threshold is the same linear
    interpolation between order statistics (checked here with the limit lowered)."""
    from toolkit.training import policy_loss as module

    values = torch.rand(1001, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    want = [module.entropy_threshold(values, q) for q in (0.2, 0.5, 0.37, 1.0)]
    monkeypatch.setattr(module, "QUANTILE_LIMIT", 100)
    have = [module.entropy_threshold(values, q) for q in (0.2, 0.5, 0.37, 1.0)]
    for w, h in zip(want, have):
        torch.testing.assert_close(h, w, rtol=0, atol=1e-7)


def trl_is_ratio(tmp_path, old_logps, sampling_logps, mask, mode, clip_min, clip_max) -> torch.Tensor:
    """TRL 1.16's vLLM importance-sampling ratio, by TRL's own lines: the block of
    `GRPOTrainer._generate_and_score_completions` that makes it (from `if self.use_vllm and
    self.vllm_importance_sampling_correction:` to the reference's log-probabilities), run on these tensors with a
    GRPOConfig's settings."""
    import inspect
    import math
    import textwrap

    source = inspect.getsource(grpo_trainer.GRPOTrainer._generate_and_score_completions)
    start = source.index("            if self.use_vllm and self.vllm_importance_sampling_correction:\n"
                         "                mask = completion_mask")
    end = source.index("            # Compute the per-token log probabilities for the reference model", start)
    args = grpo_trainer.GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False,
                                   vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=clip_min,
                                   vllm_importance_sampling_clip_max=clip_max)
    stub = types.SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=True,
                                 vllm_importance_sampling_mode=args.vllm_importance_sampling_mode,
                                 vllm_importance_sampling_clip_min=args.vllm_importance_sampling_clip_min,
                                 vllm_importance_sampling_clip_max=args.vllm_importance_sampling_clip_max)
    scope = {"self": stub, "old_per_token_logps": old_logps, "sampling_per_token_logps": sampling_logps,
             "completion_mask": mask, "tool_mask": None, "torch": torch, "math": math}
    exec(textwrap.dedent(source[start:end]), scope)
    return scope["vllm_importance_sampling_ratio"]


SAMPLER_CASES = [(mode, low, high) for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
                 for low, high in ((None, 3.0), (0.5, 2.0), (0.8, None))]


@pytest.mark.parametrize("mode, clip_min, clip_max", SAMPLER_CASES)
def test_the_sampler_correction_and_its_loss_equal_trls_vllm_importance_sampling(tmp_path, mode, clip_min, clip_max):
    """An inference server's log-probabilities of the sampled tokens (NaN where it gave none) against the trained
    model's: the ratio of every mode and bound equals TRL's own lines, and the loss and gradient with it equal
    TRL's `_compute_loss` with use_vllm (DAPO, beta 0.04, one iteration: the old log-probabilities are the policy's
    at generation)."""
    from toolkit.training.policy_loss import sampler_correction

    data = batch(seed=70 + SAMPLER_CASES.index((mode, clip_min, clip_max)))
    g = torch.Generator().manual_seed(9)
    sampler = data["logps"] + 0.15 * torch.randn(B, T, generator=g, dtype=torch.float64)
    sampler[1, 0] = float("nan")  # a token the server gave no log-probability for
    want = trl_is_ratio(tmp_path, data["logps"], sampler, data["mask"].long(), mode, clip_min, clip_max)
    got = sampler_correction(data["logps"], sampler, data["mask"], mode, clip_min, clip_max)
    assert got.shape == want.shape == ((B, T) if mode.startswith("token") else (B, 1))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert ((got != 1) & (got != 0)).any() and (got != want.new_ones(want.shape)).any()
    config = dict(loss_type="dapo", importance_sampling="token", beta=0.04, old=False)
    theirs_logps = data["logps"].clone().requires_grad_()
    theirs, _ = trl_loss(tmp_path, data, theirs_logps, **config, is_ratio=want)
    our_logps = data["logps"].clone().requires_grad_()
    loss_sum, units, _ = policy_loss(our_logps, None, data["ref_logps"], data["advantages"], data["mask"],
                                     loss_type="dapo", importance_sampling="token", epsilon=EPSILON,
                                     epsilon_high=EPSILON_HIGH, beta=0.04, max_completion_length=T,
                                     sampler_weights=got)
    torch.testing.assert_close(loss_sum / units, theirs, rtol=1e-6, atol=1e-7)
    (their_grad,) = torch.autograd.grad(theirs, theirs_logps)
    (our_grad,) = torch.autograd.grad(loss_sum / units, our_logps)
    torch.testing.assert_close(our_grad, their_grad, rtol=1e-6, atol=1e-7)
    plain, _, _ = policy_loss(data["logps"], None, data["ref_logps"], data["advantages"], data["mask"],
                              loss_type="dapo", importance_sampling="token", epsilon=EPSILON, epsilon_high=EPSILON_HIGH,
                              beta=0.04, max_completion_length=T)
    assert not torch.allclose(plain / units, theirs)  # the correction changes the loss: the check can fail


def test_rloo_weights_each_completion_by_the_sampler_correction():
    """rl.method rloo with rl.sampler vllm: each completion's term of the loss is multiplied by its sequence-level
    correction (`sampler_correction` in a sequence mode, (B, 1)); a completion masked out (weight 0) gives no
    gradient, the others theirs times their weight; no weights is TRL's RLOO loss as before."""
    from toolkit.training.policy_loss import rloo_loss, sampler_correction

    b = batch(3)
    logps = b["logps"].clone().requires_grad_(True)
    old, mask, adv = b["old_logps"], b["mask"], b["advantages"]
    sampled = old + 0.3 * torch.randn(B, T, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    weights = sampler_correction(old, sampled, mask, "sequence_mask", 0.5, 1.5)
    assert weights.shape == (B, 1) and (weights == 0).any() and (weights > 0).any()  # some kept, some masked
    plain, _, _ = rloo_loss(logps, old, adv, mask, epsilon=EPSILON, epsilon_high=EPSILON_HIGH)
    weighted, _, _ = rloo_loss(logps, old, adv, mask, epsilon=EPSILON, epsilon_high=EPSILON_HIGH,
                               sampler_weights=weights)
    per_row = [rloo_loss(logps[i:i + 1], old[i:i + 1], adv[i:i + 1], mask[i:i + 1], epsilon=EPSILON,
                         epsilon_high=EPSILON_HIGH)[0] for i in range(B)]
    assert torch.allclose(plain, sum(per_row))
    assert torch.allclose(weighted, sum(w * t for w, t in zip(weights.reshape(-1), per_row)))
    (grad,) = torch.autograd.grad(weighted, logps)
    for i in range(B):
        (own,) = torch.autograd.grad(per_row[i], logps, retain_graph=True)
        assert torch.allclose(grad[i], weights[i, 0] * own[i]), i
