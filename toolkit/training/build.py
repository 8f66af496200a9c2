"""`build`: everything the recipe asks for, checked, prepared and resumed, as the `Run` that `fit`
trains. It reads as its list of stages; each stage is a function below it, in call order, that takes
what it needs and returns what it made. Every check that can refuse the run comes before anything on
disk changes; an earlier run that `overwrite` replaces is removed only at the end, just before step 1.
Each backend hook runs in the stage where what it checks exists: `check_model` on the built model,
`check_adapter`/`adapted` around LoRA, `check_objective` on the objective, `check_prepared` after
prepare.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from .. import backends, faults
from ..backends.model_counts import count_model, read_config
from ..backends.run_sizing import recipe_config
from ..config import ModelConfig, Recipe
from ..config.methods import method_of, trained_by
from ..data.batching import Collator, EpochSampler, EvalShardSampler, longest_row, most_positions, packing_is_isolated
from ..data.prepare import Datasets, build_datasets, label_audit, remove_partial_data
from ..data.sources import check_first_rows, resolve_sources
from ..errors import ToolkitError
from ..model import activations, base_identity
from ..model.hub import is_hub_id, resolve_model
from ..model.load import (
    DTYPES,
    adapter_coverage,
    apply_kernels,
    apply_lora,
    build_model,
    build_tokenizer,
    check_head,
    compile_layers,
    count_parameters,
    fit_vocabulary,
    has_score_head,
    isolation_probe,
    mark_scorer,
    seed_score_head,
    token_rows,
)
from ..observe import measure
from ..observe.monitor import Monitor
from ..observe.watchdog import Watchdog
from ..optim import optimizers
from ..rollout.tools import check_tokenizer, load_tools
from ..stops import Preemption
from ..storage import checkpoint, disk, inputs, run_folder
from . import distill, objectives, reference, rl_tools
from .loop import Run
from .loss import use_token_loss
from .samples import Samples
from .summary import run_summary


def build(backend: backends.Backend, recipe: Recipe, preemption: Preemption,
          lock: run_folder.RunLock) -> tuple[Run, Any]:
    """(the run, its tokenizer): the run folder opened (or resumed), the model, objective, data,
    loaders, optimizer and scheduler made, prepared by accelerate, and the monitor started."""
    from accelerate.utils import set_seed

    accelerator, log, method = backend.accelerator, backend.accelerator.print, method_of(recipe)
    resume_from = run_folder.open_run(accelerator, recipe, lock)
    for line in check_data(recipe):
        log(f"data: {line}")
    if recipe.model.path is not None:  # a folder that does not fit the objective: refused from its config.json
        check_head(resolve_model(recipe.model.path, recipe.model.revision), method.scorer)
    tools = setup_tools(recipe)  # rl.tools and rl.environment: imported, their schemas read
    rewards = setup_rewards(recipe, tools)  # online RL: each reward function imported and tried on the first rows
    if method.teacher:
        distill.teacher_folder(recipe.rl)  # found, before anything reads it
    # by content: a changed base, reward or tool is refused early
    identities = base_identity.identities(recipe, rewards or [], tools.code if tools else [])
    if resume_from is not None:
        inputs.check_unchanged(checkpoint.read_state(resume_from).inputs, identities, resume_from,
                               recipe.resume_accept_changed)
    set_seed(recipe.seed)  # same initial weights on every rank and every backend
    tokenizer = build_tokenizer(recipe.model)
    if tools:  # the template must render the tools' calls and results, and read the calls back
        check_tokenizer(tokenizer, recipe.model.chat_template_kwargs)
    if method.teacher:  # a teacher of another vocabulary is refused before any model loads
        distill.check_teacher(recipe.rl, tokenizer, recipe_config(recipe).get_text_config().vocab_size)
    samples = Samples(recipe, tokenizer, accelerator)  # train.sample_prompts rendered now: a bad one fails here
    built = setup_model(backend, recipe, tokenizer, log)
    objective = setup_objective(backend, recipe, built.model, log, tokenizer, rewards, tools)
    data = setup_data(recipe, tokenizer, built.packing, accelerator, preemption, lock, log)
    loaders = setup_loaders(backend, recipe, data, tokenizer, built)
    objective.max_steps = loaders.total_steps
    state = setup_state(backend, recipe, data, loaders, resume_from, identities)
    optimizer, scheduler, ds_config = setup_optimizer(backend, built.model, recipe, loaders.total_steps)
    train_loader = backend.prepare_train_loader(loaders.train)  # the loop moves batches itself, after counting
    faults.at("prepare")
    model, optimizer, scheduler = accelerator.prepare(built.model, optimizer, scheduler)
    backend.check_prepared(model)
    objective.after_prepare()  # distillation's teacher, held as the backend holds a frozen model
    if recipe.preference.reference == "precomputed":  # with the starting weights, before any resume loads others
        for line in reference.precompute(accelerator, model, {"train": data.train, "eval": data.eval}, data.folder,
                                         recipe, loaders.collate):
            log(f"reference: {line}")
    if resume_from is not None:
        state = run_folder.resume(backend, resume_from, state, model, optimizer, scheduler, recipe, len(data.train))
        loaders.sampler.resume_at(*state.data_position)
        objective.load_state(resume_from)  # online RL's batches sampled ahead (rl.max_staleness)
    open_run_folder(backend, recipe, ds_config, state, resume_from, loaders, built, tokenizer, len(data.eval))
    monitor, speed = setup_monitor(accelerator, recipe, state, built.flops, loaders.total_steps)
    return Run(backend=backend, accelerator=accelerator, recipe=recipe, model=model, optimizer=optimizer,
               scheduler=scheduler, train_loader=train_loader, eval_loader=loaders.eval, sampler=loaders.sampler,
               state=state, total_steps=loaders.total_steps, out=Path(recipe.output_dir), objective=objective,
               monitor=monitor, preemption=preemption, samples=samples, speed=speed,
               offload=activations.offload(recipe.model.activation_offload)), tokenizer


def check_data(recipe: Recipe) -> list[str]:
    """The data files found and the first rows of each fit for its format, before the tokenizer and
    the model load (minutes for a large one): a missing file or a `data.format` its columns do not fit
    is refused now, in the words setup_data would use (sources.check_first_rows: the first rows only,
    unless they lack a column). data.format unset (supervised): found from the first file's columns,
    set in the recipe; the lines to say so."""
    d, found = recipe.data, []
    for entries, key in ((d.train_files, "data.train_files"), (d.eval_files, "data.eval_files")):
        for source in resolve_sources(entries, d, key):
            check_first_rows(source)
            found.append(source)
    if d.format is None:  # supervised, unset: as its files' first rows say (the run folder's config.yaml keeps it)
        for source in found:
            if source.format in ("preference", "unpaired", "prompt"):
                raise ToolkitError(f"{source.key}: {source.name}: its columns are data.format={source.format}'s, "
                                   f"which trains only with {trained_by(source.format)}; set it, or data.format")
        d.format = found[0].format
        return [f"format {d.format}, found from the columns of {found[0].name} (data.format unset)"]
    return []


def setup_rewards(recipe: Recipe, tools: Tools | None = None) -> list | None:
    """rl.rewards imported, and each called on the first prompt rows of the first training file (a
    JSON one) with an empty and a short completion, before the model loads: a function that cannot
    run at all fails now, by name and row. With rl.environment, each class's get_reward is added (weight 1,
    named after the class, as TRL's) and the functions get `environments=`, instances reset with those rows."""
    if not method_of(recipe).rewards:  # supervised, preference, distillation
        return None
    from ..data.sources import json_rows
    from .rewards import check_rewards, load_rewards, with_environment

    rewards = load_rewards(recipe.rl.rewards, recipe.model.chat_template_kwargs)
    environment = tools.environment if tools is not None else None
    if environment is not None:
        rewards = with_environment(rewards, environment)
    source = resolve_sources(recipe.data.train_files, recipe.data, "data.train_files")[0]
    if source.files and Path(source.files[0]).suffix.lower() in (".json", ".jsonl"):
        rows = []
        for row, number, _ in json_rows(source.files[0]):
            rows.append((row, number))
            if len(rows) == 2:
                break
        where = [f"{source.name} row {n}" for _, n in rows]
        text = next((w for (r, _), w in zip(rows, where) if isinstance(r.get("prompt"), str)), None)
        if tools is not None and text is not None:
            raise rl_tools.text_prompt(text)
        check_rewards(rewards, [r.get("prompt") for r, _ in rows], [{k: v for k, v in r.items() if k != "prompt"}
                                                                    for r, _ in rows], where,
                      (lambda picked: environment.batch([rows[i][0] for i in picked], 1,
                                                        [where[i] for i in picked]).environments)
                      if environment is not None else None)
    return rewards


