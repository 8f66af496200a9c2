"""Distillation (rl.method=distill) equal to TRL 1.16's DistillationTrainer (issue 51): TRL's own trainer, built
from a DistillationConfig with a student and a teacher folder, and our Distill objective are handed the same
prompts and completions (TRL's compute_loss on the generation batch it would have built, ours in place of
sampling); from there each runs its own code: the teacher's forward, both distributions at the temperature, the
generalized JSD (TRL's chunked kernel, in its torch tiles on a CPU), the mean over the completion tokens, the
student's entropy, and the gradient. All compared within 1e-5 for beta 0, 0.5, 1, temperatures 0.7 and 1,
train.loss full and chunked, full fine-tuning and LoRA; on the tiny models in CI and, as a slow test, on
SmolLM2-135M-Instruct as the teacher of a small random student with its vocabulary.

Then the careless-user cases: a teacher of another vocabulary or tokenizer, a missing one, a reward or policy-
gradient key under distill, beta out of range, each refused in one line before training."""

import copy
import json
import warnings
from pathlib import Path

import pytest
import torch

from families import build_family, small_student, token_drawer
from helpers import ROOT, run_toolkit, user_error_line, write_jsonl, write_recipe

trl = pytest.importorskip("trl")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

PROMPTS, MAX_NEW, PROMPT_LENGTH = 4, 7, 5


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm2", marks=[pytest.mark.slow,
                                                                              pytest.mark.real_model])])
def pair(request, tmp_path_factory):
    """(student, teacher) folders: two tiny random Llama 3 models of one tokenizer in CI; by hand (`-m slow`) a
    small random student with SmolLM2's vocabulary and SmolLM2-135M-Instruct as its teacher."""
    root = tmp_path_factory.mktemp("distill_trl")
    if request.param == "smollm2":
        teacher = request.getfixturevalue("real_model_dir")
        return small_student(teacher, root / "student"), teacher
    return build_family("llama3", root / "student", seed=3), build_family("llama3", root / "teacher", seed=4)


@pytest.fixture(scope="module")
def batch(pair):
    """PROMPTS prompts of PROMPT_LENGTH tokens and one completion each: random tokens, some ending in a stop token,
    one cut at MAX_NEW, one a lone stop token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pair[0])
    tokens = token_drawer(tokenizer)
    eos = tokenizer.eos_token_id
    prompts = [tokens(PROMPT_LENGTH) for _ in range(PROMPTS)]
    completions = [tokens(3) + [eos], tokens(MAX_NEW), [eos], tokens(5) + [eos]]
    return {"tokenizer": tokenizer, "prompt_ids": prompts, "completions": completions,
            "texts": [tokenizer.decode(p) for p in prompts]}


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                           "gate_proj", "up_proj", "down_proj"],
                      task_type="CAUSAL_LM")


def trl_trainer(tmp_path, pair, batch, *, lora, beta, temperature):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DistillationConfig, DistillationTrainer

    args = DistillationConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False, seed=0,
                              per_device_train_batch_size=PROMPTS, max_completion_length=MAX_NEW,
                              gradient_accumulation_steps=1, learning_rate=1e-6, save_strategy="no", logging_steps=1,
                              gradient_checkpointing=False, beta=beta, temperature=temperature)
    student = AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(pair[1], dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DistillationTrainer(model=student, teacher_model=teacher, args=args,
                                      train_dataset=Dataset.from_list([{"prompt": t} for t in batch["texts"]]),
                                      processing_class=batch["tokenizer"], peft_config=lora_config() if lora else None)
    if lora:
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for name, parameter in trainer.model.named_parameters():
                if "lora_B" in name:  # B = 0 would leave A without a gradient
                    parameter.copy_(0.05 * torch.randn(parameter.shape, generator=g))
    return trainer


def trl_inputs(batch) -> dict:
    """The generation batch TRL's _generate_and_score_completions builds from these prompts and completions."""
    pad = batch["tokenizer"].pad_token_id
    width = max(len(c) for c in batch["completions"])
    ids = torch.full((PROMPTS, width), pad, dtype=torch.long)
    mask = torch.zeros((PROMPTS, width), dtype=torch.long)
    for i, c in enumerate(batch["completions"]):
        ids[i, :len(c)], mask[i, :len(c)] = torch.tensor(c), 1
    return {"prompt_ids": torch.tensor(batch["prompt_ids"]), "prompt_mask": torch.ones((PROMPTS, PROMPT_LENGTH),
                                                                                           dtype=torch.long),
            "completion_ids": ids, "completion_mask": mask, "num_items_in_batch": mask.sum()}


