"""Online RL equal to TRL 1.16's GRPOTrainer end to end (issue 49): TRL's own trainer, built from a GRPOConfig on
a real model folder, and our GroupRL objective are handed the same prompts and completions (TRL through its
`rollout_func`, ours in place of sampling); from there each runs its own code: rewards through the functions
(one says None), advantages, the old-policy and reference passes, the per-token log-probabilities and entropies
at the temperature, the loss and its gradient. All compared within 1e-5, for the cases below; with
rl.num_iterations 2, both models then take the same SGD step and the second iteration's loss and gradient
against the kept old-policy log-probabilities are compared too.

What this does not cover: TRL's sampling (completions are given), and prompts of different lengths (TRL pads
prompts on the left without position ids, so its positions differ from a right-padded batch's: the prompts here
share one length)."""

import copy
import sys
import warnings

import pytest
import torch

from families import build_family, token_drawer

trl = pytest.importorskip("trl")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

G, PROMPTS, MAX_NEW = 4, 2, 7
PROMPT_LENGTH = 5


def reward_len(completions, **kwargs):
    """Longer is better; None (no opinion) for a completion that is empty text."""
    return [None if not c else len(c) / 10 for c in completions]


def reward_vowels(completions, **kwargs):
    return [sum(ch in "aeiou" for ch in c) / 5 for c in completions]


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm2", marks=[pytest.mark.slow,
                                                                              pytest.mark.real_model])])
def folder(request, tmp_path_factory):
    """A tiny random Llama 3 folder in CI; the real SmolLM2-135M-Instruct by hand (`-m slow`)."""
    if request.param == "smollm2":
        return request.getfixturevalue("real_model_dir")
    return build_family("llama3", tmp_path_factory.mktemp("grpo_trl") / "llama3", seed=3)


@pytest.fixture(scope="module")
def batch(folder):
    """PROMPTS prompts of PROMPT_LENGTH tokens, G completions each: random tokens, some ending in a stop token, one
    cut at MAX_NEW, one a lone stop token (empty text: reward_len says None)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokens = token_drawer(tokenizer)
    eos = tokenizer.eos_token_id
    prompts = [tokens(PROMPT_LENGTH) for _ in range(PROMPTS)]
    lengths = [3, MAX_NEW, 1, 5, 2, 6, MAX_NEW, 4]
    completions = []
    for i, n in enumerate(lengths):
        if n == 1:
            completions.append([eos])
        elif n == MAX_NEW and i % 2:
            completions.append(tokens(n))  # cut at MAX_NEW without a stop token
        else:
            completions.append(tokens(n - 1) + [eos])
    texts = [tokenizer.decode(p) for p in prompts]
    return {"tokenizer": tokenizer, "prompt_ids": prompts, "completions": completions, "texts": texts}


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


def perturb_lora(model) -> None:
    """B = 0 at the start would make A's gradient 0 and the policy equal the reference: B drawn instead."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.05 * torch.randn(parameter.shape, generator=g))


def trl_trainer(tmp_path, folder, batch, *, lora, **config):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False, seed=0,
                      per_device_train_batch_size=G * PROMPTS, num_generations=G, max_completion_length=MAX_NEW,
                      gradient_accumulation_steps=1, learning_rate=1e-6, save_strategy="no", logging_steps=1,
                      **config)

    def rollout(prompts, trainer):
        index = [batch["texts"].index(p) for p in prompts]
        return {"prompt_ids": [batch["prompt_ids"][i] for i in index],
                "completion_ids": [batch["completions"][k] for k in range(len(prompts))],
                "logprobs": [[0.0] * len(batch["completions"][k]) for k in range(len(prompts))]}
    model, peft = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), lora_config() if lora else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(model=model, reward_funcs=[reward_len, reward_vowels], args=args,
                              train_dataset=Dataset.from_list([{"prompt": t} for t in batch["texts"]]),
                              processing_class=batch["tokenizer"], peft_config=peft, rollout_func=rollout)
    if lora:
        perturb_lora(trainer.model)
    return trainer