@dataclass
class BuiltModel:
    """The model as `setup_model` made it (before prepare), and what its making decided."""
    model: Any
    config: ModelConfig  # the recipe's, with the attention the data needs
    flops: measure.Flops
    packing: bool  # false where the model lets packed documents attend to each other
    padding_free: bool
    preset_base: tuple[Any, dict] | None  # (config, weights) of a preset's base, saved beside a LoRA run


@dataclass
class Tools:
    """rl.tools and rl.environment as loaded: what the rollout calls, and whose code a resume compares."""
    tools: list
    environment: Any
    code: list


def setup_tools(recipe: Recipe) -> Tools | None:
    """rl.tools imported and their schemas read; rl.environment's classes imported, one instance of each made and
    its methods read; None where the recipe names neither. Before the model loads: a tool or class the loop cannot
    use fails now."""
    rl = recipe.rl
    if not rl.tools and rl.environment is None:
        return None
    from ..rollout.environments import load_environment

    modules: dict = {}
    tools = load_tools(rl.tools, modules)
    environment = load_environment(rl.environment, tools, modules) if rl.environment is not None else None
    return Tools(tools, environment, tools + (environment.methods() if environment is not None else []))


def setup_model(backend: backends.Backend, recipe: Recipe, tokenizer, log) -> BuiltModel:
    """The model in the run's dtype: attention, tiled MLPs, vocabulary, loss in the forward, packing
    isolation, fused kernels, LoRA and compile, each said in a start-of-run line."""
    t, model_cfg, out = recipe.train, recipe.model, Path(recipe.output_dir)
    split = backend.sequence_parallel > 1  # each row split across that many ranks (backends/sequence.py)
    if model_cfg.attn_implementation == "sdpa" and (recipe.data.padding_free or (split and recipe.data.packing)):
        # sdpa would build a dense mask over the micro-batch, and a split row's attention takes no mask
        model_cfg = dataclasses.replace(model_cfg, attn_implementation="varlen")
        log("attention: varlen (" + ("data.padding_free; sdpa would mask the whole micro-batch)" if not split else
                                     "packed documents split across ranks; sequence-parallel attention takes no mask)"))
    faults.at("model")
    scorer = method_of(recipe).scorer
    model = build_model(model_cfg, DTYPES[recipe.model.dtype], DTYPES[recipe.train.precision], scorer=scorer)
    if scorer:
        mark_scorer(model, tokenizer)
        if model_cfg.preset is not None or not has_score_head(resolve_model(model_cfg.path, model_cfg.revision)):
            seed_score_head(model, recipe.seed, backend.writable)
            log(f"reward model: a score head of one output on {type(model).__name__}, drawn from the seed")
        else:
            log("reward model: the folder's score head, trained further")
    if model_cfg.attn_implementation == "sdpa" and model.config._attn_implementation == "eager":
        log(f"attention: eager ({model.config.model_type} does not take sdpa in transformers)")
    backend.check_model(model, recipe)
    if recipe.model.tiled_mlp:
        row = longest_row(recipe)
        tiles, mlps = activations.tile_mlps(model, row)
        log(f"tiled MLP: each of {mlps} MLPs runs as {tiles} tiles of at most {-(-row // tiles)} positions")
    added = fit_vocabulary(model, tokenizer, backend.full_shape)
    rows = token_rows(model, tokenizer, recipe.model.add_special_tokens, added, backend.full_shape)
    if recipe.model.add_special_tokens:
        log(f"vocabulary: {len(tokenizer)} tokens with model.add_special_tokens; "
            + (f"embeddings grown by {added} rows (mean-initialised, trained)" if added else
               "the model's spare embedding rows hold them")
            + (f"; with LoRA, {len(rows)} embedding rows train whole (peft trainable tokens)"
               if recipe.lora.enabled else ""))
    counts = count_model(model.config, "model", recipe.lora)
    teacher = count_model(read_config(recipe.rl.teacher, key="rl.teacher"), "rl.teacher").params \
        if method_of(recipe).teacher else 0
    flops = measure.Flops.of(counts, recipe.lora.enabled,
                             extra_forwards=method_of(recipe).extra_forwards(recipe, counts.params, teacher))
    if not scorer:  # in the forward, where every backend has whole weights (a reward model's is its score)
        use_token_loss(model, t.loss, t.loss_chunk_tokens, backend, most_positions(recipe))
    packing, padding_free = recipe.data.packing, recipe.data.padding_free
    if (packing or padding_free) and not packing_is_isolated(
            isolation_probe(model, backend.partitioned_before_prepare(model))):
        log("warning: this model lets packed documents attend to each other; padding instead of "
            + ("packing" if packing else "data.padding_free"))
        packing = padding_free = False
    if (kernels := apply_kernels(model, recipe.model)) is not None:  # after the CPU forwards above: Triton needs CUDA
        log(f"kernels: {kernels}; the loss stays train.loss={t.loss} (Liger's fused linear cross-entropy not used)")
    preset_base = None
    if recipe.lora.enabled:
        if recipe.model.preset is not None:
            # A preset has no folder of its own: its weights are saved beside the run (open_run_folder)
            # so that the adapter in final/ loads with plain peft.
            preset_base = (model.config, {k: v.detach().clone() for k, v in model.state_dict().items()})
        model = setup_lora(backend, recipe, model, rows, out)
    if t.compile:
        backend.check_compile(recipe)
        log(f"compile: {compile_layers(model)} decoder layers (the first steps compile them)")
    trainable, total = count_parameters(model)
    log(f"parameters: {trainable:,} trainable of {total:,} ({100 * trainable / total:.2f}%)")
    if recipe.model.load_in_4bit:
        log(f"base: 4-bit NF4 (QLoRA: bitsandbytes, double quantization), computing in {recipe.train.precision}; "
            "only the LoRA adapters train")
    if recipe.lora.enabled:
        coverage, warning = adapter_coverage(model, backend.full_shape)
        log(f"lora: {coverage}")
        if warning:
            log(f"warning: {warning}")
    if backend.accelerator.is_main_process and (warning := run_folder.check_free_space(out, recipe, trainable, total)):
        log(f"warning: {warning}")
    return BuiltModel(model, model_cfg, flops, packing, padding_free, preset_base)


