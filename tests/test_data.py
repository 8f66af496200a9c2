"""Data (toolkit/data/): formats, label masking token by token, truncation, packing isolation,
collation, and eval batches of padding only on a rank whose share ran out; in real runs of the CLI,
a conversation without messages dropped by row, an opening assistant turn and tool calls rendered,
save_to_disk folders and ShareGPT rows trained."""

from pathlib import Path

import pytest
import torch

from toolkit.config import DataConfig, ModelConfig
from toolkit.data.batching import Collator, EvalShardSampler, Examples, bins_dataset, packing_is_isolated
from toolkit.data.formats import IGNORE
from toolkit.data.prepare import build_datasets
from toolkit.data.tokenize import tokenize_example
from toolkit.errors import ToolkitError
from toolkit.model.load import build_byte_tokenizer, build_model

from helpers import (
    alpaca_folder,
    run_toolkit,
    short_recipe,
    user_error_line,
    write_jsonl,
    write_recipe,
)


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_alpaca_labels_cover_only_the_response(tok):
    row = {"instruction": "Reverse.", "input": "abc", "output": "cba"}
    ex = tokenize_example(row, "alpaca", tok, 512, False)
    prompt = "<s>### Instruction:\nReverse.\n\n### Input:\nabc\n\n### Response:\n"
    expected_ids = ids(tok, prompt) + ids(tok, "cba") + [tok.eos_token_id]
    assert ex["input_ids"] == expected_ids
    n_prompt = len(ids(tok, prompt))
    assert ex["labels"] == [IGNORE] * n_prompt + ids(tok, "cba") + [tok.eos_token_id]


def test_alpaca_without_input_and_train_on_prompt(tok):
    row = {"instruction": "Say hi.", "input": "", "output": "hi"}
    ex = tokenize_example(row, "alpaca", tok, 512, True)
    assert tok.decode(ex["input_ids"]) == "<s>### Instruction:\nSay hi.\n\n### Response:\nhi</s>"
    assert ex["labels"] == [IGNORE] + ex["input_ids"][1:]  # the first token is never a target


def test_messages_labels_cover_every_assistant_turn(tok):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"},
            {"role": "assistant", "content": "ok"}]
    ex = tokenize_example({"messages": msgs}, "messages", tok, 512, False)
    assert tok.decode(ex["input_ids"]) == tok.apply_chat_template(msgs, tokenize=False)
    kept = [t for t in ex["labels"] if t != IGNORE]
    assert kept == (ids(tok, "yo") + [tok.eos_token_id] + ids(tok, "\n")
                    + ids(tok, "ok") + [tok.eos_token_id] + ids(tok, "\n"))
    # token by token: each target sits exactly where the assistant text sits
    for i, (t, lab) in enumerate(zip(ex["input_ids"], ex["labels"])):
        assert lab in (IGNORE, t)
    first = ex["labels"].index(ids(tok, "y")[0])
    assert tok.decode(ex["input_ids"][:first]).endswith("<|assistant|>\n")


def test_text_format_trains_on_everything(tok):
    ex = tokenize_example({"text": "hello"}, "text", tok, 512, False)
    assert ex["input_ids"] == [tok.bos_token_id] + ids(tok, "hello") + [tok.eos_token_id]
    assert ex["labels"] == [IGNORE] + ids(tok, "hello") + [tok.eos_token_id]


def test_truncation_keeps_max_seq_len(tok):
    row = {"instruction": "x", "input": "", "output": "y" * 100}
    ex = tokenize_example(row, "alpaca", tok, 40, False)
    assert len(ex["input_ids"]) == len(ex["labels"]) == 40 and ex["n_targets"] > 0


def test_prompt_filling_the_length_is_an_error_naming_file_and_row(tmp_path, tok):
    f = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "a", "input": "", "output": "b"},
                                          {"instruction": "long " * 40, "input": "", "output": "b"}])
    with pytest.raises(ToolkitError, match=r"d.jsonl: row 2: no target tokens left \(the prompt fills"):
        build_datasets(DataConfig(train_files=[str(f)], max_seq_len=48), tok, 0, False)


