"""rl.tools inside online RL's rollout: the prompts rendered with the tools' schemas, TRL's tool-calling loop
(`rollout/tools.run_tools`) run over the objective's own sampler or the vLLM server, each tool turn sampled with a
seed of its own, and the tool metrics reduced over the ranks. `online.GroupRL` holds one `ToolRollouts` where the
recipe names tools."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from .. import faults
from ..errors import ToolkitError
from ..model.sampling import completion_seed
from ..rollout.tools import Tool, prompt_ids, run_tools


@dataclass
class Prepared:
    """A batch's rollouts before sampling: each one's chat prompt (with what its environment's reset appended), its
    token ids with its tools' schemas, its tools (None: rl.tools for every one) and its environment instance."""
    prompts: list[list[dict]]
    ids: list[list[int]]
    tools: list[list[Tool]] | None
    environments: list | None


@dataclass
class Rolled:
    """A generated batch after its tool rounds: what the loss and the rewards take."""
    completions: list[list[int]]
    tool_masks: list[list[int]]
    answers: list[list[dict]]  # each completion as messages (assistant, tool, ..., assistant): the rewards'
    prompts: list[list[dict]]  # the prompts the rewards get (TRL's: after each environment's reset)
    environments: list | None  # the rewards' `environments` keyword
    logprobs: list[list[float]] | None
    calls: int
    failures: int
    timeouts: int
    cut: int = 0  # rollouts ending on a call whose results would not fit (rl.max_new_tokens or the context)


class ToolRollouts:
    """The run's tools and environment (loaded, and the tokenizer checked, before the model loads:
    training/build.py), and how a batch's completions go on through their tool calls."""

    def __init__(self, cfg, tools: list[Tool], tokenizer, template_kwargs: dict | None = None,
                 max_length: int | None = None, environment=None):
        self.cfg, self.tools, self.tokenizer, self.max_length = cfg, tools, tokenizer, max_length
        self.environment = environment  # rollout/environments.Environments, or None
        self.kwargs = dict(template_kwargs or {})  # the tokenizer was checked when the run started (check_tokenizer)
        self.said_cut = False  # rollouts cut before their tool results: said once

    def describe(self) -> str:
        limit = self.cfg.max_tool_calling_iterations
        names = [t.name for t in self.tools] + ([f"the environment's methods ({self.cfg.environment})"]
                                               if self.environment is not None else [])
        return (f"rl: tools {', '.join(names)} ("
                + (f"at most {limit} rounds" if limit is not None else "rounds until an answer without a call")
                + (f", {self.cfg.tool_timeout:g} s per call" if self.cfg.tool_timeout is not None else "")
                + "); tool-result tokens are not in the loss")

    def prepare(self, fields: list[dict], g: int, rows: list[str]) -> Prepared:
        """The `g` rollouts of each row (`rows[i * g]` describes row i): prompts rendered with the tools' schemas
        (TRL's _tokenize_prompts); with rl.environment each real row's rollouts reset their own instances (a row of
        eval padding, without a prompt, gets rl.tools only and no instance)."""
        for f, row in zip(fields, rows[::g]):
            if isinstance(f.get("prompt"), str):
                raise text_prompt(row)
        prompts = [self.messages(f) for f in fields for _ in range(g)]
        tools = environments = None
        if self.environment is not None:
            real = [i for i, f in enumerate(fields) if f.get("prompt")]
            made = self.environment.batch([fields[i] for i in real], g, where=[rows[i * g] for i in real])
            tools, environments = [list(self.tools) for _ in prompts], [None] * len(prompts)
            for k, i in enumerate(real):
                for j in range(g):
                    at = i * g + j
                    prompts[at] = made.prompts[k * g + j]
                    tools[at], environments[at] = made.tools[k * g + j], made.environments[k * g + j]
        return Prepared(prompts, prompt_ids(self.tokenizer, prompts, self.tools, self.kwargs, rollout_tools=tools),
                        tools, environments)

    @staticmethod
    def messages(row: dict) -> list[dict]:
        return row.get("prompt") or [{"role": "user", "content": ""}]

    def run(self, prepared: Prepared, completions: list[list[int]], sample, *, seeds: list[tuple],
            logprobs: list[list[float]] | None, synced) -> Rolled:
        """TRL's tool-calling loop over the first completions. `sample(prompt_ids, seeds)` samples one turn per
        prompt (and gives log-probabilities where `logprobs` is given); `seeds[i]`: rollout i's seed parts, the turn
        appended for each turn after the first; `synced`: whether every rank is done (every rank samples, an empty
        list where it has nothing left, until all are)."""
        if seeds and seeds[0][1] == 2:  # optimizer step 2's tool rounds start (the fault matrix's seam)
            faults.at("tool")

        def generate(ids: list[list[int]], which: list[int], turn: int):
            return sample(ids, [completion_seed(*seeds[w], turn) for w in which])
        rollouts = run_tools(prepared.prompts, prepared.ids, completions, generate, self.tokenizer, self.tools,
                             max_iterations=self.cfg.max_tool_calling_iterations,
                             max_new_tokens=self.cfg.max_new_tokens, timeout=self.cfg.tool_timeout,
                             max_length=self.max_length, logprobs=logprobs, template_kwargs=self.kwargs, synced=synced,
                             rollout_tools=prepared.tools)
        return Rolled([r.completion_ids for r in rollouts], [r.tool_mask for r in rollouts],
                      [r.messages for r in rollouts], prepared.prompts, prepared.environments,
                      [r.logprobs for r in rollouts] if logprobs is not None else None,
                      sum(r.tool_calls for r in rollouts), sum(r.tool_failures for r in rollouts),
                      sum(r.tool_timeouts for r in rollouts), sum(r.cut for r in rollouts))


def text_prompt(where: str) -> ToolkitError:
    """The refusal of a text prompt where the rollout calls tools (`where`: its row)."""
    return ToolkitError(f"{where}: rl.tools and rl.environment need prompts written as chat messages (the tools' "
                        "schemas go into the chat template); this prompt is text")


def subset(rolled: Rolled | None, rows: list[int]) -> Rolled | None:
    """What the rewards of `rows` take (evaluation scores its real rows only)."""
    if rolled is None:
        return None
    return Rolled(*([x[i] for i in rows] if isinstance(x, list) else x for x in (
        rolled.completions, rolled.tool_masks, rolled.answers, rolled.prompts, rolled.environments, rolled.logprobs)),
        rolled.calls, rolled.failures, rolled.timeouts, rolled.cut)


def tool_metrics(accelerator, rolled: Rolled | None, tools: ToolRollouts | None = None) -> dict[str, float]:
    """TRL's tools/call_frequency (calls per completion) and tools/failure_frequency (failed calls per call), the
    calls cut off by rl.tool_timeout, and the share of completions that end on a call whose results would not fit
    (`tool_rounds_cut`: said once, the first time, with what to raise), over the global batch."""
    if rolled is None:
        return {}
    local = torch.tensor([rolled.calls, rolled.failures, rolled.timeouts, rolled.cut, len(rolled.completions)],
                         dtype=torch.float64, device=accelerator.device)
    calls, failures, timeouts, cut, n = accelerator.reduce(local, "sum").cpu().tolist()
    if cut and tools is not None and not tools.said_cut:
        tools.said_cut = True
        if accelerator.is_main_process:
            tqdm.write(f"rl: {int(cut)} of {int(n)} completions end on a tool call left unanswered: its results would "
                       f"pass rl.max_new_tokens ({tools.cfg.max_new_tokens}, the call, its results and the answer "
                       "together) or the model's context, so the round was rolled back, as TRL does; raise "
                       "rl.max_new_tokens (tool_rounds_cut in the metrics counts them)")
    return {"tool_call_frequency": calls / max(n, 1), "tool_failure_frequency": failures / calls if calls else 0.0,
            "tool_timeouts": timeouts, "tool_rounds_cut": cut / max(n, 1)}


def masked(completion_mask: torch.Tensor, prompts: list[list[int]], tool_masks: list[list[int]] | None):
    """The completion mask (over labels[:, 1:]) times each row's tool mask: tool-result tokens out of the loss and
    the entropy, as TRL's completion_mask * tool_mask."""
    if tool_masks is None:
        return completion_mask
    for i, (p, m) in enumerate(zip(prompts, tool_masks)):
        completion_mask[i, len(p) - 1:len(p) - 1 + len(m)] *= torch.tensor(m, dtype=completion_mask.dtype)
    return completion_mask


def own_tokenizer(tools: ToolRollouts) -> ToolRollouts:
    """The same tool rollouts with a copy of the tokenizer, for a thread of their own (rl.max_staleness): a fast
    tokenizer used from two threads at once can fail ("Already borrowed")."""
    copied = copy.copy(tools)
    copied.tokenizer = copy.deepcopy(tools.tokenizer)
    return copied