def ours(pair, batch, trainer, *, loss, beta, temperature):
    """Our objective over a copy of TRL's student (the same weights, adapter included), the teacher loaded from
    its folder by our own loader."""
    from accelerate import Accelerator

    from toolkit.backends import Backend
    from toolkit.config import ModelConfig, RLConfig
    from toolkit.training.distill import Distill, load_teacher
    from toolkit.training.loss import use_token_loss

    model = copy.deepcopy(trainer.model)
    use_token_loss(model, loss, chunk_tokens=5)
    backend = Backend()
    backend.accelerator = Accelerator(cpu=True)
    cfg = RLConfig(method="distill", teacher=str(pair[1]), num_generations=1, max_new_tokens=MAX_NEW, beta=beta,
                   temperature=temperature)
    teacher = load_teacher(cfg, ModelConfig(path=str(pair[0])), torch.float32)
    use_token_loss(teacher, loss, chunk_tokens=5)  # its targets' distributions the same way, as a run does
    objective = Distill(cfg, teacher, batch["tokenizer"], backend, 0, ["train"], ["train"])
    objective.after_prepare()
    objective.stops = [batch["tokenizer"].eos_token_id]
    objective.generate = lambda model, prompts, seeds: [list(c) for c in batch["completions"]]
    micro = {"prompt_ids": batch["prompt_ids"], "keys": torch.tensor([[0, i] for i in range(PROMPTS)]),
             "fields": [{"prompt": t} for t in batch["texts"]]}
    return model, objective, micro


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


CASES = {  # (lora, train.loss, beta, temperature)
    "reverse-kl-T1-full": (False, "full", 1.0, 1.0),
    "forward-kl-T0.7-chunked": (False, "chunked", 0.0, 0.7),
    "jsd-0.5-T0.9-chunked": (False, "chunked", 0.5, 0.9),
    "lora-jsd-0.3-T0.7-full": (True, "full", 0.3, 0.7),
}


@pytest.mark.parametrize("name", list(CASES))
def test_distillation_equals_trls_trainer_from_completions_to_gradients(tmp_path, pair, batch, name):
    lora, loss, beta, temperature = CASES[name]
    trainer = trl_trainer(tmp_path, pair, batch, lora=lora, beta=beta, temperature=temperature)
    model, objective, micro = ours(pair, batch, trainer, loss=loss, beta=beta, temperature=temperature)
    trainer.model.train()
    model.train()
    made = objective.step_batches(model, [micro], step=1)
    assert len(made) == 1
    mine = made[0]
    theirs = trl_inputs(batch)
    assert objective.units(mine) == int(theirs["num_items_in_batch"]) == sum(len(c) for c in batch["completions"])

    trainer.current_gradient_accumulation_steps = 1
    loss_theirs = trainer.compute_loss(trainer.model, theirs)
    loss_theirs.backward()
    loss_mine = objective.loss_sum(model, mine) / objective.units(mine)
    loss_mine.backward()
    real = "smollm2" in str(pair[1]).lower()  # float32 sums over a 49,152-token vocabulary: 1e-4 there
    assert loss_mine.item() > 0
    assert loss_mine.item() == pytest.approx(loss_theirs.item(), rel=1e-4 if real else 1e-5, abs=1e-7)
    sums = objective.step_metrics(torch.device("cpu"))
    entropy = trainer._metrics["train"]["entropy"][-1]
    assert sums["entropy"].item() / sums["tokens"].item() == pytest.approx(entropy, rel=1e-5)
    g_theirs, g_mine = grads(trainer.model), grads(model)
    assert g_theirs.keys() == g_mine.keys() and g_mine
    worst = 0.0
    for key in g_mine:
        difference = (g_mine[key] - g_theirs[key]).norm() / g_theirs[key].norm().clamp(min=1e-12)
        assert difference < (1e-4 if real else 1e-5), (key, difference.item())
        worst = max(worst, difference.item())
    print(f"{name}: loss {loss_mine.item():.6g} vs TRL {loss_theirs.item():.6g}; worst relative gradient "
          f"difference {worst:.2e}")


# --- careless users: one line, before training

def recipe(tmp_path, teacher_folder, **rl):
    rows = [json.loads(line) for line in open(ROOT / "examples" / "data" / "tasks_messages_train.jsonl")][:8]
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": r["messages"][:-1]} for r in rows])
    return write_recipe(tmp_path / "distill.yaml", output_dir=str(tmp_path / "run"), seed=1,
                        model={"preset": "tiny-llama-mini"},
                        data={"train_files": [str(tmp_path / "prompts.jsonl")], "format": "prompt",
                              "max_seq_len": 64},
                        rl={"method": "distill", "teacher": str(teacher_folder), "max_new_tokens": 4, **rl},
                        train={"micro_batch_size": 2, "max_steps": 1})