def setup_lora(backend: backends.Backend, recipe: Recipe, model, rows: list[int], out: Path):
    """The peft model, its adapter seeded alike on every backend, pointing at the base it belongs to."""
    from accelerate.utils import set_seed

    backend.check_adapter(bool(rows))
    # The adapter's first weights must not depend on what building drew: under ZeRO-3's
    # zero.Init on a GPU the load draws from the CUDA generator and the isolation probe builds a
    # small model, so the CPU generator stood elsewhere than in a plain run (H100, 2026-11-26:
    # lora_A 0.27 apart between one process and ZeRO-3).
    set_seed(recipe.seed)
    model = apply_lora(model, recipe.lora, rows)
    backend.adapted(model)
    if recipe.model.preset is not None:
        model.peft_config["default"].base_model_name_or_path = str((out / "base-model").resolve())
    elif not is_hub_id(recipe.model.path):  # absolute: the adapter loads from any working directory
        model.peft_config["default"].base_model_name_or_path = str(Path(recipe.model.path).resolve())
    return model


def setup_objective(backend: backends.Backend, recipe: Recipe, model, log, tokenizer,
                    rewards: list | None, tools: list | None = None) -> objectives.Objective:
    """The recipe's objective for the built model (after LoRA: DPO's and RL's reference may be the
    model with its adapter disabled), made by its method's builder (config/methods.py), checked by the
    backend and said at the start of the run."""
    objective = method_of(recipe).build(recipe, model, backend=backend, log=log, tokenizer=tokenizer, rewards=rewards,
                                        tools=tools)
    backend.check_objective(objective)
    for line in objective.describe():
        log(line)
    return objective


