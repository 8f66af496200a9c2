"""`toolkit estimate`: which strategy fits a model on given GPUs, before anything is launched. The
arithmetic and its sources are in `toolkit/backends/sizing.py`; this is the command line and its table.
`--recipe RECIPE.yaml [key=value ...]` reads the recipe as `toolkit train` would, dotted overrides
included; `--model` with `--lora` stores the frozen base as the shipped LoRA recipes do (model.dtype
= train.precision), the adapters in fp32; `--load-in-4bit` is QLoRA's (model.load_in_4bit) NF4 base."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

from ..backends import sequence
from ..backends.model_counts import count_model, read_config
from ..backends.run_sizing import check_dense, launched_strategy, setup_from_recipe, size_text
from ..backends.sizing import (
    BYTES,
    GIB,
    USABLE_FRACTION,
    Row,
    Setup,
    Strategy,
    estimate_all,
    kv_cache_bytes,
    recommend,
    rl_forwards,
)
from ..errors import ToolkitError, command
from ..optim import optimizers


def add_arguments(p) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a Hugging Face model folder, a config.json, a cached Hub id or a preset name")
    src.add_argument("--recipe", help="a recipe YAML: model, LoRA, precision, micro-batch, sequence length, "
                                      "checkpointing from it (key=value overrides and the flags given here "
                                      "override it)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="with --recipe: dotted overrides of its keys, as `toolkit train` takes them "
                        "(train.micro_batch_size=4 data.max_seq_len=8192)")
    p.add_argument("--config_file", "--config-file", dest="config_file",
                   help="with --recipe: the accelerate launch config; its strategy is marked and its process count "
                        "used unless --gpus is given")
    p.add_argument("--gpus", type=int, default=None, help="GPUs (processes) per node (default 1, or the launch's)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpu-memory", type=float, default=80.0, metavar="GIB",
                   help="memory of one GPU in GiB (default 80)")
    p.add_argument("--precision", choices=sorted(BYTES), default=None, help="default bf16 (or the recipe's)")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per GPU per forward pass (default 1)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 2048)")
    p.add_argument("--lora", action="store_true", default=None,
                   help="LoRA on every linear layer instead of full fine-tuning; the frozen base stored in "
                        "--precision's dtype as the shipped LoRA recipes do (with --recipe: its model.dtype)")
    p.add_argument("--lora-r", type=int, default=None, help="LoRA rank (default 8)")
    p.add_argument("--load-in-4bit", action="store_true", default=None,
                   help="QLoRA (model.load_in_4bit, implies --lora): the base's linear layers in 4-bit NF4, about "
                        "0.52 bytes a weight; a model folder or config.json, not a preset")
    p.add_argument("--gradient-checkpointing", action="store_true", default=None)
    p.add_argument("--tiled-mlp", action="store_true", default=None, help="model.tiled_mlp")
    p.add_argument("--activation-offload", action="store_true", default=None,
                   help="model.activation_offload (with --gradient-checkpointing)")
    p.add_argument("--sp-size", type=int, default=None, metavar="N",
                   help="sequence parallelism (DeepSpeed's Ulysses, parallelism_config_sp_size): each sequence split "
                        "across N GPUs; DeepSpeed strategies only (default 1, or the launch's)")
    p.add_argument("--loss", choices=["chunked", "full"], default=None,
                   help="train.loss: chunked keeps one chunk's logits, full the micro-batch's (default chunked)")
    p.add_argument("--loss-chunk-tokens", type=int, default=None, help="train.loss_chunk_tokens (default 1024)")
    p.add_argument("--optim", choices=optimizers.NAMES, default=None,
                   help="train.optim: its state per trained parameter (default adamw_torch, 8 bytes; adamw_8bit 2)")
    p.add_argument("--throughput", type=float, default=None, metavar="TOKENS_PER_S_PER_GPU")
    p.add_argument("--price", type=float, default=None, metavar="PER_GPU_HOUR")
    p.add_argument("--tokens", type=float, default=None, help="dataset tokens per epoch (for time and cost)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args) -> int:
    for name in ("gpus", "nodes", "micro_batch", "seq_len", "lora_r", "loss_chunk_tokens", "sp_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ToolkitError(f"--{name.replace('_', '-')}: must be at least 1, got {value}")
    for name in ("gpu_memory", "throughput", "price", "tokens"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ToolkitError(f"--{name.replace('_', '-')}: must be positive, got {value}")
    if args.config_file and not args.recipe:
        raise ToolkitError("--config_file: only with --recipe (it decides the strategy of that recipe's launch)")
    if args.overrides and not args.recipe:
        raise ToolkitError(f"{args.overrides[0]}: key=value overrides change a recipe's keys; give --recipe "
                           "RECIPE.yaml, or the flags (--micro-batch, --seq-len, ...) with --model")
    launched = None
    if args.recipe:
        setup, launched = _from_recipe(args)
    else:
        from ..config import LoraConfig
        from ..model.load import PRESETS

        if args.load_in_4bit and (PRESETS / f"{args.model}.json").is_file() and not Path(args.model).exists():
            raise ToolkitError(f"--load-in-4bit: {args.model} is a preset, built in full precision; QLoRA quantizes a "
                               "model folder while loading it (give its folder or config.json)")
        args.lora = args.lora or args.load_in_4bit
        lora = LoraConfig(enabled=bool(args.lora), r=args.lora_r or 8)
        config = read_config(args.model)
        if args.tiled_mlp:
            check_dense(config)
        setup = Setup(model=count_model(config, args.model, lora),
                      gpus_per_node=args.gpus or 1, nodes=args.nodes, four_bit=bool(args.load_in_4bit))
    overrides = {"precision": args.precision, "micro_batch": args.micro_batch, "seq_len": args.seq_len,
                 "gradient_checkpointing": args.gradient_checkpointing, "tiled_mlp": args.tiled_mlp,
                 "activation_offload": args.activation_offload, "loss": args.loss,
                 "loss_chunk_tokens": args.loss_chunk_tokens, "sequence_parallel": args.sp_size,
                 "optimizer_bytes": optimizers.OPTIMIZERS[args.optim].state_bytes if args.optim else None}
    setup = replace(setup, gpu_memory_gib=args.gpu_memory, **{k: v for k, v in overrides.items() if v is not None})
    if args.lora and not args.recipe:  # model.dtype = train.precision, as every shipped LoRA recipe has it
        setup = replace(setup, base_dtype=setup.precision)
    if setup.precision == "fp32" and setup.base_dtype != "fp32":
        setup = replace(setup, base_dtype="fp32")
    _check_sequence_parallel(setup, "--sp-size" if args.sp_size else args.config_file)
    rows = estimate_all(setup)
    report = {"model": asdict(setup.model), "setup": {k: v for k, v in asdict(setup).items() if k != "model"},
              "strategies": [r.as_json() for r in rows], "launched": launched.name if launched else None,
              "recommendation": recommend(setup), "epoch": epoch_cost(setup, args.tokens, args.throughput, args.price),
              "rl": {"completions_sampled_per_gpu": setup.sampled, "forwards_without_gradient_per_step":
                     rl_forwards(setup), "gather_for_sampling": setup.gathered_sampling,
                     "server_sampling": setup.server_sampling, "server_gpu_share": setup.server_gpu_share}
              if setup.generations else None}
    report["setup"]["gpus"] = setup.gpus
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(render(setup, rows, report, launched))
    return 0


def _check_sequence_parallel(setup: Setup, source: str) -> None:
    """Refuse, as a launch would, a sequence-parallel size these GPUs, this recipe or this model cannot
    run (the model's heads by the launch's own check)."""
    sp = setup.sequence_parallel
    if sp == 1:
        return
    key = source if source == "--sp-size" else f"{source}: parallelism_config_sp_size"
    if setup.gpus % sp:
        raise ToolkitError(f"{key} is {sp} but {setup.gpus} GPUs do not divide into groups of {sp}; give a multiple "
                           f"of {sp} GPUs (--gpus x --nodes)")
    if setup.pairs:
        raise ToolkitError(f"{key} is {sp}: sequence parallelism does not run preference training yet")
    if setup.generations:
        raise ToolkitError(f"{key} is {sp}: online RL (rl.method) samples and scores whole completions, not rows "
                           "split across ranks; leave sequence parallelism out")
    if setup.attention == "eager":
        raise ToolkitError(f"{key} is {sp}: sequence parallelism needs attention without a dense mask; the recipe's "
                           "model.attn_implementation is eager (use sdpa or flash_attention_2)")
    sequence.check_heads(sp, setup.model.heads, setup.model.kv_heads or setup.model.heads, source)


def _from_recipe(args) -> tuple[Setup, Strategy | None]:
    from ..config import load_recipe

    # --load-in-4bit as an override, so that the recipe's own checks judge it (a preset base is refused)
    four_bit = ["model.load_in_4bit=true", "lora.enabled=true"] if args.load_in_4bit else []
    recipe = load_recipe(args.recipe, [*args.overrides, *four_bit])
    recipe.model.tiled_mlp = recipe.model.tiled_mlp or bool(args.tiled_mlp)  # judged with the model (check_dense)
    if args.lora or args.lora_r:
        recipe.lora.enabled, recipe.lora.r = True, args.lora_r or recipe.lora.r
    launched, gpus, sequence_parallel = None, args.gpus, 1
    if args.config_file:
        from ..backends import deepspeed_config
        from ..backends.launch_config import check, sequence_parallel_size, worker_env

        env = worker_env(args.config_file)
        check(recipe, env, cuda=True, source=args.config_file)  # what the launch would refuse
        path = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
        ds = deepspeed_config.load_json(path) if path not in ("", "none") else None
        world = int(env.get("WORLD_SIZE", "1"))
        launched = launched_strategy(env, ds)
        sequence_parallel = sequence_parallel_size(env)
        if gpus is None:
            import yaml

            machines = int((yaml.safe_load(Path(args.config_file).read_text()) or {}).get("num_machines") or 1)
            gpus, args.nodes = max(1, world // machines), machines
    return setup_from_recipe(recipe, gpus_per_node=gpus or 1, nodes=args.nodes,
                             sequence_parallel=sequence_parallel), launched


def epoch_cost(setup: Setup, tokens: float | None, throughput: float | None, price: float | None) -> dict | None:
    """Time (and cost) of one pass over `tokens` at `throughput` tokens/s per GPU on every GPU."""
    if tokens is None or throughput is None:
        return None
    seconds = tokens / (throughput * setup.gpus)
    cost = None if price is None else seconds / 3600 * setup.gpus * price
    return {"tokens": tokens, "tokens_per_s_per_gpu": throughput, "gpus": setup.gpus, "seconds": seconds,
            "gpu_hours": seconds / 3600 * setup.gpus, "price_per_gpu_hour": price, "cost": cost}


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _gib(b: float) -> str:
    return f"{b / GIB:.1f}" if b < 100 * GIB else f"{b / GIB:.0f}"


FROZEN = {True: "reference (rl.beta > 0, full fine-tuning: a frozen copy of the base)",
          False: "teacher (rl.teacher)"}


def rl_lines(setup: Setup) -> list[str]:
    """Online RL's generation and its forwards, below the table (none without rl.method)."""
    if not setup.generations:
        return []
    m, g, k = setup.model, setup.generations, setup.iterations
    kv_heads = m.kv_heads or m.heads
    lora = m.trainable < m.params
    once = 1 / k  # sampling and the fixed log-probabilities: once per generated batch of k optimizer steps
    t = setup.teacher  # distillation's teacher, or full fine-tuning's frozen reference
    reference = t is not None and t.name.startswith("the reference")
    forwards = [f"training {2 if lora else 3} (forward and backward{', LoRA' if lora else ''})",
                "sampling 0 (on the vLLM server)" if setup.server_sampling else f"sampling {once:g}"]
    if setup.reference_forward:
        forwards.append(f"reference log-probabilities {once:g} (rl.beta > 0: "
                        + ("a frozen copy of this model)" if reference else
                           "this model with its LoRA adapter disabled, no second model)"))
    why_old = [f"rl.num_iterations {k}"] * (k > 1) + ["rloo's KL"] * setup.rloo \
        + ["the vLLM sampler's correction"] * (setup.server_sampling and setup.server_correction)
    if why_old:
        forwards.append(f"old log-probabilities {once:g} ({', '.join(why_old)})")
    if t is not None and not reference:
        forwards.append(f"the teacher {t.params / m.params:.3g} (one forward of its {_count(t.params)} parameters, "
                        "counted in this model's forwards)")
    kv = kv_cache_bytes(m, setup)
    sampling = [f"rl: each generated batch, a vLLM server (rl.sampler) samples the {setup.sampled} completions of "
                "every GPU's prompts: its KV cache and weights are in its own memory (a GPU share of its own: "
                "--gpu-memory-utilization in rl.vllm_args), not counted here; before each batch the policy's trained "
                "weights go to it, gathered one tensor at a time"
                + (f"; the server the run starts takes {setup.server_gpu_share:.0%} of the first GPU "
                   f"(--gpu-memory-utilization): fits is judged against "
                   f"{USABLE_FRACTION - setup.server_gpu_share:.0%} of each GPU" if setup.server_gpu_share else "")
                ] if setup.server_sampling else [
               f"rl: each generated batch, every GPU samples {setup.sampled} completions at once "
            f"({setup.micro_batch // g} prompts x {setup.accumulation} accumulation steps x {g} generations), token "
            f"by token up to {setup.new_tokens} new tokens; kv cache: 2 x {m.layers} layers x {kv_heads} KV heads x "
            f"{m.kv // kv_heads} head dim x {setup.sampled} sequences x {setup.seq_len} tokens x "
            f"{BYTES[setup.precision]} bytes = {size_text(kv)}, freed before training (total: the larger of it and "
            "activ. + logits)",
            ("rl: ZeRO-3 and FSDP full-shard gather the whole weights on every GPU to sample (rl.gather_for_sampling, "
             "TRL's ds3_gather_for_generation), the gathered column, freed with the kv cache; "
             "rl.gather_for_sampling=false gathers a layer at a time instead, slower, the same completions"
             if setup.gathered_sampling else
             "rl: rl.gather_for_sampling false: ZeRO-3 and FSDP full-shard sample gathering a layer at a time, as "
             "training's forward (no whole copy; a gather per layer per token)")]
    return sampling + [
            "rl: forward passes per trained token and optimizer step: " + ", ".join(forwards)
            + (f"; all but training once per generated batch of {k} steps" if k > 1 else "")
            + ("" if setup.server_sampling else
               "; sampling runs a token at a time, bound by memory bandwidth more than compute")] \
        + ([f"rl: reward models (rl.rewards): {size_text(setup.reward_model_bytes)} of weights, whole on every GPU "
            "(no strategy shards them; their scoring forward is not counted)"] if setup.reward_model_bytes else []) \
        + ([f"rl: reward models not counted (not a local folder): {', '.join(setup.reward_models_uncounted)}"]
           if setup.reward_models_uncounted else []) \
        + ([f"rl: {FROZEN[reference]}: {_count(t.params)} parameters in {setup.precision}, sharded over the GPUs "
            "by ZeRO-3 and FSDP, whole under DDP and ZeRO-1/2; the frozen column holds its weights and its fp32 "
            "log-probabilities at a micro-batch's completion tokens"] if t is not None else []) + [""]