def test_missing_column_and_malformed_line(tmp_path, tok):
    f = write_jsonl(tmp_path / "d.jsonl", [{"question": "a", "answer": "b"}])
    with pytest.raises(ToolkitError, match="needs column.*instruction"):
        build_datasets(DataConfig(train_files=[str(f)], format="alpaca"), tok, 0, False)
    with pytest.raises(ToolkitError, match=r"d.jsonl: data.format is not set and its first row's columns \(question, "
                                           r"answer\) are none of a format's"):  # unset: found from the columns
        build_datasets(DataConfig(train_files=[str(f)]), tok, 0, False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "a", "output": "b"}\n{"instruction": oops}\n')
    with pytest.raises(ToolkitError, match="bad.jsonl: line 2: malformed JSON"):
        build_datasets(DataConfig(train_files=[str(bad)]), tok, 0, False)


@pytest.mark.parametrize("suffix", ["json", "jsonl", "parquet", "csv"])
def test_every_file_type_loads(tmp_path, tok, suffix):
    import datasets

    rows = [{"instruction": f"i{i}", "input": "", "output": f"o{i}"} for i in range(10)]
    path = tmp_path / f"d.{suffix}"
    ds = datasets.Dataset.from_list(rows)
    {"json": lambda: ds.to_json(path, lines=False), "jsonl": lambda: ds.to_json(path),
     "parquet": lambda: ds.to_parquet(path), "csv": lambda: ds.to_csv(path, index=False)}[suffix]()
    data = build_datasets(DataConfig(train_files=[str(path)], eval_fraction=0.2), tok, 0, False)
    assert len(data.train) == 8 and len(data.eval) == 2


def test_pack_restarts_positions_and_never_splits(tmp_path, tok):
    words = ["aaaa", "bbbbbbbb", "cc", "dddddd", "e", "ffffffffff"]
    f = write_jsonl(tmp_path / "t.jsonl", [{"text": w} for w in words])
    data = build_datasets(DataConfig(train_files=[str(f)], format="text", max_seq_len=16), tok, 0, True)
    rows = list(data.train)
    assert len(rows) < len(words)  # documents did share rows
    docs = sorted(tuple(r["input_ids"][s:e]) for r in rows
                  for s, e in zip(*_starts_and_ends(r["position_ids"])))
    assert docs == sorted(tuple(tokenize_example({"text": w}, "text", tok, 16, False)["input_ids"]) for w in words)
    for r in rows:
        assert len(r["input_ids"]) <= 16 and len(r["labels"]) == len(r["position_ids"]) == len(r["input_ids"])
        for s in _starts_and_ends(r["position_ids"])[0]:
            assert r["labels"][s] == IGNORE  # nothing predicts across a document boundary


def _starts_and_ends(positions):
    starts = [i for i, p in enumerate(positions) if p == 0]
    return starts, starts[1:] + [len(positions)]


def packed_rows(docs: list[dict], bins: list[list[int]]) -> list[dict]:
    """Rows as training reads them: documents in Arrow, rows of document indices in Arrow."""
    import datasets
    import numpy as np

    table = datasets.Dataset.from_list([{k: d[k] for k in ("input_ids", "labels")} for d in docs])
    return list(Examples(table, bins_dataset([np.array(b) for b in bins])))


