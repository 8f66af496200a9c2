"""`python tests/tool_driver.py RECIPE.yaml [overrides]` (or under `accelerate launch`): the toolkit's training
run, for tests of rl.tools only, where a random model would never write a tool call: each rollout's first turn is,
by its row and index in its group, a call to `add`, a call to `divide` by zero, or the model's own sample. From
there everything is the run's own: the tools run, their results appended, the model samples the next turns on
the launched backend (a rank whose rollouts are done keeps the others' collectives company), the tool mask, the
rewards, the loss, checkpoints and resume. (A scripted turn sampled by a vLLM server gets log-probabilities of 0:
run it without the server correction.)"""

import sys

from toolkit import cli
from toolkit.training import rl_tools

END = "<|im_end|>"
CALLS = ['<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' + END,
         '<tool_call>\n{"name": "divide", "arguments": {"a": 1, "b": 0}}\n</tool_call>' + END]
run = rl_tools.ToolRollouts.run


def scripted(self, prepared, completions, sample, *, seeds, logprobs, synced):
    made, made_logprobs = [], []
    for i, ((_, _, _, row, k), own) in enumerate(zip(seeds, completions)):
        pick = (row + k) % 3
        made.append(self.tokenizer.encode(CALLS[pick], add_special_tokens=False) if pick < 2 else own)
        if logprobs is not None:  # a server's sample: a scripted turn has no log-probabilities of the server's
            made_logprobs.append([0.0] * len(made[-1]) if pick < 2 else logprobs[i])
    return run(self, prepared, made, sample, seeds=seeds, logprobs=made_logprobs if logprobs is not None else None,
               synced=synced)


if __name__ == "__main__":
    rl_tools.ToolRollouts.run = scripted
    sys.exit(cli.main(["train", *sys.argv[1:]]))