def ours(folder, batch, trainer, *, lora, rl: dict, loss: str):
    """Our objective over a copy of TRL's model (the same weights, adapter included), reading the same folder."""
    from accelerate import Accelerator

    from toolkit.backends import Backend
    from toolkit.config import RewardConfig, RLConfig
    from toolkit.training.loss import use_token_loss
    from toolkit.training.online import GroupRL
    from toolkit.training.rewards import load_rewards

    model = copy.deepcopy(trainer.model)
    use_token_loss(model, loss, chunk_tokens=5)
    backend = Backend()
    backend.accelerator = Accelerator(cpu=True)
    module = type(sys)("grpo_trl_rewards")
    module.reward_len, module.reward_vowels = reward_len, reward_vowels
    sys.modules["grpo_trl_rewards"] = module
    rewards = load_rewards([RewardConfig(function="grpo_trl_rewards:reward_len"),
                            RewardConfig(function="grpo_trl_rewards:reward_vowels")])
    cfg = RLConfig(**{"method": "grpo", "num_generations": G, "max_new_tokens": MAX_NEW, "rewards": [], **rl})
    if cfg.epsilon_high is None:
        cfg.epsilon_high = cfg.epsilon
    if cfg.beta is None:  # what validation resolves for grpo and rloo
        cfg.beta = 0.0
    reference = None
    if cfg.beta > 0 and not lora:  # full fine-tuning: the base loaded once more, as build.setup_objective does
        from toolkit.config import ModelConfig
        from toolkit.model.load import build_model

        reference = build_model(ModelConfig(path=str(folder)), torch.float32).eval().requires_grad_(False)
        use_token_loss(reference, loss, chunk_tokens=5)
    objective = GroupRL(cfg, rewards, batch["tokenizer"], backend, 0, ["train"], ["train"],
                        adapter=model if lora else None, reference=reference)
    objective.after_prepare()
    objective.stops = list(trainer.eos_token_ids)
    objective.generate = lambda model, prompts, seeds: [list(c) for c in batch["completions"]]
    micro = {"prompt_ids": batch["prompt_ids"], "keys": torch.tensor([[0, i] for i in range(PROMPTS)]),
             "fields": [{"prompt": t} for t in batch["texts"]]}
    return model, objective, micro


def case(lora=False, loss="full", **keys):
    """(lora, train.loss, GRPOConfig keys, rl keys): the same settings under TRL's names and ours."""
    renamed = {"importance_sampling": "importance_sampling_level"}
    return lora, loss, {renamed.get(k, k): v for k, v in keys.items()}, keys


