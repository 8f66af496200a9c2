"""rl.tools inside online RL's rollout: the prompts rendered with the tools' schemas, TRL's tool-calling loop
(`rollout/tools.run_tools`) run over the objective's own sampler or the vLLM server, each tool turn sampled with a
seed of its own, and the tool metrics reduced over the ranks. `online.GroupRL` holds one `ToolRollouts` where the
recipe names tools."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import faults
from ..errors import ToolkitError
from ..model.sampling import completion_seed
from ..rollout.tools import Tool, prompt_ids, run_tools


@dataclass
class Rolled:
    """A generated batch after its tool rounds: what the loss and the rewards take."""
    completions: list[list[int]]
    tool_masks: list[list[int]]
    answers: list[list[dict]]  # each completion as messages (assistant, tool, ..., assistant): the rewards'
    logprobs: list[list[float]] | None
    calls: int
    failures: int
    timeouts: int


class ToolRollouts:
    """The run's tools (loaded, and the tokenizer checked, before the model loads: training/build.py), and how a
    batch's completions go on through their tool calls."""

    def __init__(self, cfg, tools: list[Tool], tokenizer, template_kwargs: dict | None = None,
                 max_length: int | None = None):
        self.cfg, self.tools, self.tokenizer, self.max_length = cfg, tools, tokenizer, max_length
        self.kwargs = dict(template_kwargs or {})  # the tokenizer was checked when the run started (check_tokenizer)

    def describe(self) -> str:
        limit = self.cfg.max_tool_calling_iterations
        return (f"rl: tools {', '.join(t.name for t in self.tools)} ("
                + (f"at most {limit} rounds" if limit is not None else "rounds until an answer without a call")
                + (f", {self.cfg.tool_timeout:g} s per call" if self.cfg.tool_timeout is not None else "")
                + "); tool-result tokens are not in the loss")

    def prompts(self, fields: list[dict], rows: list[str]) -> list[list[int]]:
        """Each row's chat prompt with the tools' schemas in the template (TRL's _tokenize_prompts); a row without
        a prompt (a batch of eval padding only) an empty user message."""
        for f, row in zip(fields, rows):
            if isinstance(f.get("prompt"), str):
                raise ToolkitError(f"{row}: rl.tools needs prompts written as chat messages (the tools' schemas go "
                                   "into the chat template); this prompt is text")
        return prompt_ids(self.tokenizer, [self.messages(f) for f in fields], self.tools, self.kwargs)

    @staticmethod
    def messages(row: dict) -> list[dict]:
        return row.get("prompt") or [{"role": "user", "content": ""}]

    def run(self, fields: list[dict], prompts: list[list[int]], completions: list[list[int]], sample, *,
            seeds: list[tuple], logprobs: list[list[float]] | None, synced) -> Rolled:
        """TRL's tool-calling loop over the first completions. `sample(prompt_ids, seeds)` samples one turn per
        prompt (and gives log-probabilities where `logprobs` is given); `seeds[i]`: rollout i's seed parts, the turn
        appended for each turn after the first; `synced`: whether every rank is done (every rank samples, an empty
        list where it has nothing left, until all are)."""
        if seeds and seeds[0][1] == 2:  # optimizer step 2's tool rounds start (the fault matrix's seam)
            faults.at("tool")

        def generate(ids: list[list[int]], which: list[int], turn: int):
            return sample(ids, [completion_seed(*seeds[w], turn) for w in which])
        rollouts = run_tools([self.messages(f) for f in fields], prompts, completions, generate, self.tokenizer,
                             self.tools, max_iterations=self.cfg.max_tool_calling_iterations,
                             max_new_tokens=self.cfg.max_new_tokens, timeout=self.cfg.tool_timeout,
                             max_length=self.max_length, logprobs=logprobs, template_kwargs=self.kwargs, synced=synced)
        return Rolled([r.completion_ids for r in rollouts], [r.tool_mask for r in rollouts],
                      [r.messages for r in rollouts], [r.logprobs for r in rollouts] if logprobs is not None else None,
                      sum(r.tool_calls for r in rollouts), sum(r.tool_failures for r in rollouts),
                      sum(r.tool_timeouts for r in rollouts))


def tool_metrics(accelerator, rolled: Rolled | None) -> dict[str, float]:
    """TRL's tools/call_frequency (calls per completion) and tools/failure_frequency (failed calls per call), and
    the calls cut off by rl.tool_timeout, over the global batch."""
    if rolled is None:
        return {}
    local = torch.tensor([rolled.calls, rolled.failures, rolled.timeouts, len(rolled.completions)],
                         dtype=torch.float64, device=accelerator.device)
    calls, failures, timeouts, n = accelerator.reduce(local, "sum").cpu().tolist()
    return {"tool_call_frequency": calls / max(n, 1), "tool_failure_frequency": failures / calls if calls else 0.0,
            "tool_timeouts": timeouts}


def masked(completion_mask: torch.Tensor, prompts: list[list[int]], tool_masks: list[list[int]] | None):
    """The completion mask (over labels[:, 1:]) times each row's tool mask: tool-result tokens out of the loss and
    the entropy, as TRL's completion_mask * tool_mask."""
    if tool_masks is None:
        return completion_mask
    for i, (p, m) in enumerate(zip(prompts, tool_masks)):
        completion_mask[i, len(p) - 1:len(p) - 1 + len(m)] *= torch.tensor(m, dtype=completion_mask.dtype)
    return completion_mask
