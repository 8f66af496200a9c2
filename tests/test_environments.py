"""rl.environment (toolkit/rollout/environments.py) against TRL 1.16's own environment_factory: a real GRPOTrainer
(a tiny random Qwen2.5-shaped model, built here) runs its `_generate_and_score_completions` on the same rows with
scripted sampled turns, stopped once its rewards are computed; the toolkit's `Environments.batch`, `prompt_ids`,
`run_tools` (rollout_tools=) and `rewards.score` (with the environments' own rewards and `environments=`) run on the
same rows and turns. The prompts after reset, the prompt and completion ids, tool masks, conversations, every reward
column, each instance's state (one per rollout), which instances are reused and how many are made must be the same.
Plus the one-line refusals of environments and rows the loop cannot use."""

import math
import re
from pathlib import Path

import pytest
from tools_fixtures import envs

from toolkit.errors import ToolkitError
from toolkit.rollout.environments import load_environment
from toolkit.rollout.tools import check_tokenizer, load_tools, prompt_ids, run_tools
from toolkit.training.rewards import Reward, score

from families import family_config, family_tokenizer

trl = pytest.importorskip("trl")
from trl import GRPOConfig  # noqa: E402
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:You are using 'environment_factory':UserWarning")

END = "<|im_end|>"
CALC = Path(__file__).parent / "tools_fixtures" / "calc.py"
ENVS = "tools_fixtures.envs"  # by module on both sides: the same classes, so TRL's `type(e) is Class` holds for ours


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def constant(completions, **kwargs) -> list[float]:
    return [0.5] * len(completions)


def counts_environments(completions, environments, **kwargs) -> list[float]:
    """A reward function reading the `environments` keyword, as TRL passes it to every function."""
    return [float(len(getattr(e, "steps", getattr(e, "tries", [])))) for e in environments]


class Script:
    """turns[r][k]: rollout r's k-th sampled turn. The first call gets every rollout's first turn; a later prompt is
    recognised by its rollout's first turn (each unique), since the rollouts of one row share their prompt."""

    def __init__(self, tokenizer, turns: list[list[str]]):
        self.tokenizer, self.texts, self.asked = tokenizer, turns, [1] * len(turns)
        self.turns = [[tokenizer.encode(t, add_special_tokens=False) for t in texts] for texts in turns]

    def first(self) -> list[list[int]]:
        return [list(t[0]) for t in self.turns]

    def __call__(self, ids_list: list[list[int]]) -> list[list[int]]:
        out = []
        for ids in ids_list:
            text = self.tokenizer.decode(ids)
            r = next(r for r, texts in enumerate(self.texts) if texts[0] in text)
            out.append(list(self.turns[r][self.asked[r]]))
            self.asked[r] += 1
        return out


class _Stop(Exception):
    pass


def trl_trainer(folder: Path, factory, tools=()):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    tokenizer = family_tokenizer("qwen2.5")
    config = family_config("qwen2.5", len(tokenizer), tokenizer)
    config.max_position_embeddings = 100_000  # byte-level prompts with tool schemas are long
    torch.manual_seed(0)
    args = GRPOConfig(output_dir=str(folder), per_device_train_batch_size=4, num_generations=2, max_steps=1,
                      max_completion_length=2048, report_to="none", use_cpu=True, save_strategy="no", bf16=False)
    rows = Dataset.from_list([{"prompt": [{"role": "user", "content": "x"}], "start": 0, "code": "0",
                               "environment": "counter"}])
    return GRPOTrainer(model=AutoModelForCausalLM.from_config(config), reward_funcs=[constant, counts_environments],
                       args=args, train_dataset=rows, processing_class=tokenizer, environment_factory=factory,
                       tools=[t.function for t in tools])


