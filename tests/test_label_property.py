"""The label invariant, over seeded random rows of every data format and every shipped chat
template: a row is refused in one line, or its tokenized examples train exactly its completion.
Prompt fields (instruction, input, user, system and tool turns, a preference prompt) are written
in Greek letters, completion fields (output, assistant content, reasoning, tool-call arguments,
chosen, rejected, text) in Cyrillic, and no template writes either; so, over a row's examples:

- no Greek letter is a target (no prompt character trains);
- the Cyrillic letters of the targets are exactly those of the trained completion fields (every
  completion character reaches the text, and trains once);
- what a template is known to render (tests/chat_templates/INDEX.yaml) is not refused.

Tokenizers only (tests/families.py's byte-level tokenizers with each real template, the presets'
own template, and gpt-oss's), no model: the whole file runs in seconds."""

import random
import re
from collections import Counter

import pytest
from jinja2 import TemplateError

from toolkit.data.tokenize import tokenize_examples
from toolkit.errors import ToolkitError
from toolkit.model.load import build_byte_tokenizer

from families import FAMILIES, family_tokenizer, target_runs

PROMPT = "αβγδεζηθικλμνξοπρστυφχψω"
COMPLETION = "абвгдежзийклмнопрстуфхцчшщэюя"
ROWS = 30  # rows per template and format
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up",
                                            "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                                                           "required": ["q"]}}}]
GPT_OSS = dict(special=["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                        "<|constrain|>", "<|return|>", "<|call|>"], added=[], bos=None, eos="<|return|>",
               pad="<|endoftext|>", template="gpt-oss.jinja")

# What each template renders (INDEX.yaml): a row using only these must not be refused.
TEMPLATES = {  # name: (system, tools and tool calls, a reasoning field, text beside a tool call)
    "preset": (True, True, False, True),
    "llama3": (True, True, False, False),
    "qwen2.5": (True, True, False, True),
    "qwen3": (True, True, True, True),
    "mistral": (False, False, False, False),  # mixtral's is the same file
    "gemma3": (True, False, False, False),
    "gemma2": (False, False, False, False),
    "phi3": (True, False, False, False),
    "gpt-oss": (True, True, True, False),
}


@pytest.fixture(scope="module")
def tokenizers():
    made = {name: family_tokenizer(name) for name in TEMPLATES if name in FAMILIES}
    made["preset"] = build_byte_tokenizer()
    made["gpt-oss"] = family_tokenizer(GPT_OSS)
    return made


# ----------------------------------------------------------------------------- rows


def words(rnd: random.Random, alphabet: str, n: int | None = None) -> str:
    """Words of `alphabet`, joined by spaces, newlines and ASCII punctuation (what templates trim or escape)."""
    out = []
    for k in range(n or rnd.randint(1, 6)):
        out.append("".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 7))))
        out.append(rnd.choice([" ", " ", "\n", ", ", ". ", "\n\n", ' "', "' ", " <", "> ", " {", "} ", " \\"]))
    return "".join(out).strip(" ") if rnd.random() < 0.7 else "".join(out)


def content(rnd: random.Random, text: str):
    """A message's content: a string, or (OpenAI's way) a list of text parts that join to it."""
    if rnd.random() < 0.8 or len(text) < 2:
        return text
    cut = rnd.randint(1, len(text) - 1)
    return [{"type": "text", "text": text[:cut]}, {"type": "text", "text": text[cut:]}]


def assistant(rnd: random.Random, tools: bool, reasoning: bool) -> list[dict]:
    """An answer: an assistant turn, or a tool call, its result (a prompt field) and the final turn."""
    turns = []
    if tools and rnd.random() < 0.5:
        call = {"type": "function", "function": {"name": "lookup", "arguments": {"q": words(rnd, COMPLETION, 2)}}}
        said = words(rnd, COMPLETION) if rnd.random() < 0.3 else ""  # a word before the call
        turns += [{"role": "assistant", "content": said, "tool_calls": [call]},
                  {"role": "tool", "content": words(rnd, PROMPT)}]
    final = {"role": "assistant", "content": content(rnd, words(rnd, COMPLETION))}
    if reasoning and rnd.random() < 0.7:
        final[rnd.choice(["reasoning_content", "thinking"])] = words(rnd, COMPLETION)
    return turns + [final]