def render(setup: Setup, rows: list[Row], report: dict, launched: Strategy | None) -> str:
    m = setup.model
    tuned = "full fine-tuning" if m.trainable == m.params else f"LoRA, {_count(m.trainable)} trainable"
    if setup.four_bit:
        tuned = f"QLoRA: {_count(m.quantized)} of the base's weights in 4-bit NF4, {_count(m.trainable)} trainable"
    lines = [f"model: {m.name}: {_count(m.params)} parameters ({tuned}); {m.layers} layers, hidden {m.hidden}, "
             f"vocab {m.vocab}",
             f"setup: {setup.gpus} GPU{'s' if setup.gpus > 1 else ''} ({setup.gpus_per_node} per node x {setup.nodes} "
             f"node{'s' if setup.nodes > 1 else ''}) of {setup.gpu_memory_gib:g} GiB; {setup.precision}; "
             f"{setup.batch_text()}; gradient checkpointing "
             f"{'on' if setup.gradient_checkpointing else 'off'}"
             f"{'; tiled MLP' if setup.tiled_mlp else ''}"
             f"{'; activations offloaded' if setup.activation_offload else ''}"
             f"{f'; sequence parallel {setup.sequence_parallel} (Ulysses)' if setup.sequence_parallel > 1 else ''}"
             f"; attention {setup.attention}; loss {setup.loss}"
             + (f" ({setup.loss_chunk_tokens} tokens a chunk)" if setup.loss == "chunked" else ""),
             ""]
    columns = [("params", "params", 7), ("gradients", "grads", 7), ("optimizer", "optim", 7),
               ("buffers", "buffers", 9), ("activations", "activ.", 8), ("logits", "logits", 8)]
    columns += [("kv_cache", "kv cache", 10)] if setup.generations else []
    columns += [("sampling", "gathered", 10)] if any(r.gpu["sampling"] for r in rows) else []
    columns += [("reward_models", "reward m.", 10)] if setup.reward_model_bytes else []
    columns += [("teacher", "frozen", 9)] if setup.teacher is not None else []
    columns += [("total", "total", 8)]
    lines.append(f"{'GiB per GPU':<33}" + "".join(f"{title:>{w}}" for _, title, w in columns)
                 + f"{'fits':>6}{'host/node':>11}{'comm/step':>11}")
    for r in rows:
        g = r.gpu
        fits = {True: "yes", False: "no", None: "?"}[r.fits]
        mark = "*" if launched is not None and r.strategy == launched else " "
        host = _gib(r.host_per_node + r.nvme_per_node) if r.host_per_node else "-"
        if r.nvme_per_node:
            host = f"{_gib(r.host_per_node)}+{_gib(r.nvme_per_node)}n"
        lines.append(f"{mark}{r.strategy.name:<32}" + "".join(f"{_gib(g[k]):>{w}}" for k, _, w in columns)
                     + f"{fits:>6}{host:>11}{_gib(r.comm_per_step):>11}")
    lines.append("")
    lines += rl_lines(setup)
    if launched is not None:
        lines.append(f"* your launch config: {launched.name}")
    if setup.sequence_parallel > 1:
        lines.append(f"sequence parallel {setup.sequence_parallel}: DeepSpeed only (Ulysses); DDP and FSDP cannot "
                     f"split a sequence and are not listed; comm/step includes the all-to-alls of one micro-batch")
    lines.append("host/node: host RAM per node for offload (NVMe: RAM + 'n' NVMe space); comm/step: what each GPU "
                 "sends per optimizer step")
    formulas = command("python -c 'import toolkit.backends.sizing as s; help(s)'")
    share = f", less the vLLM server's {setup.server_gpu_share:.0%}" if setup.server_gpu_share else ""
    lines.append(f"fits: total <= {USABLE_FRACTION:.0%} of the GPU's memory{share}; totals are upper bounds (see "
                 f"`{formulas}` for the formulas)")
    lines.append(f"recommendation: {report['recommendation']}")
    epoch = report["epoch"]
    if epoch:
        text = (f"epoch: {epoch['tokens']:.3g} tokens at {epoch['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU on "
                f"{epoch['gpus']} GPUs: {epoch['seconds'] / 3600:.2f} h ({epoch['gpu_hours']:.1f} GPU-hours)")
        if epoch["cost"] is not None:
            text += f", {epoch['cost']:,.2f} at {epoch['price_per_gpu_hour']:g} per GPU-hour"
        lines.append(text)
    return "\n".join(lines)
