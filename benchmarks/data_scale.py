"""Data preparation at scale: tokenization speed, memory of the preparing process and of the other
ranks, packing fill and time to the first optimizer step, with the list pipeline it replaced
measured in the same run as the reference.

    python benchmarks/data_scale.py                           # 20k and 100k rows (~15 min; the lists hold ~6 GB)
    python benchmarks/data_scale.py --rows 2000 --first-step  # a quick check (~2 min on 2 cores)
    python benchmarks/data_scale.py --large 1000000           # does 1M rows (~770M tokens) prepare here?

Data: N chat rows (`messages`: an optional system turn, then 1-3 user/assistant turns) written
straight to JSONL. Their text is seeded random English words from a fixed vocabulary, cut from one
corpus of sentences; their lengths are lognormal (--sigma) around a mean of --mean-tokens tokens
under the real tokenizer and chat template (SmolLM2-135M-Instruct, `--model`), so ~3% of the rows
exceed max_seq_len 2048 and are truncated. Tokens per word are measured with the model's
tokenizer.json on slices of the corpus; the template's own tokens are estimated (5 per message,
20 for the system turn). The JSON line gives the mean row length actually prepared.

Each contender is a process of its own whose HF_DATASETS_CACHE is its own temporary folder, so
nothing is cached between contenders; imports and the tokenizer are loaded before its baseline.
- prep, num_proc 1 and num_proc P = the usable cores (`os.sched_getaffinity`), and num_proc 1 again
  with the tokenizer's own threads on: wall time of
  `build_datasets(DataConfig(format=messages, max_seq_len=2048, packing=True, num_proc=...), ...)`
  on an empty cache: file hash, JSON load, tokenization, filtering, save, packing, reload. Tokens
  are the prepared train tokens (the sum of the `length` column, as in the `data:` line).
  Memory: the RSS high-water mark of this process during the call (VmHWM, reset through
  /proc/self/clear_refs right before it, so an earlier peak cannot count) minus its RSS right
  before, per million tokens. With num_proc 1 all the work is done in this process: the figure
  for the goal. With num_proc P the tokenizing happens in forked workers, whose peak is reported as
  RUSAGE_CHILDREN's ru_maxrss (the largest worker's RSS, pages shared with the parent included).
  RSS counts the pages of memory-mapped Arrow files as well as the heap; sampled peaks of RssAnon
  (heap) and RssFile (mapped files) are reported beside it, and CPU seconds of the process and of
  its workers (how many cores each contender really used).
- rank: a non-main rank on the prepared cache: `build_datasets(..., prepares=False)`, then the
  training DataLoader as toolkit/training/run.py builds it (EpochSampler over micro x world rows with
  world 2, Collator, micro_batch_size, drop_last, its own generator). Its private memory, USS
  (Private_Clean + Private_Dirty of /proc/self/smaps_rollup), once the loader is built minus right
  before build_datasets: the goal's figure, split into anonymous memory and mapped file pages (the
  header of each Arrow record batch, read when a file is opened). Then --batches batches are read
  and what that added is reported apart: anonymous memory (must stay flat) and file pages. Arrow
  pages that only this process maps count as private here; on a node whose ranks read the same
  files they are shared page cache, and how many pages one read maps is the kernel's choice (on
  6.x kernels a fault maps the whole large folio around it, up to MBs), so that figure follows
  the number of reads and the kernel, not the dataset.
- lists: the pipeline this replaced held the tokenized rows as Python lists on every rank: the
  prepared train docs (`toolkit.data.prepare.load_prepared(...).train.table`, memory-mapped) and
  `.select_columns(['input_ids', 'labels']).to_list()`; the RSS added while they are held, per
  million tokens. The figures above are also given as ratios to it.
- first step (--first-step, smallest N only): `python -m toolkit train` on the real model with
  LoRA, micro_batch_size 1, max_steps 1, packing, max_seq_len 2048 and a fresh cache; seconds from
  the process start to the `time` of step 1 in metrics.jsonl, and when the `parameters:`,
  `data:` and `run:` lines appeared.

Goals, each printed as met, not met, or n/a (not measurable in this run):
- private data memory of a non-main rank does not grow with the dataset: its USS above baseline
  at the largest N within 10% of the smallest N, and under 300 MB;
- peak RSS added on the main process by preparation (num_proc 1) at most 16 MB per million
  tokens (the list pipeline held ~124);
- num_proc 2 at least 1.7x as fast as num_proc 1, on 2 cores;
- packing fill at least 97%.

Output: one JSON line per N, the goals, and Markdown rows for benchmarks/NOTES.md on stdout;
progress on stderr. The speedup goal compares processes of one core each: num_proc 1 runs with
TOKENIZERS_PARALLELISM=false, and with num_proc > 1 the toolkit sets it so itself (unless the user
set it). The third contender, num_proc 1 with TOKENIZERS_PARALLELISM unset, is what a user who sets
`num_proc: 1` gets: the fast tokenizer's batch encode then already runs on several threads, and
num_proc P is also compared with it (speedup_vs_p1_threads).
Timings on a shared host vary between processes; --repeats N keeps the best of N.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import platform
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_SEQ_LEN = 2048
TEMPLATE_TOKENS_PER_MESSAGE = 5  # <|im_start|> role \n ... <|im_end|> \n
SYSTEM_TOKENS = 20  # SmolLM2's default system turn when a row has none
WORDS = """
the of and to in is that for it as with was on be by at this from have or are an not but which they
you one all were her she there would their we him been has when who will more no if out so said what
up its about into than them can only other new some could time these two may then do first any my now
such like our over man me even most made after also did many before must through back years where much
your way well down should because each just those people how too little state good very make world
still own see men work long get here between both life being under never day same another know while
last might us great old year off come since against go came right used take three place small found
system water number part river model light energy garden market story music paper report answer
question example problem reason result method process study value table figure section chapter point
change order data level group center course field form general house idea kind line matter name plan
power program school service side simple special street student teacher travel window winter summer
morning evening family friend country city village mountain ocean forest animal doctor history science
language memory network signal pattern structure surface balance budget control design effect factor
feature function library message option project quality record region source status support theory
useful careful important different possible available common certain clear early easy final free full
happy large local major natural open personal political public real recent short strong true whole
young ancient modern gentle quickly slowly often always usually rarely together however therefore
although perhaps instead almost already enough finally probably simply exactly really quite rather
explain describe consider suggest provide include continue remember understand develop improve reduce
measure compare create follow believe require receive allow begin build carry choose decide discover
enjoy finish happen imagine learn manage notice offer prepare protect reach return share solve wonder
""".split()


# ----------------------------------------------------------------------------- data


def default_model() -> str:
    """The real-model folder printed by the repo's fetch script (or the shared one)."""
    candidates = [ROOT / "tests" / "fetch_real_model.sh", ROOT.parent / "shared" / "real-model" / "fetch.sh",
                  Path("/work/shared/real-model/fetch.sh")]
    script = next((p for p in candidates if p.is_file()), None)
    if script is None:
        sys.exit("no fetch script for the real model; give --model PATH")
    proc = subprocess.run(["bash", str(script), sys.executable], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0 or not proc.stdout.strip():
        sys.exit(f"{script} failed: {proc.stderr.strip()}; give --model PATH")
    return proc.stdout.strip().splitlines()[-1]


def write_rows(path: Path, n: int, model: str, mean_tokens: float, sigma: float, seed: int) -> dict:
    """N chat rows as JSONL. Text is cut at word boundaries from one seeded corpus of sentences, so
    a message costs a slice, not a word-by-word draw; lengths are lognormal in tokens."""
    from tokenizers import Tokenizer

    started = time.perf_counter()
    rng = random.Random(seed)
    words = rng.choices(WORDS, k=300_000)  # ~2 MB of sentences; messages are slices of it
    i = 0
    while i < len(words):
        end = min(len(words), i + rng.randint(4, 18))
        words[i] = words[i].capitalize()
        words[end - 1] += "." if rng.random() < 0.85 else "?"
        if end - i > 8 and rng.random() < 0.5:
            words[i + 4] += ","
        i = end
    starts = [0, *itertools.accumulate(len(w) + 1 for w in words)]
    corpus = " ".join(words) + " "
    room = len(starts) - 1
    # Tokens per word as messages have them: slices of the corpus, each encoded on its own.
    cuts = [(o, o + rng.randint(10, 400)) for o in (rng.randrange(room - 400) for _ in range(500))]
    encoded = Tokenizer.from_file(str(Path(model) / "tokenizer.json")).encode_batch(
        [corpus[starts[a]:starts[b] - 1] for a, b in cuts], add_special_tokens=False)
    tokens_per_word = sum(len(e.ids) for e in encoded) / sum(b - a for a, b in cuts)

    def text(n_tokens: float) -> str:  # letters, spaces and .,? only: nothing to escape in JSON
        k = max(1, min(room - 1, int(n_tokens / tokens_per_word + 0.5)))
        o = int(rng.random() * (room - k))
        return corpus[starts[o]:starts[o + k] - 1]

    def message(role: str, content: str) -> str:
        return '{"role": "' + role + '", "content": "' + content + '"}'

    mu = math.log(mean_tokens) - sigma * sigma / 2  # the lognormal's mean is mean_tokens
    with open(path, "w") as f:
        lines = []
        for _ in range(n):
            total = max(48.0, rng.lognormvariate(mu, sigma))
            turns = rng.randint(1, 3)
            content = total - SYSTEM_TOKENS - TEMPLATE_TOKENS_PER_MESSAGE * 2 * turns
            messages = []
            if rng.random() < 0.3:  # its own system turn, instead of the template's default
                messages.append(message("system", text(SYSTEM_TOKENS - TEMPLATE_TOKENS_PER_MESSAGE)))
            shares = [rng.expovariate(1.0) + 0.2 for _ in range(turns)]
            for s in shares:
                turn = max(8.0, content * s / sum(shares))
                user = min(1000.0, turn * rng.uniform(0.15, 0.4))  # prompts shorter than answers
                messages += [message("user", text(user)), message("assistant", text(turn - user))]
            lines.append('{"messages": [' + ", ".join(messages) + "]}")
            if len(lines) == 10_000:
                f.write("\n".join(lines) + "\n")
                lines = []
        if lines:
            f.write("\n".join(lines) + "\n")
    return {"rows": n, "file_mb": round(path.stat().st_size / 2**20, 1), "tokens_per_word": round(tokens_per_word, 3),
            "write_seconds": round(time.perf_counter() - started, 2)}


# ----------------------------------------------------------------------------- memory


def status_kb(*keys: str) -> dict[str, int]:
    """Fields of /proc/self/status in kB (VmRSS, VmHWM, RssAnon, RssFile)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in keys:
                out[k] = int(v.split()[0])
    return out


def smaps_kb() -> dict[str, int]:
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1])
    out["USS"] = out["Private_Clean"] + out["Private_Dirty"]
    return out


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class RssPeaks(threading.Thread):
    """The largest RssAnon (the heap) and RssFile (mapped file pages, e.g. Arrow files) seen,
    sampled every 20 ms; VmHWM is the exact peak of their sum."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak = {"RssAnon": 0, "RssFile": 0}
        self.running = True

    def sample(self) -> None:
        now = status_kb(*self.peak)
        self.peak = {k: max(v, now[k]) for k, v in self.peak.items()}

    def run(self):
        while self.running:
            self.sample()
            time.sleep(0.02)

    def stop(self) -> dict[str, int]:
        self.running = False
        self.join()
        self.sample()
        return self.peak


def cpu_seconds(usage) -> float:
    return usage.ru_utime + usage.ru_stime


def mb(kb: float) -> float:
    return round(kb / 1024, 1)


# ----------------------------------------------------------------------------- contenders (child processes)


def child_imports(model: str):
    """Everything a contender imports, loaded before its baseline."""
    sys.path.insert(0, str(ROOT))
    import datasets  # noqa: F401
    import numpy  # noqa: F401
    import pyarrow  # noqa: F401
    import torch  # noqa: F401
    from torch.utils.data import DataLoader  # noqa: F401

    import toolkit.data.prepare  # noqa: F401
    from toolkit.config import ModelConfig
    from toolkit.model.load import build_tokenizer

    return build_tokenizer(ModelConfig(path=model)) if model else None


def data_config(a, procs: int | None = None):
    from toolkit.config import DataConfig

    return DataConfig(train_files=[a._file], format="messages", max_seq_len=MAX_SEQ_LEN, packing=True,
                      num_proc=procs)


def run_prep(a) -> dict:
    tok = child_imports(a.model)
    from toolkit.data.prepare import build_datasets
    from toolkit.data.sources import cache_root

    cfg = data_config(a, a._procs)
    gc.collect()
    exact_peak = reset_peak_rss()
    before = status_kb("VmRSS", "VmHWM", "RssAnon", "RssFile")
    maxrss_self0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    self0 = resource.getrusage(resource.RUSAGE_SELF)
    peaks = RssPeaks()
    peaks.start()
    started = time.perf_counter()
    data = build_datasets(cfg, tok, 0, True)
    seconds = time.perf_counter() - started
    sampled = peaks.stop()
    after = status_kb("VmRSS", "VmHWM", "RssAnon", "RssFile")
    self1 = resource.getrusage(resource.RUSAGE_SELF)
    children1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if exact_peak:
        peak_added = after["VmHWM"] - before["VmRSS"]
    else:  # a process-lifetime peak: only an upper bound for this call when the process peaked earlier
        peak_added = max(self1.ru_maxrss, maxrss_self0) - before["VmRSS"]
    lengths = data.train.table.select_columns(["length"]).with_format("numpy")[:]["length"]
    text = "\n".join(data.lines)
    fill = re.search(r"fill ([\d.]+)%", text)
    truncated = re.search(r"([\d,]+) of [\d,]+ rows truncated", text)
    return {
        "procs": a._procs, "seconds": seconds, "tokens": int(lengths.sum()), "train_rows": len(data.train.table),
        "packed_rows": len(data.train), "fill": float(fill.group(1)) if fill else None,
        "truncated": int(truncated.group(1).replace(",", "")) if truncated else 0,
        "data_lines": data.lines, "warnings": data.warnings, "folder": str(cache_root() / data.fingerprint),
        "rss_before_mb": mb(before["VmRSS"]), "peak_added_mb": mb(peak_added), "peak_exact": exact_peak,
        "anon_peak_added_mb": mb(sampled["RssAnon"] - before["RssAnon"]),
        "file_peak_added_mb": mb(sampled["RssFile"] - before["RssFile"]),
        "rss_held_after_mb": mb(after["VmRSS"] - before["VmRSS"]),
        "children_peak_rss_mb": mb(children1.ru_maxrss) if children1.ru_maxrss > children0.ru_maxrss else None,
        "cpu_seconds_self": round(cpu_seconds(self1) - cpu_seconds(self0), 2),
        "cpu_seconds_children": round(cpu_seconds(children1) - cpu_seconds(children0), 2),
    }


def run_rank(a) -> dict:
    tok = child_imports(a.model)
    import torch
    from torch.utils.data import DataLoader

    from toolkit.data.batching import Collator, EpochSampler
    from toolkit.data.prepare import build_datasets

    cfg = data_config(a)
    gc.collect()
    before = smaps_kb()
    data = build_datasets(cfg, tok, 0, True, prepares=False)
    world = 2  # this is rank 1 of 2; the global batch is micro x accumulation (1) x world, as in train.py
    sampler = EpochSampler(len(data.train), a.micro_batch_size * world, 0)
    loader = DataLoader(data.train, batch_size=a.micro_batch_size, sampler=sampler,
                        collate_fn=Collator(tok.pad_token_id, packed=True), drop_last=True,
                        generator=torch.Generator().manual_seed(0))
    gc.collect()
    built = smaps_kb()
    seen, tokens = 0, 0
    for batch in loader:
        seen += 1
        tokens += batch["input_ids"].numel()
        if seen == a.batches:
            break
    gc.collect()
    after = smaps_kb()

    def file_pages(x):
        return x["USS"] - x["Anonymous"]

    return {"batches": seen, "batch_tokens": tokens, "uss_before_mb": mb(before["USS"]),
            "uss_added_mb": mb(built["USS"] - before["USS"]),
            "anon_added_mb": mb(built["Anonymous"] - before["Anonymous"]),
            "private_file_added_mb": mb(file_pages(built) - file_pages(before)),
            "rss_added_mb": mb(built["Rss"] - before["Rss"]),
            "read_anon_added_mb": mb(after["Anonymous"] - built["Anonymous"]),
            "read_file_added_mb": mb(file_pages(after) - file_pages(built)), "examples": len(data.train)}


def run_lists(a) -> dict:
    child_imports("")
    gc.collect()
    exact_peak = reset_peak_rss()
    before = status_kb("VmRSS", "RssAnon")
    from toolkit.data.prepare import load_prepared

    docs = load_prepared(Path(a._folder), False, "").train.table
    rows = docs.select_columns(["input_ids", "labels"]).to_list()
    gc.collect()
    held = status_kb("VmRSS", "VmHWM", "RssAnon")
    return {"tokens": sum(len(r["input_ids"]) for r in rows), "rss_added_mb": mb(held["VmRSS"] - before["VmRSS"]),
            "anon_added_mb": mb(held["RssAnon"] - before["RssAnon"]),
            "peak_added_mb": mb(held["VmHWM"] - before["VmRSS"]) if exact_peak else None}


def contender(a, who: str, cache: Path, threads: bool | None = None, **kw) -> dict:
    """Run one contender in a fresh process with `cache` as its HF_DATASETS_CACHE; `threads`: the
    tokenizer's own threads on (TOKENIZERS_PARALLELISM unset) or off (false); None: as the caller has it."""
    out = cache.parent / f"{cache.name}-{who}.json"
    cmd = [sys.executable, __file__, "--_run", who, "--model", a.model, "--_out", str(out),
           "--micro-batch-size", str(a.micro_batch_size), "--batches", str(a.batches)]
    for k, v in kw.items():
        cmd += [f"--_{k}", str(v)]
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    if threads is not None:
        env.pop("TOKENIZERS_PARALLELISM", None)
        if not threads:
            env["TOKENIZERS_PARALLELISM"] = "false"
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{who} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(out.read_text())
    result["process_seconds"] = round(time.perf_counter() - started, 1)
    return result


def first_step(a, work: Path, rows_file: Path) -> dict:
    """Seconds from `python -m toolkit train` starting to the end of optimizer step 1."""
    import yaml

    recipe = {
        "output_dir": str(work / "first_step_run"), "overwrite": True, "seed": 0,
        "model": {"path": a.model}, "lora": {"enabled": True},
        "data": {"train_files": [str(rows_file)], "format": "messages", "max_seq_len": MAX_SEQ_LEN, "packing": True,
                 "eval_fraction": 0.0},
        "train": {"micro_batch_size": 1, "max_steps": 1, "log_every_steps": 1},
    }
    (work / "first_step.yaml").write_text(yaml.safe_dump(recipe))
    cache = work / "cache-first-step"
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONUNBUFFERED": "1"}  # log lines arrive when written, so their arrival times mean something
    seen = {}  # when the first line of each kind appeared, seconds from the start
    started = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "toolkit", "train", str(work / "first_step.yaml")], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        kind = line.split(":")[0] if ":" in line[:12] else None
        if kind in ("parameters", "data", "run") and kind not in seen:
            seen[kind] = round(time.time() - started, 1)
    proc.wait()
    wall = time.time() - started
    if proc.returncode != 0:
        sys.exit("toolkit train failed:\n" + "".join(lines)[-3000:])
    rows = [json.loads(line) for line in (work / "first_step_run" / "metrics.jsonl").read_text().splitlines()]
    step1 = next(r for r in rows if r.get("step") == 1 and "loss" in r)
    prepared = re.search(r"prepared in ([\d.]+) s", "".join(lines))
    shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(work / "first_step_run", ignore_errors=True)
    return {"first_step_seconds": round(step1["time"] - started, 1), "process_seconds": round(wall, 1),
            "model_built_at": seen.get("parameters"), "data_ready_at": seen.get("data"),
            "loop_started_at": seen.get("run"), "data_prepared_seconds": float(prepared.group(1)) if prepared else None,
            "loss": step1["loss"]}