def trl_side(trainer, rows: list[dict], turns: list[list[str]], g: int) -> dict:
    """TRL's `_generate_and_score_completions` on the rows (each repeated g times, as its sampler does), up to its
    rewards: what its tool loop and `_calculate_rewards` got and returned, and the instances it used."""
    script = Script(trainer.processing_class, turns)
    seen = {}

    def single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        return (script.first() if "first" not in seen else script(prompt_ids)), None

    def tool_loop(prompts, prompt_ids, *rest):
        seen.update(first=True, prompt_ids=[list(p) for p in prompt_ids])
        seen["loop"] = GRPOTrainer._tool_call_loop(trainer, prompts, prompt_ids, *rest)
        return seen["loop"]

    def rewards(inputs, prompts, completions, completion_ids):
        seen["rewards"] = GRPOTrainer._calculate_rewards(trainer, inputs, prompts, completions, completion_ids)
        seen["prompts"] = prompts
        raise _Stop

    trainer._generate_single_turn, trainer._tool_call_loop = single_turn, tool_loop
    trainer._calculate_rewards = rewards
    with pytest.raises(_Stop):
        trainer._generate_and_score_completions([dict(row) for row in rows for _ in range(g)])
    tool_mask, completions, completion_ids, _, calls, failures, _ = seen["loop"]
    return dict(prompts=seen["prompts"], prompt_ids=seen["prompt_ids"], completion_ids=completion_ids,
                tool_mask=tool_mask, messages=completions, calls=calls, failures=failures,
                rewards=dict(zip(trainer.reward_func_names, seen["rewards"].T.tolist())),
                environments=list(trainer.environments))


def ours(environments, rows: list[dict], turns: list[list[str]], g: int, tools=()) -> dict:
    """What the online-RL objective does per batch: instances, prompts and tools per rollout; prompt ids with each
    rollout's tools; the tool loop with each rollout's tools; the rewards with the environments' own and
    `environments=`."""
    tokenizer = family_tokenizer("qwen2.5")
    check_tokenizer(tokenizer)  # attaches TRL's response template for Qwen2.5's chat template
    batch = environments.batch(rows, g, where=[f"train.jsonl row {i + 1}" for i in range(len(rows))])
    ids = prompt_ids(tokenizer, batch.prompts, list(tools), rollout_tools=batch.tools)
    script = Script(tokenizer, turns)
    rollouts = run_tools(batch.prompts, ids, script.first(), lambda p, r, t: script(p), tokenizer, list(tools),
                         max_iterations=None, max_new_tokens=2048, timeout=10.0, max_length=100_000,
                         rollout_tools=batch.tools)
    functions = [Reward("constant", 1.0, constant), Reward("counts_environments", 1.0, counts_environments)]
    functions += [Reward(name, 1.0, function) for name, function in environments.rewards()]
    columns = [{**{k: v for k, v in row.items() if k != "prompt"}, "environments": e}
               for row, e in zip([row for row in rows for _ in range(g)], batch.environments)]
    _, per_function = score(functions, batch.prompts, [r.messages for r in rollouts], columns, step=1,
                            rows=["row"] * len(rollouts), completion_ids=[r.completion_ids for r in rollouts])
    return dict(prompts=batch.prompts, prompt_ids=ids, completion_ids=[r.completion_ids for r in rollouts],
                tool_mask=[r.tool_mask for r in rollouts], messages=[r.messages for r in rollouts],
                calls=sum(r.tool_calls for r in rollouts), failures=sum(r.tool_failures for r in rollouts),
                rewards={f.name: v.tolist() for f, v in zip(functions, per_function.values())},
                environments=batch.environments)


def state(environment) -> dict:
    return {k: v for k, v in vars(environment).items()}


def same(expected: dict, got: dict) -> None:
    for key in ("prompts", "prompt_ids", "completion_ids", "tool_mask", "messages", "calls", "failures"):
        assert got[key] == expected[key], key
    assert list(got["rewards"]) == list(expected["rewards"])
    for name, values in expected["rewards"].items():
        assert got["rewards"][name] == pytest.approx(values, nan_ok=True), name
    assert [type(e) for e in got["environments"]] == [type(e) for e in expected["environments"]]
    assert [state(e) for e in got["environments"]] == [state(e) for e in expected["environments"]]
    assert len({id(e) for e in got["environments"]}) == len(got["environments"])  # one instance per rollout


COUNTER_TURNS = [[call("step", '{"by": 2}') + END, "Done." + END],
                 [call("peek", "{}") + END, "Looked." + END],
                 ["Nothing." + END],
                 [call("step", '{"by": 5}') + call("step", '{"by": 1}') + END, call("step", '{"by": -1}') + END,
                  "Ok." + END]]


