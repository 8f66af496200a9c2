"""rl.tools: the Python functions a policy may call while it samples, and TRL 1.16's tool-calling loop over them.

A tool is named as a reward function is (`path/to/file.py:name` relative to the current folder, or `module:name`) and
needs what transformers' `get_json_schema` reads (type hints, a Google-style docstring with each argument), checked at
load time; its schema goes into the chat template's `tools`. `run_tools` is GRPOTrainer's `_tool_call_loop` (and
`_get_tool_suffix_ids`) written over any sampler: each completion is parsed as the model's template writes it
(`tokenizer.parse_response` with its `response_template`, TRL's `parse_response` wrapper), every call it makes is run
and its result appended as a tool message, the tool turn's tokens are concatenated (never re-tokenized) and the
policy goes on from there, until an answer without a call or `max_iterations` (TRL's max_tool_calling_iterations).
The tool-result tokens get 0 in `tool_mask` (TRL's: the loss and the entropy never count them). A tool that raises,
a call to an unknown tool or arguments that do not fit become TRL's tool message (`{'error': '...'}`), never a crash.

Where it differs from TRL: `timeout` (TRL has none) runs each call on a daemon thread and gives up on it after that
many seconds, reporting `Tool NAME timed out after T seconds.` as the error (the thread cannot be stopped: it runs on
in the background, and a tool that never returns keeps its thread); async tools (TRL runs them on its event loop) are
refused at load; a tokenizer without a `response_template` gets the one TRL sets for its chat template
(`response_schemas.py`) and is refused where TRL knows none (a legacy `response_schema` is not read: transformers
>= 5.13 parses with the template only), as is a template that is not prefix-preserving (TRL swaps in a training
template of its own); images in tool results (TRL's VLM path) are not handled. Environments (TRL's
environment_factory, rl.environment) are `environments.py`: each rollout's tools are its own (`rollout_tools`).
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import importlib.util
import inspect
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Optional

from ..errors import ToolkitError
from ..model.inference import end_of_turn_id
from .response_schemas import known_template


@dataclass(frozen=True)
class Tool:
    spec: str
    """As the user wrote it ("tools.py:add", "my_mod:search"), for messages."""
    function: Callable[..., Any]
    schema: dict
    """transformers' get_json_schema of the function: what the chat template renders into the prompt."""

    @property
    def name(self) -> str:
        """The name the model calls it by (the function's __name__, as TRL's tool dicts key it)."""
        return self.schema["function"]["name"]


@dataclass
class Rollout:
    """One completion after its tool calls: what the loss takes (completion_ids, tool_mask) and what the reward
    functions take (messages, the whole conversation)."""
    prompt: list[dict]
    completion_ids: list[int]
    """The assistant turns and the tool-result tokens between them, as TRL concatenates them."""
    tool_mask: list[int]
    """One per completion token: 0 on tool-result tokens, 1 on the policy's own."""
    messages: list[dict]
    """The completion as messages (TRL's `completions[i]`): assistant, tool..., assistant, ..."""
    logprobs: Optional[list[float]] = None
    """The sampler's log-probability of each completion token (0.0 on tool-result tokens), where it gave them."""
    tool_calls: int = 0
    tool_failures: int = 0
    """Calls answered with an error: the tool raised, is unknown, took arguments that do not fit, or timed out."""
    tool_timeouts: int = 0
    cut: bool = False
    """Its last round's results would have passed max_new_tokens or the context: it ends on its call unanswered."""

    @property
    def conversation(self) -> list[dict]:
        return self.prompt + self.messages


# --- loading


def load_tools(specs: list[str], modules: Optional[dict[Path, ModuleType]] = None, key: str = "rl.tools") -> list[Tool]:
    """Import each `path/to/file.py:name` or `module:name` and read its schema now, so a tool the template cannot
    describe fails before the model loads. `modules`: files imported so far this run (a file is imported once)."""
    modules = {} if modules is None else modules
    tools: list[Tool] = []
    for i, text in enumerate(specs):
        def fail(why: str, i=i, text=text) -> ToolkitError:
            return ToolkitError(f"{key}[{i}]: {text!r}: {why}")

        tool = make_tool(import_named(text, modules, fail), text, fail)
        same = next((t for t in tools if t.name == tool.name), None)
        if same is not None:
            raise fail(f"a second tool named {tool.name!r} (the first: {same.spec}); the model calls tools by name")
        tools.append(tool)
    return tools


