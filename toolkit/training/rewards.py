"""The reward functions of online RL (rl.rewards): loading them, trying them before training, scoring completions.

A function is called as TRL 1.16's GRPOTrainer calls one (`_calculate_rewards`): once per batch, with the keywords
prompts, completions, completion_ids, trainer_state, log_extra, log_metric and every other column of the rows (one
value per completion), so a function written for TRL works unchanged. It returns one real number, or None (no
opinion), per completion. A completion's total is TRL's: the weighted sum over the functions with the None terms left
out (nansum), and NaN where every function said None (TRL marks it unscorable: left out of its group's baseline, no
advantage). trainer_state is a transformers TrainerState as TRL's (global_step: the optimizer steps done, 0 at the
first; max_steps); log_metric(name, value) and log_extra(column, values) record into a `Logged` if given.
Async functions run together, after the synchronous ones, on one event loop that lives as long as the process (a
daemon thread, as TRL's), so a client a function made at the first step still works at the next.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import math
import numbers
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Optional

import numpy as np
import torch

from ..config import BUILT_IN_REWARDS, RewardConfig
from ..errors import ToolkitError
from ..rollout.tools import import_named
from .reward_model import load_reward_model

TRL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
# One object for the batch: neither copied for each call nor split per completion (log_metric and log_extra are
# made for each call, by _arguments).
_PER_BATCH = ("trainer_state",)
# Passed as they are, split per completion where one is tried alone: rl.environment's instances (TRL passes the same
# objects, whose state the rollout built; a copy would not be them, and one holding a lock or socket cannot be made).
_SHARED = ("environments",)
_CHECK_ROWS = 4
_CHECK_COMPLETIONS = ("", "The answer is 42.")


@dataclass
class Reward:
    name: str
    """As the user wrote it ("rewards.py:correct", "my_mod:fmt", "exact_match"), for messages."""
    weight: float
    function: Callable[..., Any]
    """Called as TRL calls reward functions."""
    column: Optional[str] = None
    """exact_match and numeric_match: the column holding the expected answer."""
    metric: str = ""
    """Its values' name in the step metrics, eval metrics, completions table and `toolkit eval` (metric_names):
    unique in the run and safe for every tracker. Empty: `reward_` + the sanitized name."""

    def __post_init__(self):
        self.metric = self.metric or "reward_" + safe_name(self.name.rpartition(":")[2])


@dataclass
class Logged:
    """What the functions handed log_metric and log_extra while scoring one batch (TRL's keywords)."""
    metrics: dict[str, list[float]] = field(default_factory=dict)
    """name -> the values logged (a function may log a name once per call)."""
    extra: dict[str, list] = field(default_factory=dict)
    """column -> one value per completion, for the completions table."""
    by: dict[str, str] = field(default_factory=dict)
    """name or column -> the function that logged it, to name it in an error."""
    reserved: frozenset = frozenset()
    """Columns the completions table has already: log_extra refuses them."""


def load_rewards(entries: list[RewardConfig], template_kwargs: dict | None = None) -> list[Reward]:
    """Import each function: `path/to/file.py:name` (relative to the current folder), `module:name`, or a built-in;
    load each reward model (`template_kwargs`: model.chat_template_kwargs, for its chat template too)."""
    modules: dict[Path, ModuleType] = {}
    rewards = [_load(i, entry, modules, template_kwargs) for i, entry in enumerate(entries)]
    for reward, metric in zip(rewards, metric_names([r.name for r in rewards])):
        reward.metric = metric
    return rewards


# Characters every tracker takes in a metric name (MLflow's rule is the narrowest: letters, digits, _ - . / and
# space; W&B reads "/" as a section, so it is left out of the names made here).
_SAFE = re.compile(r"[^A-Za-z0-9_.\-]")
_TRACKER_SAFE = re.compile(r"[A-Za-z0-9_.\-/ ]{1,200}")


def safe_name(text: str) -> str:
    return _SAFE.sub("_", text) or "_"


def metric_names(names: list[str]) -> list[str]:
    """One metric name per reward, the rule used wherever a function's values are named: `reward_<function>`;
    where two different sources give the same function name, `reward_<file or module>_<function>` for each;
    a repeat of one entry `_2`, `_3`; characters a tracker refuses become `_`. Unique by construction."""
    def short(name: str) -> str:
        return safe_name(name.rpartition(":")[2])

    def long(name: str) -> str:
        source, _, attr = name.rpartition(":")
        stem = Path(source).stem if source.endswith(".py") else source.rpartition(".")[2]
        return safe_name(f"{stem}_{attr}" if source else attr)

    shared = {short(n) for n in set(names) if sum(short(m) == short(n) for m in set(names)) > 1}
    out: list[str] = []
    for name in names:
        base = "reward_" + (long(name) if short(name) in shared else short(name))
        metric, k = base, 1
        while metric in out:
            k += 1
            metric = f"{base}_{k}"
        out.append(metric)
    return out


def score(rewards: list[Reward], prompts: list, completions: list, columns: list[dict], *, step: int,
          rows: list[str], completion_ids: Optional[list[list[int]]] = None, state: Any = None,
          logged: Optional[Logged] = None, environments: Optional[list] = None
          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Score the i-th completion of prompts[i] (a text, or chat messages: a text completion is then passed as
    [{"role": "assistant", "content": text}], as TRL does), its row's other columns in columns[i], its row described by
    rows[i] ("train.jsonl row 17"); `step` names where in an error. `state` is passed as trainer_state (default: a
    TrainerState at global_step `step`); what the functions log goes into `logged` (default: dropped); `environments`
    (rl.environment): each completion's instance, passed as TRL's `environments`. Returns (the weighted total,
    float32 (n,); each function's values, NaN for None)."""
    assert rewards, "validate_rl requires at least one reward function"
    from transformers import TrainerState

    completions = [[{"role": "assistant", "content": c}] if isinstance(c, str) and isinstance(p, list) else c
                   for p, c in zip(prompts, completions)]
    reserved = set(TRL_KEYWORDS) | ({"environments"} if environments is not None else set())  # shadowed, as TRL
    keys = [k for k in dict.fromkeys(k for row in columns for k in row) if k not in reserved]
    kwargs = {"prompts": list(prompts), "completions": completions, "completion_ids": completion_ids,
              "trainer_state": state if state is not None else TrainerState(global_step=step),
              **{k: [row.get(k) for row in columns] for k in keys},
              **({"environments": list(environments)} if environments is not None else {})}
    per_function = {name: torch.tensor(v, dtype=torch.float32)
                    for name, v in _call_all(rewards, kwargs, len(completions), step, rows, logged).items()}
    values = torch.stack(list(per_function.values()), dim=1)
    total = (values * torch.tensor([r.weight for r in rewards], dtype=torch.float32)).nansum(dim=1)
    total[values.isnan().all(dim=1)] = math.nan  # every function said None: unscorable, as TRL
    return total, per_function


def with_environment(rewards: list[Reward], environment) -> list[Reward]:
    """`rewards` and rl.environment's own (rollout/environments.Environments.rewards: one per class that defines
    get_reward, weight 1, named after the class, as TRL adds them), every metric name made again over them all."""
    rewards = rewards + [Reward(name, 1.0, function) for name, function in environment.rewards()]
    for reward, metric in zip(rewards, metric_names([r.name for r in rewards])):
        reward.metric = metric
    return rewards


def check_rewards(rewards: list[Reward], prompts: list, columns: list[dict], rows: list[str],
                  environments: Optional[Callable[[list[int]], list]] = None) -> None:
    """Before the model loads: every built-in finds its column in every row given, and every function scores an empty
    and a short completion of the first rows, so one that cannot run fails now (the errors of `score`, step 0).
    `environments(rows)` (rl.environment): an instance reset with each of those rows, passed as `environments`."""
    for reward in rewards:
        missing = next((i for i, row in enumerate(columns) if reward.column and row.get(reward.column) is None), None)
        if missing is not None:
            raise ToolkitError(f"{_where(reward, 0, rows[missing])}: {_no_column(reward.column)}")
    first = range(min(len(prompts), _CHECK_ROWS))
    picked = [i for i in first for _ in _CHECK_COMPLETIONS]
    tried = [c for _ in first for c in _CHECK_COMPLETIONS]
    score(rewards, [prompts[i] for i in picked], tried, [columns[i] for i in picked], step=0,
          rows=[rows[i] for i in picked], completion_ids=[[0] * len(c.split()) for c in tried],  # stand-in ids
          environments=environments(picked) if environments is not None else None)


# --- loading


def _load(i: int, entry: RewardConfig, modules: dict[Path, ModuleType], template_kwargs: dict | None = None) -> Reward:
    if entry.model is not None:
        function = load_reward_model(f"rl.rewards[{i}].model", entry.model, template_kwargs)
        return Reward(function.__name__, entry.weight, function)
    text = entry.function
    if text in BUILT_IN_REWARDS:
        column = None if text == "regex" else entry.column
        return Reward(text, entry.weight, _built_in(entry), column)

    def fail(why: str) -> ToolkitError:
        return ToolkitError(f"rl.rewards[{i}].function: {text!r}: {why}")

    function = import_named(text, modules, fail, usage="path/to/file.py:function, module:function or a built-in "
                            f"({', '.join(BUILT_IN_REWARDS)})")
    attr = text.rpartition(":")[2]
    if not callable(function):
        raise fail(f"{attr} is a {type(function).__name__}, not a function")
    if not _takes_trl_keywords(function):
        raise fail(f"{attr}{inspect.signature(function)} cannot take the keywords TRL passes "
                   f"({', '.join(k + '=' for k in TRL_KEYWORDS)} and one per column); give it **kwargs")
    return Reward(text, entry.weight, function)


def _takes_trl_keywords(function: Callable) -> bool:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return True  # no signature to read (a C function): check_rewards calls it
    if any(p.kind is p.POSITIONAL_ONLY and p.default is p.empty for p in signature.parameters.values()):
        return False  # everything comes by keyword
    try:
        signature.bind_partial(**dict.fromkeys(TRL_KEYWORDS))
    except TypeError:
        return False
    return True


# --- calling


def _call_all(rewards: list[Reward], kwargs: dict, n: int, step: int, rows: list[str],
              logged: Optional[Logged]) -> dict[str, list[float]]:
    """Every function on the whole batch, as TRL's _calculate_rewards: the synchronous ones in order, then the async
    ones together (asyncio.gather) on the process's event loop. Their values, NaN for None, or a one-line error."""
    out, waiting = {}, []
    for reward in rewards:
        try:
            result = reward.function(**_arguments(reward, kwargs, logged))
        except Exception as err:
            raise _failure(reward, kwargs, n, step, rows, err) from None
        if inspect.isawaitable(result):
            waiting.append((reward, result))
        else:
            out[reward.metric] = result
    for (reward, _), result in zip(waiting, _together([w for _, w in waiting]) if waiting else []):
        if isinstance(result, Exception):
            raise _failure(reward, kwargs, n, step, rows, result) from None
        out[reward.metric] = result
    return {r.metric: _values(r, out[r.metric], n, step, rows) for r in rewards}


def _values(reward: Reward, out: Any, n: int, step: int, rows: list[str]) -> list[float]:
    if isinstance(out, (torch.Tensor, np.ndarray)) and out.ndim == 1:
        out = out.tolist()
    if not isinstance(out, (list, tuple)):
        raise ToolkitError(f"{_where(reward, step, _batch(rows))}: returned a {type(out).__name__}; "
                           f"return a list of {n} numbers (or None), one per completion")
    if len(out) != n:
        raise ToolkitError(f"{_where(reward, step, _batch(rows))}: returned {len(out)} values for {n} completions; "
                           f"return one per completion")
    values = []
    for i, value in enumerate(out):
        if isinstance(value, torch.Tensor) and value.ndim == 0:
            value = value.item()
        if value is None:
            values.append(math.nan)
        elif not isinstance(value, (numbers.Real, np.bool_)):
            raise ToolkitError(f"{_where(reward, step, rows[i])}: returned {_short(value)} ({type(value).__name__}) "
                               f"for completion {i}; return a real number or None")
        elif not math.isfinite(value):
            raise ToolkitError(f"{_where(reward, step, rows[i])}: returned {float(value)} for completion {i}; "
                               f"return a finite number, or None for no opinion")
        else:
            values.append(float(value))
    return values


def _arguments(reward: Reward, kwargs: dict, logged: Optional[Logged]) -> dict:
    """The function's own copy of the arguments (one that changes prompts, completions or a column in place changes
    nothing another function or the loss sees), with log_metric and log_extra recording under its name."""
    n = len(kwargs["completions"])
    who = reward.name

    def log_metric(name: str, value: float) -> None:  # TRL's parameter names: log_metric(name=..., value=...)
        if not isinstance(name, str) or not name:
            raise ToolkitError(f"log_metric({name!r}, ...): give the metric a name (a text)")
        if not _TRACKER_SAFE.fullmatch(name):
            raise ToolkitError(f"log_metric({name!r}, ...) in {who}: a tracker refuses that name (MLflow's rule, the "
                               "narrowest: at most 200 of letters, digits, _ - . / and space); rename it")
        if isinstance(value, torch.Tensor) and value.numel() == 1 or isinstance(value, np.ndarray) and value.size == 1:
            value = value.item()
        if not isinstance(value, numbers.Real):  # NaN too: TRL averages it in as it is
            raise ToolkitError(f"log_metric({name!r}, {_short(value)}): give one number")
        if logged is not None:
            logged.metrics.setdefault(name, []).append(float(value))
            logged.by.setdefault(name, who)

    def log_extra(column: str, values: list) -> None:
        if not isinstance(column, str) or not column:
            raise ToolkitError(f"log_extra({column!r}, ...): give the column a name (a text)")
        if isinstance(values, (torch.Tensor, np.ndarray)):
            values = values.tolist()
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
            raise ToolkitError(f"log_extra({column!r}, ...): got {got} for {n} completions; give one per completion")
        if logged is not None and column in logged.reserved:
            raise ToolkitError(f"log_extra({column!r}, ...): the completions table has a column of that name; give "
                               "it another name")
        if logged is not None and column in logged.extra:
            raise ToolkitError(f"log_extra({column!r}, ...): {logged.by[column]} already gave this batch's "
                               f"{column!r}; give each column once per batch")
        if logged is not None:
            logged.extra.setdefault(column, []).extend(values)
            logged.by.setdefault(column, who)

    return {**{k: v if k in _PER_BATCH else list(v) if k in _SHARED else copy.deepcopy(v) for k, v in kwargs.items()},
            "log_metric": log_metric, "log_extra": log_extra}


_LOOP: Optional[asyncio.AbstractEventLoop] = None


def _together(awaitables: list) -> list:
    """Await them together on the process's one event loop, started on a daemon thread at first use (TRL's
    start_event_loop_in_daemon): an HTTP client or lock a function made at one step is bound to that loop and still
    works at the next. Each result, or the exception it raised."""
    global _LOOP
    if _LOOP is None:
        _LOOP = asyncio.new_event_loop()
        threading.Thread(target=_LOOP.run_forever, name="toolkit-rewards", daemon=True).start()

    async def gather():
        return await asyncio.gather(*awaitables, return_exceptions=True)
    return asyncio.run_coroutine_threadsafe(gather(), _LOOP).result()


def _invoke(reward: Reward, kwargs: dict) -> Any:
    """One function on its own copy of the arguments, awaited if async; what it logs is dropped."""
    out = reward.function(**_arguments(reward, kwargs, None))
    if inspect.isawaitable(out):
        out = _together([out])[0]
        if isinstance(out, Exception):
            raise out
    return out


def _failure(reward: Reward, kwargs: dict, n: int, step: int, rows: list[str], err: Exception) -> ToolkitError:
    """A one-line error naming the first completion that fails alone (its row), else the batch with the batch's
    error."""
    row = _batch(rows)
    for i in range(n):
        one = {k: v if k in _PER_BATCH or v is None else v[i:i + 1] for k, v in kwargs.items()}
        try:
            _invoke(reward, one)
        except Exception as single:
            row, err = rows[i], single
            break
    return ToolkitError(f"{_where(reward, step, row)}: {_describe(err)}")


def _where(reward: Reward, step: int, row: str) -> str:
    return f"{row}: reward {reward.name} at step {step}"


def _batch(rows: list[str]) -> str:
    distinct = list(dict.fromkeys(rows))
    return ", ".join(distinct) if len(distinct) <= 3 else f"{', '.join(distinct[:2])} and {len(distinct) - 2} more rows"


def _describe(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    message = lines[0] if lines else ""
    return message if isinstance(err, ToolkitError) else f"raised {type(err).__name__}: {message}".rstrip(": ")


def _short(value: Any) -> str:
    text = repr(value).splitlines()[0] if repr(value) else ""
    return text if len(text) <= 40 else text[:37] + "..."


# --- built-ins (pure Python; a completion is a text or a list of chat messages, the last one read)


def _built_in(entry: RewardConfig) -> Callable[..., list[float]]:
    if entry.function == "regex":
        pattern = re.compile(entry.pattern, re.DOTALL)

        def regex(completions: list, **kwargs) -> list[float]:
            return [1.0 if pattern.search(_text(c)) else 0.0 for c in completions]
        return regex

    same = _same_text if entry.function == "exact_match" else _same_number
    column = entry.column

    def match(completions: list, **kwargs) -> list[float]:
        answers = kwargs.get(column)
        if answers is None or any(a is None for a in answers):
            raise ToolkitError(_no_column(column))
        return [1.0 if same(_text(c), a) else 0.0 for c, a in zip(completions, answers)]
    match.__name__ = entry.function
    return match


def _no_column(column: str) -> str:
    return f"the row has no {column!r} column; give it one, or name the answer's column in the reward's `column` key"


def _text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    return (completion[-1].get("content") or "") if completion else ""


def _normalise(text: str) -> str:
    """Lowercase, whitespace collapsed and stripped, one final period dropped: "  The  Answer. " -> "the answer"."""
    return " ".join(text.lower().split()).removesuffix(".").rstrip()


def _same_text(completion: str, answer: Any) -> bool:
    """exact_match compares the whole completion: a model that explains first needs a regex or a function of its own."""
    return _normalise(completion) == _normalise(str(answer))


# An optional minus not glued to a word ("3-5" is 3 and 5), digits with thousands commas or plain, optional decimals.
_NUMBER = re.compile(r"(?:(?<!\w)-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def _last_number(text: str) -> Optional[float]:
    found = _NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def _same_number(completion: str, answer: Any) -> bool:
    """The completion's last number equals the answer (a number, or the last number of a text) within 1e-6 relative."""
    is_number = isinstance(answer, numbers.Real) and not isinstance(answer, bool)
    expected = float(answer) if is_number else _last_number(str(answer))
    if expected is None:
        raise ToolkitError(f"the answer {_short(answer)} holds no number for numeric_match")
    got = _last_number(completion)
    return got is not None and math.isclose(got, expected, rel_tol=1e-6)