def test_one_environment_for_every_row_as_trl(tmp_path):
    """Each rollout's own counter, reset from its row (what reset returns appended to the prompt), its methods the
    tools, get_reward a reward column named after the class; two rollouts of a row never share state."""
    rows = [{"prompt": [{"role": "user", "content": f"count {r}"}], "start": r} for r in range(2)]
    expected = trl_side(trl_trainer(tmp_path, envs.Counter), rows, COUNTER_TURNS, 2)
    got = ours(load_environment(f"{ENVS}:Counter"), rows, COUNTER_TURNS, 2)
    same(expected, got)
    assert [p[-1]["content"] for p in got["prompts"]] == ["count 0 Start at 0."] * 2 + ["count 1 Start at 1."] * 2
    assert [e.steps for e in got["environments"]] == [[2], [], [], [5, 1, -1]]
    assert got["rewards"]["Counter"] == [2.0, 0.0, 1.0, 6.0]
    assert [m["content"] for m in got["messages"][1]] == ["", "at 0", "Looked."]


def test_rows_pick_their_environment_and_the_pool_is_reused_as_trl(tmp_path):
    """A mapping: each row's `environment` column picks the class (reset without that column), only its tools in
    its prompt; a class under two names is one reward column, a subclass its own, an async get_reward awaited,
    None (NaN) for another class's rollouts. A second batch reuses the instances (reset again) and makes only the
    ones it needs beyond them."""
    factory = {"counter": envs.Counter, "safe": envs.Safe, "tally": envs.Counter, "sub": envs.AlsoCounter}
    spec = {name: f"{ENVS}:{cls.__name__}" for name, cls in factory.items()}
    rows = [{"prompt": [{"role": "user", "content": "count"}], "environment": "counter", "start": 3, "code": "0"},
            {"prompt": [{"role": "user", "content": "open"}], "environment": "safe", "start": 0, "code": "42"},
            {"prompt": [{"role": "user", "content": "sub"}], "environment": "sub", "start": 1, "code": "0"}]
    turns = [[call("step", '{"by": 1}') + END, "Four." + END], [call("guess", '{"code": "7"}') + END, "No." + END],
             [call("guess", '{"code": "boom"}') + END, "Ow." + END],
             [call("guess", '{"code": "42"}') + END, "Open." + END],
             [call("step", '{"by": 2}') + END, "Three." + END], ["Idle." + END]]
    trainer, environments = trl_trainer(tmp_path, factory), load_environment(spec)
    made = len(envs.MADE)
    expected = trl_side(trainer, rows, turns, 2)
    trl_made, made = len(envs.MADE) - made, len(envs.MADE)
    got = ours(environments, rows, turns, 2)
    assert len(envs.MADE) - made == trl_made
    same(expected, got)
    assert list(got["rewards"]) == ["constant", "counts_environments", "Counter", "Safe", "AlsoCounter"]
    assert got["messages"][1][1]["content"] == "{'error': 'Tool guess not found.'}"  # a counter has no guess
    assert got["messages"][2][1]["content"] == "{'error': 'the safe exploded'}"
    safe = got["rewards"]["Safe"]  # None (NaN) for the rollouts of other classes
    assert safe[2:4] == [0.0, 1.0] and all(math.isnan(v) for v in safe[:2] + safe[4:])
    assert all("environment" not in e.row for e in got["environments"])

    again = [rows[1], rows[1], rows[0]]  # more safes than before: one more made; counters reused
    turns = [[f"Skip {k}." + END] for k in range(6)]
    made = len(envs.MADE)
    expected_again = trl_side(trainer, again, turns, 2)
    trl_made, made = len(envs.MADE) - made, len(envs.MADE)
    got_again = ours(environments, again, turns, 2)
    assert len(envs.MADE) - made == trl_made == 2
    same(expected_again, got_again)
    assert got_again["environments"][:2] == got["environments"][2:4]  # the safes of the first batch, reset
    assert [e.tries for e in got_again["environments"][:4]] == [[]] * 4


def test_rl_tools_come_first_beside_an_environments_methods(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "count"}], "start": 1}]
    turns = [[call("add", '{"a": 1, "b": 2}') + call("step", '{"by": 3}') + END, "Both." + END],
             [call("divide", '{"a": 1, "b": 0}') + END, "Hm." + END]]
    tools = load_tools([f"{CALC}:add", f"{CALC}:divide"])
    same(trl_side(trl_trainer(tmp_path, envs.Counter, tools), rows, turns, 2),
         ours(load_environment(f"{ENVS}:Counter", tools), rows, turns, 2, tools))


