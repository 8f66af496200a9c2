"""rl.tools (toolkit/rollout/tools.py) against TRL 1.16's own tool-calling code: GRPOTrainer's `_tool_call_loop`,
`_get_tool_suffix_ids` and `_tokenize_prompts`, bound to an object carrying the attributes they read, and TRL's
`parse_response` for the first turn (as its `_generate` does). Both sides get the same prompts, tools and scripted
sampled turns (a byte-level tokenizer with Qwen2.5's real chat template and TRL's response template for it); the
completion ids, tool masks, log-probabilities, conversations and counts must be the same. Plus the timeout (TRL has
none) and the one-line refusals of tools and tokenizers the loop cannot use."""

import time
import types
from pathlib import Path

import pytest

from toolkit.errors import ToolkitError
from toolkit.rollout.tools import (
    check_tokenizer,
    load_tools,
    parse_completion,
    prompt_ids,
    run_tools,
    with_response_schema,
)

from families import FAMILIES, family_tokenizer

trl = pytest.importorskip("trl")
from trl.chat_template_utils import (  # noqa: E402
    add_response_schema,
    is_chat_template_prefix_preserving,
    parse_response,
    supports_tool_calling,
)
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402

CALC = Path(__file__).parent / "tools_fixtures" / "calc.py"
END = "<|im_end|>"
GPT_OSS = dict(special=["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                        "<|constrain|>", "<|return|>", "<|call|>"], added=[], bos=None, eos="<|return|>",
               pad="<|endoftext|>", template="gpt-oss.jinja")


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return add_response_schema(family_tokenizer("qwen2.5"))  # TRL's response template for Qwen's chat template


@pytest.fixture(scope="module")
def tools():
    return load_tools([f"{CALC}:add", f"{CALC}:divide", f"{CALC}:nap"])


class Script:
    """The sampled turns: turns[r][k] is rollout r's k-th turn (0: the first completion). A prompt's rollout is
    found by its prompt ids, so TRL's `_generate_single_turn` (which sees only token ids) gets the same turns."""

    def __init__(self, tokenizer, prompt_ids: list[list[int]], turns: list[list[str]]):
        self.prompt_ids, self.asked = prompt_ids, [0] * len(turns)
        self.turns = [[tokenizer.encode(t, add_special_tokens=False) for t in texts] for texts in turns]

    def first(self) -> list[list[int]]:
        return [list(t[0]) for t in self.turns]

    def __call__(self, ids_list: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
        out = []
        for ids in ids_list:
            r = next(r for r, p in enumerate(self.prompt_ids) if ids[:len(p)] == p)
            self.asked[r] += 1
            out.append(list(self.turns[r][self.asked[r]]))
        return out, [logprobs(ids) for ids in out]


def logprobs(ids: list[int]) -> list[float]:
    return [-0.01 * (j + 1) for j in range(len(ids))]


def trl_side(tokenizer, tools, prompts, turns, *, max_iterations, max_new_tokens, max_length, with_logprobs):
    functions = [t.function for t in tools]
    n = len(prompts)
    trainer = types.SimpleNamespace(
        processing_class=tokenizer, _tokenizer=tokenizer, chat_template=None, chat_template_kwargs={}, _is_vlm=False,
        tools=functions, environment_factories=None, max_tool_calling_iterations=max_iterations,
        max_completion_length=max_new_tokens, use_vllm=False,
        model=types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=max_length)),
        _sync_tool_dicts=[{f.__name__: f for f in functions} for _ in range(n)], _async_tool_dicts=[{}] * n)
    for name in ("_tool_call_loop", "_get_tool_suffix_ids", "_tokenize_prompts"):
        setattr(trainer, name, types.MethodType(getattr(GRPOTrainer, name), trainer))
    ids = trainer._tokenize_prompts(prompts)[0]
    script = Script(tokenizer, ids, turns)

    def single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        out, lps = script(prompt_ids)
        return out, lps if with_logprobs else None

    trainer._generate_single_turn = single_turn
    first = script.first()
    completions = [[parse_response(tokenizer, c, prefix=ids[i], tools=functions)] for i, c in enumerate(first)]
    tool_mask, completions, completion_ids, lps, calls, failures, _ = trainer._tool_call_loop(
        [list(p) for p in prompts], ids, first, completions,
        [logprobs(c) for c in first] if with_logprobs else None, None, {})
    return ids, dict(completion_ids=completion_ids, tool_mask=tool_mask, messages=completions, logprobs=lps,
                     calls=calls, failures=failures)


