"""What online RL and on-policy distillation write beside the loss: the values reward functions hand log_metric,
in the step's metrics, and the completions table (rl.log_completions: completions.jsonl in the run folder, a row
per completion, some of them shown in the log)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..errors import ToolkitError
from ..storage import disk
from .rewards import Logged

# Metric names the loop and these objectives write in a step's row: a reward function's log_metric cannot take one.
ROW_METRICS = frozenset({
    "step", "epoch", "loss", "lr", "grad_norm", "tokens", "time", "skipped_steps", "loss_scale", "compiled_graphs",
    "peak_memory_gib", "mfu", "tflops_per_device", "eta_seconds", "samples_per_second", "tokens_per_second",
    "target_tokens_per_second", "clip_ratio_low", "clip_ratio_high", "clip_ratio", "entropy", "kl",
    "sampler_logp_difference", "sampler_weight", "staleness"})


def logged_metrics(accelerator, logged: Logged, taken: set[str]) -> dict[str, float]:
    """log_metric's values: each name's mean over the calls of every rank (TRL's), in the step's metrics; a
    name in `taken` (the step's generation metrics) or the row's other metrics is refused."""
    names = sorted(logged.metrics)
    if accelerator.num_processes > 1:  # every rank reduces the same names in the same order
        from accelerate.utils import gather_object

        names = sorted(set(gather_object(names)))
    for name in names:
        if name in ROW_METRICS or name in taken or name.startswith("eval_"):
            raise ToolkitError(f"rl.rewards: {logged.by.get(name, 'a reward function')}: log_metric({name!r}) "
                               "takes the name of a metric the run writes; give it another name")
    sums = torch.tensor([[sum(logged.metrics.get(n, [])), len(logged.metrics.get(n, []))] for n in names],
                        dtype=torch.float64).reshape(-1, 2)
    if accelerator.num_processes > 1:
        sums = accelerator.reduce(sums.to(accelerator.device), "sum").cpu()
    return {n: s / c if c else math.nan for n, (s, c) in zip(names, sums.tolist())}


def append_table(accelerator, table: Path, rows: list[dict], num_to_print: int | None) -> None:
    """Every rank's rows of a generated batch gathered and appended to completions.jsonl, and num_to_print
    (rl.num_completions_to_print) of them shown in the log (None: all, as TRL)."""
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        rows = gather_object(rows)
    if not accelerator.is_main_process:
        return
    with disk.writing("completions table", table, remove=False), open(table, "a") as f:
        f.write("".join(json.dumps(row, default=str) + "\n" for row in rows))
    for row in rows if num_to_print is None else rows[:num_to_print]:
        prompt = row["prompt"][-1]["content"] if isinstance(row["prompt"], list) and row["prompt"] \
            and isinstance(row["prompt"][-1], dict) else row["prompt"]
        scores = "".join(f", {k} {row[k]:.4g}" if isinstance(row[k], float) else f", {k} {row[k]}"
                         for k in ("reward", "advantage") if k in row)
        tqdm.write(f"step {row['step']}: {str(prompt)[-80:]!r} -> {row['completion'][:200]!r}{scores}")


def generation_metrics(accelerator, cfg, rewards: torch.Tensor, per_function: dict[str, torch.Tensor],
                       completions: list[list[int]], truncated: list[bool], seconds: float) -> tuple[dict, float]:
    """(the generated batch's metrics, the completions scored and not left out): reward mean and std (total and per
    function), completion lengths, the share cut at max_new_tokens (`truncated`) and of groups without reward spread,
    over the global batch (every rank's sums reduced)."""
    g = cfg.num_generations
    lengths = torch.tensor([len(c) for c in completions], dtype=torch.float64)
    cut = torch.tensor(truncated, dtype=torch.float64)
    r = rewards.double()
    flat_groups = r.view(-1, g)  # a group's spread over its scored completions; none scored: no spread
    unscored = flat_groups.isnan()
    no_spread = (flat_groups.masked_fill(unscored, -math.inf).max(1).values
                 - flat_groups.masked_fill(unscored, math.inf).min(1).values) < 1e-12
    columns = {"reward": r, **{name: v.double() for name, v in per_function.items()}}
    sums = []
    for v in columns.values():
        ok = ~torch.isnan(v)
        sums += [torch.where(ok, v, 0).sum(), torch.where(ok, v * v, 0).sum(), ok.sum()]
    left_out = cut.bool() if cfg.mask_truncated_completions else torch.zeros_like(cut, dtype=torch.bool)
    sums += [lengths.sum(), cut.sum(), no_spread.sum(), float(len(completions)), float(len(flat_groups)), seconds,
             unscored.sum(), (~r.isnan() & ~left_out).sum()]
    extremes = torch.tensor([lengths.max(), -lengths.min()], dtype=torch.float64)
    device = accelerator.device
    total = accelerator.reduce(torch.tensor(sums, dtype=torch.float64).to(device), "sum").cpu().tolist()
    most = accelerator.reduce(extremes.to(device), "max").cpu().tolist() \
        if accelerator.num_processes > 1 else extremes.tolist()
    out = {}
    for i, name in enumerate(columns):
        s, s2, n = total[3 * i:3 * i + 3]
        out[name] = s / n if n else math.nan  # the mean of what was scored: none, no mean
        if name == "reward":
            out["reward_std"] = (max(s2 - s * s / n, 0.0) / max(n - 1, 1)) ** 0.5 if n else math.nan
    length_sum, cut_n, flat_n, n, groups, secs, unscored_n, counted_n = total[3 * len(columns):]
    world = accelerator.num_processes
    return {**out, "completion_length": length_sum / n, "completion_length_max": most[0],
            "completion_length_min": -most[1], "clipped_completions": cut_n / n, "zero_std_groups": flat_n / groups,
            "generation_seconds": secs / world, "unscored_completions": unscored_n / n}, counted_n


def sampler_metrics(accelerator, cfg, made: list[dict]) -> dict[str, float]:
    """rl.sampler=vllm with its correction: how far the server's log-probabilities of the sampled tokens are from
    the trained model's (the mean |difference| over the global batch's completion tokens, TRL's
    sampling/sampling_logp_difference/mean) and the mean correction weight (TRL's
    sampling/importance_sampling_ratio/mean, over tokens or completions as the mode takes it)."""
    device = accelerator.device
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    per_token = cfg.vllm_importance_sampling_mode.startswith("token")
    for b in made:
        mask = b["completion_mask"].to(device)
        sampled = b["sampler_logps"].to(device)
        known = mask * ~sampled.isnan()  # tokens the server gave a log-probability for, as TRL's
        diff = (b["old_logps"] - sampled).abs().nan_to_num(0.0) * known
        weights = b["sampler_weights"]
        where = mask if per_token else torch.ones_like(weights)
        sums += torch.stack([diff.sum(), known.sum(), (weights * where).sum(), where.sum()]).double()
    s = accelerator.reduce(sums, "sum").tolist() if accelerator.num_processes > 1 else sums.tolist()
    return {"sampler_logp_difference": s[0] / max(s[1], 1.0), "sampler_weight": s[2] / max(s[3], 1.0)}


def completion_rows(step: int, fields: list[dict], texts: list[str], rewards: torch.Tensor,
                    per_function: dict[str, torch.Tensor], advantages: torch.Tensor, logged: Logged) -> list[dict]:
    """The completions table's rows of a batch (rl.log_completions; `append_table` gathers every rank's into
    completions.jsonl): step, prompt, completion, reward and each function's (null: no opinion), advantage and the
    columns the functions gave log_extra."""
    def value(x: float):
        return None if math.isnan(x) else x
    values = {name: v.tolist() for name, v in per_function.items()}
    return [{"step": step, "prompt": f.get("prompt"), "completion": text, "reward": value(r),
             **{name: value(v[i]) for name, v in values.items()}, "advantage": a,
             **{column: extra[i] for column, extra in logged.extra.items()}}
            for i, (f, text, r, a) in enumerate(zip(fields, texts, rewards.tolist(), advantages.tolist()))]