def test_ranks_and_runs_share_no_instance():
    """Each process loads its own: two loads (two ranks) never hand out one instance."""
    rows = [{"prompt": [{"role": "user", "content": "count"}], "start": 1}]
    one, two = load_environment(f"{ENVS}:Counter"), load_environment(f"{ENVS}:Counter")
    a, b = one.batch(rows, 3).environments, two.batch(rows, 3).environments
    assert not {id(e) for e in a} & {id(e) for e in b}
    a[0].step(5)
    assert [e.total for e in a] == [6, 1, 1] and [e.total for e in b] == [1, 1, 1]


@pytest.mark.parametrize("spec, why", [
    ("{envs}:NoReset", "NoReset has no reset method"),
    ("{envs}:NoTools", "NoTools has no tool methods"),
    ("{envs}:Undescribed", "method step: the chat template cannot describe it"),
    ("{envs}:AsyncTool", "method step: async tools are not supported"),
    ("{envs}:Breaks", "making one raised OSError: no such device"),
    ("{envs}:ShadowsATool", "method add: rl.tools has a tool of that name"),
    ("{envs}:NOT_A_CLASS", "NOT_A_CLASS is a int, not a class"),
    ("{envs}:Missing", "has no 'Missing'"),
    ("Counter", "give path/to/file.py:Class or module:Class"),
    ("missing.py:Counter", "file not found"),
])
def test_an_environment_that_cannot_be_used_is_refused_in_one_line(spec, why):
    spec = spec.format(envs=ENVS)
    tools = load_tools([f"{CALC}:add"])
    for key, given in (("rl.environment", spec), ("rl.environment.maze", {"maze": spec})):
        with pytest.raises(ToolkitError) as err:
            load_environment(given, tools)
        assert str(err.value).startswith(f"{key}: {spec!r}: ") and why in str(err.value), str(err.value)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("spec, why", [
    ([], "rl.environment: give FILE.py:Class, or a mapping of names to them"),
    ({}, "got a dict with nothing in it"),
    ({"a": 3}, "rl.environment.a: give a name (a text) and FILE.py:Class (a text)"),
])
def test_a_spec_of_neither_form_is_refused(spec, why):
    with pytest.raises(ToolkitError, match=re.escape(why)) as err:
        load_environment(spec)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("row, why", [
    ({"prompt": [{"role": "user", "content": "x"}], "environment": "maze"},
     "train.jsonl row 2: environment 'maze' is not one of rl.environment's; give each row one of: counter, safe"),
    ({"prompt": [{"role": "user", "content": "x"}]},
     "train.jsonl row 2: no 'environment' column; give each row one of: counter, safe"),
    ({"prompt": "just text", "environment": "counter", "start": 1},
     "train.jsonl row 2: rl.environment: the prompt is not chat messages"),
    ({"prompt": [{"role": "user", "content": "x"}], "environment": "counter"},
     "train.jsonl row 2: rl.environment: Counter.reset raised KeyError: 'start'"),
    ({"prompt": [{"role": "user", "content": "x"}], "environment": "bad", "start": 1},
     "train.jsonl row 2: rl.environment: ResetsBadly.reset returned a int; return None, a text"),
])
def test_a_row_the_environments_cannot_take_is_refused_in_one_line(row, why):
    environments = load_environment({"counter": f"{ENVS}:Counter", "safe": f"{ENVS}:Safe"}
                                    | ({"bad": f"{ENVS}:ResetsBadly"} if row.get("environment") == "bad" else {}))
    good = {"prompt": [{"role": "user", "content": "x"}], "environment": "safe", "code": "1"}
    with pytest.raises(ToolkitError) as err:
        environments.batch([good, row], 2, where=["train.jsonl row 1", "train.jsonl row 2"])
    assert str(err.value).startswith(why.split("; ")[0]) and why.split("; ")[-1] in str(err.value), str(err.value)
    assert "\n" not in str(err.value)



def test_a_row_without_a_prompt_starts_from_an_empty_user_message_as_trl():
    batch = load_environment(f"{ENVS}:Counter").batch([{"start": 2}], 1)
    assert batch.prompts == [[{"role": "user", "content": " Start at 2."}]]
    assert [t.name for t in batch.tools[0]] == ["peek", "step"] and batch.tools[0][1].function.__self__ is \
        batch.environments[0]
