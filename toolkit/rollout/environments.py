"""rl.environment: TRL 1.16's environment_factory, a class whose instances the policy acts on through tool calls.

`FILE.py:Class` (or `module:Class`, any callable that makes an instance) is one environment for every row; a mapping
`{name: FILE.py:Class}` lets each row pick one by its `environment` column. As GRPOTrainer: each rollout gets an
instance of its own (drawn from a pool per process, made when a batch needs more than were made before: constructed
once, reset every batch), `reset(**row)` is called on it before sampling (the row without its `environment` column
where a mapping picks; a text it returns is appended to the prompt's last message), and its public methods (not
starting with `_`, not `reset` or `get_reward`, listed on the class as inspect.getmembers does, so in name order) are
that rollout's tools, bound to that instance, after rl.tools; their schemas, read from the docstrings, go into its
prompt. A class that defines `get_reward()` scores its rollouts: one extra reward function per class, weight 1, named
after the class, called with `environments=` (one instance per completion) as TRL calls it, None for a rollout of
another class. Every reward function gets `environments=` too (TRL's keyword).

Where it differs from TRL: everything is checked when the recipe loads (one instance made; a class without tool
methods, a method the chat template cannot describe, an async method or one named as an rl.tools tool is refused in
one line; TRL finds some of these mid-run or lets the environment's method shadow the tool); a reset that raises or
returns something other than None, a text or content blocks, and a row naming no known environment, are refused in
one line naming the row, as is a prompt written as text.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Optional, Union

from ..errors import ToolkitError
from .tools import Tool, import_named, make_tool

_NOT_TOOLS = ("reset", "get_reward")


@dataclass
class EnvironmentBatch:
    """One batch's rollouts, each with its own instance: what prompt_ids and run_tools (rollout_tools=) take."""
    prompts: list[list[dict]]
    """The rows' prompts, each rollout's with what its reset returned appended to the last message."""
    tools: list[list[Tool]]
    """rl.tools, then the rollout's environment's methods bound to its instance."""
    environments: list[Any]
    """The instances: pass as the reward functions' `environments` keyword (one per completion)."""


@dataclass
class _Kind:
    spec: str
    factory: Callable[[], Any]
    methods: list[str]
    schemas: dict[str, dict]
    """method name -> its schema, read once from the first instance (they are the class's)."""
    pool: list[Any]


class Environments:
    """The run's environments (per process): their classes, tools and pooled instances. `batch` once per batch."""

    def __init__(self, kinds: dict[Optional[str], _Kind], tools: list[Tool], key: str):
        self.kinds, self.tools, self.key = kinds, tools, key
        self.by_row = None not in kinds
        """A mapping: each row names its environment in its `environment` column."""

    def names(self, rows: list[dict], where: Optional[list[str]] = None) -> list[Optional[str]]:
        """Each row's environment (None where there is one for every row); a row naming none known is refused."""
        if not self.by_row:
            return [None] * len(rows)
        for i, row in enumerate(rows):
            if row.get("environment") not in self.kinds:
                said = (f"environment {row['environment']!r} is not one of {self.key}'s"
                        if row.get("environment") is not None else "no 'environment' column")
                raise ToolkitError(f"{_row(where, i)}: {said}; give each row one of: {', '.join(self.kinds)}")
        return [row["environment"] for row in rows]

    def batch(self, rows: list[dict], num_generations: int, where: Optional[list[str]] = None) -> EnvironmentBatch:
        """Per rollout (each row's num_generations rollouts in a row, as the rows are repeated for sampling): an
        instance, reset with its row, its tools and its prompt. `where`: each row's description for errors."""
        names = self.names(rows, where)
        handed: dict[Optional[str], int] = {}
        out = EnvironmentBatch([], [], [])
        for i, (row, name) in enumerate(zip(rows, names)):
            kind = self.kinds[name]
            for _ in range(num_generations):
                at = handed.get(name, 0)
                if at == len(kind.pool):
                    kind.pool.append(kind.factory())
                handed[name] = at + 1
                instance = kind.pool[at]
                out.prompts.append(self.reset(instance, row, _row(where, i)))
                out.tools.append(self.tools + [Tool(f"{kind.spec}.{m}", getattr(instance, m), kind.schemas[m])
                                               for m in kind.methods])
                out.environments.append(instance)
        return out

    def reset(self, instance: Any, row: dict, where: str) -> list[dict]:
        """instance.reset(**row) (without `environment` where a mapping picks), and the row's prompt (an empty user
        message where it has none, as TRL) with what it returned appended to the last message's content, as TRL."""
        prompt = row.get("prompt") or [{"role": "user", "content": ""}]  # TRL's, for a row without one
        if not isinstance(prompt, list) or not isinstance(prompt[-1], dict):
            raise ToolkitError(f"{where}: {self.key}: the prompt is not chat messages; an environment's tools are "
                               "called in a conversation (data.format=prompt with a list of messages)")
        arguments = {k: v for k, v in row.items() if k != "environment"} if self.by_row else row
        try:
            observation = instance.reset(**arguments)
        except Exception as err:
            message = (str(err).strip().splitlines() or [""])[0]
            raise ToolkitError(f"{where}: {self.key}: {type(instance).__name__}.reset raised "
                               f"{type(err).__name__}: {message}".rstrip(": ")) from None
        if observation is None:
            return prompt
        if not isinstance(observation, (str, list)):
            raise ToolkitError(f"{where}: {self.key}: {type(instance).__name__}.reset returned a "
                               f"{type(observation).__name__}; return None, a text (appended to the prompt) or "
                               "content blocks")
        content = prompt[-1]["content"]
        if isinstance(observation, list) and isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if isinstance(observation, str) and isinstance(content, list):
            observation = [{"type": "text", "text": observation}]
        return prompt[:-1] + [{**prompt[-1], "content": content + observation}]

    def methods(self) -> list[Tool]:
        """Each class's tool methods, bound to its first instance: what a resume compares by their source files."""
        return [Tool(f"{kind.spec}.{m}", getattr(kind.pool[0], m), kind.schemas[m])
                for kind in self.kinds.values() for m in kind.methods]

    def rewards(self) -> list[tuple[str, Callable[..., Any]]]:
        """(name, function) of the environments' own rewards, as GRPOTrainer adds them: one per class that defines
        `get_reward` (a class under two names counted once), named after the class, weight 1, called with
        `environments=`; None for a rollout whose instance is not exactly that class. Async where get_reward is."""
        out, seen = [], []
        for kind in self.kinds.values():
            env_type = type(kind.pool[0])
            if "get_reward" not in dict(inspect.getmembers(env_type, inspect.isfunction)) or env_type in seen:
                continue
            seen.append(env_type)
            if inspect.iscoroutinefunction(env_type.get_reward):
                async def get_reward(environments, _env_type=env_type, **kwargs):
                    return [await e.get_reward() if type(e) is _env_type else None for e in environments]
            else:
                def get_reward(environments, _env_type=env_type, **kwargs):
                    return [e.get_reward() if type(e) is _env_type else None for e in environments]
            out.append((env_type.__name__, get_reward))
        return out


