"""The data section's schema: `data` (DataConfig) and the entries of its file lists (DataSource)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union


@dataclass
class DataSource:
    """An entry of data.train_files / data.eval_files written as a mapping."""
    path: str = ""
    """A .json, .jsonl, .parquet or .csv file, a folder or glob of such shards, or a Hub dataset id."""
    format: Optional[Literal["alpaca", "messages", "text", "prompt_completion", "preference", "unpaired",
                             "prompt"]] = None
    """This entry's format (default: data.format); every format renders through the same tokenizer.
    `preference` entries mix only with `preference` entries, `unpaired` with `unpaired`, `prompt` with
    `prompt`."""
    weight: Optional[float] = None
    """Share of the training set drawn from this entry, relative to the other entries' weights
    (the set keeps its total size: a heavier entry is repeated, a lighter one subsampled)."""
    max_rows: Optional[int] = None
    """Use only the first N rows of this entry."""
    split: str = "train"
    """Hub datasets and `save_to_disk` folders of a DatasetDict: the split to read."""
    revision: Optional[str] = None
    """Hub datasets: a branch, tag or commit."""
    columns: dict[str, str] = field(default_factory=dict)
    """Rename this entry's columns to the ones its format reads, `{from: to}`: `{question: prompt}` for
    a dataset whose prompts are in `question` (the other columns keep their names and still reach the
    reward functions). A column named here that the data lacks is refused in one line."""


@dataclass
class DataConfig:
    train_files: list[Union[str, DataSource]] = field(default_factory=list)
    """Local .json, .jsonl, .parquet or .csv files, folders or globs of them, Hub dataset ids,
    or mappings (see DataSource) with a weight or max_rows per entry."""
    eval_files: list[Union[str, DataSource]] = field(default_factory=list)
    """Held-out data, the same kinds of entries as train_files; its loss is the eval loss."""
    eval_fraction: float = 0.0
    """Hold out this fraction of the training rows for eval when no eval_files are given."""
    format: Optional[Literal["alpaca", "messages", "text", "prompt_completion", "preference", "unpaired",
                             "prompt"]] = None
    """Unset: `preference` under preference.method (`unpaired` under kto), `prompt` under rl.method, and
    for supervised training found from each file's first row, as TRL finds a dataset's type: `messages`
    (or ShareGPT `conversations`), `prompt` + `completion` (prompt_completion), `instruction` + `output`
    (alpaca), `text`; the run's first lines and `config show` say which. A Hub dataset needs it set.
    `alpaca` (instruction, input, output), `messages` (chat turns through the tokenizer's chat
    template; ShareGPT `conversations` too), `text` (a `text` field, every token of it trained on, eos
    appended), or `preference` (`prompt`, `chosen`, `rejected`, each text or a list of chat messages,
    TRL's standard and conversational preference formats; a row without `prompt` whose chosen and
    rejected conversations share their opening turns has those turns as its prompt): each row is a
    pair of sequences, prompt + chosen and prompt + rejected, with targets on the completions only;
    text completions get the tokenizer's eos appended, chat ones end as the template ends a turn.
    A pair longer than max_seq_len keeps its prompt and has its completions cut (or is dropped
    with overlong=drop, a reward model's default); for preference.method, which needs it; not with packing (padding_free
    puts a micro-batch's sequences in one row). Or `unpaired` (preference.method=kto, TRL's unpaired
    preference format): `prompt`, `completion` (each text or a list of chat messages, as `preference`)
    and `label` (true: desirable, false: undesirable), one sequence per row with targets on the
    completion. Or `prompt_completion` (supervised, TRL's prompt-completion format): `prompt` and
    `completion`, each text or a list of chat messages, rendered as `unpaired` renders them; the loss
    covers the completion only (TRL's completion_only_loss), all of the row with train_on_prompt.
    Or `prompt` (online RL, rl.method): a `prompt` column,
    text or a list of chat messages (TRL's prompt-only formats), rendered up to where the answer
    starts; every other column of the row (an `answer`, say) goes to the reward functions. A prompt
    longer than max_seq_len is dropped (a cut prompt would lose where the answer starts)."""
    max_seq_len: int = 512
    """Longest example in tokens (see overlong); with packing, the length of a packed row."""
    packing: bool = False
    """Concatenate examples into rows of max_seq_len; documents never attend to each other."""
    padding_free: bool = False
    """Each micro-batch is one row: its examples (packed rows or documents) concatenated with no
    padding. Same examples, same loss; attention runs as model.attn_implementation=varlen unless
    flash_attention_2 or eager is chosen."""
    train_on_prompt: bool = False
    """By default the loss covers only response tokens."""
    overlong: Optional[Literal["truncate", "drop"]] = None
    """Examples longer than max_seq_len: cut to max_seq_len, or left out. Unset: `truncate`, but `drop`
    for preference.method=reward, as TRL's RewardTrainer drops every pair whose chosen or rejected
    sequence is longer than its max_length (a cut pair's score would be read mid-answer); the run's
    `data:` lines count what was cut or dropped."""
    num_proc: Optional[int] = None
    """Processes that tokenize (default: the usable cores, at most 16; at least 1,000 rows each)."""
