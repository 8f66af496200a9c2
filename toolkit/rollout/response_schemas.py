"""The response templates (transformers' `response_template`: how a completion is parsed into content, reasoning and
tool calls) that TRL sets on a tokenizer whose chat template it knows, so a Qwen, Llama, GLM, gpt-oss, Nemotron, LFM,
Gemma 4 or DeepSeek-R1-Distill tokenizer reads its tool calls without TRL installed.

Provenance: copied verbatim from TRL 1.16.0, `trl/chat_template_utils.py` (the new-style `*_template` dicts above
`add_response_schema`, and its choice of template by chat template), Copyright 2020-2026 The HuggingFace Team,
licensed under the Apache License, Version 2.0 (http://www.apache.org/licenses/LICENSE-2.0). Changes: TRL compares the
tokenizer's chat template with the text of its own `trl/chat_templates/*.jinja` files; here each file is named by the
SHA-256 of that text (`BY_CHAT_TEMPLATE`), the same decision without shipping the files. The legacy `*_schema` dicts
(transformers < 5.13) are left out: rl.tools needs transformers >= 5.15.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Optional

# --- TRL's response templates, verbatim

qwen3_template = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {
            "open": "<think>",
            "close_pattern": r"</think>\s*",
            "content": "text",
        },
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {
            "close_pattern": r"<\|im_end\|>\s*",
            "content": "text",
        },
    },
}

# Qwen3.5, GLM-4-MoE and Nemotron 3 render a string tool-call argument as raw text, so `"75001"` and `75001` render the
# same. Only the tool's JSON schema can tell them apart: on transformers >= 5.15, where `parse_response` types the
# arguments from `tools`, the values are kept as text. Older versions guess the type with a lenient JSON parse.
# (TRL: `{"name": "text"} if _SUPPORTS_PARSE_RESPONSE_TOOLS else ...`; rl.tools needs transformers >= 5.15: the first.)
_XML_INLINE_VALUE_PARSER = {"name": "text"}

qwen3_5_template = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {
            "open": "<think>",
            "close_pattern": r"</think>\s*",
            "content": "text",
        },
        "tool_calls": {
            "open_pattern": r"<tool_call>\s*<function=(?P<name>[^\n>]+)>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "xml-inline",
            "content_args": {
                "tag_pattern": r"<parameter=(?P<key>[^>\n]+)>\s*(?P<value>.*?)\s*</parameter>",
                "value_parser": _XML_INLINE_VALUE_PARSER,
            },
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {
            "close_pattern": r"<\|im_end\|>\s*",
            "content": "text",
        },
    },
}

glm4moe_template = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "reasoning_content": {
            "open": "<think>",
            "close_pattern": r"</think>\s*",
            "content": "text",
        },
        "tool_calls": {
            "open_pattern": r"<tool_call>(?P<name>\S+)\n?",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "xml-inline",
            "content_args": {
                "tag_pattern": r"<arg_key>(?P<key>[^<]+)</arg_key>\s*\n<arg_value>(?P<value>.*?)</arg_value>",
                "value_parser": _XML_INLINE_VALUE_PARSER,
            },
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {
            "close_pattern": r"<\|user\|>\s*|$",
            "content": "text",
        },
    },
}

llama3_template = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "fields": {
        "tool_calls": {
            "open_pattern": r'\{"name":\s*"(?P<name>[^"]+)",\s*"parameters":\s*',
            "close_pattern": r"\}<\|eot_id\|>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {
            "close_pattern": r"<\|eot_id\|>\s*",
            "content": "text",
        },
    },
}

gptoss_template = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|start|>assistant",
    "fields": {
        "thinking": {
            "open": "<|channel|>analysis<|message|>",
            "close_pattern": r"<\|end\|>\s*",
            "content": "text",
        },
        "content": {
            "open": "<|channel|>final<|message|>",
            "close_pattern": r"<\|return\|>\s*",
            "content": "text",
        },
        "tool_calls": {
            "open_pattern": r"to=functions\.(?P<name>\S+?)<\|channel\|>commentary\s+json<\|message\|>",
            "close_pattern": r"<\|call\|>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
    },
}

# An LFM2.5 argument value is either a single-quoted string, a JSON list/mapping, or a bare literal running up to the
# next `,` or `)`. Lists and mappings contain those very separators, so the pattern has to consume balanced brackets,
# which a regex can only do up to a fixed nesting depth. Three levels covers realistic tool arguments; deeper values
# truncate.
_LFM2_2_5_ATOM = r"[^\[\]{}'\"]|'[^']*'|\"[^\"]*\""
_LFM2_2_5_NESTED = _LFM2_2_5_ATOM
for _ in range(3):
    _LFM2_2_5_NESTED = rf"{_LFM2_2_5_ATOM}|[\[{{](?:{_LFM2_2_5_NESTED})*[\]}}]"
_LFM2_2_5_ARG_VALUE = rf"'[^']*'|[\[{{](?:{_LFM2_2_5_NESTED})*[\]}}]|[^,)]*"

lfm2_2_5_template = {
    # LFM2.5 renders every tool call of a turn into a single `<|tool_call_start|>[...]<|tool_call_end|>` block, as a
    # comma-separated list of Python-style calls: `[get_weather(city='Paris', days=3), ping()]`. The `open_pattern`
    # therefore matches either the opening bracket or the comma separating two calls, and `close_pattern` matches the
    # closing paren plus, for the last call, the trailing `]<|tool_call_end|>`.
    #
    # Argument values are rendered by the template's `format_arg_value` macro: strings single-quoted, mappings as JSON,
    # everything else via Jinja's `string` filter. `string_delims` turns the single-quoted strings back into JSON
    # strings so they parse. Note that this round-trip is lossy for Python literals the `string` filter emits but JSON
    # cannot express: `flag=False` parses back as the string `"False"`, not `False`. That's inherent to the upstream
    # template, not something we can recover here.
    #
    # The thinking field is named `thinking` (not `reasoning_content` as in other families) to match what the LFM2.5
    # template itself reads back off the message.
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "thinking": {
            "open": "<think>",
            "close_pattern": r"</think>\s*",
            "content": "text",
        },
        "tool_calls": {
            "open_pattern": r"(?:<\|tool_call_start\|>\[|,\s*)(?P<name>\w+)\(",
            "close_pattern": r"\)(?:\]<\|tool_call_end\|>)?\s*",
            "repeats": True,
            "content": "xml-inline",
            "content_args": {
                "tag_pattern": rf"(?P<key>\w+)=(?P<value>{_LFM2_2_5_ARG_VALUE})",
                "value_parser": {"name": "json", "args": {"string_delims": [["'", "'"]], "allow_non_json": True}},
            },
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {
            "close_pattern": r"<\|im_end\|>\s*",
            "content": "text",
        },
    },
}

nemotron_3_template = {
    # Nemotron 3 always prefills the assistant turn with the `<think>` opener (and a trailing `\n` when thinking is
    # enabled, or `</think>` when it is not), so the start anchor consumes it. Reasoning content is therefore not framed
    # by a `<think>` open in the model output; the zero-width `open_pattern` only activates the reasoning field when a
    # closing `</think>` is actually present, so a turn with no reasoning is parsed entirely as content. Tool calls use
    # the same `<function=...>` / `<parameter=...>` XML as Qwen3.5.
    "defaults": {"role": "assistant"},
    "start_anchor_pattern": r"<\|im_start\|>assistant\n<think>(?:\n|</think>)?",
    "fields": {
        "reasoning_content": {
            "open_pattern": r"(?=[\s\S]*?</think>)",
            "close_pattern": r"</think>\s*",
            "content": "text",
        },
        "tool_calls": {
            "open_pattern": r"<tool_call>\s*<function=(?P<name>[^\n>]+)>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "xml-inline",
            "content_args": {
                "tag_pattern": r"<parameter=(?P<key>[^>\n]+)>\s*(?P<value>.*?)\s*</parameter>",
                "value_parser": _XML_INLINE_VALUE_PARSER,
            },
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {
            "close_pattern": r"<\|im_end\|>\s*",
            "content": "text",
        },
    },
}

# Gemma 4 frames each field with its own sentinels (`<|channel>thought\n...<channel|>`, one
# `<|tool_call>call:<name>{...}<tool_call|>` block per call, content up to `<turn|>`/`<|tool_response>`/`<eos>`). Tool
# arguments are JSON with unquoted keys and `<|"|>`-delimited strings, hence the `json` parser config. Mirrors the
# new-style `response_template` recent Gemma 4 repos ship natively, but with `\s*`-tolerant close patterns.
gemma4_template = {
    "defaults": {"role": "assistant"},
    "start_anchor_pattern": r"(?:<\|turn>model\n|<tool_response\|>)",
    "fields": {
        "reasoning_content": {
            "open": "<|channel>thought\n",
            "close_pattern": r"<channel\|>\s*",
            "content": "text",
        },
        "tool_calls": {
            "open_pattern": r"<\|tool_call>call:(?P<name>\w+)",
            "close_pattern": r"<tool_call\|>\s*",
            "repeats": True,
            "content": "json",
            "content_args": {"string_delims": [['<|"|>', '<|"|>']], "unquoted_keys": True},
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {
            "close_pattern": r"(?:<turn\|>|<\|tool_response>|<eos>)\s*|$",
            "content": "text",
        },
    },
}

deepseek_r1_distill_template = {
    # DeepSeek-R1-Distill prefills the assistant turn with the `<think>` opener, so the start anchor consumes it.
    # Reasoning content is therefore not framed by a `<think>` open in the model output; the zero-width `open_pattern`
    # only activates the reasoning field when a closing `</think>` is actually present, so a turn with no reasoning is
    # parsed entirely as content. No tool calls: the template drops `tool_calls` whenever `content` is set and never
    # closes a single-call turn, so `supports_tool_calling` rejects it and there is nothing to parse.
    "defaults": {"role": "assistant"},
    "start_anchor": "<｜Assistant｜><think>\n",
    "fields": {
        "reasoning_content": {
            "open_pattern": r"(?=[\s\S]*?</think>)",
            "close_pattern": r"</think>\s*",
            "content": "text",
        },
        "content": {
            "close_pattern": r"<｜end▁of▁sentence｜>\s*|$",
            "content": "text",
        },
    },
}


# TRL's add_response_schema, in its order: the SHA-256 of a trl/chat_templates/*.jinja file's text -> (that file, the
# response template TRL sets for it).
BY_CHAT_TEMPLATE: dict[str, tuple[str, dict]] = {
    "44f815868bf02fa458dd2f741a338046f4bf45f398eb6d067766726b9d96cce3": ("glm4moe.jinja", glm4moe_template),
    "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146": ("gptoss.jinja", gptoss_template),
    "e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65": ("llama3_1.jinja", llama3_template),
    "5816fce10444e03c2e9ee1ef8a4a1ea61ae7e69e438613f3b17b69d0426223a4": ("llama3_2.jinja", llama3_template),
    "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f": ("qwen2_5.jinja", qwen3_template),
    "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8": ("qwen3.jinja", qwen3_template),
    "64f85b198065d0fba2a81f37e10ed68161ce2c19a754c7100e67e0ca2ee9c326": ("qwen3_instruct_2507.jinja", qwen3_template),
    "3636d0f0bd6bef02654cdffdc447b79cb2cef8ab02cc75267345946291a489e4": ("qwen3_vl.jinja", qwen3_template),
    "273d8e0e683b885071fb17e08d71e5f2a5ddfb5309756181681de4f5a1822d80": ("qwen3_5_nothink.jinja", qwen3_5_template),
    "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715": ("qwen3_5_think.jinja", qwen3_5_template),
    "e84f32a23fdda27689f868aa4a1a5621f41133e51a48d7f3efcbea2839574259": ("qwen3_6.jinja", qwen3_5_template),
    "c3cf9e34abf4f9e36c2d72165aa9c132d3e2a725b6c2586aaa3a8af9d7a81041": ("qwen3_8.jinja", qwen3_5_template),
    "ab7813c3abdd9cb655905a410728b26c7884eca45ddfab8d9f931553485a7862": ("nemotron_3_nano.jinja", nemotron_3_template),
    "575fb74f54ed264df9047d0ecce3c98938aae953fb4f50356675706264cbb68a": ("nemotron_3_super.jinja", nemotron_3_template),
    "82753bef5cedc4932c1ed509b5c9a12be680fd86d1adb65bc3f7398d11c8eebc": ("nemotron_3_ultra.jinja", nemotron_3_template),
    "58933db77d3099b4f78c55a38347a72e1ea05b97d6bd8f38775303dc0194e0a9":
        ("nemotron_3_5_lightning.jinja", nemotron_3_template),
    "5504d163d879bfb6fd4135b7fa3d56768b2e69dd718338f7b146750289f46ab0": ("lfm2_v2.jinja", lfm2_2_5_template),
    "6d65c8804847ad74eea912dd7eca3dc1cf7a457b53a77f47d841a14121910963": ("lfm2_2_5.jinja", lfm2_2_5_template),
    "c5b67247c9f736f6c40eaa91ae1ef27dc67f5b041eedaadb97a1bea5030fb0ff": ("lfm2_2_5_v2.jinja", lfm2_2_5_template),
    "86f4770449a4797c9b4212d110b0cc70fb993c1ce960095bcfb12eea22f61cca": ("lfm2_2_5_vl.jinja", lfm2_2_5_template),
    "33204f1acb5bd0002713e16a593847f24ceeafe711ed88bda2a352dc996a3373": ("gemma4.jinja", gemma4_template),
    "55572b8d3c8342044e25874c73fe5234b661fa0a57a57f6ef75b58e03d7d959a": ("gemma4_v2.jinja", gemma4_template),
    "781d10940fbc44be40064b5d43a056fc486c84ceaa55538226368b57314132bf": ("gemma4_v3.jinja", gemma4_template),
    "2f1b4d75d067bae3fe44e676721c7f077d243bc007156cb9c2f8b5836613d082": ("gemma4_v4.jinja", gemma4_template),
    "0a2c8073c878ab1da004bee933a998606537bbb62016310352c7285c3f01c5b5": ("gemma4_v5.jinja", gemma4_template),
    "56a1447ad31926fdc21fb07e56e5642bd9c850c4f52d8c8af7bbe5f079a84f5f":
        ("deepseek_r1_distill.jinja", deepseek_r1_distill_template),
}


def known_template(chat_template) -> Optional[tuple[str, dict]]:
    """(TRL's file the chat template is, as `qwen2_5.jinja`; a copy of the response template TRL 1.16's
    add_response_schema sets for it), or None where it knows none: a template TRL does not ship, or one given as named
    variants (TRL compares the text only)."""
    if not isinstance(chat_template, str):
        return None
    found = BY_CHAT_TEMPLATE.get(hashlib.sha256(chat_template.encode("utf-8")).hexdigest())
    return (found[0], copy.deepcopy(found[1])) if found else None