def make_tool(function: Any, spec: str, fail: Callable[[str], Exception]) -> Tool:
    """`function` (a function or a bound method) as a tool, its schema read now; `fail(why)` is raised when the model
    could not call it: not callable, async, or without what get_json_schema reads."""
    from transformers.utils import get_json_schema

    if not callable(function):
        raise fail(f"{spec.rpartition(':')[2]} is a {type(function).__name__}, not a function")
    if inspect.iscoroutinefunction(function):
        raise fail("async tools are not supported; write it as a plain (synchronous) function")
    try:
        schema = get_json_schema(function)
    except Exception as err:  # no type hints, no docstring, an argument the docstring does not describe
        message = (str(err).strip().splitlines() or [""])[0]
        raise fail(f"the chat template cannot describe it ({message}); give every argument a type hint and "
                   "a Google-style docstring with an Args: line for each") from None
    return Tool(spec, function, schema)


def import_named(text: str, modules: dict[Path, ModuleType], fail: Callable[[str], Exception],
                 usage: str = "path/to/file.py:function or module:function") -> Any:
    """The object `path/to/file.py:name` (relative to the current folder) or `module:name` names; `fail(why)` is
    raised when it cannot be had (`usage`: the forms accepted, for a text of neither form). A file is imported once
    per `modules`, under a name no other module has. Used by rl.rewards and rl.environment too."""
    source, _, attr = text.rpartition(":")
    if not source or not attr:
        raise fail(f"give {usage}")
    if source.endswith(".py") and not Path(source).expanduser().is_file():
        raise fail(f"file not found: {Path(source).expanduser()} (relative to the current folder, {Path.cwd()})")
    try:
        if source.endswith(".py"):
            module = import_file(Path(source).expanduser().resolve(), modules)
        else:
            module = importlib.import_module(source)
    except Exception as err:
        message = (str(err).strip().splitlines() or [""])[0]
        raised = message if isinstance(err, ToolkitError) else f"raised {type(err).__name__}: {message}".rstrip(": ")
        raise fail(f"importing {source}: {raised}") from None
    if not hasattr(module, attr):
        raise fail(f"{source} has no {attr!r}")
    return getattr(module, attr)


def import_file(path: Path, modules: dict[Path, ModuleType]) -> ModuleType:
    """Import a file once per `modules`, under a name no other module has; its folder is on sys.path only while it
    runs (so it can import the modules beside it)."""
    if path not in modules:
        name = f"toolkit_user_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickle look a class's module up there
        sys.path.insert(0, str(path.parent))
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        finally:
            if str(path.parent) in sys.path:
                sys.path.remove(str(path.parent))
        modules[path] = module
    return modules[path]


# --- the tokenizer