def conversation(rnd: random.Random, system: bool, tools: bool, reasoning: bool) -> list[dict]:
    messages = []
    if system and rnd.random() < 0.5:
        messages.append({"role": "system", "content": content(rnd, words(rnd, PROMPT))})
    for _ in range(rnd.randint(1, 3)):
        messages.append({"role": "user", "content": content(rnd, words(rnd, PROMPT))})
        messages += assistant(rnd, tools, reasoning)
    return messages


def context(messages: list[dict]) -> list[dict]:
    """A preference prompt's turns: its assistant turns are context too, so written as prompt text."""
    def greek(text: str) -> str:
        return "".join(PROMPT[COMPLETION.index(c) % len(PROMPT)] if c in COMPLETION else c for c in text)

    return [{**m, "content": greek(text_of(m["content"]))} for m in messages]


def row_of(fmt: str, rnd: random.Random, features: tuple[bool, bool, bool]) -> dict:
    """A random row of `fmt` using `features` (system, tools, reasoning)."""
    system, tools, reasoning = (rnd.random() < 0.4 and feature for feature in features)
    if fmt == "alpaca":
        row = {"instruction": words(rnd, PROMPT), "output": words(rnd, COMPLETION)}
        return {**row, "input": words(rnd, PROMPT)} if rnd.random() < 0.5 else row
    if fmt == "text":
        return {"text": words(rnd, COMPLETION)}
    if fmt == "messages":
        messages = conversation(rnd, system, tools, reasoning)
        return {"messages": messages, **({"tools": TOOLS} if tools and any("tool_calls" in m for m in messages)
                                         else {})}
    if fmt == "preference-text":
        return {"prompt": words(rnd, PROMPT), "chosen": words(rnd, COMPLETION), "rejected": words(rnd, COMPLETION)}
    # preference as chat: an explicit prompt (a string or turns), the conversations pasted whole, or implicit
    prompt = context(conversation(rnd, system, False, False)[:-1]) if rnd.random() < 0.5 else \
        [{"role": "user", "content": words(rnd, PROMPT)}]
    chosen, rejected = assistant(rnd, tools, reasoning), assistant(rnd, tools, reasoning)
    extra = {"tools": TOOLS} if any("tool_calls" in m for m in chosen + rejected) else {}
    shape = rnd.choice(["explicit", "string", "pasted", "implicit"])
    if shape == "string" and len(prompt) == 1:
        return {"prompt": prompt[0]["content"], "chosen": chosen, "rejected": rejected, **extra}
    if shape == "pasted":
        return {"prompt": prompt, "chosen": prompt + chosen, "rejected": prompt + rejected, **extra}
    if shape == "implicit":
        return {"chosen": prompt + chosen, "rejected": prompt + rejected, **extra}
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected, **extra}


# ----------------------------------------------------------------------------- the invariant