def ours(tokenizer, tools, prompts, turns, *, max_iterations, max_new_tokens, max_length, with_logprobs,
         timeout=10.0):
    ids = prompt_ids(tokenizer, prompts, tools)
    script = Script(tokenizer, ids, turns)
    first = script.first()

    def generate(prompt_ids, rollouts, turn):
        out, lps = script(prompt_ids)
        return (out, lps) if with_logprobs else out

    rollouts = run_tools(prompts, ids, first, generate, tokenizer, tools, max_iterations=max_iterations,
                         max_new_tokens=max_new_tokens, timeout=timeout, max_length=max_length,
                         logprobs=[logprobs(c) for c in first] if with_logprobs else None)
    return ids, rollouts, dict(completion_ids=[r.completion_ids for r in rollouts],
                               tool_mask=[r.tool_mask for r in rollouts], messages=[r.messages for r in rollouts],
                               logprobs=[r.logprobs for r in rollouts] if with_logprobs else None,
                               calls=sum(r.tool_calls for r in rollouts),
                               failures=sum(r.tool_failures for r in rollouts))


def same_as_trl(tokenizer, tools, turns, *, max_iterations=None, max_new_tokens=2048, max_length=100_000,
                with_logprobs=False):
    prompts = [[{"role": "user", "content": f"question {r}"}] for r in range(len(turns))]
    limits = dict(max_iterations=max_iterations, max_new_tokens=max_new_tokens, max_length=max_length,
                  with_logprobs=with_logprobs)
    trl_ids, expected = trl_side(tokenizer, tools, prompts, turns, **{
        **limits, "max_iterations": 2**63 - 1 if max_iterations is None else max_iterations})
    our_ids, rollouts, got = ours(tokenizer, tools, prompts, turns, **limits)
    assert our_ids == trl_ids
    for key in expected:
        assert got[key] == expected[key], key
    for rollout, prompt in zip(rollouts, prompts):
        assert rollout.conversation == prompt + rollout.messages
        assert len(rollout.tool_mask) == len(rollout.completion_ids)
    return rollouts


def conversation_reward(prompts, completions, completion_ids, **kwargs) -> list[float]:
    """Reads the whole conversation: the tool results and the final answer."""
    return [sum(len(m["content"]) for m in c if m["role"] == "tool") + 0.5 * len(c) + 1e-3 * len(ids) + len(p)
            for p, c, ids in zip(prompts, completions, completion_ids)]


def test_reward_functions_get_the_whole_conversation_as_trl_gives_it(tokenizer, tools):
    """TRL's _calculate_rewards on its loop's completions, and the toolkit's rewards.score on the rollouts."""
    from transformers import TrainerState

    from toolkit.training.rewards import Reward, score

    turns = [[call("add", '{"a": 2, "b": 3}') + END, call("divide", '{"a": 1, "b": 0}') + END, "Five." + END],
             ["Four." + END], [call("nope", "{}") + END, "Hm." + END]]
    prompts = [[{"role": "user", "content": f"question {r}"}] for r in range(len(turns))]
    limits = dict(max_iterations=2**63 - 1, max_new_tokens=2048, max_length=100_000, with_logprobs=False)
    _, trl_out = trl_side(tokenizer, tools, prompts, turns, **limits)
    trainer = types.SimpleNamespace(
        accelerator=types.SimpleNamespace(device="cpu", is_main_process=True), args=types.SimpleNamespace(report_to=[]),
        state=TrainerState(), reward_funcs=[conversation_reward], reward_processing_classes=[None],
        reward_func_names=["conversation_reward"], environments=None, _log_completion_extra=None, _log_metric=None)
    expected = GRPOTrainer._calculate_rewards(trainer, [{"prompt": p} for p in prompts], prompts,
                                              trl_out["messages"], trl_out["completion_ids"])[:, 0]
    _, rollouts, _ = ours(tokenizer, tools, prompts, turns, **{**limits, "max_iterations": None})
    got, _ = score([Reward("conversation_reward", 1.0, conversation_reward)], prompts,
                   [r.messages for r in rollouts], [{} for _ in prompts], step=1, rows=["row"] * len(prompts),
                   completion_ids=[r.completion_ids for r in rollouts])
    assert got.tolist() == pytest.approx(expected.tolist(), abs=1e-5)
    assert [r.conversation[-1]["content"] for r in rollouts] == ["Five.", "Four.", "Hm."]


