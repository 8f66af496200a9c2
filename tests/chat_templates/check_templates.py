"""Render every template in this folder with transformers' own Jinja renderer and print a table.

Run: /work/main/.venv/bin/python tests/chat_templates/check_templates.py
Cases: (a) user/assistant, (b) system first, (c) tools + tool_calls + tool result,
(d) two assistant turns whose content starts with <think>...</think>: is the first one dropped?
(d2) the same reasoning passed as `reasoning_content` (transformers also copies it to `thinking`):
     is turn 1's reasoning rendered / is turn 2's (the last) rendered?
"""

import hashlib
from pathlib import Path

from transformers.utils.chat_template_utils import render_jinja_template

HERE = Path(__file__).parent
FAMILIES = ["qwen2.5", "qwen3", "mistral", "mixtral", "gpt-oss", "gemma3", "gemma2", "phi3", "llama3"]

CHAT = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
SYSTEM = [{"role": "system", "content": "SYSMARK be brief"}] + CHAT
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "DESCMARK current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City"}},
                   "required": ["city"]}}}]
TOOL_CHAT = [
    {"role": "user", "content": "What is the weather?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": "Nice weather today."},
]
THINK = [
    {"role": "user", "content": "Q1"},
    {"role": "assistant", "content": "<think>\nreasoning-1\n</think>\n\nanswer-1"},
    {"role": "user", "content": "Q2"},
    {"role": "assistant", "content": "<think>\nreasoning-2\n</think>\n\nanswer-2"},
]
REASONING = [dict(m, content=m["content"].split("\n\n")[-1], reasoning_content=m["content"].split("\n")[1])
             if m["role"] == "assistant" else m for m in THINK]


def render(template, messages, tools=None):
    try:
        out, _ = render_jinja_template(conversations=[messages], tools=tools, chat_template=template,
                                       bos_token="<s>", eos_token="</s>", add_generation_prompt=False)
        return out[0], None
    except Exception as exc:  # record what the template raises
        return None, f"raises {type(exc).__name__}: {exc}"[:90]


def main():
    print(f"{'family':8} | {'sha256[:12]':12} | (a) chat | (b) system | (c) tools/call/result | (d) 1st think dropped | (d2) reasoning_content 1st/last rendered")
    for fam in FAMILIES:
        text = (HERE / f"{fam}.jinja").read_text()
        sha = hashlib.sha256(text.encode()).hexdigest()[:12]
        a, ea = render(text, CHAT)
        ra = "ok" if a and "Hello!" in a else ea
        b, eb = render(text, SYSTEM)
        rb = ("yes" if "SYSMARK" in b else "dropped") if b else eb
        c, ec = render(text, TOOL_CHAT, TOOLS)
        rc = "/".join("yes" if s in c else "no" for s in ("DESCMARK", "Paris", "sunny")) if c else ec
        d, ed = render(text, THINK)
        rd = (f"{'yes' if 'reasoning-1' not in d else 'no'} (last kept: {'yes' if 'reasoning-2' in d else 'no'})"
              if d else ed)
        r, er = render(text, REASONING)
        rr = "/".join("yes" if s in r else "no" for s in ("reasoning-1", "reasoning-2")) if r else er
        print(f"{fam:8} | {sha:12} | {ra} | {rb} | {rc} | {rd} | {rr}")


if __name__ == "__main__":
    main()