def setup_data(recipe: Recipe, tokenizer, packing: bool, accelerator, preemption: Preemption,
               lock: run_folder.RunLock, log) -> Datasets:
    """The prepared train and eval data, with what preparing found said, and the label audit of the
    first row (what the loss is taken on, before an hour is spent on it)."""
    # The main process of each node prepares the data; the others wait on the file system, not in a
    # collective that a long tokenization could time out.
    with preemption.abrupt(lock.release, remove_partial_data):  # a signal while datasets' workers tokenize
        data = build_datasets(recipe.data, tokenizer, recipe.seed, packing, prepares=accelerator.is_local_main_process,
                              margins=method_of(recipe).scorer)
    data.train.kl_max_length = data.eval.kl_max_length = recipe.data.max_seq_len  # KTO's mismatched sequences
    for line in data.lines:
        log(f"data: {line}")
    warnings = list(data.warnings)
    warnings += method_of(recipe).warnings(data.train.table, recipe)  # KTO: rows of one label, as TRL warns
    for line in warnings:
        log(f"warning: {line}")
    if accelerator.is_main_process:
        log(f"data: {label_audit(data.train[0], tokenizer)}")
    return data


@dataclass
class Loaders:
    train: DataLoader
    eval: DataLoader
    sampler: EpochSampler
    collate: Collator
    eval_batch: int
    global_batch: int
    total_steps: int


