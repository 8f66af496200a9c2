"""train.optim and train.lr_scheduler_type, end to end.

Optimizers: each trains 4 steps of helpers.layout_recipe (global batch 8, checkpoints every 2 steps) on one process
and under the backends it accepts; the losses of every step equal one process's within 1e-4 (DDP, FSDP2 and
ZeRO-3 x 2 processes). A run killed after step 3 and resumed from its step-2 checkpoint (same layout) ends
bitwise where the uninterrupted run ends; a checkpoint moves to another layout through its portable state, the
optimizer's own state tensors (8-bit ones included) read back bitwise. Pairings that cannot work are one line
before the model loads.

Schedules: the learning rate of every step of a whole run equals `transformers.get_scheduler`'s for the same
settings, a run resumed mid-warmup and mid-decay included; every schedule name against get_scheduler over a
state-dict resume in-process.
"""

import json
import math

import pytest
import torch
from objective_runs import assert_sigkill_resumes_bitwise
from safetensors.torch import load_file

from toolkit.config import Recipe
from toolkit.errors import ToolkitError
from toolkit.optim import build, optimizers, schedules
from toolkit.storage.portable import flat_state

from helpers import (
    finish,
    layout_command,
    layout_recipe,
    load_weights,
    read_metrics,
    run_toolkit,
    start,
    user_error_line,
    write_layout_data,
)

STEPS = 4
# momentum: SGD with a state to carry (plain SGD keeps none)
ARGS = {"sgd": {"momentum": 0.9}}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return write_layout_data(tmp_path_factory.mktemp("optim"))


def recipe(work, name, layout, optim, **extra):
    train = {"train__max_steps": STEPS, "train__optim": optim, "train__optim_args": ARGS.get(optim, {}),
             "train__eval_every_steps": 0, "checkpoint__every_steps": 2}
    return layout_recipe(work, name, layout, **{**train, **extra})


@pytest.fixture(scope="module")
def optim_run(work):
    """`get(optim, layout)`: the run folder of `optim` trained without interruption under `layout`, once a module."""
    done = {}

    def get(optim: str, layout: str):
        name = f"{optim}_{layout}"
        if name not in done:
            rc, out, err = finish(start(layout_command(work, layout, recipe(work, name, layout, optim))))
            assert rc == 0, err[-3000:]
            assert f"run: optimizer {optim} (" in err, err[-3000:]
            done[name] = work / name
        return done[name]

    return get


def losses(run):
    return {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r}


BACKENDS = [("sgd", "fsdp"), ("sgd", "zero3"), ("adafactor", "ddp"), ("adamw_8bit", "ddp"), ("muon", "ddp"),
            ("adamw_torch_fused", "zero3"), ("paged_adamw_8bit", "ddp"), ("lion_8bit", "ddp"), ("sgd", "ddp"),
            ("adamw_torch_fused", "fsdp"), ("paged_adamw_32bit", "ddp"), ("lion_32bit", "ddp")]
IN_CI = BACKENDS[:5]  # the rest by hand: -m slow


@pytest.mark.launch
@pytest.mark.parametrize("optim,layout", [b if b in IN_CI else pytest.param(*b, marks=pytest.mark.slow)
                                          for b in BACKENDS], ids=[f"{o}-{b}" for o, b in BACKENDS])
def test_an_optimizer_learns_the_same_under_each_backend_it_accepts(optim, layout, optim_run):
    one, other = losses(optim_run(optim, "single")), losses(optim_run(optim, layout))
    assert sorted(one) == sorted(other) == list(range(1, STEPS + 1))
    assert one[STEPS] < one[1]  # it learns
    for step in one:
        assert other[step] == pytest.approx(one[step], rel=1e-4), (step, one, other)
    a, b = load_weights(optim_run(optim, "single") / "final"), load_weights(optim_run(optim, layout) / "final")
    # Muon orthogonalises each update in bf16 (torch's Newton-Schulz): the order of the gradient's float sums moves
    # its matrices by bf16 rounding (seen: 1.5e-3 of weights ~0.08; the losses stay within 1e-6)
    atol = 3e-3 if optim == "muon" else 1e-4
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=atol, msg=k)