def test_packed_batch_gives_document_b_the_logits_of_b_alone(tok):
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="tiny-llama-mini")).eval()
    a = tokenize_example({"text": "first document, longer"}, "text", tok, 64, False)
    b = tokenize_example({"text": "second one"}, "text", tok, 64, False)
    collate = Collator(tok.pad_token_id)
    packed = collate(packed_rows([a, b], [[0, 1], [1]]))  # a second row, shorter: padded
    alone = collate([{k: b[k] for k in ("input_ids", "labels")}])
    with torch.no_grad():
        logits_packed = model(**{k: v for k, v in packed.items() if k != "labels"}, use_cache=False).logits
        logits_alone = model(**{k: v for k, v in alone.items() if k != "labels"}, use_cache=False).logits
    n_a, n_b = len(a["input_ids"]), len(b["input_ids"])
    torch.testing.assert_close(logits_packed[0, n_a:n_a + n_b], logits_alone[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits_packed[1, :n_b], logits_alone[0], atol=1e-5, rtol=1e-5)
    assert packing_is_isolated(model)


def test_packing_check_detects_a_leaky_model(tok):
    """The start-up probe must fail for attention that ignores position_ids (eager + full mask)."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="tiny-llama-mini"))

    class Leaky(torch.nn.Module):  # drops position_ids: documents see each other
        def __init__(self, m):
            super().__init__()
            self.m = m

        def get_input_embeddings(self):
            return self.m.get_input_embeddings()

        def forward(self, input_ids, position_ids=None, **kw):
            return self.m(input_ids=input_ids, **kw)

    assert not packing_is_isolated(Leaky(model))


def test_collator_pads_and_masks(tok):
    batch = Collator(tok.pad_token_id)([{"input_ids": [1, 5, 6], "labels": [IGNORE, 5, 6]},
                                        {"input_ids": [1, 7], "labels": [IGNORE, 7]}, None])
    assert batch["input_ids"].tolist() == [[1, 5, 6], [1, 7, 0], [0, 0, 0]]
    assert batch["labels"].tolist() == [[IGNORE, 5, 6], [IGNORE, 7, IGNORE], [IGNORE] * 3]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0], [1, 0, 0]]


# ----------------------------------------------------------------------------- eval padding


def test_a_rank_whose_eval_share_is_all_padding_gets_a_batch():
    """9 eval rows, 2 ranks, eval batches of 2: rank 1 holds 4 rows and pads to 3 batches, the last
    of which has no row at all (it once crashed the collator with `max() arg is an empty sequence`)."""
    rows = [{"input_ids": [5, 6, 7][: 1 + i % 3], "labels": [5, 6, 7][: 1 + i % 3]} for i in range(9)]
    for packed in (False, True):
        data = [dict(r, position_ids=list(range(len(r["input_ids"])))) if packed else r for r in rows]
        sampler = EvalShardSampler(len(data), 2, rank=1, world=2)
        batches = list(torch_loader(Rows(data), sampler, Collator(0, packed=packed)))
        assert len(batches) == 3
        last = batches[-1]
        assert last["input_ids"].shape == (2, 1) and (last["labels"] == -100).all()
        assert ("position_ids" in last) == packed and ("attention_mask" in last) != packed


class Rows(torch.utils.data.Dataset):
    """Examples by index, None (eval padding) as None, as toolkit.data.batching.Examples reads them from Arrow."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return None if i is None else self.rows[i]


def torch_loader(dataset, sampler, collate):
    from torch.utils.data import DataLoader

    return DataLoader(dataset, batch_size=2, sampler=sampler, collate_fn=collate)


def test_a_system_turn_after_the_last_answer_is_warned_by_file_and_row(tmp_path, tok):
    """A conversation that ends with a system turn trains as written (the turn carries no loss) and
    the preparation report says which row, in a warning the run prints at its start."""
    answered = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"}]
    late = {"messages": answered + [{"role": "system", "content": "be brief"}]}
    f = write_jsonl(tmp_path / "chat.jsonl", [{"messages": answered}, late, {"messages": answered}, late])
    data = build_datasets(DataConfig(train_files=[str(f)], format="messages"), tok, 0, False)
    assert data.warnings == [f"{f}: row 2: messages[3] is a system turn after the last assistant turn: no answer "
                             "sees it and it trains nothing (a system prompt opens a conversation); 2 of 4 rows "
                             "end so"]
    targets = [[t for t in data.train[i]["labels"] if t != IGNORE] for i in range(4)]
    assert targets[1] == targets[0] == ids(tok, "yo") + [tok.eos_token_id] + ids(tok, "\n")
    ordinary = write_jsonl(tmp_path / "ok.jsonl", [{"messages": answered + [{"role": "user", "content": "x"}]}] * 4)
    assert build_datasets(DataConfig(train_files=[str(ordinary)], format="messages"), tok, 0, False).warnings == []


TURN_TEMPLATE = ("{% for m in messages %}{{ '## ' + m['role'] + ': ' + m['content'] + ' ;;\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '## assistant: ' }}{% endif %}")


@pytest.mark.parametrize("given", ["file", "text", "chatml"])
def test_model_chat_template_renders_and_labels_the_assistant_turns(tmp_path, given):
    """model.chat_template replaces the tokenizer's template: rows render through it, the targets are
    the assistant turns as it renders them, it changes the prepared data's fingerprint (a recipe
    without it keeps its fingerprint), and the tokenizer saved (as in final/) holds it."""
    from transformers import AutoTokenizer

    from toolkit.config import CHAT_TEMPLATES
    from toolkit.data.prepare import fingerprint
    from toolkit.data.sources import resolve_sources
    from toolkit.model.load import build_tokenizer

    (tmp_path / "turns.jinja").write_text(TURN_TEMPLATE)
    value = {"file": str(tmp_path / "turns.jinja"), "text": TURN_TEMPLATE, "chatml": "chatml"}[given]
    template = CHAT_TEMPLATES["chatml"] if given == "chatml" else TURN_TEMPLATE
    tok = build_tokenizer(ModelConfig(preset="tiny-llama-mini", chat_template=value))
    assert tok.chat_template == template
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": "ok"}]
    ex = tokenize_example({"messages": msgs}, "messages", tok, 512, False)
    end = "<|im_end|>\n" if given == "chatml" else " ;;\n"
    prompt = ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" if given == "chatml"
              else "## user: hi ;;\n## assistant: ")
    assert tok.decode(ex["input_ids"]) == tok.apply_chat_template(msgs, tokenize=False)
    assert tok.decode(ex["input_ids"]).startswith(prompt + "yo" + end)
    assert [t for t in ex["labels"] if t != IGNORE] == ids(tok, "yo" + end) + ids(tok, "ok" + end)
    cfg = DataConfig(train_files=[str(write_jsonl(tmp_path / "c.jsonl", [{"messages": msgs}]))], format="messages")
    sources = resolve_sources(cfg.train_files, cfg, "data.train_files")
    plain = build_tokenizer(ModelConfig(preset="tiny-llama-mini"))
    assert fingerprint(sources, cfg, plain) == fingerprint(sources, cfg, build_byte_tokenizer())
    assert fingerprint(sources, cfg, tok) != fingerprint(sources, cfg, plain)
    tok.save_pretrained(tmp_path / "final")
    assert AutoTokenizer.from_pretrained(tmp_path / "final").chat_template == template