def test_a_good_call_and_a_completion_without_one(tokenizer, tools):
    rollouts = same_as_trl(tokenizer, tools, [
        [call("add", '{"a": 2, "b": 3}') + call("add", '{"a": 1, "b": 1}') + END, "It is 5 and 2." + END],
        ["No tools needed: 4." + END]], with_logprobs=True)
    assert [m["role"] for m in rollouts[0].messages] == ["assistant", "tool", "tool", "assistant"]
    assert [m["content"] for m in rollouts[0].messages[1:3]] == ["5", "2"]
    assert 0 in rollouts[0].tool_mask and set(rollouts[1].tool_mask) == {1}
    assert (rollouts[0].tool_calls, rollouts[0].tool_failures, rollouts[1].tool_calls) == (2, 0, 0)


def test_a_tool_that_raises_an_unknown_tool_and_malformed_arguments(tokenizer, tools):
    rollouts = same_as_trl(tokenizer, tools, [
        [call("divide", '{"a": 1, "b": 0}') + END, "Cannot." + END],
        [call("multiply", '{"a": 1, "b": 2}') + END, "No such tool." + END],
        [call("add", '{"a": 1, "c": 2}') + END, "Wrong." + END],
        [call("add", '"one and two"') + END, "Wrong again." + END],
        [call("add", '{"a": 1, "b": 2') + END]])  # unreadable JSON: plain text, no call (TRL's fallback)
    said = [r.messages[1]["content"] if len(r.messages) > 1 else None for r in rollouts]
    assert said[:3] == ["{'error': 'division by zero'}", "{'error': 'Tool multiply not found.'}",
                        "{'error': \"add() got an unexpected keyword argument 'c'\"}"]
    assert said[3].endswith("calc.add() argument after ** must be a mapping, not str'}") and said[4] is None
    assert [(r.tool_calls, r.tool_failures) for r in rollouts] == [(1, 1)] * 4 + [(0, 0)]


def test_the_iteration_limit(tokenizer, tools):
    turns = [[call("add", f'{{"a": {k}, "b": 1}}') + END for k in range(4)] + ["Done." + END]]
    for limit in (0, 1, 2, None):
        rollouts = same_as_trl(tokenizer, tools, turns, max_iterations=limit, with_logprobs=True)
        assert rollouts[0].tool_calls == (4 if limit is None else limit)