def check_tokenizer(tokenizer, template_kwargs: Optional[dict] = None, key: str = "rl.tools") -> None:
    """Refuse, in one line, a tokenizer the loop cannot work with: transformers without response parsing by tool
    schema (5.15), no `response_template` to read tool calls with (one TRL knows for its chat template is attached
    first: `with_response_schema`), a chat template that drops a tool call or its result (TRL's
    supports_tool_calling), or one that renders a turn differently once a tool message follows it (TRL's
    is_chat_template_prefix_preserving: the tool turn's tokens are cut from two renderings)."""
    kwargs = template_kwargs or {}
    if "tools" not in inspect.signature(tokenizer.parse_response).parameters:
        raise ToolkitError(f"{key}: reading tool calls needs transformers >= 5.15 (parse_response with tools=); "
                           "upgrade transformers")
    with_response_schema(tokenizer, key)
    sentinels = ("tool_name_a8f3e2b1", "tool_arg_key_b9d4f5c2", "tool_arg_val_d6e7a9f3", "tool_content_c4f9a8e2")
    name, arg, value, content = sentinels
    call = [{"type": "function", "function": {"name": name, "arguments": {arg: value}}}]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": call},
                {"role": "tool", "name": name, "content": content}]
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception:
        rendered = ""
    if not all(s in rendered for s in sentinels):
        raise ToolkitError(f"{key}: the chat template cannot render a tool-calling conversation (user, assistant "
                           "with tool_calls, tool); use the model's tool-calling template (model.chat_template)")
    dummy = _dummy_turn("dummy")
    before = tokenizer.apply_chat_template(dummy, tokenize=True, return_dict=False, **kwargs)
    after = tokenizer.apply_chat_template(dummy + [{"role": "tool", "name": "dummy", "content": "dummy"}],
                                          tokenize=True, return_dict=False, add_generation_prompt=True, **kwargs)
    if after[:len(before)] != before:
        raise ToolkitError(f"{key}: the chat template renders an assistant turn differently once a tool message "
                           "follows it (not prefix-preserving), so the tool turn's tokens cannot be cut out; use a "
                           "template that renders earlier turns the same whatever follows (model.chat_template)")


def with_response_schema(tokenizer, key: str = "rl.tools"):
    """The tokenizer, given the response template TRL 1.16's add_response_schema sets for its chat template where it
    has none (GRPOTrainer does so when it has tools): Qwen2.5/3, Llama 3.1/3.2, GLM-4-MoE, gpt-oss, Nemotron 3, LFM2.5,
    Gemma 4 and DeepSeek-R1-Distill templates. One it has is kept; without one, a template TRL does not know is
    refused in one line."""
    if getattr(tokenizer, "response_template", None) is not None:
        return tokenizer
    known = known_template(tokenizer.chat_template)
    if known is None:
        raise ToolkitError(f"{key}: the tokenizer has no response_template and its chat template is none TRL knows one "
                           "for (Qwen2.5 to 3.x, Llama 3.1/3.2, GLM-4-MoE, gpt-oss, Nemotron 3, LFM2.5, Gemma 4), so "
                           "the model's tool calls cannot be read; give it the one for its chat template "
                           "(transformers' response parsing: `response_template` in tokenizer_config.json)")
    tokenizer.response_template = known[1]
    return tokenizer


def prompt_ids(tokenizer, prompts: list[list[dict]], tools: list[Tool], template_kwargs: Optional[dict] = None,
               rollout_tools: Optional[list[list[Tool]]] = None) -> list[list[int]]:
    """Each chat prompt's token ids with the tools' schemas in the template's `tools` (TRL's _tokenize_prompts);
    `rollout_tools`: each prompt's own tools instead (an environment's: TRL renders each prompt with its own)."""
    return [tokenizer.apply_chat_template([prompt], tools=[t.schema for t in own] or None,
                                          add_generation_prompt=True, tokenize=True, return_dict=True,
                                          **(template_kwargs or {}))["input_ids"][0]
            for prompt, own in zip(prompts, rollout_tools if rollout_tools is not None else [tools] * len(prompts))]


