"""GRPO with rl.tools equal to TRL 1.16's GRPOTrainer(tools=...) end to end (issue 67): TRL's own trainer, built
from a GRPOConfig on a tiny Qwen2.5-family folder (Qwen's chat template, which renders tool calls), and our
GroupRL objective get the same chat prompts and the same sampled turns (TRL's first turn through `rollout_func`,
its later turns through `_generate_single_turn`; ours through the objective's sampler, scripted alike); from there
each runs its own code: the prompts rendered with the tools' schemas, the tool calls parsed and run (a good call, a
tool that raises, an unknown tool, a completion without a call), the tool-result tokens masked out of the loss, the
rewards on the whole conversation, the advantages, the per-token log-probabilities, the loss and its gradient:
all within 1e-5. The loop itself against TRL's, case by case, is tests/test_tools.py."""

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch
from test_grpo_trl import iterations_agree

from families import build_family

trl = pytest.importorskip("trl")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

CALC = Path(__file__).parent / "tools_fixtures" / "calc.py"
G, MAX_NEW = 2, 256
END = "<|im_end|>"


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>{END}'


# Each rollout's turns (prompt 0's two, then prompt 1's two): a good call then an answer; an answer without a call;
# a tool that raises (division by zero) then an answer; an unknown tool then an answer.
TURNS = [[call("add", '{"a": 2, "b": 3}'), f"It is 5.{END}"], [f"Seven.{END}"],
         [call("divide", '{"a": 1, "b": 0}'), f"Cannot divide.{END}"], [call("lookup", '{"q": "x"}'), f"No.{END}"]]
PROMPTS = [[{"role": "user", "content": "What is 2 + 3?"}], [{"role": "user", "content": "What is 1 / 0?"}]]


def conversation_reward(completions, **kwargs):
    """From the whole conversation: the tool results' length, the turns, the last answer's length."""
    return [sum(len(m["content"]) for m in c if m["role"] == "tool") / 10 + 0.5 * len(c) + len(c[-1]["content"]) / 20
            for c in completions]


class Script:
    """The sampled turns, a rollout found by its prompt (the prompt ids its turn continues): the same for TRL and
    for us."""

    def __init__(self, tokenizer, prompt_ids: list[list[int]]):
        self.prompt_ids, self.asked = prompt_ids, [0] * len(TURNS)
        self.turns = [[tokenizer.encode(t, add_special_tokens=False) for t in texts] for texts in TURNS]

    def __call__(self, ids_list: list[list[int]]) -> list[list[int]]:
        out = []
        for ids in ids_list:
            r = next(r for r, p in enumerate(self.prompt_ids) if ids[:len(p)] == p and self.asked[r] < len(
                self.turns[r]) and (len(ids) == len(p)) == (self.asked[r] == 0))
            out.append(list(self.turns[r][self.asked[r]]))
            self.asked[r] += 1
        return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Qwen2.5-family model whose context holds a byte-level prompt with two tools' schemas and its turns."""
    import json

    folder = build_family("qwen2.5", tmp_path_factory.mktemp("tools_trl") / "qwen", seed=3)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    return folder