def test_the_max_length_rollback_and_cut(tokenizer, tools):
    turns = [[call("add", '{"a": 2, "b": 3}') + END, "The sum is five, written at length." + END],
             ["Short." + END]]
    whole = same_as_trl(tokenizer, tools, turns, with_logprobs=True)[0]
    first, suffix, answer = whole.tool_mask.index(0), whole.tool_mask.count(0), whole.tool_mask[::-1].index(0)
    for budget in (first, first + suffix - 1, first + suffix, first + suffix + 5, len(whole.completion_ids)):
        same_as_trl(tokenizer, tools, turns, max_new_tokens=budget, with_logprobs=True)  # rolled back ... cut
    prompt = len(prompt_ids(tokenizer, [[{"role": "user", "content": "question 0"}]], tools)[0])
    for length in (prompt + first + suffix, prompt + first + suffix + 1):  # the model's context: max_model_len
        same_as_trl(tokenizer, tools, turns, max_length=length)
    rolled = same_as_trl(tokenizer, tools, turns, max_new_tokens=first + suffix - 1)[0]
    assert rolled.tool_calls == 1 and len(rolled.messages) == 1 and rolled.tool_mask == [1] * first
    assert rolled.cut and not whole.cut  # counted in tool_rounds_cut, and said once
    cut = same_as_trl(tokenizer, tools, turns, max_new_tokens=first + suffix + 5)[0]
    assert cut.tool_mask == [1] * first + [0] * suffix + [1] * 5 and answer > 5 and not cut.cut
    assert [m["role"] for m in cut.messages] == ["assistant", "tool", "assistant"]


def test_a_hanging_tool_is_cut_off_and_counted(tokenizer, tools):
    prompts = [[{"role": "user", "content": "sleep"}], [{"role": "user", "content": "nap"}]]
    turns = [[call("nap", '{"seconds": 30}') + END, "Gave up." + END],
             [call("nap", '{"seconds": 0}') + END, "Slept." + END]]
    started = time.perf_counter()
    _, rollouts, _ = ours(tokenizer, tools, prompts, turns, max_iterations=None, max_new_tokens=2048,
                          max_length=None, with_logprobs=False, timeout=0.3)
    assert time.perf_counter() - started < 5
    assert rollouts[0].messages[1]["content"] == "{'error': 'Tool nap timed out after 0.3 seconds.'}"
    assert (rollouts[0].tool_calls, rollouts[0].tool_failures, rollouts[0].tool_timeouts) == (1, 1, 1)
    assert rollouts[1].messages[1]["content"] == "awake" and rollouts[1].tool_timeouts == 0
    assert rollouts[0].messages[-1]["content"] == "Gave up."


def test_a_tool_is_loaded_from_a_file_or_a_module(tools):
    assert [t.name for t in tools] == ["add", "divide", "nap"]
    assert tools[0].schema["function"]["parameters"]["properties"]["a"]["type"] == "integer"
    (by_module,) = load_tools(["tools_fixtures.calc:divide"])
    assert by_module.function(6, 3) == 2


@pytest.mark.parametrize("spec, why", [
    ("add", "give path/to/file.py:function or module:function"),
    ("missing.py:add", "file not found"),
    ("no_such_module_xyz:add", "importing no_such_module_xyz: raised ModuleNotFoundError"),
    ("{calc}:subtract", "has no 'subtract'"),
    ("{calc}:NOT_A_FUNCTION", "NOT_A_FUNCTION is a int, not a function"),
    ("{calc}:no_docstring", "the chat template cannot describe it"),
    ("{calc}:no_hints", "the chat template cannot describe it"),
    ("{calc}:later", "async tools are not supported"),
])
def test_a_tool_that_cannot_be_used_is_refused_in_one_line(spec, why):
    spec = spec.format(calc=CALC)
    with pytest.raises(ToolkitError) as err:
        load_tools([f"{CALC}:add", spec])
    assert str(err.value).startswith(f"rl.tools[1]: {spec!r}: ") and why in str(err.value)
    assert "\n" not in str(err.value)


def test_two_tools_of_one_name_are_refused():
    with pytest.raises(ToolkitError, match=r"rl.tools\[1\]: .*a second tool named 'add'") as err:
        load_tools([f"{CALC}:add", "tools_fixtures.calc:add"])
    assert "\n" not in str(err.value)