THINKING = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}"
            "{% if enable_thinking is defined and enable_thinking is false %}assistant: <think></think>"
            "{% else %}assistant: {% endif %}{% endif %}")


def test_chat_template_kwargs_reach_every_rendering_the_cache_key_and_final(tmp_path):
    """model.chat_template_kwargs (TRL's chat_template_kwargs; Qwen3's enable_thinking=False): online RL's
    prompts render the template's other branch, the prepared data's fingerprint changes, and the tokenizer
    saved as final/ renders the same without being told; a name a template cannot read is one line."""
    from transformers import AutoTokenizer

    from toolkit.config import ConfigError, load_recipe
    from toolkit.data.prepare import fingerprint
    from toolkit.data.sources import resolve_sources
    from toolkit.data.tokenize import prompt_example
    from toolkit.model.load import build_tokenizer

    plain = build_tokenizer(ModelConfig(preset="tiny-llama-mini", chat_template=THINKING))
    told = build_tokenizer(ModelConfig(preset="tiny-llama-mini", chat_template=THINKING,
                                       chat_template_kwargs={"enable_thinking": False}))
    row = {"prompt": [{"role": "user", "content": "2 + 2?"}]}
    assert prompt_example(row, plain)[0] == "user: 2 + 2?\nassistant: "
    assert prompt_example(row, told)[0] == "user: 2 + 2?\nassistant: <think></think>"
    cfg = DataConfig(train_files=[str(write_jsonl(tmp_path / "p.jsonl", [row]))], format="prompt")
    sources = resolve_sources(cfg.train_files, cfg, "data.train_files")
    assert fingerprint(sources, cfg, told) != fingerprint(sources, cfg, plain)
    told.save_pretrained(tmp_path / "final")
    again = AutoTokenizer.from_pretrained(tmp_path / "final")
    assert again.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True).endswith(
        "<think></think>")
    recipe = write_recipe(tmp_path / "r.yaml", output_dir=str(tmp_path / "o"), model={"preset": "tiny-llama"},
                          data={"train_files": ["a.jsonl"]})
    with pytest.raises(ConfigError, match=r"model.chat_template_kwargs.enable-thinking: not a name a template can "):
        load_recipe(recipe, ["model.chat_template_kwargs={enable-thinking: false}"])