def setup_loaders(backend: backends.Backend, recipe: Recipe, data: Datasets, tokenizer, built: BuiltModel) -> Loaders:
    """The train loader (a seeded epoch sampler over global batches) and the eval loader (each rank a
    disjoint share), and the run's number of optimizer steps."""
    t, accelerator = recipe.train, backend.accelerator
    world, (_, ranks) = accelerator.num_processes, backend.data_parallel()  # ranks that see different rows
    global_batch = t.micro_batch_size * t.gradient_accumulation_steps * ranks
    sampler = EpochSampler(len(data.train), global_batch, recipe.seed)
    if sampler.steps_per_epoch == 0:
        raise ToolkitError(f"data.train_files: {len(data.train)} training rows do not fill one global batch of "
                           f"{global_batch} (micro_batch_size x gradient_accumulation_steps x {ranks} "
                           + ("processes)" if ranks == world else f"data-parallel ranks of {world} processes)"))
    collate = Collator(tokenizer.pad_token_id, packed=built.packing, padding_free=built.padding_free,
                       bounds=built.config.attn_implementation == "varlen", pairs=data.train.pairs,
                       unpaired=data.train.unpaired,
                       multiple=backend.sequence_parallel, prompts=method_of(recipe).online)
    # Own generators: a DataLoader iterator otherwise draws its seed from the global RNG, so a resumed
    # run (which starts a fresh iterator mid-epoch) would leave dropout's random stream shifted.
    train_loader = DataLoader(data.train, batch_size=t.micro_batch_size, sampler=sampler, collate_fn=collate,
                              drop_last=True, generator=torch.Generator().manual_seed(recipe.seed),
                              pin_memory=accelerator.device.type == "cuda")
    # At most one rank's share of the eval rows: a larger batch is the same one forward, without padding to it.
    eval_batch = min(t.eval_batch_size or t.micro_batch_size, max(1, math.ceil(len(data.eval) / world)))
    eval_loader = DataLoader(data.eval, batch_size=eval_batch, collate_fn=collate,
                             sampler=EvalShardSampler(len(data.eval), eval_batch, accelerator.process_index, world),
                             generator=torch.Generator().manual_seed(recipe.seed))
    total_steps = t.max_steps or t.epochs * sampler.steps_per_epoch * recipe.rl.num_iterations
    return Loaders(train_loader, eval_loader, sampler, collate, eval_batch, global_batch, total_steps)


def setup_state(backend: backends.Backend, recipe: Recipe, data: Datasets, loaders: Loaders,
                resume_from: Path | None, identities: dict[str, str]) -> checkpoint.TrainerState:
    """The training state at step 0; a checkpoint this launch cannot continue is refused now, before any work."""
    state = checkpoint.TrainerState(world_size=backend.accelerator.num_processes, global_batch=loaders.global_batch,
                                    launch=backend.kind, data_fingerprint=data.train_fingerprint,
                                    data_content=data.train_content,
                                    recipe=run_folder.learning_relevant(recipe), layout=backend.layout(),
                                    inputs=identities)
    if resume_from is not None:
        run_folder.check_resumable(checkpoint.read_state(resume_from), state, resume_from,
                                   recipe.resume_new_global_batch, recipe.resume_accept_changed)
    return state


def setup_optimizer(backend: backends.Backend, model, recipe: Recipe, total_steps: int):
    """(optimizer, scheduler, the resolved DeepSpeed config or None): the backend's, or a DeepSpeed JSON's own."""
    lrs = optimizers.learning_rates(model, recipe.lora, recipe.train)  # LoRA+, embeddings: their own rates
    optimizer = backend.make_optimizer(backend.param_groups(model, recipe.train.weight_decay, lrs), recipe, model)
    scheduler = backend.make_scheduler(optimizer, recipe, total_steps)
    return optimizer, scheduler, backend.finalize_config(model, recipe, total_steps)