def text_of(value) -> str:
    """Every string inside a field (content parts, tool-call arguments) joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return " ".join(text_of(v) for v in value.values())
    if isinstance(value, list):
        return " ".join(text_of(v) for v in value)
    return ""


def trained_fields(row: dict, fmt: str) -> list[str]:
    """Per example side (one string for most formats; chosen, rejected for pairs): the completion text."""
    if fmt == "alpaca":
        return [row["output"]]
    if fmt == "text":
        return [row["text"]]
    if fmt == "messages":  # an opening assistant turn is context
        return [" ".join(text_of({k: v for k, v in m.items() if k != "role"})
                         for m in row["messages"][1:] if m["role"] == "assistant")]
    return [text_of(row["chosen"]), text_of(row["rejected"])]


def letters(text: str, alphabet: str) -> Counter:
    return Counter(c for c in text if c in alphabet)


def target_text(tokenizer, example: dict) -> str:
    """The decoded runs of target tokens of one example, a line each."""
    return "\n".join(target_runs(tokenizer, [example]))


def check_row(tokenizer, row: dict, fmt: str) -> str | None:
    """None when the row's examples keep the invariant; "refused: ..." when it is refused in one
    line; else what is wrong."""
    data_format = "preference" if fmt.startswith("preference") else fmt
    try:
        examples = tokenize_examples(row, data_format, tokenizer, 100_000, False)
    except (ToolkitError, TemplateError, KeyError, TypeError, AttributeError) as e:  # one line: _tokenize_batch
        return f"refused: {e}"
    sides = trained_fields(row, fmt)
    groups = [examples] if len(sides) == 1 else [[examples[0]], [examples[1]]]
    for side, group, other in zip(sides, groups, ["rejected", "chosen"]):
        trained = "\n".join(target_text(tokenizer, e) for e in group)
        rendered = "".join(tokenizer.decode(e["input_ids"]) for e in group)
        fields = text_of({k: v for k, v in row.items() if k not in ("tools", other)})  # this side's
        dropped = [w for w in re.findall(f"[{PROMPT}]+", fields) if w not in rendered]
        if dropped:
            return f"prompt text not rendered: {dropped[0]!r}; rendered {rendered!r}"
        if letters(trained, PROMPT):
            return f"prompt characters are targets: {trained!r}"
        want, have = letters(side, COMPLETION), letters(trained, COMPLETION)
        if fmt == "text" and tokenizer.bos_token_id is None:  # nothing predicts a document's first token
            want -= letters(side[:1], COMPLETION)
        if want != have:
            lost = "".join((want - have).elements())
            return (f"completion characters {'not rendered' if lost and lost[0] not in rendered else 'not targets'}: "
                    f"{lost!r} missing, {''.join((have - want).elements())!r} extra; targets {trained!r}")
    return None


def features_of(row: dict) -> tuple[bool, bool, bool, bool]:
    turns = [m for k in ("messages", "prompt", "chosen", "rejected") if isinstance(row.get(k), list) for m in row[k]]
    return (any(m["role"] == "system" for m in turns), any("tool_calls" in m for m in turns),
            any("reasoning_content" in m or "thinking" in m for m in turns),
            any("tool_calls" in m and m["content"] for m in turns))


FORMATS = ["alpaca", "text", "messages", "preference-text", "preference-chat"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("template", list(TEMPLATES))
def test_only_completions_train(tokenizers, template, fmt):
    """Rows with every feature (system, tools, reasoning; content parts; preference prompts given,
    pasted into the conversations or implicit): each keeps the invariant, or is refused where its
    template cannot render a feature it uses."""
    tokenizer = tokenizers[template]
    renders = TEMPLATES[template]
    rnd = random.Random(f"{template}/{fmt}")
    wrong, refused, trained = [], [], 0
    for i in range(ROWS):
        row = row_of(fmt, rnd, tuple(r or rnd.random() < 0.5 for r in renders[:3]))  # fewer of the refused
        outcome = check_row(tokenizer, row, fmt)
        used = features_of(row)
        if outcome is not None and outcome.startswith("refused: "):
            if all(r or not u for r, u in zip(renders, used)):  # it uses only what the template renders
                refused.append((i, outcome, row))
        elif outcome is not None:
            wrong.append((i, outcome, row))
        else:
            trained += 1
    assert not wrong, f"{len(wrong)} of {ROWS} rows train wrongly; the first: {wrong[0]}"
    assert trained >= ROWS // 4, f"only {trained} of {ROWS} rows trained: the property held of too few"
    assert not refused, f"{len(refused)} rows the template renders were refused; the first: {refused[0]}"
