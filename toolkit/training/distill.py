"""On-policy distillation (rl.method=distill, TRL 1.16's DistillationTrainer) as an objective of the one loop:
each optimizer step the policy (the student) samples completions for its prompts, as online RL does
(`online.GroupRL.generate`: seeded per prompt, step and index, so completions do not depend on the backend,
the ranks or a resume), and the loss is the generalized Jensen-Shannon divergence (`loss.generalized_jsd`,
rl.beta) between the student's and the teacher's next-token distributions at every completion token, both at
rl.temperature, summed here and divided by the global batch's completion tokens in the loop (TRL's
`num_items_in_batch`). No rewards, no advantages, no ratio.

The teacher (rl.teacher) is a causal LM with the student's vocabulary, loaded in the student's dtype, frozen,
and prepared by the backend after the student (`Backend.prepare_frozen`: a ZeRO-3 engine of its own, FSDP2
sharding, or a whole copy per rank, as TRL's prepare_deepspeed / prepare_model(evaluation_mode=True)). Its
log-probabilities at a micro-batch's completion tokens are taken without gradient before the student's
forward; the student's divergence goes through the chunked output layer (train.loss=chunked), so only the
teacher's (completion tokens x vocabulary) log-probabilities and one chunk of the student's logits are held.

Evaluation samples rl.num_generations_eval (default one) completion per eval prompt with the same seeds at every
evaluation and reports eval_loss: the student's mean divergence to the teacher per completion token on them."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from .. import faults
from ..config.methods import divergence_name
from ..data.formats import IGNORE
from ..errors import ToolkitError, first_line
from ..model.load import full_numel
from ..model.sampling import completion_seed
from . import rl_log
from .loss import target_distributions, token_divergences
from .objectives import Preparation
from .online import GroupRL


def teacher_folder(rl) -> Path:
    """rl.teacher's local folder (a Hub id's cached snapshot), refused in one line naming the key."""
    from ..model.hub import resolve_model

    try:
        return Path(resolve_model(rl.teacher))
    except ToolkitError as err:
        raise ToolkitError(f"rl.teacher: {str(err).removeprefix('model.path: ')}") from None


def check_teacher(rl, tokenizer, student_vocab: int) -> None:
    """Before any model loads: rl.teacher is a causal LM whose vocabulary is the student's (TRL's
    DistillationTrainer needs one: the divergence compares the two distributions token by token); where its
    folder has a tokenizer, it maps every token as the student's does."""
    from transformers import AutoConfig, AutoTokenizer

    folder = teacher_folder(rl)
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise ToolkitError(f"rl.teacher: {rl.teacher}: its config cannot be read: {first_line(err)}") from None
    heads = config.architectures or []
    if heads and not any(a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")) for a in heads):
        raise ToolkitError(f"rl.teacher: {rl.teacher} is a {', '.join(heads)}, not a causal LM (the teacher's "
                           "next-token distribution is what the student learns)")
    vocab = getattr(config.get_text_config(), "vocab_size", None)
    if vocab != student_vocab:
        raise ToolkitError(f"rl.teacher: {rl.teacher} has a vocabulary of {vocab} tokens where the student's "
                           f"output layer has {student_vocab}: distillation compares the two distributions token by "
                           "token, so the teacher needs the student's vocabulary (as TRL's DistillationTrainer)")
    if any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        try:
            theirs = AutoTokenizer.from_pretrained(folder, local_files_only=True).get_vocab()
        except (OSError, ValueError, KeyError) as err:
            raise ToolkitError(f"rl.teacher: {rl.teacher}: its tokenizer cannot be read: {first_line(err)}") from None
        ours = tokenizer.get_vocab()
        if theirs != ours:
            differ = sorted(set(theirs.items()) ^ set(ours.items()), key=lambda kv: kv[1])[:1]
            raise ToolkitError(f"rl.teacher: {rl.teacher}'s tokenizer differs from the student's ({len(theirs)} "
                               f"tokens vs {len(ours)}; first difference: {differ[0][0]!r} at id {differ[0][1]}): "
                               "the same ids would be different tokens to the two models; distill from a teacher "
                               "of the student's tokenizer")


def check_student_vocabulary(rl, model, full_shape) -> None:
    """After the student is built (model.add_special_tokens may have grown its output layer): its output
    layer's rows equal the teacher's vocabulary."""
    from transformers import AutoConfig

    rows = full_shape(model.get_output_embeddings().weight)[0]
    vocab = AutoConfig.from_pretrained(teacher_folder(rl), local_files_only=True).get_text_config().vocab_size
    if rows != vocab:
        raise ToolkitError(f"rl.teacher: the student's output layer has {rows} rows (model.add_special_tokens grew "
                           f"it?) where {rl.teacher} has {vocab}: the teacher needs the student's vocabulary")


def load_teacher(rl, model_cfg, dtype: torch.dtype) -> torch.nn.Module:
    """The teacher as transformers loads it, in `dtype` (train.precision's: frozen, it needs no fp32 master
    weights), under ZeRO-3 partitioned as it loads (accelerate's plugin makes transformers build it under
    zero.Init), in eval mode."""
    from transformers import AutoModelForCausalLM

    from ..model.heads import MISFIT, misfit

    attn = "sdpa" if model_cfg.attn_implementation == "varlen" else model_cfg.attn_implementation
    try:
        model = AutoModelForCausalLM.from_pretrained(teacher_folder(rl), local_files_only=True, dtype=dtype,
                                                     attn_implementation=attn)
    except (OSError, ValueError, RuntimeError) as err:
        if isinstance(err, RuntimeError) and not misfit(err):
            raise
        raise ToolkitError(f"rl.teacher: {rl.teacher} cannot be loaded as a causal LM: "
                           f"{MISFIT if misfit(err) else first_line(err)}") from None
    return model.eval()


class Distill(GroupRL):
    """rl.method=distill: the divergence to the teacher over the student's own completions."""

    eval_metrics = ()
    has_eval_loss = True

    def __init__(self, cfg, teacher, tokenizer, backend, seed: int, sources: list[str], eval_sources: list[str],
                 out: Path | None = None):
        super().__init__(cfg, [], tokenizer, backend, seed, sources, eval_sources, out=out)
        self.teacher = teacher  # as loaded; `after_prepare` puts it where the backend holds it
        self.teacher_params = sum(full_numel(p) for p in teacher.parameters())
        self.unit = "completion tokens"
        self.eval_metrics = ()
        self.evaluating = False
        self.eval_units = 0
        self.held_said = False

    def describe(self) -> list[str]:
        c = self.cfg
        return [f"distill: {divergence_name(c.beta)} to the teacher at temperature {c.temperature:g} on every "
                f"completion token; the loss is a mean over completion tokens",
                f"distill: teacher {c.teacher} ({self.teacher_params / 1e6:,.1f}M parameters, frozen, "
                f"{self.backend.frozen_line()}); {self.sampling_text()}; sampling from "
                f"{self.backend.sampling_line(c.gather_for_sampling)}"
                + (f"; completions logged to {self.table}" if self.table else "")]

    def after_prepare(self) -> None:
        self.teacher = self.backend.prepare_frozen(self.teacher)

    def preparation(self) -> Preparation:
        return Preparation(
            "generate", "sampling the student's completions (distillation)",
            "distillation samples the student's own completions token by token (rl.num_generations per prompt, up "
            "to rl.max_new_tokens; nothing is scored: the teacher's forward is in the step's forward): fewer or "
            "shorter completions shorten it")

    def units(self, batch: dict) -> int:
        if "completion_mask" not in batch:  # an eval batch of prompts: its completions' tokens, counted in loss_sum
            return self.eval_units
        return int(batch["completion_mask"].sum())

    def step_batches(self, model, micro_batches: list[dict], step: int, later: list = ()) -> list[dict]:
        self.evaluating = False
        started = time.perf_counter()
        if step == 2:
            faults.at("generate")
        g = self.cfg.num_generations
        keys = torch.cat([b["keys"] for b in micro_batches]).tolist()
        seeds = [completion_seed(self.seed, step, source, row, k) for source, row in keys for k in range(g)]
        prompts = [p for b in micro_batches for p in b["prompt_ids"] for _ in range(g)]
        completions = self.generate(model, prompts, seeds)
        made, start = [], 0
        for b in micro_batches:
            n = len(b["prompt_ids"]) * g
            made.append(self.sequences(prompts[start:start + n], completions[start:start + n], torch.zeros(n)))
            start += n
        generated = self.generation_metrics(torch.zeros(len(completions)), {}, completions,
                                            time.perf_counter() - started)
        self.generated = {k: v for k, v in generated.items()
                          if k not in ("reward", "reward_std", "zero_std_groups", "unscored_completions")}
        self.write_completions(step, [f for b in micro_batches for f in b["fields"] for _ in range(g)], completions)
        return made

    @torch.no_grad()
    def teacher_logps(self, batch: dict) -> torch.Tensor:
        """The teacher's log-probabilities (at rl.temperature) at the batch's target positions, (targets, vocab),
        in float32, on the run's device: through its own forward (where every backend has its weights whole),
        its output layer applied to the targets only, a chunk at a time (train.loss=chunked)."""
        with self.accelerator.autocast():
            logps = target_distributions(self.teacher, batch, self.cfg.temperature)
        if not self.held_said:  # what a rank keeps of the teacher between its forwards
            self.held_said = True
            if self.accelerator.is_main_process:
                held = sum(self.backend.held_numel(p) * p.element_size() for p in self.teacher.parameters())
                whole = self.teacher_params * next(self.teacher.parameters()).element_size()
                self.say(f"distill: between forwards the teacher's weights take {held / 2**20:,.2f} MiB on this "
                         f"rank (the whole model: {whole / 2**20:,.2f} MiB)")
        return logps

    def divergences(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(each completion token's divergence, the student's entropy there, the completion mask there), flat."""
        device = self.accelerator.device
        inputs = {k: batch[k].to(device) for k in ("input_ids", "attention_mask", "labels")}
        teacher = self.teacher_logps(inputs)
        divergence, entropy = token_divergences(model, inputs, teacher, self.cfg.beta, self.cfg.temperature)
        where = batch["labels"][:, 1:] != IGNORE
        return divergence, entropy, batch["completion_mask"].to(divergence.device)[where.to(divergence.device)]

    def loss_sum(self, model, batch: dict) -> torch.Tensor:
        if "completion_mask" not in batch:
            return self.evaluate_prompts(model, batch)
        divergence, entropy, mask = self.divergences(model, batch)
        for name, value in (("entropy", (entropy * mask).sum()), ("tokens", mask.sum())):
            self.sums[name] = self.sums.get(name, 0) + value.detach().double()
        return (divergence * mask).sum()

    def step_metrics(self, device) -> dict[str, torch.Tensor]:
        sums, self.sums = self.sums, {}
        names = [] if self.evaluating else ["entropy", "tokens"]
        return {name: torch.as_tensor(sums.get(name, 0.0), dtype=torch.float64, device=device).reshape(())
                for name in names}

    def finish_metrics(self, sums: dict[str, float], units: float) -> dict[str, float]:
        if "tokens" not in sums:  # evaluation: eval_loss is all it reports
            return {}
        tokens = max(sums.pop("tokens"), 1.0)
        return {**self.generated, **{k: v / tokens for k, v in sums.items()}}

    def begin_eval(self, model, batches) -> None:
        self.evaluating = True

    @torch.no_grad()
    def evaluate_prompts(self, model, batch: dict) -> torch.Tensor:
        """rl.num_generations_eval completions (default one) per eval prompt, with the same seeds at every
        evaluation (step -1): the summed divergence to the teacher over the real prompts' completion tokens
        (their count is this batch's units)."""
        g = self.cfg.num_generations_eval or 1
        keys = batch["keys"].cpu().tolist()
        seeds = [completion_seed(self.seed, -1, source, row, k) for source, row in keys for k in range(g)]
        prompts = [p for p in batch["prompt_ids"] for _ in range(g)]
        completions = self.generate(model, prompts, seeds)
        valid = [v for v in batch["valid"].cpu().tolist() for _ in range(g)]
        made = self.sequences(prompts, completions, torch.zeros(len(prompts)), left_out=[not v for v in valid])
        divergence, _, mask = self.divergences(model, made)
        self.eval_units = int(mask.sum())
        if self.accelerator.is_main_process and len(self.shown) < 3:
            for i in range(0, len(completions), g):
                if valid[i] and len(self.shown) < 3:
                    self.shown.append({"prompt": self.tokenizer.decode(batch["prompt_ids"][i // g],
                                                                       skip_special_tokens=True),
                                       "answer": self.text(completions[i])})
        return (divergence * mask).sum()

    def write_completions(self, step: int, fields: list[dict], completions: list[list[int]]) -> None:
        """rl.log_completions: a row per completion of the global batch (every rank's, gathered) appended to
        completions.jsonl: step, prompt, completion."""
        if self.table is None:
            return
        rows = [{"step": step, "prompt": f.get("prompt"), "completion": self.text(c)}
                for f, c in zip(fields, completions)]
        rl_log.append_table(self.accelerator, self.table, rows, self.cfg.num_completions_to_print)
