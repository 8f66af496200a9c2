"""Chat messages as a tokenizer's chat template renders them, for every format that holds them
(data.format=messages, and the chat forms of preference, unpaired, prompt_completion and prompt rows):
the messages checked (`chat_messages`; ShareGPT's `conversations` read as messages), a conversation's
examples with the character spans of its assistant turns (`chat_examples`, `located_examples`), a
turn's reasoning under the name the template reads (`template_fields`), and the refusal of a field
the template leaves out (`check_rendered`). `MissingField`: the refusal of a row's absent field,
which every format's rendering shares (rows without targets are dropped under tokenize's rule)."""

from __future__ import annotations

import json
import re

from ..errors import ToolkitError
from .formats import SHAREGPT_ROLES


class MissingField(ToolkitError):
    """A row whose required field is null or absent (or that cannot train for another `reason`: a
    preference pair whose completions are empty or identical): dropped under the
    EMPTY_ROWS_TOLERATED rule (in training), refused by file and row otherwise. `field` names it
    (`output`, `messages[2].content`)."""

    def __init__(self, field: str, reason: str = "is null or missing"):
        super().__init__(f"{field} {reason}")
        self.field = field


def chat_messages(row: dict, key: str = "messages") -> list[dict]:
    """A conversation's messages (`row[key]`) as the template will see them, checked: a list of
    mappings with a string role, at least one assistant turn, and text (or, for an assistant turn
    with tool calls, nothing) as content. Content written as OpenAI's text parts is their text
    joined (chat templates read content as a string: parts rendered as empty turns or as a Python
    list); parts of another type (an image) are refused. Null or empty: MissingField."""
    messages = row.get(key)
    if messages is None and key == "messages" and "conversations" in row:  # ShareGPT: {"from": "human", ...}
        messages = sharegpt_messages(row["conversations"])
    if not messages:
        raise MissingField(key)
    if not isinstance(messages, list):
        raise ToolkitError(f"{key} is {type(messages).__name__}, not a list of messages")
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ToolkitError(f"{key}[{i}] is not a message with a role ({m!r:.80})")
        content = m.get("content")
        if content is None and not (m["role"] == "assistant" and m.get("tool_calls")):
            raise MissingField(f"{key}[{i}].content")
        if content is not None and not isinstance(content, (str, list)):
            raise ToolkitError(f"{key}[{i}].content is {type(content).__name__} ({content!r:.40}), not text")
        checked.append({**m, "content": text_parts(content, f"{key}[{i}].content")} if isinstance(content, list)
                       else m)
    if not any(m["role"] == "assistant" for m in checked):
        raise MissingField("an assistant message")
    return checked