def test_a_model_chat_template_that_is_not_jinja_is_one_line_naming_the_key():
    from toolkit.model.load import build_tokenizer

    with pytest.raises(ToolkitError, match=r"^model.chat_template: line 1: not a Jinja template \(unexpected '}'\)"):
        build_tokenizer(ModelConfig(preset="tiny-llama-mini", chat_template="{% for m in messages %}{{ m }"))


def test_an_entry_renames_its_columns_to_the_ones_its_format_reads(tmp_path):
    """`columns: {question: prompt}` (a public dataset's own names): the first-row check and the rows
    read see the renamed columns, the others keep theirs, and the rename is part of the prepared
    data's fingerprint; a rename of a column the data lacks, or onto one it has, is one line."""
    from toolkit.config import DataSource
    from toolkit.data.prepare import fingerprint
    from toolkit.data.sources import check_first_rows, load_rows, resolve_sources

    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(3)]
    f = str(write_jsonl(tmp_path / "gsm.jsonl", rows))

    def source(columns, fmt="prompt"):
        cfg = DataConfig(train_files=[DataSource(path=f, columns=columns)], format=fmt)
        return cfg, resolve_sources(cfg.train_files, cfg, "data.train_files")[0]

    cfg, s = source({"question": "prompt"})
    check_first_rows(s)
    ds = load_rows(s, tmp_path / "cache")
    assert ds.column_names == ["prompt", "answer"] and ds["prompt"] == ["q0", "q1", "q2"]
    tok = build_byte_tokenizer()
    assert fingerprint([s], cfg, tok) != fingerprint([source({"question": "text"})[1]], cfg, tok)
    for columns, message in [({"quest": "prompt"}, r"data.train_files\[0\].columns: .*gsm.jsonl has no column 'quest' "
                                                   r"to rename \(found question, answer\)$"),
                             ({"question": "answer"}, r"data.train_files\[0\].columns: renaming 'question' to "
                                                      r"'answer', but .*gsm.jsonl already has a column 'answer'$"),
                             ({"answer": "solution"}, r"gsm.jsonl: data.format=prompt needs column\(s\) prompt; found "
                                                      r"question, solution$")]:
        with pytest.raises(ToolkitError, match=message):
            check_first_rows(source(columns)[1])
        with pytest.raises(ToolkitError, match=message):
            load_rows(source(columns)[1], tmp_path / "cache")


# ----------------------------------------------------------------------------- data shapes in a real run


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return alpaca_folder(tmp_path_factory.mktemp("data"))


recipe = short_recipe


def chat(user="hi", answer="hello") -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def trained_first_example(work: Path, rows: list[dict], tmp_path: Path, name: str = "run") -> str:
    data = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    proc = run_toolkit("train", recipe(work, "chat"), f"output_dir={tmp_path / name}", f"data.train_files=[{data}]",
                       "data.format=messages", "data.eval_files=[]", "data.max_seq_len=512")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.launch
def test_a_conversation_with_no_messages_is_dropped_by_row(work, tmp_path):
    proc = trained_first_example(work, [{"messages": []}] + [chat()] * 120, tmp_path)
    assert "row 1: no target tokens left (messages is null or missing); dropped 1 such row(s) of 121" in proc.stdout


