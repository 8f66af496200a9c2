"""The model families users bring (tests/families.py: tiny models of transformers' own config
classes, each with its family's real chat template): labels lie exactly on the assistant turns as
each template renders them, with system prompts, tool calls and reasoning; what a template cannot
render is refused in one line naming the row."""

import pytest

from toolkit.data.formats import IGNORE
from toolkit.data.tokenize import tokenize_examples
from toolkit.errors import ToolkitError

from families import FAMILIES, build_family, family_tokenizer, target_runs
from helpers import run_toolkit, write_jsonl, write_recipe

CHAT = [{"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris is the capital."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome, since 1871."}]
SYSTEM = [{"role": "system", "content": "Answer in one short sentence."}] + CHAT
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}]
TOOL_CHAT = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "content": "sunny, 21 C"},
             {"role": "assistant", "content": "It is sunny in Paris."}]
THINK = [{"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "<think>\nadd two and two\n</think>\n\n4"},
         {"role": "user", "content": "times 3?"},
         {"role": "assistant", "content": "<think>\nfour times three\n</think>\n\n12"}]

# What each family's template renders (tests/chat_templates/INDEX.yaml has the full account).
RENDERS_SYSTEM = {f for f in FAMILIES if f not in ("mistral", "mixtral", "gemma2")}  # they raise on a system role
RENDERS_TOOLS = {"llama3", "qwen2.5", "qwen3", "qwen3-moe"}  # gemma3 raises, phi3 drops tool turns
REWRITES_EARLIER_THINK = {"qwen3", "qwen3-moe"}
# Templates whose rendering of a turn changes once later turns follow, so a conversation of 2 assistant
# turns is 2 examples: Qwen3 writes an (empty) <think> block only in turns after the last user message,
# Phi-3 ends only the whole conversation with its eos token.
ONE_EXAMPLE_PER_TURN = REWRITES_EARLIER_THINK | {"phi3"}


def assert_labels_on_turns(family, messages, tools=None, expect=None):
    tokenizer = family_tokenizer(family)
    row = {"messages": messages, **({"tools": tools} if tools else {})}
    examples = tokenize_examples(row, "messages", tokenizer, 2048, False)
    runs = target_runs(tokenizer, examples)
    turns = [m for m in messages[1:] if m["role"] == "assistant"]
    assert len(runs) == len(turns), (family, runs)
    end = FAMILIES[family]["end_of_turn"]
    for run, turn, want in zip(runs, turns, expect or [m["content"] for m in turns]):
        assert want in run, (family, run, want)
        assert end in run and run.rstrip("\n").endswith((end, tokenizer.eos_token)), (family, run)
        assert not any(m["content"] in run for m in messages
                       if m["role"] != "assistant" and m["content"]), (family, run)
    return examples, runs


@pytest.mark.parametrize("family", list(FAMILIES))
def test_labels_are_exactly_the_assistant_turns(family):
    examples, runs = assert_labels_on_turns(family, CHAT)
    assert len(examples) == (2 if family in ONE_EXAMPLE_PER_TURN else 1), (family, len(examples))
    if family in RENDERS_SYSTEM:
        examples, _ = assert_labels_on_turns(family, SYSTEM)
        text = family_tokenizer(family).decode(examples[-1]["input_ids"])
        assert SYSTEM[0]["content"] in text


@pytest.mark.parametrize("family", sorted(RENDERS_TOOLS))
def test_tool_calls_and_tool_results_train_as_the_template_renders_them(family):
    """The `tools` column reaches the template; the tool-call turn is a target (its call rendered),
    the tool's result is context."""
    _, runs = assert_labels_on_turns(family, TOOL_CHAT, tools=TOOLS, expect=["get_weather", "It is sunny in Paris."])
    assert "Paris" in runs[0] and "sunny" not in runs[0]


@pytest.mark.parametrize("family", sorted(REWRITES_EARLIER_THINK))
def test_each_reasoning_turn_trains_as_rendered_at_its_point(family):
    """Qwen3's template drops the <think> block of turns before the last user message. Labelling
    by prefix then marked the user's next question as a target (measured before the fix: the first
    run was 'a1<|im_end|>\\n<|im_start|>user\\nq2<|'). Now each turn is its own example, rendered
    as the template renders it when that turn is the last: both reasoning blocks are trained."""
    tokenizer = family_tokenizer(family)
    examples, runs = assert_labels_on_turns(family, THINK, expect=["add two and two", "four times three"])
    assert len(examples) == 2
    assert ("<think>\nadd two and two\n</think>\n\n4" in runs[0]
            and "<think>\nfour times three\n</think>\n\n12" in runs[1])
    assert "add two and two" not in tokenizer.decode(examples[1]["input_ids"])  # the template's own rendering


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_what_a_template_cannot_render_is_refused_naming_the_row(family, tmp_path):
    """Mistral's template raises on a system role, Gemma 3's on tool turns: one line, the row named."""
    from toolkit.config import DataConfig
    from toolkit.data.sources import Source
    from toolkit.data.tokenize import Report, tokenize_source

    rows = [{"messages": CHAT}] * 3 + [{"messages": SYSTEM if family == "mistral" else TOOL_CHAT}]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    source = Source(key="data.train_files[0]", files=[str(path)], format="messages")
    with pytest.raises(ToolkitError) as e:
        tokenize_source(source, 0, DataConfig(train_files=[str(path)], format="messages"), family_tokenizer(family),
                        1, Report(), tmp_path / "cache.arrow")
    assert "row 4" in str(e.value) and "Conversation roles must alternate" in str(e.value), str(e.value)


# ----------------------------------------------------------------------------- training each family
# One process, full and LoRA, through the CLI on chat data; LoRA on 2 processes under ZeRO-3 and FSDP
# equal to one process. In CI: the MoE family under ZeRO-3 (uneven routing across ranks) and one
# dense family; the whole table is `slow` (make test PYTEST_ARGS="-m slow -k families").
IN_CI = {("qwen3-moe", "lora", "zero3"), ("qwen3-moe", "lora", "single"), ("gemma3", "full", "single")}
LAYOUT_CASES = [(f, mode, layout) for f in FAMILIES for mode, layout in
                (("full", "single"), ("lora", "single"), ("lora", "zero3"), ("lora", "fsdp"))]


def chat_rows(n: int, seed: int, system: bool) -> list[dict]:
    import random

    rnd = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rnd.randint(1, 40), rnd.randint(1, 40)
        messages = [{"role": "user", "content": f"What is {a} plus {b}?"},
                    {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]
        rows.append({"messages": ([{"role": "system", "content": "Be brief."}] if system else []) + messages})
    return rows


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    """Each family's model folder (built on first use) and its chat data."""
    root = tmp_path_factory.mktemp("families")
    built = {}

    def get(family: str):
        if family not in built:
            folder = build_family(family, root / family / "model")
            system = family in RENDERS_SYSTEM
            write_jsonl(root / family / "train.jsonl", chat_rows(48, 1, system))
            write_jsonl(root / family / "eval.jsonl", chat_rows(6, 2, system))
            built[family] = (root / family, folder)
        return built[family]
    return get


def family_recipe(workdir, folder, name, mode, layout):
    recipe = {
        "output_dir": str(workdir / name), "seed": 5,
        "model": {"path": str(folder), "attn_implementation": FAMILIES[workdir.name].get("attn", "sdpa")},
        "lora": {"enabled": True, "r": 4, "alpha": 8} if mode == "lora" else {"enabled": False},
        "data": {"train_files": [str(workdir / "train.jsonl")], "eval_files": [str(workdir / "eval.jsonl")],
                 "format": "messages", "max_seq_len": 128, "packing": True},
        "train": {"micro_batch_size": 4 if layout == "single" else 2, "gradient_accumulation_steps": 2,
                  "max_steps": 4, "learning_rate": 3e-3, "warmup_steps": 1, "eval_every_steps": 2,
                  "log_every_steps": 1},
    }
    return write_recipe(workdir / f"{name}.yaml", **recipe)


def train_family(family_dir, family, mode, layout):
    from helpers import LAYOUTS, accelerate_launch, launch_config_for

    workdir, folder = family_dir(family)
    name = f"{mode}_{layout}"
    if (workdir / name / "final").is_dir():
        return workdir / name, None
    path = family_recipe(workdir, folder, name, mode, layout)
    backend = LAYOUTS[layout]
    launcher = accelerate_launch(launch_config_for(backend, workdir)) if backend else None
    proc = run_toolkit("train", path, launcher=launcher)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (workdir / name / "train.log").write_text(proc.stdout + proc.stderr)
    return workdir / name, proc


@pytest.mark.launch
@pytest.mark.parametrize("family, mode, layout", [
    pytest.param(*case, marks=() if case in IN_CI else pytest.mark.slow, id="-".join(case)) for case in LAYOUT_CASES])
def test_family_trains(family_dir, family, mode, layout):
    """Trains (losses finite, falling); on 2 processes, equal to one process within 1e-4 (losses and
    the trained weights)."""
    import math

    import torch

    from helpers import load_weights, train_losses

    run, proc = train_family(family_dir, family, mode, layout)
    losses = train_losses(run)
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    log = (run / "train.log").read_text()
    audit = [line for line in log.splitlines() if line.startswith("data: ") and "[[" in line]
    assert len(audit) == 1 and "is]]" not in audit[0], log[-3000:]  # the label audit, shown once
    assert "padding instead of packing" not in log  # packed: documents kept apart in one row
    if layout == "single":
        return
    ref, _ = train_family(family_dir, family, mode, "single")
    want = train_losses(ref)
    rel = max(abs(a - b) / abs(a) for a, b in zip(want, losses))
    print(f"\n{family} {mode} {layout}: max relative loss difference vs one process {rel:.2e}")
    assert rel <= 1e-4, (want, losses)
    have, expect = load_weights(run / "final"), load_weights(ref / "final")
    assert have.keys() == expect.keys() and have
    for k in expect:
        torch.testing.assert_close(have[k], expect[k], rtol=1e-4, atol=1e-4, msg=k)


@pytest.fixture(scope="module")
def merged(family_dir):
    """merged(family): `toolkit merge` of the family's one-process LoRA run (merged once), checked
    by merge's own logits check against base + adapter."""
    done = {}

    def get(family: str):
        if family not in done:
            run, _ = train_family(family_dir, family, "lora", "single")
            proc = run_toolkit("merge", run / "final", "--out", run.parent / "merged")
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert "check: merged vs base + adapter" in proc.stdout, proc.stdout
            done[family] = run.parent / "merged"
        return done[family]
    return get


@pytest.mark.launch
@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f == "qwen3-moe" else pytest.mark.slow)
                                    for f in ("qwen3-moe", "mixtral")])