def test_a_tokenizer_that_cannot_read_or_render_tool_calls_is_refused(tokenizer):
    """The template checks agree with TRL's supports_tool_calling and is_chat_template_prefix_preserving."""
    check_tokenizer(tokenizer)
    with pytest.raises(ToolkitError, match="no response_template and its chat template is none TRL knows") as err:
        check_tokenizer(family_tokenizer("qwen3"))  # the tests' Qwen3 template is an older one than TRL's
    assert "\n" not in str(err.value)
    for family, why in [("gemma3", "cannot render a tool-calling conversation"), ("qwen3", "not prefix-preserving"),
                        ("llama3", None)]:
        other = family_tokenizer(family)
        other.response_template = tokenizer.response_template
        assert (why is None) == (supports_tool_calling(other) and is_chat_template_prefix_preserving(other))
        if why is None:
            check_tokenizer(other)
            continue
        with pytest.raises(ToolkitError, match=why) as err:
            check_tokenizer(other)
        assert str(err.value).startswith("rl.tools: ") and "\n" not in str(err.value)


def test_ranks_go_round_together_until_all_are_done(tokenizer, tools):
    """`synced`: a rank whose rollouts are done keeps calling generate (with nothing) while another rank goes on,
    and its rollouts come out as when it runs alone."""
    turns = [[call("add", '{"a": 2, "b": 3}') + END, "Five." + END], ["Four." + END]]
    prompts = [[{"role": "user", "content": f"question {r}"}] for r in range(len(turns))]
    limits = dict(max_iterations=None, max_new_tokens=2048, max_length=None, with_logprobs=True)
    _, _, alone = ours(tokenizer, tools, prompts, turns, **limits)
    ids = prompt_ids(tokenizer, prompts, tools)
    script, asked = Script(tokenizer, ids, turns), []

    def generate(prompt_ids, rollouts, turn):
        asked.append((rollouts, turn))
        return script(prompt_ids)

    rounds = iter(range(100))
    rollouts = run_tools(prompts, ids, script.first(), generate, tokenizer, tools, max_iterations=None,
                         max_new_tokens=2048, timeout=None, logprobs=[logprobs(c) for c in script.first()],
                         synced=lambda done: done and next(rounds) >= 3)  # the other rank needs 4 rounds
    assert asked == [([0], 1), ([], 2), ([], 3), ([], 4)]
    assert [r.completion_ids for r in rollouts] == alone["completion_ids"]
    assert [r.tool_mask for r in rollouts] == alone["tool_mask"] and [r.messages for r in rollouts] == alone["messages"]


# Completions as each template writes them: a call, plain text, text beside a call, reasoning; TRL's response template
# for the family must read them as TRL does.
WRITTEN = {
    "qwen2.5": [call("add", '{"a": 2, "b": 3}') + END, "Five." + END,
                "Let me add.\n" + call("add", '{"a": "2", "b": 3}') + END, call("add", '{"a": 1') + END],
    "llama3": ['{"name": "add", "parameters": {"a": 2, "b": 3}}<|eot_id|>', "Five.<|eot_id|>"],
    "gpt-oss": ["<|channel|>analysis<|message|>Add them.<|end|><|start|>assistant to=functions.add"
                '<|channel|>commentary json<|message|>{"a": 2, "b": 3}<|call|>',
                "<|channel|>final<|message|>Five.<|return|>"],
}


@pytest.mark.parametrize("family", [*FAMILIES, "gpt-oss"])
def test_the_response_template_attached_is_trls(family, tools):
    """For every chat template the tests build: the template TRL's add_response_schema sets (Qwen2.5, Llama 3.1,
    gpt-oss) is the one attached, and completions parse to the same messages; where TRL knows none (the others),
    a one-line refusal."""
    ours, theirs = (family_tokenizer(GPT_OSS if family == "gpt-oss" else family) for _ in range(2))
    try:
        expected = add_response_schema(theirs).response_template
    except ValueError:
        expected = None
    if expected is None:
        with pytest.raises(ToolkitError, match=r"^rl.tools: the tokenizer has no response_template") as err:
            with_response_schema(ours)
        assert "\n" not in str(err.value) and family not in WRITTEN
        return
    assert with_response_schema(ours).response_template == expected
    prefix = prompt_ids(ours, [[{"role": "user", "content": "hi"}]], tools)[0]
    for text in WRITTEN[family]:
        ids = ours.encode(text, add_special_tokens=False)
        assert parse_completion(ours, ids, prefix, tools) == parse_response(theirs, ids, prefix=prefix,
                                                                              tools=[t.function for t in tools])
    kept = family_tokenizer("qwen2.5")
    kept.response_template = {"fields": {}}
    assert with_response_schema(kept).response_template == {"fields": {}}  # one the tokenizer has is kept, as TRL