def parse_completion(tokenizer, ids: list[int], prefix: list[int], tools: list[Tool]) -> dict:
    """A completion as the assistant message its template wrote (TRL's parse_response): content, and tool_calls
    where it made any; a completion the parser cannot read (a malformed call) is plain text, as TRL's fallback."""
    try:
        parsed = tokenizer.parse_response(ids, prefix=prefix, tools=[t.schema for t in tools])
        if parsed is None:  # heavily truncated
            raise ValueError("parse_response returned None")
        if isinstance(parsed.get("content"), str):
            parsed["content"] = parsed["content"].removesuffix(tokenizer.eos_token)
        if not parsed.get("content"):
            parsed["content"] = ""
        if "tool_calls" in parsed:
            _check_calls(parsed["tool_calls"])
    except (ValueError, TypeError):
        parsed = {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
    return parsed


def _check_calls(calls: Any) -> None:
    """TRL's _validate_tool_calls: a call without a name is unreadable (ValueError); missing arguments are {}."""
    if calls is None:
        return
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise ValueError("tool_calls must be a list of dicts")
    for call in calls:
        inner = call.get("function", call)
        if not isinstance(inner, dict) or not isinstance(inner.get("name"), str):
            raise ValueError("a tool call needs a name")
        if inner.get("arguments") is None:
            inner["arguments"] = {}


def tool_suffix_ids(tokenizer, tool_messages: list[dict], template_kwargs: Optional[dict] = None) -> list[int]:
    """The tokens the template writes for the tool messages after an assistant turn, up to the next assistant turn's
    header (TRL's _get_tool_suffix_ids: a dummy conversation rendered without and with them, the first cut after its
    last EOS, or its last end-of-turn token: where the tokenizer's eos is not the template's end of turn (a base
    model's tokenizer), TRL's cut keeps what the template writes after the turn's end ("\n") out of the tool turn,
    while sampling stops at the end of turn, so the conversation would lack it)."""
    kwargs = template_kwargs or {}
    dummy = _dummy_turn(tool_messages[0]["name"])  # the real name: some templates derive the tool header from it
    prefix = tokenizer.apply_chat_template(dummy, add_generation_prompt=False, tokenize=True, return_dict=False,
                                           **kwargs)
    full = tokenizer.apply_chat_template(dummy + tool_messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=False, **kwargs)
    ends = {tokenizer.eos_token_id, end_of_turn_id(tokenizer)} - {None}
    cuts = [i for i, token in enumerate(prefix) if token in ends]
    if cuts:  # templates that write "<end of turn>\n" after a turn: the cut is after the end, where sampling stops
        prefix = prefix[:cuts[-1] + 1]
    if full[:len(prefix)] != prefix:
        raise ToolkitError("rl.tools: the chat template renders the assistant turn differently once a tool message "
                           "follows it; the tool turn's tokens cannot be cut out")
    return full[len(prefix):]


def _dummy_turn(name: str) -> list[dict]:
    call = [{"type": "function", "function": {"name": name, "arguments": {}}}]
    return [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": call}]


# --- the loop


def run_tools(prompts: list[list[dict]], prompt_ids: list[list[int]], completion_ids: list[list[int]],
              generate: Callable, tokenizer, tools: list[Tool], *, max_iterations: Optional[int],
              max_new_tokens: int, timeout: Optional[float], max_length: Optional[int] = None,
              logprobs: Optional[list[list[float]]] = None, template_kwargs: Optional[dict] = None,
              synced: Optional[Callable[[bool], bool]] = None,
              rollout_tools: Optional[list[list[Tool]]] = None) -> list[Rollout]:
    """TRL 1.16's _tool_call_loop over the first completions of `prompts` (chat messages, rendered with the tools
    into `prompt_ids`). `generate(prompt_ids, rollouts, turn)`: the next completion of each prompt given (the
    indices of the rollouts they belong to, and the turn, 1 after the first tool results, for seeding); it returns
    the token ids, or (ids, log-probabilities) where `logprobs` (the first turns') is given. `max_iterations`: tool
    rounds at most (None: no limit). `max_new_tokens`: the completion's budget, tool tokens included: a round whose
    tool results would pass it, or reach `max_length` (the model's context) with the prompt, is rolled back and the
    rollout ends there; a turn after tool results is cut to what remains. `timeout`: seconds one call may take (None:
    no limit, as TRL). `synced(done)`: whether every rank is done (sampling's convention); given, the ranks go round
    together until all are, a rank with nothing left calling `generate([], [], turn)` (a sharded forward is a
    collective), so `generate` must take an empty list; None: this process alone, TRL's loop exactly.
    `rollout_tools`: each rollout's own tools instead of `tools` (its environment's bound methods: TRL's per-rollout
    tool dicts, a later tool of a name winning), rendered into its prompt ids the same way (`prompt_ids`)."""
    own = rollout_tools if rollout_tools is not None else [tools] * len(prompts)
    by_name = [{t.name: t for t in tool_list} for tool_list in own]
    rollouts = [Rollout(copy.deepcopy(p), list(c), [1] * len(c), [parse_completion(tokenizer, c, ids, own[i])],
                        list(logprobs[i]) if logprobs is not None else None)
                for i, (p, ids, c) in enumerate(zip(prompts, prompt_ids, completion_ids))]
    calls = {i: r.messages[0].get("tool_calls") for i, r in enumerate(rollouts)}
    active = [i for i in calls if calls[i]]
    turn = 0
    while True:
        done = not active or max_iterations is not None and turn >= max_iterations
        if synced(done) if synced is not None else done:
            break
        active = [] if done else active  # at the limit, waiting for the other ranks: no more calls
        extended = {}
        for i in active:
            rollout = rollouts[i]
            before = len(rollout.messages)
            rollout.messages += [_answer(call, by_name[i], timeout, rollout) for call in calls[i]]
            ids = prompt_ids[i] + rollout.completion_ids + tool_suffix_ids(tokenizer, rollout.messages[before:],
                                                                           template_kwargs)
            if len(ids) - len(prompt_ids[i]) > max_new_tokens or max_length is not None and len(ids) >= max_length:
                del rollout.messages[before:]  # the results would not fit: the rollout ends with its call unanswered
                rollout.cut = True
            else:
                extended[i] = ids
        active = [i for i in active if i in extended]
        if not active and synced is None:
            break
        out = generate([extended[i] for i in active], list(active), turn + 1)
        turns, turn_logprobs = out if logprobs is not None else (out, None)
        for k, i in enumerate(active):
            rollout, ids, new = rollouts[i], extended[i], list(turns[k])
            room = max_new_tokens - (len(ids) - len(prompt_ids[i]))
            new = new[:room]  # the sampler's turn cut to the completion's budget, as TRL cuts it
            tool_length = len(ids) - len(prompt_ids[i]) - len(rollout.completion_ids)
            rollout.tool_mask += [0] * tool_length + [1] * len(new)
            if rollout.logprobs is not None:
                rollout.logprobs += [0.0] * tool_length + list(turn_logprobs[k])[:len(new)]
            rollout.completion_ids = ids[len(prompt_ids[i]):] + new
            parsed = parse_completion(tokenizer, new, ids, own[i]) if new else {}
            if parsed:  # {}: the turn was cut to nothing
                rollout.messages.append(parsed)
            calls[i] = parsed.get("tool_calls")
        active = [i for i in active if calls[i]]
        turn += 1
    return rollouts


def _answer(call: dict, tools: dict[str, Tool], timeout: Optional[float], rollout: Rollout) -> dict:
    """The tool message for one call: the tool's result as text, or TRL's error dict as text."""
    rollout.tool_calls += 1
    if call.get("type") != "function":
        rollout.tool_failures += 1
        return _message(call.get("name", "unknown"), {"error": f"Unsupported tool call type: {call.get('type')}"})
    function = call["function"]
    name = function["name"]
    try:
        if name not in tools:
            raise ValueError(f"Tool {name} not found.")
        result = _call(tools[name].function, name, function["arguments"], timeout)
    except _TimedOut as err:
        rollout.tool_failures += 1
        rollout.tool_timeouts += 1
        result = {"error": str(err)}
    except Exception as err:  # what TRL catches: the tool raised, or its arguments did not fit its signature
        rollout.tool_failures += 1
        result = {"error": str(err)}
    return _message(name, result)


def _message(name: str, result: Any) -> dict:
    # A list is passed as it is (TRL: content blocks); anything else as its str().
    return {"role": "tool", "name": name, "content": result if isinstance(result, list) else str(result)}


class _TimedOut(Exception):
    pass


def _call(function: Callable, name: str, arguments: Any, timeout: Optional[float]) -> Any:
    """function(**arguments), on a daemon thread given up on after `timeout` seconds (None: here, no limit)."""
    if timeout is None:
        return function(**arguments)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = function(**arguments)
        except BaseException as err:  # raised again below, where the loop runs
            box["error"] = err

    thread = threading.Thread(target=target, name=f"toolkit-tool-{name}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise _TimedOut(f"Tool {name} timed out after {timeout:g} seconds.")
    if "error" in box:
        raise box["error"]
    return box["value"]