def trl_trainer(tmp_path, folder, rows: list[dict], **given):
    """TRL's GRPOTrainer on `rows`, its turns scripted; `given`: tools= or environment_factory=."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False, seed=0,
                      per_device_train_batch_size=G * len(rows), num_generations=G, max_completion_length=MAX_NEW,
                      gradient_accumulation_steps=1, learning_rate=1e-6, save_strategy="no", logging_steps=1,
                      temperature=0.7, loss_type="grpo")
    state = {}

    def rollout(prompts, trainer):
        ids = trainer._tokenize_prompts(prompts)[0]
        state["script"] = Script(trainer.processing_class, ids)
        first = state["script"](ids)
        return {"prompt_ids": ids, "completion_ids": first, "logprobs": [[0.0] * len(c) for c in first]}

    def single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        out = state["script"](prompt_ids)
        return out, [[0.0] * len(c) for c in out]

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(model=model, reward_funcs=[conversation_reward], args=args,
                              train_dataset=Dataset.from_list(rows),
                              processing_class=AutoTokenizer.from_pretrained(folder), rollout_func=rollout, **given)
    trainer._generate_single_turn = single_turn
    return trainer


def ours(trainer, rows: list[dict], tools, loaded=None, **rl):
    """Our GroupRL over a copy of TRL's model, its turns scripted alike; with `loaded` (rl.environment as loaded),
    its rewards beside ours, as the run adds them."""
    from accelerate import Accelerator

    from toolkit.backends import Backend
    from toolkit.config import RewardConfig, RLConfig
    from toolkit.training.loss import use_token_loss
    from toolkit.training.online import GroupRL
    from toolkit.training.rewards import load_rewards, with_environment
    from toolkit.training.rl_tools import ToolRollouts

    model = copy.deepcopy(trainer.model)
    use_token_loss(model, "full", chunk_tokens=5)
    backend = Backend()
    backend.accelerator = Accelerator(cpu=True)
    module = type(sys)("tools_trl_rewards")
    module.conversation_reward = conversation_reward
    sys.modules["tools_trl_rewards"] = module
    rewards = load_rewards([RewardConfig(function="tools_trl_rewards:conversation_reward")])
    if loaded is not None:
        rewards = with_environment(rewards, loaded)
    cfg = RLConfig(method="grpo", num_generations=G, max_new_tokens=MAX_NEW, rewards=[], temperature=0.7,
                   loss_type="grpo", beta=0.0, tools=[t.spec for t in tools], **rl)
    cfg.epsilon_high = cfg.epsilon
    tokenizer = trainer.processing_class  # with the response schema TRL gave it (ours: the same, rollout/tools)
    rolls = ToolRollouts(cfg, tools, tokenizer, {}, model.config.max_position_embeddings, loaded)
    objective = GroupRL(cfg, rewards, tokenizer, backend, 0, ["train"], ["train"], tools=rolls)
    objective.stops = list(trainer.eos_token_ids)
    script = {}

    def generate(model, prompts, seeds):
        if "s" not in script:
            script["s"] = Script(tokenizer, prompts)
        return script["s"](prompts)
    objective.generate = generate
    micro = {"prompt_ids": [[0]] * len(rows), "keys": torch.tensor([[0, i] for i in range(len(rows))]),
             "fields": [dict(r) for r in rows]}
    return model, objective, micro


def same_sequences(theirs: dict, mine: dict) -> None:
    """Each rollout's prompt and completion token for token, and the same tokens in the loss (TRL's completion mask
    times its tool mask: the tool-result tokens out of it)."""
    loss_mask = theirs["completion_mask"] * theirs["tool_mask"]
    for i in range(len(theirs["prompt_ids"])):
        p, n = int(theirs["prompt_mask"][i].sum()), int(theirs["completion_mask"][i].sum())
        assert mine["input_ids"][i, :p + n].tolist() == theirs["prompt_ids"][i, -p:].tolist() \
            + theirs["completion_ids"][i, :n].tolist()
        assert mine["completion_mask"][i, p - 1:p - 1 + n].tolist() == loss_mask[i, :n].tolist()
        assert mine["completion_mask"][i].sum() == loss_mask[i].sum()


def test_grpo_with_tools_equals_trls_trainer_from_turns_to_gradients(tmp_path, folder):
    from toolkit.rollout.tools import load_tools

    tools = load_tools([f"{CALC}:add", f"{CALC}:divide"])
    rows = [{"prompt": p} for p in PROMPTS]
    trainer = trl_trainer(tmp_path, folder, rows, tools=[t.function for t in tools])
    model, objective, micro = ours(trainer, rows, tools)
    trainer.model.train()
    model.train()
    theirs = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS for _ in range(G)])
    mine = objective.step_batches(model, [micro], step=1)[0]

    # the tool rounds: 3 calls, 2 failed (the tool that raised, the unknown one), as TRL counts them
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    assert objective.generated["tool_call_frequency"] == pytest.approx(trl_metrics["tools/call_frequency"]) == 3 / 4
    assert objective.generated["tool_failure_frequency"] == pytest.approx(trl_metrics["tools/failure_frequency"])
    assert trl_metrics["tools/failure_frequency"] == pytest.approx(2 / 3)
    # the same sequences, and the same tokens in the loss: the tool-result tokens out of it
    assert (theirs["tool_mask"] == 0).sum() > 20
    same_sequences(theirs, mine)
    assert objective.generated["reward"] == pytest.approx(trl_metrics["reward"], rel=1e-6)
    torch.testing.assert_close(mine["advantages"].double(), theirs["advantages"].double(), rtol=1e-5, atol=1e-5)
    assert mine["advantages"].abs().sum() > 0
    # the loss, its entropy metric and every gradient
    iterations_agree(trainer, theirs, model, objective, mine, 1, False, lambda sums, metrics: None)


ENVS = Path(__file__).parent / "tools_fixtures" / "envs.py"
ENV_TURNS = [[call("step", '{"by": 2}'), f"Now 5.{END}"], [f"Still 3.{END}"],
             [call("step", '{"by": 5}'), f"Now 12.{END}"], [call("peek", "{}"), f"Seen.{END}"]]
ENV_ROWS = [{"prompt": [{"role": "user", "content": "Count up."}], "start": 3},
            {"prompt": [{"role": "user", "content": "Count on."}], "start": 7}]


def test_grpo_with_an_environment_equals_trls_trainer_from_turns_to_gradients(tmp_path, folder, monkeypatch):
    """TRL's GRPOTrainer(environment_factory=Counter): each rollout its own instance, reset with its row (the text
    reset returns appended to the prompt), its methods the tools, its get_reward a reward beside ours; the same
    rollouts, rewards (each column), advantages, loss and gradients."""
    import importlib.util

    from toolkit.rollout.environments import load_environment

    monkeypatch.setattr(sys.modules[__name__], "TURNS", ENV_TURNS)
    spec = importlib.util.spec_from_file_location("tools_trl_envs", ENVS)
    envs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(envs)
    trainer = trl_trainer(tmp_path, folder, ENV_ROWS, environment_factory=envs.Counter)
    model, objective, micro = ours(trainer, ENV_ROWS, [], load_environment(f"{ENVS}:Counter"),
                                   environment=f"{ENVS}:Counter")
    rolls = objective.tools

    trainer.model.train()
    model.train()
    theirs = trainer._generate_and_score_completions([dict(r) for r in ENV_ROWS for _ in range(G)])
    mine = objective.step_batches(model, [micro], step=1)[0]
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    assert trl_metrics["tools/call_frequency"] == pytest.approx(3 / 4)
    assert objective.generated["tool_call_frequency"] == pytest.approx(trl_metrics["tools/call_frequency"])
    # each rollout's own counter: 3 + 2, 3, 7 + 5, 7 (peek changes nothing); TRL's reward column for it
    assert [e.total for e in rolls.environment.kinds[None].pool[:4]] == [5, 3, 12, 7]
    assert objective.generated["reward_Counter"] == pytest.approx(trl_metrics["rewards/Counter/mean"]) == 27 / 4
    assert objective.generated["reward"] == pytest.approx(trl_metrics["reward"], rel=1e-6)
    same_sequences(theirs, mine)
    torch.testing.assert_close(mine["advantages"].double(), theirs["advantages"].double(), rtol=1e-5, atol=1e-5)
    iterations_agree(trainer, theirs, model, objective, mine, 1, False, lambda sums, metrics: None)