def test_moe_lora_reaches_the_experts_says_so_and_merges(family_dir, merged, family):
    """`all-linear` on a mixture-of-experts model adapts the fused expert stacks and the router (peft's
    target_parameters), the start-of-run line says so, and `toolkit merge` writes the experts (its
    logits check against base + adapter passes, which it cannot if the experts' update were lost)."""
    import json

    run, _ = train_family(family_dir, family, "lora", "single")
    log = (run / "train.log").read_text()
    line = next(x for x in log.splitlines() if x.startswith("lora: adapter on "))
    assert "experts: all" in line and "router: yes" in line, line
    assert "leaves the experts" not in log
    config = json.loads((run / "final" / "adapter_config.json").read_text())
    assert {"gate_up_proj", "down_proj"} <= set(config["target_parameters"]) or family != "qwen3-moe", config
    assert (merged(family) / "config.json").is_file()


# ----------------------------------------------------------------------------- after training, each family
# What a user does next with a family's run: eval it, merge it, chat with it, and train padding-free.
AFTER_IN_CI = {"qwen3-moe"}
NO_PADDING_FREE = {"gemma3": "sliding-window"}  # varlen attends causally over whole documents only


@pytest.mark.launch
@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f in AFTER_IN_CI else pytest.mark.slow)
                                    for f in FAMILIES])