@pytest.mark.launch
def test_an_opening_assistant_turn_is_context_and_tool_calls_are_rendered(work, tmp_path):
    opening = {"messages": [{"role": "assistant", "content": "Welcome!"}, {"role": "user", "content": "hi"},
                            {"role": "assistant", "content": "hello"}]}
    tool = {"messages": [{"role": "user", "content": "weather?"},
                         {"role": "assistant", "content": None,
                          "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                           "arguments": {"city": "Paris"}}}]},
                         {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}]}
    proc = trained_first_example(work, [opening] * 20, tmp_path)
    assert "<s><|assistant|>\\nWelcome!</s>\\n<|user|>\\nhi</s>\\n<|assistant|>\\n[[hello</s>\\n]]" in proc.stdout
    proc = trained_first_example(work, [tool] * 20, tmp_path, "tools")
    assert ('[[<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call></s>\\n]]'
            '<|tool|>\\nsunny</s>\\n<|assistant|>\\n[[It is sunny.</s>\\n]]') in proc.stdout


@pytest.mark.launch
def test_save_to_disk_folders_and_sharegpt_rows_train(work, tmp_path):
    import datasets

    sharegpt = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}] * 20
    datasets.DatasetDict({"train": datasets.Dataset.from_list(sharegpt),
                          "test": datasets.Dataset.from_list(sharegpt[:4])}).save_to_disk(str(tmp_path / "saved"))
    proc = run_toolkit("train", recipe(work, "saved"), f"output_dir={tmp_path / 'run'}",
                       f"data.train_files=[{tmp_path / 'saved'}]", "data.format=messages", "data.eval_files=[]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "<s><|user|>\\nhi</s>\\n<|assistant|>\\n[[hello</s>\\n]]" in proc.stdout
    line = user_error_line(run_toolkit("train", recipe(work, "saved"), f"output_dir={tmp_path / 'run2'}",
                                       f"data.train_files=[{{path: {tmp_path / 'saved'}, split: validation}}]",
                                       "data.format=messages", "data.eval_files=[]"))
    assert "has splits train, test; no split 'validation'" in line


# A template of the shape of Mistral's newer ones (written for this test, not copied): the system message is
# rendered inside the last user turn only, so the conversation up to one turn is no prefix of the whole.
SYSTEM_IN_LAST_USER_TURN = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}{%- for message in loop_messages %}{%- if message['role'] == 'user' %}"
    "{%- if loop.last and system_message is defined %}{{- '[INST]' + system_message + '\\n\\n' + message['content']"
    " + '[/INST]' }}{%- else %}{{- '[INST]' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- message['content'] + eos_token }}{%- endif %}{%- endfor %}")


def test_a_template_that_moves_the_system_message_trains_each_turn_as_it_is_answered():
    """Issue 52: a Mistral chat with a system turn was refused ("does not render turns as prefixes of each
    other"). Each assistant turn is now an example of its own: the conversation before it as the model sees it
    when answering (the system message in that turn's user message), its content and end of turn the targets."""
    from test_label_property import target_text

    from toolkit.data.tokenize import tokenize_examples

    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = SYSTEM_IN_LAST_USER_TURN
    bos, eos = tokenizer.bos_token or "", tokenizer.eos_token
    row = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Sum 2 2"},
                        {"role": "assistant", "content": "4"}]}
    examples = tokenize_examples(row, "messages", tokenizer, 256, False)
    assert [target_text(tokenizer, e) for e in examples] == [f"Hello.{eos}", f"4{eos}"]
    texts = [tokenizer.decode(e["input_ids"]) for e in examples]
    assert texts == [f"{bos}[INST]Be brief.\n\nHi[/INST]Hello.{eos}",
                     f"{bos}[INST]Hi[/INST]Hello.{eos}[INST]Be brief.\n\nSum 2 2[/INST]4{eos}"]
    row["messages"][2]["tool_calls"] = [{"type": "function", "function": {"name": "f", "arguments": {}}}]
    with pytest.raises(ToolkitError, match="assistant turn 2 is not text content alone"):
        tokenize_examples(row, "messages", tokenizer, 256, False)