def test_the_optimizers_differ():
    """Each name builds its own algorithm: one step from the same gradient moves the weights differently."""
    moved = {}
    for name in optimizers.NAMES:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(16, 128), torch.nn.Linear(128, 128), torch.nn.Linear(128, 16))
        t = Recipe().train
        opt = build.make(name, [{"params": list(model.parameters()), "weight_decay": 0.0}], t,
                              torch.device("cpu"), model, ARGS.get(name))
        for _ in range(2):
            model(torch.arange(8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        moved[name] = model[1].weight.detach().clone()
    fused, plain = moved.pop("adamw_torch_fused"), moved["adamw_torch"]
    torch.testing.assert_close(fused, plain)  # the same algorithm, another kernel
    names = list(moved)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            # bitsandbytes' 32-bit AdamW is AdamW; paged states are the same algorithm (on a CPU not even paged); Lion
            # moves by the sign of its momentum, which 8-bit states keep over two steps
            if {a, b} not in ({"adamw_torch", "paged_adamw_32bit"}, {"adamw_8bit", "paged_adamw_8bit"},
                              {"lion_8bit", "lion_32bit"}):
                assert not torch.allclose(moved[a], moved[b]), (a, b)


@pytest.mark.launch
@pytest.mark.parametrize("optim", ["adamw_8bit", "sgd"] + [pytest.param(o, marks=pytest.mark.slow) for o in (
    "adafactor", "muon", "adamw_torch_fused", "paged_adamw_8bit", "paged_adamw_32bit", "lion_8bit", "lion_32bit")])
def test_a_killed_run_resumes_bitwise(optim, work, optim_run):
    """SIGKILL in step 2's forward (the toolkit's fault seam: these runs are too fast to catch from outside), a
    checkpoint after every step: resume=auto continues from step 1 to the uninterrupted run's metrics and weights,
    bit for bit."""
    path = recipe(work, f"{optim}_killed", "single", optim, checkpoint__every_steps=1)
    assert_sigkill_resumes_bitwise(work, path, optim_run(optim, "single"), fault="step:KILL")


MOVES = [("adamw_8bit", "ddp", "single"), ("sgd", "zero3", "fsdp"), ("adafactor", "single", "ddp")]


@pytest.mark.launch
@pytest.mark.parametrize("optim,source,target", MOVES, ids=[f"{o}-{a}-to-{b}" for o, a, b in MOVES])
def test_an_optimizer_state_moves_to_another_layout(optim, source, target, work, optim_run):
    saved = optim_run(optim, source) / "checkpoints" / "step-000002" / "portable"
    name, seen = f"{optim}_{source}_to_{target}", work / f"{optim}_{source}_to_{target}_after_load"
    rc, out, err = finish(start(layout_command(work, target, recipe(work, name, target, optim),
                                               f"resume={saved.parent}"),
                                env={"TOOLKIT_FAULT_PORTABLE_AFTER_LOAD": str(seen)}))
    assert rc == 0, err[-3000:]
    assert "(written by" in out + err, (out + err)[-2000:]
    want, have = load_file(saved / "moments.safetensors"), load_file(seen / "portable" / "moments.safetensors")
    assert want.keys() == have.keys() and want
    assert all(torch.equal(want[k], have[k]) for k in want), [k for k in want if not torch.equal(want[k], have[k])]
    if optim == "adamw_8bit":
        assert any(v.dtype == torch.uint8 for v in want.values())  # the 8-bit states themselves, not a dequantized copy
    states = [json.loads((d / "state.json").read_text()) for d in (saved, seen / "portable")]
    assert states[0]["scalars"] == states[1]["scalars"]
    reference, resumed = losses(optim_run(optim, target)), losses(work / name)
    assert sorted(resumed) == [3, 4]
    for step in resumed:
        assert resumed[step] == pytest.approx(reference[step], rel=1e-4), (step, resumed, reference)


# ----------------------------------------------------------------------------- refusals, before the model loads

@pytest.mark.parametrize("optim", [n for n, o in optimizers.OPTIMIZERS.items() if o.whole])
def test_an_optimizer_that_needs_whole_parameters_is_refused_under_sharding(optim):
    from toolkit.backends import deepspeed_config, launch_config

    r = Recipe(output_dir="x")
    r.train.optim = optim
    with pytest.raises(ToolkitError, match=f"train.optim: {optim} needs each parameter whole .* FSDP shards them"):
        launch_config.check(r, {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "WORLD_SIZE": "2"})
    with pytest.raises(ToolkitError, match=f"train.optim: {optim} needs each parameter whole .* flat partitions"):
        deepspeed_config.resolve({"zero_optimization": {"stage": 1}}, r, 2, "ds.json")


def test_a_recipe_optimizer_beside_a_json_optimizer_or_an_offload_is_refused():
    from toolkit.backends import deepspeed_config

    r = Recipe(output_dir="x")
    r.train.optim = "sgd"
    with pytest.raises(ToolkitError, match="train.optim is sgd but ds.json brings its own optimizer .AdamW.; remove"):
        deepspeed_config.resolve({"optimizer": {"type": "AdamW", "params": {}}}, r, 2, "ds.json")
    with pytest.raises(ToolkitError, match="train.optim is sgd but ds.json offloads the optimizer to cpu"):
        deepspeed_config.resolve({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, r, 2,
                                 "ds.json")
    r.train.optim = "adamw_torch_fused"  # an AdamW beside the JSON's AdamW: the JSON's, as before
    deepspeed_config.resolve({"optimizer": {"type": "AdamW", "params": {}}}, r, 2, "ds.json")
    # DeepSpeed's own Muon where the JSON asks for it (train.optim=muon agrees); its momentum is in DeepSpeed's
    # layout, so a portable checkpoint is refused until the recipe turns it off
    r.train.optim = "muon"
    muon = {"zero_optimization": {"stage": 2}, "optimizer": {"type": "Muon", "params": {"lr": "auto"}}}
    with pytest.raises(ToolkitError, match="ds.json: optimizer Muon .DeepSpeed's. keeps its momentum in DeepSpeed's"):
        deepspeed_config.resolve(muon, r, 2, "ds.json")
    r.checkpoint.portable = False
    assert deepspeed_config.resolve(muon, r, 2, "ds.json")["optimizer"]["type"] == "Muon"
    with pytest.raises(ToolkitError, match="train.optim: muon needs each parameter whole .* or give your DeepSpeed"):
        deepspeed_config.resolve({"zero_optimization": {"stage": 2}}, r, 2, "ds.json")


@pytest.mark.launch
@pytest.mark.parametrize("overrides,line", [
    (["train.optim=adamw_9bit"], "train.optim"),
    (["train.optim_args={nesterov_typo: true}"], "train.optim_args.nesterov_typo: not an argument of adamw_torch"),
    (["train.lr_scheduler_type=cosine_annealing"], "train.lr_scheduler_type"),
    (["train.lr_scheduler_kwargs={min_lr_rate: 0.1}"], "train.lr_scheduler_kwargs.min_lr_rate: not an argument of "
                                                       "the warmup_cosine schedule (it takes none)"),
    (["train.warmup_ratio=0.1"], "train.warmup_ratio: give either train.warmup_steps (2) or train.warmup_ratio (0.1)"),
    (["train.min_lr_ratio=0.1", "train.lr_scheduler_type=linear"],
     "train.min_lr_ratio: is read by the warmup_cosine and cosine_with_min_lr schedules only"),
], ids=["optim", "optim_args", "schedule", "schedule_kwargs", "warmup_twice", "min_lr_ratio"])
def test_a_wrong_optimizer_or_schedule_key_is_one_line(overrides, line, work):
    path = recipe(work, "refused", "single", "adamw_torch")
    proc = run_toolkit("train", path, *overrides)
    assert line in user_error_line(proc)
    assert not (work / "refused").exists()


# ----------------------------------------------------------------------------- schedules

def lrs_of_get_scheduler(name, steps, warmup, kwargs, lr=3e-3):
    from transformers import get_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=steps,
                          scheduler_specific_kwargs=dict(kwargs))
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


SCHEDULE_KWARGS = {"cosine_with_min_lr": {"min_lr_rate": 0.1}, "polynomial": {"power": 2.0, "lr_end": 1e-5},
                   "warmup_stable_decay": {"num_decay_steps": 4}, "cosine_with_restarts": {"num_cycles": 2}}


@pytest.mark.parametrize("name", schedules.TRANSFORMERS)
def test_every_schedule_is_get_schedulers_across_a_resume(name):
    r = Recipe(output_dir="x")
    t = r.train
    t.lr_scheduler_type, t.lr_scheduler_kwargs, t.warmup_ratio, t.learning_rate = name, SCHEDULE_KWARGS.get(name, {}), \
        0.25, 3e-3
    steps = 13
    want = lrs_of_get_scheduler(name, steps, math.ceil(0.25 * steps), t.lr_scheduler_kwargs)
    for resume_at in (2, 9):  # mid-warmup, mid-decay
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=t.learning_rate)
        sched, have = build.schedule(opt, t, steps), []
        for i in range(steps):
            if i == resume_at:  # a new optimizer and schedule, as a resumed run builds them, then the saved states
                state, opt_state = sched.state_dict(), opt.state_dict()
                opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=t.learning_rate)
                sched = build.schedule(opt, t, steps)
                opt.load_state_dict(opt_state)
                sched.load_state_dict(state)
            have.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        assert have == pytest.approx(want, rel=1e-9, abs=1e-15), (resume_at, have, want)