def test_family_evaluates_merges_generates_and_trains_padding_free(family_dir, merged, family):
    """On the family's one-process LoRA run (packed): `toolkit eval` of its adapter gives the eval
    loss the run logged last (1e-4) and answers every row through the family's template; `toolkit
    merge` passes its logits check; `toolkit generate` answers from the merged folder, stopping
    within its budget; data.padding_free learns what the packed run learned (losses 1e-5, weights),
    or is refused in one line naming the reason (Gemma 3's sliding window)."""
    import json

    import torch

    from helpers import load_weights, read_metrics, train_losses, user_error_line

    workdir, _ = family_dir(family)
    run, _ = train_family(family_dir, family, "lora", "single")
    proc = run_toolkit("eval", run / "final", "--data", workdir / "eval.jsonl", "--max-new-tokens", "8", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    logged = [r["eval_loss"] for r in read_metrics(run) if "eval_loss" in r][-1]
    assert result["loss"] == pytest.approx(logged, rel=1e-4), (result["loss"], logged)
    assert result["answers"]["scored"] == 6, result["answers"]

    proc = run_toolkit("generate", merged(family), "--prompt", "What is 2 plus 3?", "--max-new-tokens", "8", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 1 <= answer["tokens"] <= 8, answer

    path = family_recipe(workdir, family_dir(family)[1], "lora_padding_free", "lora", "single")
    proc = run_toolkit("train", path, "data.padding_free=true")
    if family in NO_PADDING_FREE:
        line = user_error_line(proc)
        assert "model.attn_implementation" in line and NO_PADDING_FREE[family] in line, line
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    varlen = FAMILIES[family].get("attn", "sdpa") == "sdpa"  # eager (Gemma 2) keeps eager with its packed mask
    assert (("attention: varlen" in proc.stdout + proc.stderr) == varlen
            and "padding instead" not in proc.stdout + proc.stderr)
    free, packed = train_losses(workdir / "lora_padding_free"), train_losses(run)
    torch.testing.assert_close(torch.tensor(free), torch.tensor(packed), rtol=1e-5, atol=0)
    want, have = load_weights(run / "final"), load_weights(workdir / "lora_padding_free" / "final")
    assert want.keys() == have.keys() and want
    for k in want:
        torch.testing.assert_close(have[k], want[k], rtol=1e-5, atol=1e-5, msg=k)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generation_stops_at_the_familys_end_of_turn(family, tmp_path):
    """The stop tokens `toolkit generate` and eval use include the family's end-of-turn token, found
    from its real template (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, `<|end|>`, `</s>`), and
    generation ends at it: a model made to emit it first answers with nothing, in one token."""
    import torch

    from toolkit.model.inference import generate_with_counts, stop_token_ids

    tokenizer = family_tokenizer(family)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(build_family(family, tmp_path / "model")).eval()
    end = tokenizer.convert_tokens_to_ids(FAMILIES[family]["end_of_turn"])
    assert end in stop_token_ids(model, tokenizer), (family, stop_token_ids(model, tokenizer))
    head = model.get_output_embeddings()
    with torch.no_grad():  # every position's most likely next token: the end of turn
        if model.config.tie_word_embeddings:
            head = torch.nn.Linear(head.in_features, head.out_features, bias=True)
            head.weight.copy_(model.get_input_embeddings().weight)
            model.set_output_embeddings(head)
        else:
            head.bias = torch.nn.Parameter(torch.zeros(head.out_features))
        head.bias[end] = 1e4
    [(answer, tokens)] = generate_with_counts(model, tokenizer, ["What is 2 plus 3?"], max_new_tokens=8)
    assert (answer, tokens) == ("", 1), (family, answer, tokens)


def test_an_adapter_that_misses_the_experts_is_said_at_start():
    from transformers import AutoModelForCausalLM

    from toolkit.config import LoraConfig
    from toolkit.model.load import adapter_coverage, apply_lora

    from families import family_config

    tokenizer = family_tokenizer("qwen3-moe")
    model = AutoModelForCausalLM.from_config(family_config("qwen3-moe", len(tokenizer), tokenizer))
    line, warning = adapter_coverage(apply_lora(model,
                                                LoraConfig(enabled=True, r=4, target_modules=["q_proj", "v_proj"])))
    assert "experts: none" in line and "router: no" in line, line
    assert warning.startswith("lora.target_modules leaves the experts of this mixture-of-experts model untouched")


# ----------------------------------------------------------------------------- the router's auxiliary loss


def moe_model(family="qwen3-moe", **config):
    import torch
    from transformers import AutoModelForCausalLM

    from families import family_config

    tokenizer = family_tokenizer(family)
    cfg = family_config(family, len(tokenizer), tokenizer)
    for key, value in config.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("kind", ["full", "chunked"])
@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])
def test_router_aux_loss_is_the_models_own_and_weighs_as_a_mean(family, kind):
    """token_loss_sum(router_aux=True) gives the model's own load-balancing loss (transformers'
    forward with output_router_logits, padding masked), with either loss; the objective adds it
    times the coefficient, weighted by the micro-batch's target tokens, and counts it for `aux_loss`."""
    import copy

    import torch

    from toolkit.training.loss import token_loss_sum, use_token_loss
    from toolkit.training.objectives import Supervised

    model = moe_model(family)
    reference = copy.deepcopy(model)
    use_token_loss(model, kind, chunk_tokens=5)
    ids = torch.randint(10, 200, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # the second row padded at its end
    labels = ids.clone()
    labels[:, :4] = IGNORE
    labels[mask == 0] = IGNORE
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    ce, aux = token_loss_sum(model, batch, router_aux=True)
    own = reference(input_ids=ids, attention_mask=mask, output_router_logits=True)
    assert aux.item() > 0
    torch.testing.assert_close(aux, own.aux_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(ce, token_loss_sum(model, batch), rtol=1e-6, atol=0)
    objective = Supervised(router_aux_coef=0.25)
    units = objective.units(batch)
    model.train()
    total = objective.loss_sum(model, batch)
    torch.testing.assert_close(total, ce + 0.25 * aux * units, rtol=1e-6, atol=0)
    metrics = objective.step_metrics("cpu")
    assert metrics["aux_loss"].item() == pytest.approx(aux.item() * units, rel=1e-6)
    assert objective.step_metrics("cpu")["aux_loss"].item() == 0  # reset after each step
    model.eval()  # the eval loss is the language-model loss alone
    torch.testing.assert_close(objective.loss_sum(model, batch), ce, rtol=1e-6, atol=0)


def test_router_aux_loss_follows_the_model_config_and_the_recipe(tmp_path):
    from toolkit.config import ModelConfig, load_recipe
    from toolkit.model.load import build_model
    from toolkit.training.objectives import for_recipe

    def recipe(**model):
        path = write_recipe(tmp_path / "r.yaml", output_dir=str(tmp_path / "run"),
                            model={"preset": "tiny-llama-mini", **model}, data={"train_files": ["t.jsonl"]})
        return load_recipe(path)

    assert for_recipe(recipe(), moe_model()).router_aux_coef == 0  # output_router_logits false: off
    assert for_recipe(recipe(), moe_model(output_router_logits=True, router_aux_loss_coef=0.02)).router_aux_coef == 0.02
    assert for_recipe(recipe(router_aux_loss_coef=0.5), moe_model()).router_aux_coef == 0.5
    assert for_recipe(recipe(router_aux_loss_coef=0), moe_model(output_router_logits=True)).router_aux_coef == 0
    dense = build_model(ModelConfig(preset="tiny-llama-mini"))
    assert for_recipe(recipe(), dense).router_aux_coef == 0
    with pytest.raises(ToolkitError, match="model.router_aux_loss_coef: LlamaForCausalLM has no router"):
        for_recipe(recipe(router_aux_loss_coef=0.01), dense)


@pytest.mark.launch
def test_router_aux_loss_trains_and_is_logged(family_dir):
    """Qwen3-MoE with model.router_aux_loss_coef: the run says so at start and logs `aux_loss` at
    every step (Switch Transformer's load-balancing loss, about num_experts_per_tok, 2 here, when
    routing is balanced; measured 2.05 in the first steps)."""
    import math

    from helpers import read_metrics

    workdir, folder = family_dir("qwen3-moe")
    path = family_recipe(workdir, folder, "aux", "lora", "single")
    proc = run_toolkit("train", path, "model.router_aux_loss_coef=0.01")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "router: load-balancing loss x 0.01 added to the training loss (aux_loss)" in proc.stdout + proc.stderr
    rows = [r for r in read_metrics(workdir / "aux") if "loss" in r]
    assert len(rows) == 4 and all(math.isfinite(r["aux_loss"]) and 0.5 < r["aux_loss"] < 4 for r in rows), rows


# ----------------------------------------------------------------------------- the shipped model recipes, at toy size
# Each recipe in examples/recipes/models/ as shipped (LoRA settings, dtype, precision, gradient
# checkpointing, attention, packing, loss, launch config), with only the size changed: the family's
# tiny model in model.path, its chat data, 2 steps of sequences of 128 tokens, 2 processes of the
# launch config its header names.
RECIPE_FAMILY = {"llama3.1-8b-full": "llama3", "llama3.1-8b-lora": "llama3", "qwen2.5-0.5b-full": "qwen2.5",
                 "qwen2.5-7b-lora": "qwen2.5", "qwen3-8b-full": "qwen3", "qwen3-30b-a3b-lora": "qwen3-moe",
                 "mistral-7b-lora": "mistral", "gemma2-9b-lora": "gemma2", "gemma3-1b-full": "gemma3"}
RECIPES_IN_CI = {"qwen3-30b-a3b-lora"}


def test_every_model_recipe_has_its_family():
    from helpers import ROOT

    shipped = {p.stem for p in (ROOT / "examples" / "recipes" / "models").glob("*.yaml")}
    assert shipped == set(RECIPE_FAMILY), shipped ^ set(RECIPE_FAMILY)


@pytest.mark.launch
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in RECIPES_IN_CI else pytest.mark.slow)
                                  for n in RECIPE_FAMILY])