@pytest.mark.launch
@pytest.mark.parametrize("rl, expected", [
    ({"rewards": ["exact_match"]}, "rl.rewards: a grpo/rloo setting: distill's loss is the divergence to rl.teacher"),
    ({"loss_type": "grpo"}, "rl.loss_type: a grpo/rloo setting"),
    ({"num_iterations": 2}, "rl.num_iterations: a grpo/rloo setting"),
    ({"beta": 1.5}, "rl.beta: distill: in [0, 1]"),
    ({"teacher": None}, "rl.teacher: rl.method=distill needs a teacher"),
    ({"sampler": "vllm"}, "rl.sampler: distill samples with the student itself; vllm: grpo"),
])
def test_contradicting_distillation_keys_are_refused_at_load(tmp_path, rl, expected):
    path = recipe(tmp_path, tmp_path / "nowhere", **rl)
    proc = run_toolkit("config", "show", path)
    assert proc.returncode != 0
    assert expected in user_error_line(proc), proc.stderr[-2000:]


@pytest.mark.launch
def test_a_teacher_that_is_missing_or_of_another_vocabulary_is_refused_before_the_model_loads(tmp_path):
    proc = run_toolkit("train", recipe(tmp_path, tmp_path / "nowhere"))
    assert proc.returncode != 0
    assert user_error_line(proc) == f"error: rl.teacher: folder not found: {tmp_path / 'nowhere'}", proc.stderr[-2000:]
    other = build_family("llama3", tmp_path / "llama3")  # another tokenizer and vocabulary than the preset's
    proc = run_toolkit("train", recipe(tmp_path, other))
    assert proc.returncode != 0
    line = user_error_line(proc)
    assert line.startswith(f"error: rl.teacher: {other} has a vocabulary of") and "student's" in line, line
    assert not (tmp_path / "run" / "final").exists()


# --- launched: the loop on every backend, resume, and learning

STEPS = 4


