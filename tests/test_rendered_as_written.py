"""Chat rows train as written or are refused by file and row, never rendered as nothing: OpenAI's
content parts join into the content; a reasoning field goes under the name the chat template
reads, or is refused where the template reads none; a field the template leaves out (tool calls
Phi-3 drops, text beside a Llama 3 tool call) is refused; a preference pair whose conversations
repeat the prompt's turns trains the answer only, and tool results inside a completion are context.
(tests/test_label_property.py checks the same over random rows of every format and template.)"""

import pytest

from toolkit.config import DataConfig
from toolkit.data.formats import IGNORE
from toolkit.data.sources import Source
from toolkit.data.tokenize import Report, tokenize_examples, tokenize_source
from toolkit.errors import ToolkitError
from toolkit.model.load import build_byte_tokenizer

from families import family_tokenizer
from helpers import write_jsonl

QUESTION, ANSWER = "What is two and two?", "Four, as ever."
CHAT = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": ANSWER}]
PARTS = [{"role": "user", "content": [{"type": "text", "text": "What is two "}, {"type": "text", "text": "and two?"}]},
         {"role": "assistant", "content": [{"type": "text", "text": "Four, "}, {"type": "text", "text": "as ever."}]}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def tokenizer_of(name: str):
    return build_byte_tokenizer() if name == "preset" else family_tokenizer(name)


def trained(tokenizer, example) -> str:
    return tokenizer.decode([i for i, y in zip(example["input_ids"], example["labels"]) if y != IGNORE])


def refusal(tmp_path, rows: list[dict], tokenizer, fmt: str = "messages") -> str:
    """The one-line error preparing `rows` as a file gives (file and row named)."""
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    source = Source(key="data.train_files[0]", files=[str(path)], format=fmt)
    with pytest.raises(ToolkitError) as e:
        tokenize_source(source, 0, DataConfig(train_files=[str(path)], format=fmt), tokenizer, 1, Report(),
                        tmp_path / "cache.arrow")
    return str(e.value)


# ----------------------------------------------------------------------------- content parts


@pytest.mark.parametrize("name", ["preset", "llama3", "qwen3", "gemma3"])
def test_text_parts_train_as_the_string_they_join_to(name):
    """Before: the presets' template rendered parts as empty turns (every row trained on a bare end
    token), Llama 3's as the Python list ("[{'type': 'text', ..."), Qwen3's raised a TypeError."""
    tokenizer = tokenizer_of(name)
    assert (tokenize_examples({"messages": PARTS}, "messages", tokenizer, 2048, False)
            == tokenize_examples({"messages": CHAT}, "messages", tokenizer, 2048, False))
    [example] = tokenize_examples({"messages": PARTS}, "messages", tokenizer, 2048, False)
    assert ANSWER in trained(tokenizer, example) and QUESTION in tokenizer.decode(example["input_ids"])


def test_a_part_that_is_not_text_is_refused_naming_row_and_field(tmp_path):
    image = {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                         {"type": "image_url", "image_url": {"url": "cat.png"}}]}
    error = refusal(tmp_path, [{"messages": CHAT}, {"messages": [image, CHAT[1]]}], tokenizer_of("qwen2.5"))
    assert "rows.jsonl: row 2: messages[0].content[1] is a part of type 'image_url'; only text parts" in error
    assert "\n" not in error


# ----------------------------------------------------------------------------- reasoning