# ----------------------------------------------------------------------------- orchestration


def measure(a, n: int, all_procs: int, with_first_step: bool, base: Path) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"n{n}-", dir=base))
    try:
        rows_file = work / "rows.jsonl"
        gen = write_rows(rows_file, n, a.model, a.mean_tokens, a.sigma, a.seed)
        print(f"N={n}: wrote {gen['file_mb']} MB in {gen['write_seconds']} s", file=sys.stderr)
        # num_proc 1 on one core (the tokenizer's threads off), num_proc P (the toolkit turns them off
        # itself), and num_proc 1 with the tokenizer's threads on (what a user who sets num_proc: 1 gets)
        runs = {"p1": (1, False), "pall": (all_procs, None), "p1_threads": (1, True)}
        prep = {k: [] for k in runs}
        for r in range(a.repeats):  # interleaved, so drift in the machine's speed hits all alike
            for key, (procs, threads) in runs.items():
                cache = work / f"cache-{key}-{r}"
                res = contender(a, "prep", cache, threads=threads, file=rows_file, procs=procs)
                prep[key].append(res)
                print(f"N={n}: prep {key} (num_proc={procs}): {res['seconds']:.1f} s, "
                      f"{res['tokens'] / res['seconds']:,.0f} tok/s, "
                      f"peak +{res['peak_added_mb']} MB (children {res['children_peak_rss_mb']} MB)", file=sys.stderr)
                if not (key == "p1" and r == 0):
                    shutil.rmtree(cache, ignore_errors=True)  # only the first P=1 cache is read again
        kept = work / "cache-p1-0"
        rank = contender(a, "rank", kept, file=rows_file)
        print(f"N={n}: non-main rank: USS +{rank['uss_added_mb']} MB (anonymous +{rank['anon_added_mb']} MB); "
              f"reading {rank['batches']} batches: anonymous +{rank['read_anon_added_mb']} MB, "
              f"file pages +{rank['read_file_added_mb']} MB", file=sys.stderr)
        lists = contender(a, "lists", work / "cache-lists", folder=prep["p1"][0]["folder"])
        print(f"N={n}: list reference: RSS +{lists['rss_added_mb']} MB", file=sys.stderr)
        first = first_step(a, work, rows_file) if with_first_step else None
        if first:
            print(f"N={n}: first optimizer step after {first['first_step_seconds']} s", file=sys.stderr)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)

    one, many = prep["p1"][0], prep["pall"][0]
    tokens = one["tokens"]
    assert all(p["tokens"] == tokens for ps in prep.values() for p in ps) and lists["tokens"] == tokens
    per_m = 1e6 / tokens
    best = {p: min(x["seconds"] for x in v) for p, v in prep.items()}
    main_peak = max(x["peak_added_mb"] for x in prep["p1"]) * per_m
    list_ref = lists["rss_added_mb"] * per_m
    return {
        "rows": n, "tokens": tokens, "train_rows": one["train_rows"],
        "mean_row_tokens": round(tokens / one["train_rows"], 1),
        "truncated_rows": one["truncated"], "packed_rows": one["packed_rows"], "generation": gen,
        "procs_all": all_procs, "repeats": a.repeats,
        "seconds_p1": round(best["p1"], 2), "seconds_pall": round(best["pall"], 2),
        "seconds_p1_threads": round(best["p1_threads"], 2),
        "seconds_all_repeats": {p: [round(x["seconds"], 2) for x in v] for p, v in prep.items()},
        "tokens_per_second_p1": round(tokens / best["p1"]), "tokens_per_second_pall": round(tokens / best["pall"]),
        "tokens_per_second_p1_threads": round(tokens / best["p1_threads"]),
        "speedup": round(best["p1"] / best["pall"], 3),
        "speedup_vs_p1_threads": round(best["p1_threads"] / best["pall"], 3),
        "cpu_seconds_p1": {"self": one["cpu_seconds_self"], "children": one["cpu_seconds_children"]},
        "cpu_seconds_p1_threads": prep["p1_threads"][0]["cpu_seconds_self"],
        "cpu_seconds_pall": {"self": many["cpu_seconds_self"], "children": many["cpu_seconds_children"]},
        "main_peak_added_mb_p1": max(x["peak_added_mb"] for x in prep["p1"]),
        "main_peak_mb_per_m_tokens": round(main_peak, 2),
        "main_anon_peak_mb_per_m_tokens": round(max(x["anon_peak_added_mb"] for x in prep["p1"]) * per_m, 2),
        "main_file_peak_mb_per_m_tokens": round(max(x["file_peak_added_mb"] for x in prep["p1"]) * per_m, 2),
        "main_anon_peak_added_mb_p1": max(x["anon_peak_added_mb"] for x in prep["p1"]),
        "main_file_peak_added_mb_p1": max(x["file_peak_added_mb"] for x in prep["p1"]),
        "main_peak_exact": one["peak_exact"],
        "main_peak_added_mb_pall": many["peak_added_mb"], "children_peak_rss_mb_pall": many["children_peak_rss_mb"],
        "main_rss_before_mb": one["rss_before_mb"],
        "list_reference_rss_added_mb": lists["rss_added_mb"], "list_reference_anon_added_mb": lists["anon_added_mb"],
        "list_reference_peak_added_mb": lists["peak_added_mb"],
        "list_reference_mb_per_m_tokens": round(list_ref, 2),
        "main_peak_vs_list": round(main_peak / list_ref, 3) if list_ref > 0 else None,
        "rank_uss_added_mb": rank["uss_added_mb"], "rank_anon_added_mb": rank["anon_added_mb"],
        "rank_private_file_added_mb": rank["private_file_added_mb"], "rank_rss_added_mb": rank["rss_added_mb"],
        "rank_read_anon_added_mb": rank["read_anon_added_mb"], "rank_read_file_added_mb": rank["read_file_added_mb"],
        "rank_uss_vs_list": round(rank["uss_added_mb"] / lists["rss_added_mb"], 3)
        if lists["rss_added_mb"] > 0 else None,
        "rank_batches": rank["batches"], "micro_batch_size": a.micro_batch_size,
        "fill": one["fill"], "data_lines": one["data_lines"], "warnings": one["warnings"],
        "first_step": first,
    }


