"""Online RL (GRPO and its variants) as an objective of the one loop: each optimizer step makes its
own batch in `step_batches`. For the step's prompts (the loader's micro-batches, data.format=prompt)
the policy samples rl.num_generations completions each (`model/sampling.py`: each completion seeded
by the run's seed, the step, the prompt's source and row and its index in the group, so completions
do not depend on the backend, the number of ranks or a resume); the reward functions score them
(`rewards.py`); rewards become advantages within each prompt's group; and the micro-batches the loss
is taken on are the prompt + completion sequences, with their advantages (and the old policy's and
the reference's log-probabilities where rl.num_iterations > 1 or rl.beta > 0). The loss is
`policy_loss.policy_loss`, a sum over this objective's units, which the loop divides by their
global count.

A prompt's group is sampled, scored and normalised on the rank that holds the prompt: groups never
straddle ranks. rl.scale_rewards=batch divides by the standard deviation of the whole global batch,
reduced over the ranks. Evaluation samples one answer per eval prompt (the same seeds at every
evaluation) and reports the mean reward (`eval_reward`, and `eval_reward_<function>`): held-out
accuracy where the reward is a correctness check.

What reward functions log goes where TRL puts it: log_metric values into the step's metrics (the mean over the
calls of every rank), log_extra columns into the completions table (rl.log_completions: completions.jsonl in the
run folder, a row per completion with its prompt, rewards and advantage).
"""

from __future__ import annotations

import math
import time
from functools import partial
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .. import faults
from ..data.formats import IGNORE
from ..errors import ToolkitError
from ..model.inference import stop_token_ids
from ..model.sampling import completion_seed, sample
from . import rewards as reward_functions
from . import rl_ahead, rl_log, rl_tools
from .loss import token_logps_each
from .objectives import ONLINE_RL, Objective, Preparation
from .policy_loss import (
    TOKEN_MEAN,
    entropy_threshold,
    group_advantages,
    high_entropy_mask,
    leave_one_out,
    leave_one_out_advantages,
    policy_loss,
    rloo_loss,
    sampler_correction,
)