def test_every_chat_template_trl_ships_gets_trls_response_template():
    """TRL's own chat templates (trl/chat_templates/*.jinja, its training variants too): the same decision as its
    add_response_schema, template by template."""
    known = 0
    for path in sorted((Path(trl.__file__).parent / "chat_templates").glob("*.jinja")):
        theirs, ours = (types.SimpleNamespace(chat_template=path.read_text(encoding="utf-8")) for _ in range(2))
        try:
            expected = add_response_schema(theirs).response_template
        except ValueError:
            expected = None
        if expected is None:
            with pytest.raises(ToolkitError):
                with_response_schema(ours)
            continue
        known += 1
        assert with_response_schema(ours).response_template == expected, path.name
    assert known == 26


def test_a_tool_turn_follows_the_end_of_turn_whatever_the_eos(tokenizer):
    """A tokenizer whose eos is not the template's end of turn (a base model's: Qwen2.5's base ends with
    <|endoftext|>): sampling stops at <|im_end|>, so the tool turn must start with what the template writes after it
    ("\\n"). The conversation, the assistant turn through its end + the tool turn, is the template's own rendering,
    and the same as with an eos that is the end of turn (TRL's cut at the eos alone would lose the "\\n")."""
    import copy

    from toolkit.rollout.tools import _dummy_turn, tool_suffix_ids

    base = copy.deepcopy(tokenizer)
    base.eos_token = "<|endoftext|>"
    messages = [{"role": "tool", "name": "add", "content": "5"}]
    dummy = _dummy_turn("add")
    end = base.convert_tokens_to_ids(END)
    for tok in (tokenizer, base):
        full = tok.apply_chat_template(dummy + messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        turn = tok.apply_chat_template(dummy, tokenize=True, return_dict=False)
        turn = turn[:len(turn) - turn[::-1].index(end)]  # through the end of turn, where the sampler stops
        assert turn + tool_suffix_ids(tok, messages) == full
    assert tool_suffix_ids(base, messages) == tool_suffix_ids(tokenizer, messages)
    assert base.decode(tool_suffix_ids(base, messages)).startswith("\n")


def test_rounds_cut_short_are_counted_and_said_once(capsys):
    """A batch with completions that end on a call whose results would not fit: `tool_rounds_cut` counts them and the
    first such batch says so in one line with what to raise (a run whose every round was rolled back learned nothing
    of its tool, with no failure and no clipped completion to show it)."""
    from accelerate import Accelerator

    from toolkit.config.objectives import RLConfig
    from toolkit.training.rl_tools import Rolled, ToolRollouts, tool_metrics

    tools = ToolRollouts(RLConfig(max_new_tokens=56), [], tokenizer=None)
    rolled = Rolled([[1], [2], [3], [4]], [[1]] * 4, [[]] * 4, [[]] * 4, None, None, calls=4, failures=0, timeouts=0,
                    cut=3)
    for _ in range(2):
        metrics = tool_metrics(Accelerator(cpu=True), rolled, tools)
        assert metrics["tool_rounds_cut"] == 0.75 and metrics["tool_call_frequency"] == 1.0
    said = [line for line in capsys.readouterr().out.splitlines() if "left unanswered" in line]
    assert said == ["rl: 3 of 4 completions end on a tool call left unanswered: its results would pass "
                    "rl.max_new_tokens (56, the call, its results and the answer together) or the model's context, "
                    "so the round was rolled back, as TRL does; raise rl.max_new_tokens (tool_rounds_cut in the "
                    "metrics counts them)"]
