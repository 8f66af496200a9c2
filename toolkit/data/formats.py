"""The vocabulary of the data formats: the label that carries no loss (`IGNORE`), the columns each
`data.format` needs, the Alpaca prompt templates and ShareGPT's speaker names. Constants only (no
torch, no datasets), so that any part can import them cheaply."""

IGNORE = -100
COLUMNS = {"alpaca": ("instruction", "output"), "messages": ("messages",), "text": ("text",),
           "preference": ("chosen", "rejected"),  # `prompt` too, unless the conversations carry it (implicit)
           "unpaired": ("prompt", "completion", "label"),  # KTO: one completion, desirable (true) or not
           "prompt_completion": ("prompt", "completion"),  # SFT on TRL's prompt-completion rows
           "prompt": ("prompt",)}  # online RL: the other columns go to the reward functions
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                  "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system",
                  "tool": "tool", "observation": "tool", "function_response": "tool", "ipython": "tool"}

# A dataset's format from its columns, as TRL tells a dataset's type (most specific first); `messages` also reads
# ShareGPT's `conversations`.
DETECTED = (("messages", ("messages",)), ("messages", ("conversations",)), ("preference", ("chosen", "rejected")),
            ("unpaired", ("prompt", "completion", "label")), ("prompt_completion", ("prompt", "completion")),
            ("alpaca", ("instruction", "output")), ("text", ("text",)), ("prompt", ("prompt",)))


def format_of(columns) -> str | None:
    """The data.format a row of these columns is written in (DETECTED), or None."""
    found = set(columns)
    return next((fmt for fmt, needs in DETECTED if found.issuperset(needs)), None)