def measure_large(a, n: int, all_procs: int, base: Path) -> dict:
    """--large N: only what a size too big for the comparisons needs: preparation with all cores
    (time, peak RSS of the process and of its largest worker, the lowest MemAvailable the host
    saw while it ran) and the non-main rank. No list reference (it would need ~80 MB per million
    tokens) and no num_proc 1 runs."""
    work = Path(tempfile.mkdtemp(prefix=f"large{n}-", dir=base))
    low = {"MemAvailable": None}

    def watch(stop: threading.Event):
        while not stop.wait(1.0):
            with open("/proc/meminfo") as f:
                kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
            low["MemAvailable"] = kb if low["MemAvailable"] is None else min(low["MemAvailable"], kb)

    try:
        rows_file = work / "rows.jsonl"
        gen = write_rows(rows_file, n, a.model, a.mean_tokens, a.sigma, a.seed)
        print(f"N={n}: wrote {gen['file_mb']} MB in {gen['write_seconds']} s", file=sys.stderr)
        stop = threading.Event()
        watcher = threading.Thread(target=watch, args=(stop,), daemon=True)
        watcher.start()
        cache = work / "cache-pall"
        try:
            prep = contender(a, "prep", cache, file=rows_file, procs=all_procs)
        finally:
            stop.set()
            watcher.join()
        folder = Path(prep["folder"])
        disk_mb = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20
        print(f"N={n}: prep num_proc={all_procs}: {prep['seconds']:.1f} s, peak +{prep['peak_added_mb']} MB "
              f"(children {prep['children_peak_rss_mb']} MB), {disk_mb:,.0f} MB on disk", file=sys.stderr)
        rank = contender(a, "rank", cache, file=rows_file)
        print(f"N={n}: non-main rank: USS +{rank['uss_added_mb']} MB", file=sys.stderr)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    tokens = prep["tokens"]
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    return {"rows": n, "tokens": tokens, "train_rows": prep["train_rows"], "generation": gen, "procs_all": all_procs,
            "seconds_pall": round(prep["seconds"], 1), "tokens_per_second_pall": round(tokens / prep["seconds"]),
            "main_peak_added_mb_pall": prep["peak_added_mb"], "children_peak_rss_mb_pall": prep["children_peak_rss_mb"],
            "mem_total_mb": mb(total),
            "mem_available_low_mb": mb(low["MemAvailable"]) if low["MemAvailable"] is not None else None,
            "prepared_disk_mb": round(disk_mb), "fill": prep["fill"], "packed_rows": prep["packed_rows"],
            "rank_uss_added_mb": rank["uss_added_mb"], "rank_anon_added_mb": rank["anon_added_mb"],
            "rank_private_file_added_mb": rank["private_file_added_mb"],
            "rank_read_anon_added_mb": rank["read_anon_added_mb"],
            "rank_read_file_added_mb": rank["read_file_added_mb"],
            "data_lines": prep["data_lines"]}