def text_parts(parts: list, where: str) -> str:
    """OpenAI's content parts ([{"type": "text", "text": ...}, ...]) as the one string they mean."""
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            what = f"a part of type {kind!r}" if isinstance(kind, str) else f"not a text part ({part!r:.60})"
            raise ToolkitError(f"{where}[{j}] is {what}; only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                               "train: a text model has no place for images or audio")
        texts.append(part["text"])
    return "".join(texts)


def trailing_system_turn(row: dict) -> str:
    """What is odd about a conversation that trains as written: a system turn after its last
    assistant turn, which no answer sees and nothing learns from (a system prompt opens a
    conversation; one at the end is usually a converter's slip). "" where nothing is. A row left
    as it is: the warning names it, the labels are what the template renders."""
    messages = chat_messages(row)
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    later = [i for i, m in enumerate(messages[last + 1:], last + 1) if m["role"] == "system"]
    if not later:
        return ""
    return (f"messages[{later[0]}] is a system turn after the last assistant turn: no answer sees it and it "
            "trains nothing (a system prompt opens a conversation)")


def sharegpt_messages(turns) -> list[dict] | None:
    """ShareGPT `conversations` (`from`/`value`) as chat messages (`role`/`content`)."""
    if not turns:
        return None
    if not isinstance(turns, list):
        raise ToolkitError(f"conversations is {type(turns).__name__}, not a list of turns")
    messages = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or "from" not in t:
            raise ToolkitError(f"conversations[{i}] has no `from` ({t!r:.80})")
        role = SHAREGPT_ROLES.get(str(t["from"]).lower())
        if role is None:
            raise ToolkitError(f"conversations[{i}]: unknown speaker from={t['from']!r} (known: "
                               f"{', '.join(sorted(SHAREGPT_ROLES))})")
        messages.append({"role": role, "content": t.get("value")})
    return messages


def need_chat_template(tokenizer, what: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ToolkitError(f"{what} render through the tokenizer's chat template, and this tokenizer has none "
                           "(no chat_template in its tokenizer_config.json or chat_template.jinja); give one in "
                           "model.chat_template (a Jinja file, or chatml), or use data.format=alpaca or text")


def chat_examples(messages: list[dict], tools, tokenizer) -> list[tuple[str, list[tuple[int, int]], bool]]:
    """Assistant turn i carries loss on what the template adds between the conversation up to its
    prompt (add_generation_prompt) and the conversation up to and including it. When every such
    rendering is a prefix of the whole conversation's, one example holds them all. Otherwise (the
    template rewrote earlier turns), the last turn's rendering is an example with every turn it
    renders alike, and so on backwards with the turns left; `tools` (function schemas) go to every
    rendering. Reasoning goes under the name the template reads (template_fields); a field the
    template leaves out of its rendering is refused (check_rendered), never trained as absent."""
    need_chat_template(tokenizer, "chat messages")
    messages = template_fields(messages, tokenizer)
    turns = []  # (end of prompt, end of turn, rendering up to the turn's end)
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i == 0:  # an opening assistant turn (a greeting) answers nothing: context
            continue
        before = tokenizer.apply_chat_template(messages[:i], tools=tools, tokenize=False, add_generation_prompt=True)
        upto = tokenizer.apply_chat_template(messages[: i + 1], tools=tools, tokenize=False)
        if not upto.startswith(before):  # the template moves text between turns: find each turn in the whole
            return located_examples(messages, tools, tokenizer)
        turns.append((len(before), len(upto), upto))
    whole = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)  # a template's own refusal first
    trained = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i > 0]
    for i, (start, end, upto) in zip(trained, turns):
        check_rendered([messages[i]], upto[start:end], "messages", i)
    check_rendered([m for m in messages if m["role"] != "assistant"], whole, "messages",
                   indices=[i for i, m in enumerate(messages) if m["role"] != "assistant"])
    if all(whole.startswith(upto) for _, _, upto in turns):
        return [(whole, [(a, b) for a, b, _ in turns], True)]
    examples = []
    while turns:
        text = turns[-1][2]
        alike = [t for t in turns if text.startswith(t[2])]
        examples.append((text, [(a, b) for a, b, _ in alike], True))
        turns = [t for t in turns if t not in alike]
    return examples[::-1]


TURN_MARK = "TOOLKIT-ASSISTANT-TURN-MARK"
NOT_LOCATED = ("data.format=messages: the tokenizer's chat template does not render turns as prefixes of each "
               "other, and assistant turn {i} is not text content alone, so its targets cannot be located")