def test_model_recipe_trains_at_toy_size(name, family_dir, tmp_path):
    import math
    import re

    import yaml

    from helpers import ROOT, accelerate_launch, launch_config_for, train_losses

    path = ROOT / "examples" / "recipes" / "models" / f"{name}.yaml"
    text = path.read_text()
    recipe = yaml.safe_load(text)
    workdir, folder = family_dir(RECIPE_FAMILY[name])
    recipe["output_dir"] = str(tmp_path / "run")
    recipe["model"]["path"] = str(folder)
    recipe["data"].pop("eval_fraction", None)
    recipe["data"].update(train_files=[str(workdir / "train.jsonl")], eval_files=[str(workdir / "eval.jsonl")],
                          max_seq_len=128)
    recipe["train"].update(max_steps=2, warmup_steps=1, eval_every_steps=2, log_every_steps=1,
                           micro_batch_size=min(recipe["train"]["micro_batch_size"], 2))
    recipe["checkpoint"] = {"every_steps": 2, "keep_last": 1}
    launch = re.search(r"^# launch: (?:\.venv/bin/)?accelerate launch --config_file accelerate_configs/(\S+)\.yaml",
                       text, re.M).group(1)
    launcher = None if launch == "single" else accelerate_launch(launch_config_for(launch, tmp_path))
    proc = run_toolkit("train", write_recipe(tmp_path / f"{name}.yaml", **recipe), launcher=launcher)
    assert proc.returncode == 0, proc.stderr[-4000:]
    losses = train_losses(tmp_path / "run")
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses
    assert (tmp_path / "run" / "final").is_dir() and (tmp_path / "run" / "checkpoints" / "step-000002").is_dir()
    log = proc.stdout + proc.stderr
    if recipe["lora"]["enabled"] and RECIPE_FAMILY[name] == "qwen3-moe":
        assert "experts: all" in log and "router: load-balancing loss x 0.001" in log, log[-3000:]