def load_environment(spec: Union[str, dict[str, str]], tools: Optional[list[Tool]] = None,
                     modules: Optional[dict[Path, ModuleType]] = None, key: str = "rl.environment") -> Environments:
    """Import the class (`FILE.py:Class`, or a mapping of names to them), make one instance of each (the first of
    its pool) and read its tool methods' schemas now, so a class the loop cannot use fails before the model loads.
    `tools`: rl.tools (each rollout gets them too; an environment's method of the same name is refused)."""
    modules = {} if modules is None else modules
    tools = list(tools or [])
    if isinstance(spec, str):
        entries = {None: (key, spec)}
    elif isinstance(spec, dict) and spec:
        entries = {name: (f"{key}.{name}", text) for name, text in spec.items()}
    else:
        raise ToolkitError(f"{key}: give FILE.py:Class, or a mapping of names to them (a row's `environment` column "
                           f"picks one); got a {type(spec).__name__}" + (" with nothing in it" if spec == {} else ""))
    kinds = {}
    for name, (where, text) in entries.items():
        if not isinstance(name, str) and name is not None or not isinstance(text, str):
            raise ToolkitError(f"{where}: give a name (a text) and FILE.py:Class (a text); got {name!r}: "
                               f"a {type(text).__name__}")
        kinds[name] = _load_kind(where, text, tools, modules)
    return Environments(kinds, tools, key)


def _load_kind(where: str, text: str, tools: list[Tool], modules: dict[Path, ModuleType]) -> _Kind:
    def fail(why: str) -> ToolkitError:
        return ToolkitError(f"{where}: {text!r}: {why}")

    factory = import_named(text, modules, fail, usage="path/to/file.py:Class or module:Class")
    if not callable(factory):
        raise fail(f"{text.rpartition(':')[2]} is a {type(factory).__name__}, not a class")
    try:
        instance = factory()
    except Exception as err:
        message = (str(err).strip().splitlines() or [""])[0]
        raise fail(f"making one raised {type(err).__name__}: {message}".rstrip(": ")) from None
    cls = type(instance)
    members = dict(inspect.getmembers(cls, predicate=inspect.isfunction))  # on the class: properties not evaluated
    if "reset" not in members:
        raise fail(f"{cls.__name__} has no reset method; give it reset(self, **row), called with each rollout's row "
                   "before sampling (it may return a text to append to the prompt)")
    methods = [m for m in members if m not in _NOT_TOOLS and not m.startswith("_")]
    if not methods:
        raise fail(f"{cls.__name__} has no tool methods (public methods besides reset and get_reward); give it "
                   "one the model can call, with type hints and a Google-style docstring")
    schemas = {}
    for m in methods:
        tool = make_tool(getattr(instance, m), f"{text}.{m}", lambda why, m=m: fail(f"method {m}: {why}"))
        same = next((t for t in tools if t.name == tool.name), None)
        if same is not None:
            raise fail(f"method {m}: rl.tools has a tool of that name ({same.spec}); the model calls tools by name")
        schemas[m] = tool.schema
    return _Kind(text, factory, methods, schemas, [instance])


def _row(where: Optional[list[str]], i: int) -> str:
    return where[i] if where is not None else f"row {i + 1}"