def preset_teacher(folder: Path, seed: int = 9) -> Path:
    """A random model of the tiny-llama preset (twice tiny-llama-mini's width and depth) with the presets' byte
    tokenizer: a teacher for a tiny-llama-mini student."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.model.load import PRESETS, build_byte_tokenizer

    config = LlamaConfig(**json.loads((PRESETS / "tiny-llama.json").read_text()))
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)
    build_byte_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    rows = [json.loads(line) for line in open(ROOT / "examples" / "data" / "tasks_messages_train.jsonl")]
    write_jsonl(root / "train.jsonl", [{"prompt": r["messages"][:-1]} for r in rows[:16]])
    write_jsonl(root / "eval.jsonl", [{"prompt": r["messages"][:-1]} for r in rows[100:105]])  # 5: padding on 2 ranks
    preset_teacher(root / "teacher")
    return root


def launch_recipe(workdir, name, layout="single", **extra):
    from objective_runs import sectioned_recipe

    sections = {
        "output_dir": str(workdir / name), "seed": 5, "model": {"preset": "tiny-llama-mini"},
        "data": {"train_files": [str(workdir / "train.jsonl")], "eval_files": [str(workdir / "eval.jsonl")],
                 "format": "prompt", "max_seq_len": 64},
        "rl": {"method": "distill", "teacher": str(workdir / "teacher"), "num_generations": 2, "max_new_tokens": 8,
               "temperature": 0.9, "beta": 0.5, "log_completions": True},
        "train": {"micro_batch_size": 2 if layout == "single" else 1, "gradient_accumulation_steps": 2,
                  "max_steps": STEPS, "learning_rate": 1e-2, "eval_every_steps": 2, "log_every_steps": 1},
        "checkpoint": {"every_steps": 2, "keep_last": 10},
    }
    return sectioned_recipe(workdir / f"{name}.yaml", sections, **extra)


KEYS = ("loss", "eval_loss", "grad_norm", "entropy", "completion_length")


@pytest.fixture(scope="module")
def single(workdir):
    from objective_runs import trained

    return trained(workdir, "single", launch_recipe(workdir, "single"))


@pytest.mark.launch
def test_one_process_distills_the_teacher(single):
    from helpers import read_metrics

    run, log = single
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    evals = [r["eval_loss"] for r in rows if r.get("eval_loss") is not None]
    assert len(evals) == 3 and evals[-1] < evals[0], evals  # the held-out divergence to the teacher falls
    assert all(r["loss"] > 0 and r["entropy"] > 0 and r["completion_length"] > 0 for r in rows[1:])
    assert "distill: generalized JSD (beta 0.5" in log and "a whole copy on every rank" in log
    table = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert len(table) == STEPS * 4 * 2 and set(table[0]) == {"step", "prompt", "completion"}
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(run / "final") is not None  # the student, as a causal LM


@pytest.mark.launch
@pytest.mark.parametrize("layout", ["ddp", "fsdp", "zero3"])
def test_two_processes_equal_one(workdir, single, layout):
    from objective_runs import assert_runs_close, trained

    run, log = trained(workdir, layout, launch_recipe(workdir, f"run_{layout}", layout))
    assert_runs_close(single[0], run, KEYS, STEPS)
    held = {"ddp": "a whole copy on every rank", "fsdp": "sharded across the ranks (FSDP2)",
            "zero3": "sharded across the ranks (a ZeRO-3 engine of its own)"}[layout]
    assert held in log
    said = log.split("distill: between forwards the teacher's weights take ", 1)[1].split(")", 1)[0]
    held, whole = float(said.split(" MiB")[0]), float(said.split("whole model: ")[1].split(" MiB")[0])
    assert (held < 0.52 * whole) == (layout != "ddp"), said  # sharded: half on each of 2 ranks, after a forward too


@pytest.mark.launch
def test_sigkill_mid_run_resumes_bitwise(workdir, single):
    from objective_runs import assert_sigkill_resumes_bitwise

    # killed by the fault seam while step 2 samples (a run this small finishes before a poll sees step 2),
    # after step 1's checkpoint
    path = launch_recipe(workdir, "killed", checkpoint__every_steps=1)
    run = assert_sigkill_resumes_bitwise(workdir, path, single[0], fault="generate:KILL")
    table = (run / "completions.jsonl").read_text().splitlines()
    assert table == (single[0] / "completions.jsonl").read_text().splitlines()  # the killed step's rows dropped


def test_estimate_counts_the_teacher_sharded_under_zero3_and_fsdp_and_whole_otherwise(tmp_path, capsys):
    """`toolkit estimate --recipe` of a distillation recipe: a teacher column, whole under DDP and ZeRO-1/2, its
    weights over the GPUs under ZeRO-3 and FSDP full-shard, and its forward among the forward passes."""
    from toolkit.cli import main

    teacher = preset_teacher(tmp_path / "teacher")
    path = recipe(tmp_path, teacher)
    capsys.readouterr()
    assert main(["estimate", "--recipe", str(path), "--gpus", "4", "--gpu-memory", "80", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["strategy"]: r["gpu_bytes"] for r in report["strategies"]}
    from transformers import AutoModelForCausalLM

    from toolkit.backends.sizing import BYTES
    from toolkit.config import load_recipe

    e = BYTES[load_recipe(path).train.precision]  # the teacher is held in train.precision's dtype
    model = AutoModelForCausalLM.from_pretrained(teacher)
    weights = sum(p.numel() for p in model.parameters()) * e
    layer = sum(p.numel() for p in model.model.layers[0].parameters()) * e
    whole, sharded = rows["DDP"]["teacher"], rows["ZeRO-3"]["teacher"]
    assert whole == rows["ZeRO-2"]["teacher"] > weights  # and its log-probabilities at a micro-batch's targets
    assert whole - sharded == pytest.approx(weights * 3 / 4 - 2 * layer, rel=0.01)  # a quarter, 2 layers gathered
    assert rows["FSDP full-shard"]["teacher"] == sharded
    assert all(r["total"] >= r["teacher"] > 0 for r in rows.values())
    assert main(["estimate", "--recipe", str(path), "--gpus", "4", "--gpu-memory", "80"]) == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.startswith("GiB per GPU"))
    assert "frozen" in header and "the teacher " in text and "rl: teacher (rl.teacher):" in text


@pytest.mark.launch
def test_a_teacher_that_is_not_a_causal_lm_is_refused_before_the_model_loads(tmp_path):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from toolkit.model.load import PRESETS, build_byte_tokenizer

    folder = tmp_path / "scorer"
    config = LlamaConfig(**json.loads((PRESETS / "tiny-llama-mini.json").read_text()), num_labels=1)
    LlamaForSequenceClassification(config).save_pretrained(folder)
    build_byte_tokenizer().save_pretrained(folder)
    proc = run_toolkit("train", recipe(tmp_path, folder))
    assert user_error_line(proc) == (f"error: rl.teacher: {folder} is a LlamaForSequenceClassification, not a causal "
                                     "LM (the teacher's next-token distribution is what the student learns)")


@pytest.mark.launch
def test_a_teacher_under_zero3_with_parameters_on_nvme_is_refused_before_it_loads(workdir):
    """Its swapper would set up in the student's nvme_path, which DeepSpeed clears first: refused in one line,
    before the teacher loads."""
    import subprocess

    from helpers import accelerate_launch, launch_config_for

    path = launch_recipe(workdir, "nvme", "zero3")
    command = accelerate_launch(launch_config_for("zero3_nvme", workdir)) + ["toolkit", "train", str(path)]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert user_error_line(proc, launched=True).startswith(
        "error: rl.teacher: ZeRO-3 with offload_param on NVMe cannot hold a second model"), proc.stderr[-2000:]