SEQ = dict(importance_sampling="sequence")
CASES = {
    "dapo-T0.7": case(temperature=0.7),
    "dapo-T1-top_p-chunked": case(temperature=1.0, top_p=0.8, loss="chunked"),
    "grpo-sequence-T0.7": case(loss_type="grpo", temperature=0.7, **SEQ),
    "dr_grpo-2-iterations": case(loss_type="dr_grpo", num_iterations=2),
    "cispo-2-iterations": case(loss_type="cispo", epsilon_high=1.5, num_iterations=2, temperature=0.7),
    "dapo-delta-2-iterations": case(delta=1.1, epsilon_high=0.05, epsilon=0.05, num_iterations=2),
    "grpo-scale-batch": case(loss_type="grpo", scale_rewards="batch"),
    "dapo-scale-none": case(scale_rewards="none", temperature=0.7),
    "dapo-mask-truncated": case(mask_truncated_completions=True),
    "grpo-top-entropy": case(loss_type="grpo", top_entropy_quantile=0.5, temperature=0.7),
    "full-dapo-beta-reference-model": case(beta=0.04, temperature=0.7, loss="chunked"),
    "lora-dapo-beta-2-iterations": case(lora=True, beta=0.04, num_iterations=2, temperature=0.7),
    "lora-grpo-sequence-beta": case(lora=True, loss_type="grpo", beta=0.04, **SEQ),
    "lora-dr_grpo": case(lora=True, loss_type="dr_grpo", temperature=0.7),
}


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def iterations_agree(trainer, theirs, model, objective, mine, iterations: int, real: bool, metrics_agree):
    """Each iteration: TRL's loss (its compute_loss on its generated batch) and ours, their entropy metrics (and
    `metrics_agree`'s), and every parameter's gradient within 1e-5 relative to its norm (1e-4 on the real model;
    element by element too on the tiny one); then the same SGD step on both, TRL's gradient. Returns (the worst
    relative gradient difference, our last metric sums)."""
    worst = 0.0
    for iteration in range(iterations):
        trainer.model.zero_grad()
        model.zero_grad()
        trainer.current_gradient_accumulation_steps = 1
        loss_theirs = trainer.compute_loss(trainer.model, theirs)
        loss_theirs.backward()
        loss_mine = objective.loss_sum(model, mine) / objective.units(mine)
        loss_mine.backward()
        sums = objective.step_metrics(torch.device("cpu"))
        assert loss_mine.item() == pytest.approx(loss_theirs.item(), rel=1e-5, abs=1e-6), iteration
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        assert sums["entropy"].item() / sums["tokens"].item() == pytest.approx(metrics["entropy"], rel=1e-5)
        metrics_agree(sums, metrics)
        g_theirs, g_mine = grads(trainer.model), grads(model)
        assert g_theirs.keys() == g_mine.keys() and g_mine
        assert sum(g.abs().sum() for g in g_mine.values()) > 0 or (real and iteration)  # all clipped: both 0
        for key in g_mine:
            difference = (g_mine[key] - g_theirs[key]).norm() / g_theirs[key].norm().clamp(min=1e-12)
            assert difference < (1e-4 if real else 1e-5), (iteration, key, difference.item())
            worst = max(worst, difference.item())
            if not real:
                torch.testing.assert_close(g_mine[key], g_theirs[key], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{key}: {m}")
        with torch.no_grad():
            for m in (trainer.model, model):
                for key, p in m.named_parameters():
                    if key in g_theirs:
                        p -= (0.01 if real else 20.0) * g_theirs[key]
    return worst, sums


@pytest.mark.parametrize("name", list(CASES))
def test_grpo_equals_trls_trainer_from_completions_to_gradients(tmp_path, folder, batch, name):
    lora, loss, trl_config, rl = CASES[name]
    trainer = trl_trainer(tmp_path, folder, batch, lora=lora, **trl_config)
    model, objective, micro = ours(folder, batch, trainer, lora=lora, rl=rl, loss=loss)
    trainer.model.train()
    model.train()
    inputs = [{"prompt": t} for t in batch["texts"] for _ in range(G)]
    theirs = trainer._generate_and_score_completions(inputs)
    made = objective.step_batches(model, [micro], step=1)
    assert len(made) == 1
    mine = made[0]
    # the rewards: one completion is unscorable (reward_len says None, reward_vowels 0 on empty text)
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    assert objective.generated["reward_reward_len"] == pytest.approx(trl_metrics["rewards/reward_len/mean"])
    torch.testing.assert_close(mine["advantages"].double(), theirs["advantages"].double(), rtol=1e-5, atol=1e-5)
    assert mine["advantages"].abs().sum() > 0

    # the model side: each completion token's log-probability and entropy at the temperature
    ids = torch.cat([theirs["prompt_ids"], theirs["completion_ids"]], dim=1)
    attention = torch.cat([theirs["prompt_mask"], theirs["completion_mask"]], dim=1)
    with torch.no_grad():
        want, want_entropy, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, attention, theirs["completion_ids"].size(1), compute_entropy=True)
        have, have_entropy = objective.per_token(model, mine)
    both = theirs["completion_mask"].bool()  # where TRL attends to the completion (not a masked truncated one)
    assert both.sum() > 10
    for i, completion in enumerate(batch["completions"]):
        n = int(both[i].sum())
        span = slice(PROMPT_LENGTH - 1, PROMPT_LENGTH - 1 + n)
        torch.testing.assert_close(have[i, span], want[i, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(have_entropy[i, span], want_entropy[i, :n], rtol=1e-5, atol=1e-5)

    real = "smollm2" in str(folder).lower()

    def metrics_agree(sums, metrics):
        if rl.get("beta"):
            assert sums["kl"].item() / sums["tokens"].item() == pytest.approx(metrics["kl"], rel=1e-5, abs=1e-9)
    worst, sums = iterations_agree(trainer, theirs, model, objective, mine, rl.get("num_iterations", 1), real,
                                   metrics_agree)
    print(f"{name}: worst relative gradient difference {worst:.2e}")
    if objective.reference is not None:  # after the SGD steps the policy moved; the reference did not
        made = objective.step_batches(model, [micro], step=1 + rl.get("num_iterations", 1))
        with torch.no_grad():
            want = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, attention,
                                                              theirs["completion_ids"].size(1))[0]
            moved = objective.per_token(model, made[0])[0]
        for i in range(len(batch["completions"])):
            n = int(both[i].sum())
            span = slice(PROMPT_LENGTH - 1, PROMPT_LENGTH - 1 + n)
            torch.testing.assert_close(made[0]["ref_logps"][i, span], want[i, :n], rtol=1e-5, atol=1e-5)
        assert (moved - made[0]["ref_logps"]).abs().max() > 1e-3  # a frozen copy, not the policy as it is
    if rl.get("num_iterations", 1) > 1 and not real:  # the second iteration's ratios moved off 1: clipping exercised
        assert sums["clip_ratio"].item() > 0 or rl.get("loss_type") == "dr_grpo"


# --- RLOO: TRL's RLOOTrainer (no rollout_func: its prompt tokenizer and single-turn generation hand over the
# given prompts and completions; its own _generate decodes them and the rest is its code)


def rloo_trainer(tmp_path, folder, batch, *, lora, **config):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import RLOOConfig, RLOOTrainer

    args = RLOOConfig(output_dir=str(tmp_path / "rloo"), report_to=[], use_cpu=True, bf16=False, seed=0,
                      per_device_train_batch_size=G * PROMPTS, num_generations=G, max_completion_length=MAX_NEW,
                      gradient_accumulation_steps=1, learning_rate=1e-6, save_strategy="no", logging_steps=1,
                      **{"beta": 0.0, **config})
    model, peft = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), lora_config() if lora else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = RLOOTrainer(model=model, reward_funcs=[reward_len, reward_vowels], args=args,
                              train_dataset=Dataset.from_list([{"prompt": t} for t in batch["texts"]]),
                              processing_class=batch["tokenizer"], peft_config=peft)
    trainer._tokenize_prompts = lambda prompts: ([batch["prompt_ids"][batch["texts"].index(p)] for p in prompts],
                                                 None, {})
    trainer._generate_single_turn = lambda prompt_ids, images, fields: [list(c) for c in batch["completions"]]
    if lora:
        perturb_lora(trainer.model)
    return trainer