def test_a_family_without_sdpa_loads_with_eager_attention_and_lora_reaches_its_experts(tmp_path):
    """Issue 52: gpt-oss under the default attention (sdpa) failed inside transformers ("does not support an
    attention implementation through torch.nn.functional.scaled_dot_product_attention yet"): its class takes no
    sdpa (attention sinks), so it loads with eager attention (build.setup_model says so) and runs."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    from toolkit.config import ModelConfig
    from toolkit.model.load import build_model

    config = GptOssConfig(vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=16, max_position_embeddings=256)
    GptOssForCausalLM(config).save_pretrained(tmp_path / "gpt-oss")
    model = build_model(ModelConfig(path=str(tmp_path / "gpt-oss")))
    assert model.config._attn_implementation == "eager"
    assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 300)
    # LoRA on all-linear reaches its fused experts and router (peft's target_parameters; peft's own all-linear
    # converts only Mixtral and Qwen MoE stacks): before, `experts: none (60% of the parameters)`
    from toolkit.config import LoraConfig
    from toolkit.model.load import adapter_coverage, apply_lora

    adapted = apply_lora(model, LoraConfig(enabled=True))
    line, warning = adapter_coverage(adapted)
    assert "experts: all" in line and "router: yes" in line and warning is None, (line, warning)
    x = torch.tensor([[1, 2, 3, 4]])
    adapted(input_ids=x, labels=x).loss.backward()
    assert all(p.grad is not None for n, p in adapted.named_parameters() if p.requires_grad and ".experts." in n)
    build_model(ModelConfig(preset="tiny-llama-mini")).save_pretrained(tmp_path / "llama")
    llama = build_model(ModelConfig(path=str(tmp_path / "llama")))  # a family that takes sdpa keeps it
    assert llama.config._attn_implementation == "sdpa"