@pytest.mark.parametrize("field", ["reasoning_content", "thinking", "reasoning"])
def test_reasoning_goes_under_the_name_the_template_reads(field):
    """Qwen3 reads `reasoning_content`; a template may read `reasoning` alone (transformers fills
    only `reasoning_content` and `thinking` from each other): each name renders and trains."""
    reads_reasoning = ("{% for m in messages %}<|{{ m['role'] }}|>\n{% if m.reasoning %}[{{ m.reasoning }}]{% endif %}"
                       "{{ m['content'] }}</s>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    custom = build_byte_tokenizer()
    custom.chat_template = reads_reasoning
    for tokenizer in (tokenizer_of("qwen3"), custom):
        row = {"messages": [CHAT[0], {**CHAT[1], field: "add two and two"}]}
        [example] = tokenize_examples(row, "messages", tokenizer, 2048, False)
        assert "add two and two" in trained(tokenizer, example) and ANSWER in trained(tokenizer, example), field


def test_reasoning_a_template_cannot_render_is_refused(tmp_path):
    """Llama 3's template reads no reasoning field: before, the reasoning was dropped and the row
    trained as if it had none."""
    row = {"messages": [CHAT[0], {**CHAT[1], "reasoning_content": "add two and two"}]}
    error = refusal(tmp_path, [{"messages": CHAT}, row], tokenizer_of("llama3"))
    assert "row 2: messages[1].reasoning_content: the chat template renders no reasoning field" in error


# ----------------------------------------------------------------------------- fields a template drops


@pytest.mark.parametrize("name, messages, field", [
    ("phi3", [CHAT[0], {"role": "assistant", "content": "", "tool_calls": [CALL]}, {"role": "tool", "content": "sunny"},
              CHAT[1]], "messages[1].tool_calls"),
    ("llama3", [CHAT[0], {"role": "assistant", "content": "Let me look.", "tool_calls": [CALL]},
                {"role": "tool", "content": "sunny"}, CHAT[1]], "messages[1].content"),
])
def test_a_field_the_template_leaves_out_is_refused(tmp_path, name, messages, field):
    """Phi-3's template renders tool calls as an empty turn and drops tool results; Llama 3's drops
    the text of an assistant turn that calls a tool. Before, both trained as if the field were absent."""
    error = refusal(tmp_path, [{"messages": messages, "tools": TOOLS}], tokenizer_of(name))
    assert f"row 1: {field}: the chat template does not render it as written" in error


# ----------------------------------------------------------------------------- preference prompts


@pytest.mark.parametrize("name", ["llama3", "qwen2.5"])
def test_conversations_pasted_whole_train_the_answer_only(name):
    """chosen and rejected that repeat the prompt's turns (whole conversations pasted beside an
    explicit prompt): before, the user's turn was trained as part of the completion."""
    tokenizer = tokenizer_of(name)
    prompt = [{"role": "system", "content": "Be brief."}, CHAT[0]]
    chosen, rejected = [CHAT[1]], [{"role": "assistant", "content": "Five."}]
    written = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    pasted = {"prompt": prompt, "chosen": prompt + chosen, "rejected": prompt + rejected}
    examples = tokenize_examples(pasted, "preference", tokenizer, 2048, False)
    assert examples == tokenize_examples(written, "preference", tokenizer, 2048, False)
    assert [QUESTION in trained(tokenizer, e) for e in examples] == [False, False]
    string_prompt = {"prompt": QUESTION, "chosen": [CHAT[0]] + chosen, "rejected": [CHAT[0]] + rejected}
    assert [QUESTION in trained(tokenizer, e)
            for e in tokenize_examples(string_prompt, "preference", tokenizer, 2048, False)] == [False, False]


def test_a_completion_holding_another_prompt_is_refused(tmp_path):
    """A completion whose conversation repeats the prompt only in part (here another question) would
    train that user turn as the answer: refused by row and field."""
    row = {"prompt": [CHAT[0]], "chosen": [{"role": "user", "content": "Another question?"}, CHAT[1]],
           "rejected": [{"role": "assistant", "content": "Five."}]}
    error = refusal(tmp_path, [row], tokenizer_of("qwen2.5"), fmt="preference")
    assert "row 1: chosen[0] is a user turn, and all of a completion trains as the answer" in error


def test_tool_results_inside_a_completion_are_context():
    tokenizer = tokenizer_of("qwen2.5")
    chosen = [{"role": "assistant", "content": "", "tool_calls": [CALL]}, {"role": "tool", "content": "sunny, 21 C"},
              {"role": "assistant", "content": "It is sunny."}]
    row = {"prompt": "Weather in Paris?", "chosen": chosen, "rejected": [{"role": "assistant", "content": "No idea."}],
           "tools": TOOLS}
    example = tokenize_examples(row, "preference", tokenizer, 2048, False)[0]
    text = trained(tokenizer, example)
    assert "get_weather" in text and "It is sunny." in text and "sunny, 21 C" not in text