class GroupRL(Objective):
    """rl.method grpo or rloo: the clipped policy-gradient loss over groups of sampled completions."""

    eval_metrics = ("reward",)
    has_eval_loss = False

    def __init__(self, cfg, rewards: list, tokenizer, backend, seed: int, sources: list[str],
                 eval_sources: list[str], adapter=None, router_coef: float = 0.0, out: Path | None = None,
                 reference=None, sampler=None, tools=None):
        self.cfg, self.rewards, self.tokenizer, self.backend = cfg, rewards, tokenizer, backend
        self.accelerator = backend.accelerator
        self.seed, self.sources, self.eval_sources, self.adapter = seed, sources, eval_sources, adapter
        self.reference = reference  # full fine-tuning with rl.beta > 0: a frozen copy of the base (after_prepare)
        self.sampler = sampler  # rl.sampler=vllm: the server's client (rollout/vllm_sampler.py); None: our own
        self.tools = tools  # rl.tools: rl_tools.ToolRollouts, the completions go on through their tool calls
        self.corrected = sampler is not None and cfg.vllm_importance_sampling_correction
        self.router_coef = router_coef  # what a mixture-of-experts model's config asks for; not trained here
        self.rloo = cfg.method == "rloo"
        self.unit = "completion tokens" if cfg.loss_type in TOKEN_MEAN and not self.rloo else "completions"
        self.eval_metrics = ("reward", *(r.metric for r in rewards))  # rewards.metric_names: unique, tracker-safe
        self.iterations = cfg.num_iterations
        self.made: list[dict] | None = None  # this generation's micro-batches, kept for its num_iterations steps
        self.sums: dict[str, torch.Tensor] = {}
        self.generated: dict[str, float] = {}  # the step's generation metrics, global already
        self.shown: list[dict] = []
        self.unscored = 0  # generated batches in a row that taught nothing (rl.max_unscored_steps)
        self.counted = 0.0  # the last batch's completions that were scored and not left out (global)
        self.said_flat = False  # a batch without advantages: said once
        self.stops: list[int] | None = None  # where a completion ends: set on first use, from the model
        self.table = out / "completions.jsonl" if out is not None and cfg.log_completions else None
        self.last_step = 0  # the optimizer steps done when evaluation runs (trainer_state.global_step)
        self.sampling_said = False  # the weights a rank held while sampling: said once, after the first sampling
        # rl.max_staleness: later steps' batches sampled on the server in a thread, with a tokenizer of their own
        self.ahead = rl_ahead.Ahead(cfg.max_staleness, self.accelerator) if sampler and cfg.max_staleness else None
        self.lookahead = cfg.max_staleness if self.ahead else 0
        self.tools_ahead = rl_tools.own_tokenizer(tools) if self.ahead and tools else None

    # ------------------------------------------------------------------ the contract

    def describe(self) -> list[str]:
        c = self.cfg
        names = ", ".join(f"{r.name} x {r.weight:g}" for r in self.rewards)
        return [f"rl: {self.loss_text()}"
                + (f"; {c.num_iterations} optimizer steps per generated batch" if c.num_iterations > 1 else "")
                + f"; the loss is a mean over {self.unit}",
                f"rl: rewards {names}; groups stay on one rank"
                + (", the batch std is reduced over ranks" if c.scale_rewards == "batch" else "")
                + (f"; sampling by {self.sampler.describe()}" if self.sampler is not None else
                   f"; sampling from {self.backend.sampling_line(c.gather_for_sampling)}")
                + (f"; completions logged to {self.table}" if self.table else "")] \
            + ([self.tools.describe()] if self.tools is not None else []) \
            + ([self.ahead.describe()] if self.ahead is not None else []) \
            + ([f"router: no load-balancing loss: the model's config asks for one (router_aux_loss_coef "
                f"{self.router_coef:g}) but the policy loss has no router term"] if self.router_coef else [])

    def preparation(self) -> Preparation:
        return ONLINE_RL

    def reference_text(self) -> str:
        return ("adapter disabled" if self.reference is None else
                f"a frozen copy of it, {self.backend.frozen_line()}")

    def sampling_text(self) -> str:
        """How completions are sampled, in words."""
        c = self.cfg
        return (f"{c.num_generations} completion{'s' if c.num_generations > 1 else ''} per prompt (seeded per prompt "
                f"and step), at most {c.max_new_tokens} new tokens, temperature {c.temperature:g}"
                + (f", top_k {c.top_k}" if c.top_k else "") + (f", top_p {c.top_p:g}" if c.top_p < 1 else "")
                + (f", min_p {c.min_p:g}" if c.min_p is not None else "")
                + (f", repetition_penalty {c.repetition_penalty:g}" if c.repetition_penalty != 1 else ""))

    def loss_text(self) -> str:
        """The method, its sampling and its loss's settings, in words."""
        c = self.cfg
        sampling = self.sampling_text()
        if self.rloo:
            return (f"RLOO (leave-one-out baselines, one ratio per completion), {sampling}; "
                    f"clip [1 - {c.epsilon:g}, 1 + {c.epsilon_high:g}]"
                    + ("; rewards clipped to [{:g}, {:g}]".format(*c.reward_clip_range) if c.reward_clip_range else "")
                    + ("; advantages standardised over the global batch" if c.normalize_advantages else "")
                    + (f"; reward minus {c.beta:g} x the summed log-ratio to the base ({self.reference_text()})"
                       if c.beta else "; no reference model"))
        variant = {"grpo": "GRPO", "dapo": "DAPO", "dr_grpo": "Dr. GRPO", "cispo": "CISPO"}[c.loss_type] \
            + (" with sequence-level ratios (GSPO)" if c.importance_sampling == "sequence" else "")
        clip = (f"importance weight capped at {c.epsilon_high:g}" if c.loss_type == "cispo" else
                f"clip [1 - {c.epsilon:g}, 1 + {c.epsilon_high:g}]"
                + (f", ratio capped at {c.delta:g} (two-sided)" if c.delta is not None else ""))
        scale = {"group": "group's std", "batch": "global batch's std", "none": "nothing"}[c.scale_rewards]
        return (f"{variant}, {sampling}; {clip}; advantages scaled by the {scale}"
                + (f"; KL to the base ({self.reference_text()}) x {c.beta:g}" if c.beta else "; no reference model")
                + (f"; the policy term on the top {c.top_entropy_quantile:g} of the global batch's completion "
                   "tokens by entropy" if c.top_entropy_quantile < 1 else ""))

    def unsplittable(self) -> str | None:
        return "online RL samples and scores whole completions, not rows split across ranks"

    def after_prepare(self) -> None:
        if self.reference is not None:  # held as the backend holds a frozen model, as TRL's ref_model
            self.reference = self.backend.prepare_frozen(self.reference)

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.close()
        if self.sampler is not None:
            self.sampler.close()

    def save_state(self, folder: Path) -> None:
        if self.ahead is not None:  # the batches sampled ahead: the weights they were sampled with are gone
            self.ahead.save(folder)

    def load_state(self, folder: Path) -> None:
        if self.ahead is not None:
            self.ahead.load(folder)

    def resumable_after(self, step: int) -> bool:
        return step % self.iterations == 0  # a checkpoint between a generated batch's steps would lose it

    def units(self, batch: dict) -> int:
        if "completion_mask" not in batch:  # an eval batch of prompts: its real prompts
            return int(batch["valid"].sum())
        mask = batch["completion_mask"]
        # grpo / dr_grpo / rloo: every completion, one left out as truncated too (TRL's mean over the batch's rows)
        return int(mask.sum()) if self.unit == "completion tokens" else mask.shape[0]

    def host_counts(self, micro_batches: list[dict]) -> list[float]:
        units = sum(self.units(b) for b in micro_batches)
        tokens = sum(int(b["attention_mask"].sum()) for b in micro_batches)
        squared = sum(int(b["attention_mask"].sum(-1).pow(2).sum()) for b in micro_batches)
        return [units, tokens, squared]

    def step_batches(self, model, micro_batches: list[dict], step: int, later: list = ()) -> list[dict]:
        self.last_step = step
        if (step - 1) % self.iterations and self.made is not None:
            self.mark_high_entropy(model, self.made)
            return self.made
        started = time.perf_counter()
        if step == 2:
            faults.at("generate")
        keys, fields, prompts, rows = self.parts(micro_batches)
        g = self.cfg.num_generations
        if self.sampler is not None and self.stops is None:
            self.stops = stop_token_ids(self.accelerator.unwrap_model(model), self.tokenizer)
        staleness = {}
        if self.ahead is not None:  # sampled in a thread with the weights after step max(step - 1 - s, 0)
            (expanded, completions, sampled_logps, rolled), lag = self.ahead.step(
                step, keys, later, lambda: self.sampler.sync(model, step),
                lambda at, batches: partial(self.rollout, model, at, *self.parts(batches or micro_batches),
                                            server=True, ahead=True))
            staleness = {"staleness": lag}
        else:
            if self.sampler is not None:  # the adapter as it stands into the server, then every rank asks for its own
                self.sampler.sync(model, step)
            expanded, completions, sampled_logps, rolled = self.rollout(model, step, keys, fields, prompts, rows,
                                                                        server=self.sampler is not None)
        logged = reward_functions.Logged(reserved=frozenset(self.table_columns()))
        rewards, per_function = self.score([f for f in fields for _ in range(g)], completions, step, rows,
                                           global_step=step - 1, logged=logged, rolled=rolled)
        advantages = torch.zeros_like(rewards) if self.rloo else \
            group_advantages(rewards, g, self.cfg.scale_rewards, self.batch_std(rewards))
        made, start = [], 0
        for b in micro_batches:
            n = len(b["prompt_ids"]) * g
            made.append(self.sequences(expanded[start:start + n], completions[start:start + n],
                                       advantages[start:start + n],
                                       left_out=[self.truncated(c) for c in completions[start:start + n]]
                                       if self.cfg.mask_truncated_completions else None,
                                       sampled_logps=sampled_logps[start:start + n] if sampled_logps else None,
                                       tool_masks=rolled.tool_masks[start:start + n] if rolled is not None else None))
            start += n
        if self.iterations > 1 or self.cfg.beta > 0 or self.corrected:
            self.add_fixed_logps(model, made)
        kl = {}
        if self.rloo:
            advantages, kl = self.rloo_advantages(rewards, made)
        self.mark_high_entropy(model, made)
        self.made = made
        generated = {**self.generation_metrics(rewards, per_function, completions, time.perf_counter() - started),
                     **staleness, **kl,
                     **self.sampler_metrics(made), **rl_tools.tool_metrics(self.accelerator, rolled, self.tools)}
        self.generated = {**generated, **rl_log.logged_metrics(self.accelerator, logged, set(generated))}
        self.write_table(step, [f for f in fields for _ in range(g)], completions, rewards, per_function, advantages,
                         logged)
        self.check_signal(step)
        return made

    def parts(self, micro_batches: list[dict]) -> tuple[list, list, list, list]:
        """(the (source, row) of each prompt, its columns, its token ids, each completion's row in words)."""
        keys = rl_ahead.keys_of(micro_batches)
        rows = [f"{self.sources[s]} row {row + 1}" for s, row in keys for _ in range(self.cfg.num_generations)]
        fields = [f for b in micro_batches for f in b["fields"]]
        return keys, fields, [p for b in micro_batches for p in b["prompt_ids"]], rows

    def say(self, line: str) -> None:
        if self.accelerator.is_main_process:
            tqdm.write(line)

    def check_signal(self, step: int) -> None:
        """Report the first generated batch that teaches nothing, with its reason (from the global counts, so every
        rank agrees), and stop after rl.max_unscored_steps such batches in a row: no completion scored, or every
        scored one cut at max_new_tokens and left out (rl.mask_truncated_completions). A batch whose groups all got
        one reward each (no advantage anywhere) is reported once and not counted: early in a hard task it is the
        usual case, and the KL term (rl.beta) may still teach."""
        g = self.generated
        names = ", ".join(r.name for r in self.rewards)
        if g["unscored_completions"] >= 1:
            key, why = "rl.rewards", f"no completion was scored ({names} said None for every one)"
            advice = "return a number for the completions a function can judge"
        elif self.counted == 0:
            key = "rl.mask_truncated_completions"
            why = (f"every scored completion was cut at rl.max_new_tokens ({self.cfg.max_new_tokens}) and is left "
                   "out of the loss (rl.mask_truncated_completions)")
            advice = "raise rl.max_new_tokens, or set rl.mask_truncated_completions=false"
        else:
            self.unscored = 0
            if g["zero_std_groups"] >= 1 and not self.said_flat:
                self.said_flat = True
                self.say(f"rl: at step {step} every group's completions got one reward each: no completion has an "
                         "advantage, so the policy term teaches nothing this step (zero_std_groups in the metrics "
                         "counts such groups)")
            return
        self.unscored += 1
        limit = self.cfg.max_unscored_steps
        if limit and self.unscored >= limit:
            raise ToolkitError(f"{key}: {self.unscored} generated batches in a row taught nothing, up to step {step} "
                               f"({why}): the run learns nothing; {advice} (rl.max_unscored_steps: how many "
                               "such batches stop a run)")
        if self.unscored == 1:
            self.say(f"rl: at step {step} {why}: this batch teaches nothing"
                     + (f"; the run stops after {limit} such batches in a row" if limit else ""))

    def loss_sum(self, model, batch: dict) -> torch.Tensor:
        if "completion_mask" not in batch:
            return self.evaluate_prompts(model, batch)
        mask = batch["completion_mask"]
        logps, entropy = self.per_token(model, batch)
        high = high_entropy_mask(entropy, mask, batch["entropy_threshold"]) if "entropy_threshold" in batch else None
        if self.rloo:
            loss, _, sums = rloo_loss(logps, batch.get("old_logps"), batch["advantages"], mask,
                                      epsilon=self.cfg.epsilon, epsilon_high=self.cfg.epsilon_high,
                                      sampler_weights=batch.get("sampler_weights"))
        else:
            loss, _, sums = policy_loss(
                logps, batch.get("old_logps"), batch.get("ref_logps"), batch["advantages"], mask,
                loss_type=self.cfg.loss_type, importance_sampling=self.cfg.importance_sampling,
                epsilon=self.cfg.epsilon, epsilon_high=self.cfg.epsilon_high, beta=self.cfg.beta,
                max_completion_length=self.cfg.max_new_tokens, delta=self.cfg.delta, entropy_mask=high,
                sampler_weights=batch.get("sampler_weights"))
        sums = {**sums, "entropy": (entropy * mask).sum().double()}
        for name, value in sums.items():
            self.sums[name] = self.sums.get(name, 0) + value.detach().double()
        return loss

    def step_metrics(self, device) -> dict[str, torch.Tensor]:
        sums, self.sums = self.sums, {}
        names = ["prompts", *self.eval_metrics] if "prompts" in sums else \
            ["clip_ratio_low", "clip_ratio_high", "clip_ratio", "clip_units", "entropy", "tokens"] \
            + (["kl"] if self.cfg.beta and not self.rloo else [])  # rloo's KL is in the reward: generated
        return {name: torch.as_tensor(sums.get(name, 0.0), dtype=torch.float64, device=device).reshape(())
                for name in names}

    def finish_metrics(self, sums: dict[str, float], units: float) -> dict[str, float]:
        if "prompts" in sums:  # evaluation: the mean reward (total and per function) per eval prompt
            prompts = max(sums.pop("prompts"), 1.0)
            return {k: v / prompts for k, v in sums.items()}
        tokens, clip_units = max(sums.pop("tokens"), 1.0), max(sums.pop("clip_units"), 1.0)
        return {**self.generated, **{k: v / (clip_units if k.startswith("clip_ratio") else tokens)
                                     for k, v in sums.items()}}

    def eval_samples(self) -> list[dict]:
        shown, self.shown = self.shown, []
        return shown

    # ------------------------------------------------------------------ making the batch

    def rollout(self, model, step: int, keys: list, fields: list[dict], prompts: list[list[int]], rows: list[str],
                server: bool, g: int | None = None,
                ahead: bool = False) -> tuple[list, list, list | None, rl_tools.Rolled | None]:
        """(the prompts sampled from, the completions, the server's log-probabilities, the tool rounds) of
        rl.num_generations rollouts per prompt, each seeded by the run's seed, `step`, its prompt's source and row and
        its index (`g` per prompt: rl.num_generations); with rl.tools the prompts carry the tools' schemas and each
        completion goes on through its calls. `ahead`: in the thread that samples ahead on the server (no
        collective; rl_ahead)."""
        g = g or self.cfg.num_generations
        parts = [(self.seed, step, source, row, k) for source, row in keys for k in range(g)]
        seeds = [completion_seed(*p) for p in parts]
        tools = self.tools_ahead if ahead else self.tools
        prepared = None if tools is None else tools.prepare(fields, g, rows)
        expanded = [p for p in prompts for _ in range(g)] if prepared is None else prepared.ids

        def sample(ids: list[list[int]], seeds: list[int]):
            return self.sampler.sample(ids, seeds, self.stops, together=not ahead) if server else \
                self.generate(model, ids, seeds)

        out = sample(expanded, seeds)
        completions, logps = out if server else (out, None)
        if tools is None:
            return expanded, completions, logps, None
        rolled = tools.run(prepared, completions, sample, seeds=parts, logprobs=logps,
                           synced=None if ahead else self.all_done)
        return expanded, rolled.completions, rolled.logprobs, rolled

    def generate(self, model, prompts: list[list[int]], seeds: list[int] | None) -> list[list[int]]:
        """Each prompt's completion, sampled from the model as the backend holds it for sampling
        (`Backend.sampling`), in eval mode (no dropout), in the run's precision. No prompts (a rank whose tool rounds
        are over while another's go on): one row that is done at once keeps the other ranks' collectives company."""
        with self.backend.sampling(model, self.cfg.gather_for_sampling) as module:
            if self.stops is None:
                self.stops = stop_token_ids(module, self.tokenizer)
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stops[0]
            idle = not prompts
            prompts, seeds = ([[pad]], None) if idle else (prompts, seeds)
            was_training = module.training
            module.eval()
            try:
                with self.accelerator.autocast():
                    completions = sample(module, prompts, seeds, max_new_tokens=self.cfg.max_new_tokens,
                                         stop_ids=self.stops, pad_id=pad, temperature=self.cfg.temperature,
                                         top_p=self.cfg.top_p, top_k=self.cfg.top_k, min_p=self.cfg.min_p,
                                         repetition_penalty=self.cfg.repetition_penalty,
                                         synced=(lambda _: self.all_done(True)) if idle else self.all_done)
            finally:
                module.train(was_training)
            if not self.sampling_said:  # after the last forward of sampling: what stays between its forwards
                self.sampling_said = True
                held = sum(self.backend.materialized_numel(p) * p.element_size() for p in module.parameters())
                whole = sum(self.backend.full_shape(p).numel() * p.element_size() for p in module.parameters())
                self.say(f"rl: between sampling's forwards the policy's weights took {held / 2**20:,.2f} MiB on this "
                         f"rank (the whole model: {whole / 2**20:,.2f} MiB)")
            return [] if idle else completions

    def all_done(self, done: bool) -> bool:
        """Whether every rank's completions have all stopped (each rank steps until then)."""
        if self.accelerator.num_processes == 1:
            return done
        flag = torch.tensor([0.0 if done else 1.0], device=self.accelerator.device)
        return self.accelerator.reduce(flag, "sum").item() == 0

    def text(self, completion: list[int]) -> str:
        ids = completion[:-1] if completion and completion[-1] in self.stops else completion
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def score(self, fields: list[dict], completions: list[list[int]], step: int, rows: list[str], *,
              global_step: int, logged: reward_functions.Logged | None = None, rolled=None):
        """The rewards of the completions, the functions called as TRL calls them: trainer_state is a TrainerState
        at `global_step` (the optimizer steps done, as TRL's at that point), of this run's steps."""
        from transformers import TrainerState

        # a chat prompt's completion is passed as a message (score); with tools (rl_tools.Rolled), as its whole
        # conversation, its prompt after its environment's reset, and its environment
        prompts = [f.get("prompt") for f in fields] if rolled is None else rolled.prompts
        texts = [self.text(c) for c in completions] if rolled is None else rolled.answers
        columns = [{k: v for k, v in f.items() if k != "prompt"} for f in fields]
        main = self.accelerator.is_main_process
        state = TrainerState(global_step=global_step, max_steps=self.max_steps, is_world_process_zero=main,
                             is_local_process_zero=self.accelerator.is_local_main_process)
        return reward_functions.score(self.rewards, prompts, texts, columns, step=step, rows=rows,
                                      completion_ids=completions, state=state, logged=logged,
                                      environments=rolled.environments if rolled is not None else None)

    def batch_std(self, rewards: torch.Tensor) -> torch.Tensor | None:
        """The global batch's reward std (unbiased, as torch.std), reduced over ranks; only for scale_rewards=batch."""
        if self.cfg.scale_rewards != "batch":
            return None
        r = rewards.double()[~rewards.isnan()]  # unscorable completions left out, as TRL's nanstd
        local = torch.tensor([r.sum(), (r * r).sum(), float(len(r))], dtype=torch.float64)
        s, s2, n = self.accelerator.reduce(local.to(self.accelerator.device), "sum").cpu().tolist()
        return torch.tensor(max(s2 - s * s / n, 0.0) / max(n - 1, 1)).sqrt().to(rewards.dtype)

    def truncated(self, completion: list[int]) -> bool:
        """Cut at rl.max_new_tokens without a stop token."""
        return len(completion) == self.cfg.max_new_tokens and (not completion or completion[-1] not in self.stops)

    def sequences(self, prompts: list[list[int]], completions: list[list[int]], advantages: torch.Tensor,
                  left_out: list[bool] | None = None, sampled_logps: list[list[float]] | None = None,
                  tool_masks: list[list[int]] | None = None) -> dict:
        """The micro-batch the loss is taken on: prompt + completion rows, right-padded; labels on the
        completion tokens (its stop token included); `completion_mask` over labels[:, 1:], zero on the
        rows `left_out` (rl.mask_truncated_completions: TRL multiplies its mask so); `sampler_logps` over
        labels[:, 1:] too, where an inference server sampled the completions (NaN elsewhere)."""
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stops[0]
        width = max(len(p) + max(len(c), 1) for p, c in zip(prompts, completions))
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        labels = torch.full((len(prompts), width), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, (p, c) in enumerate(zip(prompts, completions)):
            ids[i, :len(p) + len(c)] = torch.as_tensor(p + c)
            labels[i, len(p):len(p) + len(c)] = torch.as_tensor(c, dtype=torch.long)
            mask[i, :len(p) + len(c)] = 1
        completion_mask = rl_tools.masked((labels[:, 1:] != IGNORE).float(), prompts, tool_masks)
        if left_out is not None:
            completion_mask[torch.tensor(left_out, dtype=torch.bool)] = 0.0
        made = {"input_ids": ids, "attention_mask": mask, "labels": labels,
                "completion_mask": completion_mask, "advantages": advantages.float()}
        if sampled_logps is not None:
            at = torch.full((len(prompts), width - 1), float("nan"))
            for i, (p, values) in enumerate(zip(prompts, sampled_logps)):
                at[i, len(p) - 1:len(p) - 1 + len(values)] = torch.tensor(values, dtype=torch.float32)
            made["sampler_logps"] = at
        return made

    def per_token(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T-1) log-probabilities of the completion tokens and the entropy there (0 elsewhere)."""
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
        flat, entropy = token_logps_each(model, inputs, self.cfg.temperature)  # of the distribution sampled from
        where = batch["labels"][:, 1:] != IGNORE  # every completion token, those the mask leaves out too
        logps = flat.new_zeros(where.shape).masked_scatter(where, flat)
        return logps, entropy.new_zeros(where.shape).masked_scatter(where, entropy)

    @torch.no_grad()
    def add_fixed_logps(self, model, made: list[dict]) -> None:
        """The old policy's log-probabilities (rl.num_iterations > 1) and the reference's (rl.beta > 0:
        the model with its LoRA adapter disabled), taken once per generated batch, on the run's device
        (`sequences` builds the batch on the host; the loop moves it only before the loss)."""
        device = self.accelerator.device
        for batch in made:
            inputs = {k: batch[k].to(device) for k in ("input_ids", "attention_mask", "labels")}
            if self.iterations > 1 or self.rloo or self.corrected:  # rloo: its KL in the reward is of the policy
                batch["old_logps"] = self.per_token(model, inputs)[0]  # that sampled; a server's: TRL's correction
            if self.corrected:
                c = self.cfg
                batch["sampler_weights"] = sampler_correction(
                    batch["old_logps"], batch["sampler_logps"].to(device), batch["completion_mask"].to(device),
                    c.vllm_importance_sampling_mode, c.vllm_importance_sampling_clip_min,
                    c.vllm_importance_sampling_clip_max)
            if self.cfg.beta > 0 and self.reference is not None:
                with self.accelerator.autocast():
                    batch["ref_logps"] = self.per_token(self.reference, inputs)[0]
            elif self.cfg.beta > 0:
                with self.adapter.disable_adapter():
                    batch["ref_logps"] = self.per_token(model, inputs)[0]

    def sampler_metrics(self, made: list[dict]) -> dict[str, float]:
        return rl_log.sampler_metrics(self.accelerator, self.cfg, made) if self.corrected else {}

    def rloo_advantages(self, rewards: torch.Tensor, made: list[dict]) -> tuple[torch.Tensor, dict[str, float]]:
        """rl.method=rloo, TRL's RLOO: the rewards clipped (rl.reward_clip_range), minus rl.beta x each completion's
        summed log-ratio of the policy that sampled it to the reference, then leave-one-out advantages, standardised
        over the global batch where rl.normalize_advantages (moments reduced over ranks), written into `made`.
        Returns them and the `kl` metric (the mean per-token log-ratio over the global batch) where beta > 0."""
        c, device = self.cfg, self.accelerator.device
        r = rewards.clone()
        if c.reward_clip_range:
            r = r.clamp(*c.reward_clip_range)
        metrics = {}
        if c.beta > 0:
            per_token = [(b["old_logps"] - b["ref_logps"]) * b["completion_mask"].to(device) for b in made]
            r = r - c.beta * torch.cat([t.sum(-1) for t in per_token]).float().cpu()
            local = torch.stack([sum(t.sum() for t in per_token),
                                 sum(b["completion_mask"].sum() for b in made).to(device)])
            kl, tokens = self.accelerator.reduce(local.double().to(device), "sum").tolist()
            metrics["kl"] = kl / max(tokens, 1.0)
        moments = None
        if c.normalize_advantages:  # over every rank's scored completions, as TRL's over the gathered batch
            raw = leave_one_out(r, c.num_generations).double()
            raw = raw[~raw.isnan()]
            local = torch.tensor([raw.sum(), (raw * raw).sum(), float(len(raw))], dtype=torch.float64)
            s, s2, n = self.accelerator.reduce(local.to(device), "sum").cpu().tolist()
            moments = (torch.tensor(s / n if n else math.nan),
                       torch.tensor(max(s2 - s * s / n, 0.0) / max(n - 1, 1) if n else math.nan).sqrt())
            moments = tuple(m.to(r.dtype) for m in moments)
        advantages = leave_one_out_advantages(r, c.num_generations, moments, c.normalize_advantages)
        start = 0
        for batch in made:
            n = len(batch["advantages"])
            batch["advantages"] = advantages[start:start + n].float()
            start += n
        return advantages, metrics

    @torch.no_grad()
    def mark_high_entropy(self, model, made: list[dict]) -> None:
        """rl.top_entropy_quantile < 1: the step's entropy threshold (TRL's get_high_entropy_mask) over every
        completion token of the global batch, under the policy as this step starts (one pass without gradient, on
        every step: the weights change between a generated batch's iterations). TRL takes it per micro-batch,
        which the layout changes; it equals this where the global batch is one micro-batch on one process."""
        if self.cfg.top_entropy_quantile >= 1:
            return
        device, local = self.accelerator.device, []
        for batch in made:
            inputs = {k: batch[k].to(device) for k in ("input_ids", "attention_mask", "labels")}
            entropy = self.per_token(model, inputs)[1]
            local.append(entropy[batch["completion_mask"].to(device).bool()].float())
        values = torch.cat(local)
        if self.accelerator.num_processes > 1:  # entropies are never negative: -1 marks the padding
            values = self.accelerator.gather(self.accelerator.pad_across_processes(values, dim=0, pad_index=-1.0))
            values = values[values >= 0]
        threshold = entropy_threshold(values, self.cfg.top_entropy_quantile).cpu()
        for batch in made:
            batch["entropy_threshold"] = threshold

    def table_columns(self) -> list[str]:
        """The completions table's own columns: a reward function's log_extra cannot take one (refused in the call,
        on the rank that makes it, before any collective)."""
        return ["step", "prompt", "completion", "reward", *(r.metric for r in self.rewards), "advantage"]

    def write_table(self, step: int, fields: list[dict], completions: list[list[int]], rewards: torch.Tensor,
                    per_function: dict[str, torch.Tensor], advantages: torch.Tensor,
                    logged: reward_functions.Logged) -> None:
        """rl.log_completions: a row per completion of the global batch (rl_log.completion_rows)."""
        if self.table is not None:
            rows = rl_log.completion_rows(step, fields, [self.text(c) for c in completions], rewards, per_function,
                                          advantages, logged)
            rl_log.append_table(self.accelerator, self.table, rows, self.cfg.num_completions_to_print)

    def generation_metrics(self, rewards, per_function, completions, seconds: float) -> dict[str, float]:
        """Reward mean and std (total and per function), completion lengths, the share cut at max_new_tokens and
        of groups without reward spread, over the global batch (rl_log.generation_metrics)."""
        out, self.counted = rl_log.generation_metrics(self.accelerator, self.cfg, rewards, per_function, completions,
                                                      [self.truncated(c) for c in completions], seconds)
        return out

    # ------------------------------------------------------------------ evaluation

    def evaluate_prompts(self, model, batch: dict) -> torch.Tensor:
        """rl.num_generations_eval completions (default one) per eval prompt, sampled as in training with the
        same seeds at every evaluation (step -1), scored: the sum of rewards over the real prompts' completions
        (the loss of an eval batch is 0; the reward is the metric). The mean reward of the policy's samples, not
        of its most likely answers, which sharpening does not change."""
        g = self.cfg.num_generations_eval or 1
        keys = batch["keys"].cpu().tolist()
        valid = [v for v in batch["valid"].cpu().tolist() for _ in range(g)]
        rows = [f"{self.eval_sources[s]} row {r + 1}" if v else "eval padding"
                for (s, r), v in zip([k for k in keys for _ in range(g)], valid)]
        _, completions, _, rolled = self.rollout(model, -1, keys, batch["fields"], batch["prompt_ids"], rows,
                                                 server=False, g=g)
        kept = torch.tensor(valid, dtype=torch.bool)
        rewards = torch.full((len(completions),), math.nan)  # padding rows (filler of the last batches) unscored
        per_function = {r.metric: rewards.clone() for r in self.rewards}
        if kept.any():
            real = kept.nonzero().flatten().tolist()
            fields = [f for f in batch["fields"] for _ in range(g)]
            scored, scored_each = self.score([fields[i] for i in real], [completions[i] for i in real], 0,
                                             [rows[i] for i in real], global_step=self.last_step,
                                             rolled=rl_tools.subset(rolled, real))
            rewards[kept] = scored
            for name, values in scored_each.items():
                per_function[name][kept] = values
        for name, values in [("reward", rewards), *per_function.items()]:
            self.sums[name] = self.sums.get(name, 0) + torch.nan_to_num(values.double())[kept].sum()
        self.sums["prompts"] = self.sums.get("prompts", 0) + float(kept.sum())
        if self.accelerator.is_main_process and len(self.shown) < 3:
            for i in range(0, len(completions), g):
                if valid[i] and len(self.shown) < 3:
                    prompt = self.tokenizer.decode(batch["prompt_ids"][i // g], skip_special_tokens=True)
                    self.shown.append({"prompt": prompt, "answer": self.text(completions[i]),
                                       "reward": float(rewards[i])})
        return torch.zeros((), device=self.accelerator.device)