RUN_SCHEDULES = [("linear", {}, {"train__warmup_ratio": 0.5, "train__warmup_steps": 0}, 2),
                 ("warmup_stable_decay", {"num_decay_steps": 3}, {"train__warmup_steps": 2}, 5)]


@pytest.mark.launch
@pytest.mark.parametrize("name,kwargs,extra,resume_at", RUN_SCHEDULES, ids=[s[0] for s in RUN_SCHEDULES])
def test_a_whole_run_steps_at_get_schedulers_rates_across_a_resume(name, kwargs, extra, resume_at, work):
    """6 steps (warmup ceil(0.5 x 6) = 3, or 2 then stable then 3 decaying), a checkpoint every step; a second run
    resumed from the checkpoint at `resume_at` (mid-warmup for linear, mid-decay for WSD) into a new folder."""
    steps, run = 6, f"schedule_{name}"
    sections = {"train__max_steps": steps, "train__lr_scheduler_type": name, "train__lr_scheduler_kwargs": kwargs,
                "train__eval_every_steps": 0, "checkpoint__every_steps": 1, **extra}
    rc, out, err = finish(start(layout_command(work, "single", layout_recipe(work, run, "single", **sections))))
    assert rc == 0, err[-3000:]
    warmup = 3 if "train__warmup_ratio" in extra else 2
    assert f"run: schedule {name} (transformers') with {warmup} warmup steps" in err, err[-3000:]
    ckpt = work / run / "checkpoints" / f"step-{resume_at:06d}"
    resumed = layout_recipe(work, f"{run}_resumed", "single", **sections)
    rc, out, err = finish(start(layout_command(work, "single", resumed, f"resume={ckpt}")))
    assert rc == 0, err[-3000:]
    want = lrs_of_get_scheduler(name, steps, warmup, kwargs)
    for folder, first in ((run, 1), (f"{run}_resumed", resume_at + 1)):
        logged = {r["step"]: r["lr"] for r in read_metrics(work / folder) if "lr" in r}
        assert sorted(logged) == list(range(first, steps + 1)), folder
        assert [logged[s] for s in sorted(logged)] == pytest.approx(want[first - 1:], rel=1e-9, abs=1e-15), folder