RLOO_CASES = {  # (lora, RLOOConfig keys = rl keys)
    "T0.7": (False, dict(temperature=0.7)),
    "normalized-clipped-rewards": (False, dict(normalize_advantages=True, reward_clip_range=(0.0, 0.5))),
    "mask-truncated-2-iterations": (False, dict(mask_truncated_completions=True, num_iterations=2, epsilon=0.05,
                                                epsilon_high=0.1)),
    "lora-beta-2-iterations": (True, dict(beta=0.05, num_iterations=2, temperature=0.7)),
}


@pytest.mark.parametrize("name", list(RLOO_CASES))
def test_rloo_equals_trls_trainer_from_completions_to_gradients(tmp_path, folder, batch, name):
    """rl.method=rloo against TRL's RLOOTrainer: the leave-one-out advantages (rewards clipped, minus beta x the
    summed log-ratio to the reference, standardised), the KL metric, the sequence-level clipped loss and every
    gradient, over a second iteration too."""
    lora, keys = RLOO_CASES[name]
    trainer = rloo_trainer(tmp_path, folder, batch, lora=lora, **keys)
    rl = {"method": "rloo", **{k: list(v) if isinstance(v, tuple) else v for k, v in keys.items()}}
    model, objective, micro = ours(folder, batch, trainer, lora=lora, rl=rl, loss="full")
    trainer.model.train()
    model.train()
    theirs = trainer._generate_and_score_completions([{"prompt": t} for t in batch["texts"] for _ in range(G)])
    mine = objective.step_batches(model, [micro], step=1)[0]
    torch.testing.assert_close(mine["advantages"].double(), theirs["advantages"].double(), rtol=1e-5, atol=1e-5)
    assert mine["advantages"].abs().sum() > 0
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    if keys.get("beta"):
        assert objective.generated["kl"] == pytest.approx(trl_metrics["kl"], rel=1e-5, abs=1e-9)
        assert trl_metrics["kl"] != 0
    real = "smollm2" in str(folder).lower()

    def metrics_agree(sums, metrics):
        assert sums["clip_ratio"].item() / sums["clip_units"].item() == pytest.approx(metrics["clip_ratio/region_mean"])
    worst, _ = iterations_agree(trainer, theirs, model, objective, mine, keys.get("num_iterations", 1), real,
                                metrics_agree)
    print(f"rloo {name}: worst relative gradient difference {worst:.2e}")