def goals(results: list[dict]) -> list[tuple[str, bool | None, str]]:
    """(goal, met (None: not measurable in this run), the figures)."""
    out = []
    small, large = results[0], results[-1]
    if len(results) > 1:
        grow = (large["rank_uss_added_mb"] - small["rank_uss_added_mb"]) / max(small["rank_uss_added_mb"], 1e-9)
        out.append((f"non-main rank USS at N={large['rows']:,} within 10% of N={small['rows']:,}", abs(grow) <= 0.10,
                    f"{large['rank_uss_added_mb']} vs {small['rank_uss_added_mb']} MB ({grow:+.1%})"))
    else:
        out.append(("non-main rank USS does not grow with N", None, "needs two sizes (--rows A B)"))
    for r in results:
        out.append((f"N={r['rows']:,}: non-main rank USS under 300 MB above baseline", r["rank_uss_added_mb"] < 300,
                    f"{r['rank_uss_added_mb']} MB (anonymous {r['rank_anon_added_mb']}, "
                    f"mapped file pages {r['rank_private_file_added_mb']}); then reading {r['rank_batches']} "
                    f"batches: anonymous +{r['rank_read_anon_added_mb']} MB, mapped file pages "
                    f"+{r['rank_read_file_added_mb']} MB"))
        out.append((f"N={r['rows']:,}: main peak RSS added (num_proc 1) <= 16 MB per million tokens",
                    r["main_peak_mb_per_m_tokens"] <= 16,
                    f"{r['main_peak_mb_per_m_tokens']} MB/M: {r['main_peak_added_mb_p1']} MB over "
                    f"{r['tokens']:,} tokens "
                    f"(sampled peaks: heap {r['main_anon_peak_added_mb_p1']} MB, mapped files "
                    f"{r['main_file_peak_added_mb_p1']} MB; list pipeline {r['list_reference_mb_per_m_tokens']} MB/M)"))
        cpu = (f"cpu seconds: num_proc 1 {r['cpu_seconds_p1']['self']}, num_proc {r['procs_all']} "
               f"{r['cpu_seconds_pall']['self']} + workers {r['cpu_seconds_pall']['children']}; against num_proc 1 "
               f"with the tokenizer's threads ({r['seconds_p1_threads']} s, {r['cpu_seconds_p1_threads']} cpu s): "
               f"{r['speedup_vs_p1_threads']}x")
        if r["procs_all"] == 2:
            out.append((f"N={r['rows']:,}: num_proc 2 >= 1.7x num_proc 1", r["speedup"] >= 1.7,
                        f"{r['speedup']}x ({r['seconds_p1']} s vs {r['seconds_pall']} s; {cpu})"))
        else:
            out.append((f"N={r['rows']:,}: num_proc 2 >= 1.7x num_proc 1", None,
                        f"{r['speedup']}x with num_proc {r['procs_all']}; the goal is stated for 2 cores"))
        out.append((f"N={r['rows']:,}: packing fill >= 97%", r["fill"] is not None and r["fill"] >= 97,
                    f"{r['fill']}%"))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[20_000, 100_000])
    p.add_argument("--model", help="real model folder (default: printed by the real-model fetch script)")
    p.add_argument("--first-step", action="store_true", help="also time `toolkit train` to step 1 (smallest N)")
    p.add_argument("--mean-tokens", type=float, default=790.0)
    p.add_argument("--sigma", type=float, default=0.6, help="spread of the lognormal row lengths")
    p.add_argument("--micro-batch-size", type=int, default=4, help="the non-main rank's DataLoader batch")
    p.add_argument("--batches", type=int, default=20, help="batches the non-main rank reads")
    p.add_argument("--repeats", type=int, default=1, help="prep processes per num_proc (best time is kept)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", default=None, help="where the temporary files go (default: the system temp)")
    p.add_argument("--keep", action="store_true", help="keep the temporary files")
    p.add_argument("--large", type=int, metavar="N",
                   help="only prepare N rows with all cores and measure a non-main rank (e.g. 1000000)")
    for hidden in ("_run", "_out", "_file", "_folder"):
        p.add_argument(f"--{hidden}", help=argparse.SUPPRESS)
    p.add_argument("--_procs", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a._run:
        result = {"prep": run_prep, "rank": run_rank, "lists": run_lists}[a._run](a)
        Path(a._out).write_text(json.dumps(result))
        return

    started = time.perf_counter()
    a.model = str(Path(a.model or default_model()).resolve())
    all_procs = len(os.sched_getaffinity(0))
    results = []
    base = Path(tempfile.mkdtemp(prefix="data_scale_", dir=a.work_dir))
    if a.large:
        try:
            result = measure_large(a, a.large, all_procs, base)
        finally:
            if not a.keep:
                shutil.rmtree(base, ignore_errors=True)
        result.update(date=time.strftime("%Y-%m-%d"), host=f"{platform.node()} ({all_procs} cores)")
        print(json.dumps(result), flush=True)
        print(f"| {result['date']} | {result['host']} | {result['rows']:,} | {result['tokens']:,} | "
              f"{result['seconds_pall']} s ({result['tokens_per_second_pall']:,} tok/s, P={all_procs}) | "
              f"main +{result['main_peak_added_mb_pall']} MB, "
              f"largest worker {result['children_peak_rss_mb_pall']} MB | "
              f"lowest MemAvailable {result['mem_available_low_mb']} of {result['mem_total_mb']} MB | "
              f"{result['prepared_disk_mb']:,} MB on disk | non-main USS +{result['rank_uss_added_mb']} MB | "
              f"{result['fill']}% |")
        print(f"data_scale.py took {time.perf_counter() - started:.0f} s", file=sys.stderr)
        return
    try:
        for n in sorted(a.rows):
            result = measure(a, n, all_procs, a.first_step and n == min(a.rows), base)
            result.update(date=time.strftime("%Y-%m-%d"), host=f"{platform.node()} ({all_procs} cores)",
                          python=platform.python_version(),
                          tokenizers_parallelism=os.environ.get("TOKENIZERS_PARALLELISM", "unset"))
            results.append(result)
            print(json.dumps(result), flush=True)
    finally:
        if a.keep:
            print(f"kept {base}", file=sys.stderr)
        else:
            shutil.rmtree(base, ignore_errors=True)
    print()
    for goal, met, figures in goals(results):
        print(f"goal {'MET    ' if met else 'NOT MET' if met is not None else 'n/a    '} {goal}: {figures}")
    print()
    print("| date | host | N | tokens | tok/s P=1 | tok/s P=all | speedup | tok/s P=1, tokenizer threads | "
          "main peak MB/M tokens | list reference MB/M tokens | non-main USS MB | fill | first step s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        fs = r["first_step"]["first_step_seconds"] if r["first_step"] else "-"
        print(f"| {r['date']} | {r['host']} | {r['rows']:,} | {r['tokens']:,} | {r['tokens_per_second_p1']:,} | "
              f"{r['tokens_per_second_pall']:,} (P={r['procs_all']}) | {r['speedup']}x | "
              f"{r['tokens_per_second_p1_threads']:,} ({r['speedup_vs_p1_threads']}x) | "
              f"{r['main_peak_mb_per_m_tokens']} ({r['main_peak_vs_list']}x list) | "
              f"{r['list_reference_mb_per_m_tokens']} | "
              f"{r['rank_uss_added_mb']} ({r['rank_uss_vs_list']}x list) | {r['fill']}% | {fs} |")
    print(f"data_scale.py took {time.perf_counter() - started:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