def located_examples(messages: list[dict], tools, tokenizer) -> list[tuple[str, list[tuple[int, int]], bool]]:
    """For a template that moves text between turns, so that the conversation up to a turn is no prefix of the
    whole (Mistral's newer templates put the system message into the last user turn only): each assistant turn
    is an example of its own, as the model sees it when it answers that turn. Its prompt is the conversation
    before it rendered for generation; its targets, the turn's content as written and what the template closes
    an assistant turn with (what follows a mark put in place of the content when the conversation ends there).
    A turn with reasoning or tool calls, which render around its content, is refused (NOT_LOCATED)."""
    def render(msgs, prompt=False):
        return tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=prompt)

    examples = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i == 0:
            continue
        content = m.get("content")
        around = m.get("tool_calls") or any(m.get(k) for k in REASONING_FIELDS)
        ending = render([*messages[:i], {**m, "content": TURN_MARK}])
        if around or not isinstance(content, str) or not content or TURN_MARK not in ending:
            raise ToolkitError(NOT_LOCATED.format(i=i))
        before = render(messages[:i], prompt=True)
        check_rendered(messages[:i], before, "messages")  # a field the template leaves out is refused, not lost
        text = before + content + ending[ending.index(TURN_MARK) + len(TURN_MARK):]
        examples.append((text, [(len(before), len(text))], True))
    return examples


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the names a turn's reasoning comes under
PROBE = "TOOLKIT-REASONING-PROBE"
_reasoning_read: dict = {}  # (chat template, bos, eos) -> the reasoning names it renders


def template_fields(messages: list[dict], tokenizer, key: str = "messages") -> list[dict]:
    """The messages with each assistant turn's reasoning under a name the chat template renders
    (Qwen3 reads `reasoning_content`, gpt-oss `thinking`): a reasoning field under another name is
    renamed; one that the template renders under no name is refused (it would train as if absent)."""
    out = []
    for i, m in enumerate(messages):
        given = [k for k in REASONING_FIELDS if m.get(k) not in (None, "")]
        read = reasoning_read(tokenizer) if given and m["role"] == "assistant" else given
        if any(k in read for k in given) or not given:  # as written (a reasoning elsewhere: check_rendered)
            out.append(m)
            continue
        if not read:
            raise ToolkitError(f"{key}[{i}].{given[0]}: the chat template renders no reasoning field (none of "
                               f"{', '.join(REASONING_FIELDS)}), so the row would train as if it had none; write the "
                               "reasoning into content as the model should produce it (such as <think>...</think>), "
                               "or leave the field out")
        out.append({**{k: v for k, v in m.items() if k not in given}, read[0]: m[given[0]]})
    return out


def reasoning_read(tokenizer) -> tuple[str, ...]:
    """The reasoning field names the tokenizer's chat template renders, found by rendering a turn
    with each (or, where the template refuses that conversation, by the names its text reads)."""
    template = str(tokenizer.chat_template)
    cache_key = (template, tokenizer.bos_token, tokenizer.eos_token)
    if cache_key not in _reasoning_read:
        read = []
        for name in REASONING_FIELDS:
            probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", name: PROBE}]
            try:
                rendered = PROBE in tokenizer.apply_chat_template(probe, tokenize=False)
            except Exception:  # noqa: BLE001 - jinja's errors or the template's raise_exception
                rendered = re.search(rf"\b{name}\b", template) is not None
            if rendered:
                read.append(name)
        _reasoning_read[cache_key] = tuple(read)
    return _reasoning_read[cache_key]


def check_rendered(messages: list[dict], text: str, key: str, first: int = 0, indices: list[int] | None = None) -> None:
    """Refuse a row whose template leaves a field out of `text` (where the messages are rendered):
    a turn's content, reasoning or tool call's name. Compared without whitespace, which templates
    trim and re-space; a tool result may be rendered as JSON (Llama 3)."""
    squeezed = "".join(text.split())
    for i, m in zip(indices or range(first, first + len(messages)), messages):
        values = [("content", m.get("content"))] + [(k, m.get(k)) for k in REASONING_FIELDS]
        values += [("tool_calls", (c.get("function") or c).get("name") if isinstance(c, dict) else None)
                   for c in m.get("tool_calls") or []]
        for name, value in values:
            if not isinstance(value, str) or not value.strip():
                continue
            forms = (value, json.dumps(value, ensure_ascii=False)[1:-1])
            if not any("".join(form.split()) in squeezed for form in forms):
                raise ToolkitError(f"{key}[{i}].{name}: the chat template does not render it as written (a "
                                   f"{m['role']} turn's {name} it leaves out or rewrites), so the row would not "
                                   "train as written; give a template that renders it (model.chat_template), or "
                                   "leave it out of the row")