def open_run_folder(backend: backends.Backend, recipe: Recipe, ds_config, state: checkpoint.TrainerState,
                    resume_from: Path | None, loaders: Loaders, built: BuiltModel, tokenizer, eval_rows: int) -> None:
    """The start-of-run summary said and recorded in the run folder (where `overwrite` removes the
    earlier run's results, the last thing before step 1), a preset's base saved beside a LoRA run,
    and the trackers started."""
    accelerator, out = backend.accelerator, Path(recipe.output_dir)
    summary = run_summary(recipe, backend, ds_config, rows=len(loaders.train.dataset), eval_rows=eval_rows,
                          steps_per_epoch=loaders.sampler.steps_per_epoch, total_steps=loaders.total_steps)
    if accelerator.is_main_process:
        for line in summary:
            print(line if line.startswith("warning: ") else f"run: {line}", file=sys.stderr)
        with disk.writing("output_dir", out, remove=False, error=ToolkitError):
            removed = run_folder.record_launch(recipe, state, ds_config, resume_from, summary)
        if removed:
            accelerator.print(f"overwrite: removed the earlier run's {', '.join(removed)} from {out}")
        if built.preset_base is not None:
            run_folder.save_preset_base(*built.preset_base, tokenizer, out / "base-model")
    accelerator.wait_for_everyone()
    start_trackers(accelerator, recipe)  # after the overwrite: TensorBoard writes into output_dir


def start_trackers(accelerator, recipe: Recipe) -> None:
    """train.report_to through accelerate, the recipe as hyperparameters: W&B's run folder and MLflow's
    file store (where MLFLOW_TRACKING_URI names none) in output_dir. A tracker that does not start (no
    login, a server out of reach) is one line naming it, before step 1."""
    trackers = recipe.train.report_to
    if not trackers:
        return
    from accelerate.tracking import GeneralTracker

    out = Path(recipe.output_dir).resolve()
    if "mlflow" in trackers and not os.environ.get("MLFLOW_TRACKING_URI"):
        # MLflow 3 keeps its file store (maintenance mode) behind this switch; its database store needs
        # SQLAlchemy, which mlflow-skinny leaves out
        os.environ.update(MLFLOW_TRACKING_URI=(out / "mlruns").as_uri(), MLFLOW_ALLOW_FILE_STORE="true")
    flat = {k: v if isinstance(v, (int, float, str, bool)) else str(v)
            for k, v in run_folder.flat_recipe(recipe).items()}
    project, name = tracker_names(recipe)
    accelerator.print(f"trackers: {', '.join(trackers)}, project {project}, run {name}")
    try:
        accelerator.init_trackers(project, config=flat, init_kwargs={"wandb": {"dir": str(out), "name": name},
                                                                     "mlflow": {"run_name": name},
                                                                     "trackio": {"name": name}})
    except Exception as e:  # noqa: BLE001 - each tracker raises its own types (no login, no server, ...)
        failed, tb = "a tracker", e.__traceback__
        while tb is not None:  # the tracker whose start raised: accelerate's tracker object in the traceback
            if isinstance(owner := tb.tb_frame.f_locals.get("self"), GeneralTracker):
                failed = owner.name
            tb = tb.tb_next
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise ToolkitError(f"train.report_to: {failed} did not start: {first}") from None


def tracker_names(recipe: Recipe) -> tuple[str, str]:
    """(project, run name) for the trackers: train.project, else the team's W&B project (WANDB_PROJECT, when
    reporting to W&B), else the run folder's name; train.run_name, else the run folder's name. MLflow's
    experiment is MLFLOW_EXPERIMENT_NAME where set (accelerate reads it), W&B's entity WANDB_ENTITY (wandb does)."""
    t, folder = recipe.train, Path(recipe.output_dir).resolve().name
    team = os.environ.get("WANDB_PROJECT") if "wandb" in t.report_to else None
    return t.project or team or folder, t.run_name or folder


def setup_monitor(accelerator, recipe: Recipe, state: checkpoint.TrainerState, flops: measure.Flops,
                  total_steps: int) -> tuple[Monitor, measure.Throughput]:
    """The watchdog behind the monitor, and the throughput and MFU of each step."""
    t, out, world = recipe.train, Path(recipe.output_dir), accelerator.num_processes
    watchdog = Watchdog(out, accelerator.process_index, world, accelerator.is_main_process, t.watchdog_seconds,
                        t.watchdog, cpu=accelerator.device.type == "cpu")
    monitor = Monitor(accelerator, out, watchdog, t.profile_steps, first_step=state.step + 1)
    speed = measure.Throughput(flops, measure.peak_tflops(t.precision, t.peak_tflops), world, total_steps, state.step)
    return monitor, speed
