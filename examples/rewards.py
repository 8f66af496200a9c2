"""Reward functions for examples/recipes/quickstart_grpo.yaml and tasks/grpo-qwen2.5-1.5b.yaml, written as
TRL's are (`f(prompts, completions, **columns)`, one float per completion), so they work unchanged in TRL.

`similarity` gives partial credit: the share of the answer a completion gets right (difflib's
ratio of the two strings), so a task the model rarely answers exactly (writing a word in capitals)
still gives the policy a signal that some answers are better than others.

`boxed_answer` is a verifiable reward for math: 1.0 where the last `\\boxed{...}` of a completion, with
spaces and `$` dropped, is the row's `solution` written the same way; 0.0 otherwise (no box: 0.0). TRL's
`accuracy_reward` compares the two with math_verify, which also accepts equal values written differently
(`1/2` and `0.5`); this one is exact and needs no package."""

import difflib


def similarity(completions, answer, **kwargs):
    texts = [_text(c) for c in completions]
    return [difflib.SequenceMatcher(None, t.strip(), str(a)).ratio() for t, a in zip(texts, answer)]


def boxed_answer(completions, solution, **kwargs):
    return [1.0 if (box := last_box(_text(c))) is not None and _plain(box) == _plain(str(s)) else 0.0
            for c, s in zip(completions, solution)]


def last_box(text: str) -> str | None:
    """The content of the last \\boxed{...} in `text` (braces inside it balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1: j]
    return None


def _text(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def _plain(answer: str) -> str:
    return "".join(answer.split()).strip("$")