@pytest.mark.launch
def test_a_warmup_longer_than_the_run_is_cut_to_it(work, optim_run):
    """train.max_steps=3 on a recipe warming up over 10 steps trains, the warmup cut to the run with a note."""
    path = layout_recipe(work, "short", "single", train__max_steps=3, train__warmup_steps=10,
                         train__eval_every_steps=0)
    proc = run_toolkit("train", path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "train.warmup_steps 10 cut to the run's 3 steps" in proc.stderr, proc.stderr[-3000:]
    assert [r["lr"] for r in read_metrics(work / "short") if "lr" in r] == pytest.approx([1e-3, 2e-3, 3e-3])


def test_the_estimates_state_bytes_are_what_each_optimizer_allocates():
    """`toolkit estimate` counts optimizer.state_bytes per trained parameter: within 2% of the bytes each optimizer
    holds after a step on the CPU (Adafactor's factored moments: at most that), on matrices large enough for
    bitsandbytes' 8-bit states (>= 4096 elements) and Muon's hidden matrices."""
    for name, spec in optimizers.OPTIMIZERS.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(512, 1024, bias=False), torch.nn.Linear(1024, 512, bias=False))
        opt = build.make(name, [{"params": list(model.parameters()), "weight_decay": 0.0}], Recipe().train,
                              torch.device("cpu"), torch.nn.Sequential(torch.nn.Identity(), model), ARGS.get(name))
        model(torch.randn(2, 512)).sum().backward()
        opt.step()
        held = {}
        for st in opt.state.values():
            for value in flat_state(st).values():
                if torch.is_tensor(value) and value.dim() > 0:
                    held[value.data_ptr()] = value.numel() * value.element_size()  # a shared qmap counted once
        params = sum(p.numel() for p in model.parameters())
        if name == "adafactor":
            assert sum(held.values()) <= spec.state_bytes * params, name
        else:
            assert sum(held.values()) == pytest.approx(spec.state_bytes * params, rel=0.02), name


