"""What `toolkit generate` and `toolkit eval` show is what the model produced: a tiny Llama 3
whose tokenizer has added special tokens (model.add_special_tokens), taught in this process to
answer with them, shows them in its answer (decoding with skip_special_tokens hid them: the answer
was "1+2"); padding, BOS, eos and the end of turn are left out; and eval scores the reference as
the answer is shown, so a reference holding an added token (or ending with the end of turn) can
match."""

import json

import pytest
import torch

from toolkit.cli import main
from toolkit.model import inference

from families import build_family, family_tokenizer
from helpers import write_jsonl

NEW = ["<|calc|>", "<|endcalc|>"]
QUESTION, ANSWER = "What is 1+2?", "<|calc|>1+2<|endcalc|> 3"


@pytest.fixture(scope="module")
def taught(tmp_path_factory):
    """A model folder whose greedy answer to QUESTION is ANSWER, then the end of turn."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = build_family("llama3", tmp_path_factory.mktemp("answers") / "model")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens(NEW, special_tokens=True)  # as model.add_special_tokens adds them
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.resize_token_embeddings(len(tokenizer))
    prompt = tokenizer(inference.prompt_text(tokenizer, QUESTION)[0], add_special_tokens=False)["input_ids"]
    answer = tokenizer(ANSWER + "<|eot_id|>", add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt + answer])
    labels = torch.tensor([[-100] * len(prompt) + answer])
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(300):  # until greedy decoding gives the answer (teacher-forced argmax), and 10 steps more
        out = model(input_ids=ids, labels=labels)
        if out.logits[0, len(prompt) - 1:-1].argmax(-1).tolist() == answer:
            break
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert step < 299, "the model did not learn its answer"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def cli(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_shows_added_tokens(taught, capsys):
    code, out, err = cli(capsys, "generate", taught, "--prompt", QUESTION, "--max-new-tokens", "24")
    assert code == 0, err
    assert out == ANSWER + "\n"


def test_framing_tokens_are_left_out():
    """The tokenizer's padding, BOS, eos and the template's end of turn are not part of an answer;
    an added special token and a family's own non-framing specials are."""
    tokenizer = family_tokenizer("llama3")
    tokenizer.add_tokens(NEW, special_tokens=True)
    framing = inference.framing_token_ids(None, tokenizer)  # no model: no generation_config's eos ids
    ids = tokenizer("<|begin_of_text|><|calc|>1<|endcalc|><|python_tag|><|eot_id|><|finetune_right_pad_id|>",
                    add_special_tokens=False)["input_ids"]
    assert inference.shown_text(tokenizer, ids, framing) == "<|calc|>1<|endcalc|><|python_tag|>"


@pytest.mark.parametrize("reference", [ANSWER, ANSWER + "<|eot_id|>", " " + ANSWER + "\n"])
def test_eval_scores_the_reference_as_the_answer_is_shown(taught, tmp_path, capsys, reference):
    data = write_jsonl(tmp_path / "eval.jsonl", [{"messages": [{"role": "user", "content": QUESTION},
                                                               {"role": "assistant", "content": reference}]}])
    for mode in ("exact", "contains"):
        code, out, err = cli(capsys, "eval", taught, "--data", data, "--answers", mode, "--max-new-tokens", "24",
                             "--json")
        assert code == 0, err
        answers = json.loads(out)["answers"]
        assert answers["records"][0]["answer"] == ANSWER
        assert answers["correct"] == 1, (mode, answers["records"])

