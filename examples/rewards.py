"""Reward functions for examples/recipes/quickstart_grpo.yaml, written as TRL's are
(`f(prompts, completions, **columns)`, one float per completion), so they work unchanged in TRL.

`similarity` gives partial credit: the share of the answer a completion gets right (difflib's
ratio of the two strings), so a task the model rarely answers exactly (writing a word in capitals)
still gives the policy a signal that some answers are better than others."""

import difflib


def similarity(completions, answer, **kwargs):
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [difflib.SequenceMatcher(None, t.strip(), str(a)).ratio() for t, a in zip(texts, answer)]