# ----------------------------------------------------------------------------- parameter groups

def test_loraplus_gives_each_parameter_peft_s_rate_and_embeddings_their_own():
    """lora.loraplus_lr_ratio: each trained parameter's learning rate is the one peft's create_loraplus_optimizer
    gives it; train.embedding_learning_rate: the embeddings' trained weights at theirs; one group per rate and
    decay, the groups' order fixed."""
    from peft import LoraConfig as PeftLora
    from peft import get_peft_model
    from peft.optimizers import create_loraplus_optimizer
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.backends import Backend
    from toolkit.config import LoraConfig

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))
    model = get_peft_model(base, PeftLora(r=4, lora_alpha=8, target_modules="all-linear", bias="lora_only"))
    t = Recipe().train
    t.learning_rate = 1e-4
    lrs = optimizers.learning_rates(model, LoraConfig(enabled=True, loraplus_lr_ratio=16.0), t)
    theirs = create_loraplus_optimizer(model, torch.optim.AdamW, lr=1e-4, loraplus_lr_ratio=16.0)
    names = {id(p): n for n, p in model.named_parameters()}
    for group in theirs.param_groups:
        for p in group["params"]:
            assert lrs.get(names[id(p)], t.learning_rate) == pytest.approx(group["lr"]), names[id(p)]
    assert {lr for lr in lrs.values()} == {1.6e-3}
    groups = Backend().param_groups(model, 0.1, lrs)
    assert [(g.get("lr"), g["weight_decay"]) for g in groups] == [(None, 0.1), (1.6e-3, 0.1)]  # A; B

    full = LlamaForCausalLM(base.config)
    t.embedding_learning_rate = 5e-5
    lrs = optimizers.learning_rates(full, LoraConfig(), t)
    assert set(lrs) == {"model.embed_tokens.weight", "lm_head.weight"} and set(lrs.values()) == {5e-5}


LORAPLUS = ["zero3", pytest.param("fsdp", marks=pytest.mark.slow), pytest.param("ddp", marks=pytest.mark.slow)]


@pytest.mark.launch
@pytest.mark.parametrize("layout", LORAPLUS)
def test_loraplus_learns_the_same_under_each_backend(layout, work):
    """LoRA+ (B matrices at 16x) on one process and on 2 processes: the same losses within 1e-4, each group at its
    own rate in the checkpoint's portable state."""
    runs = {}
    for where in ("single", layout):
        name = f"loraplus_{where}"
        if not (work / name / "final").exists():
            path = layout_recipe(work, name, where, lora=True, train__max_steps=STEPS, train__eval_every_steps=0,
                                 lora__loraplus_lr_ratio=16.0, checkpoint__every_steps=2)
            rc, out, err = finish(start(layout_command(work, where, path)))
            assert rc == 0, err[-3000:]
            assert "LoRA+: B matrices and 1-D parameters at lr x 16" in err, err[-2000:]
        runs[where] = losses(work / name)
    for step, loss in runs["single"].items():
        assert runs[layout][step] == pytest.approx(loss, rel=1e-4), (step, runs)
    state = json.loads((work / f"loraplus_{layout}" / "checkpoints" / "step-000002" / "portable" / "state.json")
                       .read_text())
    rates = {n: g["initial_lr"] for g in state["param_groups"] for n in g["names"]}
    assert {r for n, r in rates.items() if "lora_B" in n} == {3e-3 * 16} and \
        {r for n, r in rates.items() if "lora_A" in n} == {3e-3}
