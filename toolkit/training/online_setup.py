"""Online RL's objectives built for a run (config/methods.py names these builders): what every
method that samples completions checks and sets first, GRPO's and RLOO's `online.GroupRL` with its
reference and sampler, and distillation's `distill.Distill` with its teacher."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..backends.run_sizing import check_positions
from ..data.batching import most_positions
from ..data.sources import resolve_sources
from ..model.load import DTYPES, build_model, disable_dropout
from . import distill, objectives, online, rl_tools
from .loss import has_router, use_token_loss


def sampling_setup(backend, recipe, model, log) -> tuple[list[str], list[str]]:
    """What a sampling objective checks and sets on the built model (positions, dropout); the names of its
    train and held-out prompt sources (held-out: the eval files, else the train files)."""
    check_positions(recipe, model.config)
    if recipe.rl.disable_dropout:
        log(f"rl: dropout off in {disable_dropout(model)} layers (rl.disable_dropout)")
    d = recipe.data
    sources = [s.name for s in resolve_sources(d.train_files, d, "data.train_files")]
    held = [s.name for s in resolve_sources(d.eval_files, d, "data.eval_files")] if d.eval_files else sources
    return sources, held


def frozen_with_loss(backend, recipe, model):
    """A second model that only runs forwards (distillation's teacher, full fine-tuning's reference), frozen, in
    eval mode, its output layer applied to the targets only as the trained model's (train.loss); the backend
    prepares it after the trained model (`Objective.after_prepare`)."""
    t = recipe.train
    model.eval().requires_grad_(False)
    use_token_loss(model, t.loss, t.loss_chunk_tokens, backend, most_positions(recipe))
    return model


def group_rl(recipe, model=None, *, backend, log, tokenizer, rewards, tools=None, **_) -> online.GroupRL:
    """GRPO or RLOO: scored with the rewards; the reference (rl.beta > 0, full fine-tuning) the base loaded once
    more; the vLLM server (rl.sampler vllm) started now, while the data is prepared; rl.tools called in the
    rollout with rl.environment's instances (`tools`: build.Tools, as the run loaded them)."""
    sources, held = sampling_setup(backend, recipe, model, log)
    reference = None
    if recipe.rl.beta > 0 and not recipe.lora.enabled:  # TRL's ref_model: the base loaded once more
        backend.check_frozen()
        base = dataclasses.replace(recipe.model, gradient_checkpointing=False)
        # in the policy's dtype, as TRL's ref_model: one rounded to bf16 under an fp32 policy has another KL
        reference = frozen_with_loss(backend, recipe, build_model(base, DTYPES[recipe.model.dtype],
                                                                  DTYPES[recipe.train.precision]))
    sampler = None
    if recipe.rl.sampler == "vllm":
        from ..rollout.vllm_sampler import VLLMSampler

        sampler = VLLMSampler(recipe.rl, model_path=recipe.model.path, tokenizer=tokenizer, backend=backend,
                              out=Path(recipe.output_dir), seed=recipe.seed,
                              max_model_len=recipe.data.max_seq_len + recipe.rl.max_new_tokens,
                              precision=recipe.train.precision,
                              lora_rank=recipe.lora.r if recipe.lora.enabled else None)
    rollouts = rl_tools.ToolRollouts(recipe.rl, tools.tools, tokenizer, recipe.model.chat_template_kwargs,
                                     model.config.get_text_config().max_position_embeddings,
                                     tools.environment) if tools else None
    return online.GroupRL(recipe.rl, rewards, tokenizer, backend, recipe.seed, sources, held,
                          adapter=model if recipe.lora.enabled else None,
                          router_coef=objectives.config_router_coef(model) if has_router(model) else 0.0,
                          out=Path(recipe.output_dir), reference=reference, sampler=sampler,
                          tools=rollouts)


def distillation(recipe, model=None, *, backend, log, tokenizer, **_) -> distill.Distill:
    """On-policy distillation: the teacher loads now, checked against the student, and is prepared after it."""
    sources, held = sampling_setup(backend, recipe, model, log)
    distill.check_student_vocabulary(recipe.rl, model, backend.full_shape)
    backend.check_frozen()
    teacher = frozen_with_loss(backend, recipe,
                               distill.load_teacher(recipe.rl, recipe.model, DTYPES[recipe.train.precision]))
    return distill.Distill(recipe.rl, teacher, tokenizer, backend, recipe.seed, sources, held,
                           out=Path(recipe.output_dir))
