"""training/rewards.py: loading reward functions, the built-ins, TRL's calling convention, and one-line errors."""

import math
import re
import sys
import textwrap

import numpy as np
import pytest
import torch

from toolkit.config import RewardConfig
from toolkit.errors import ToolkitError
from toolkit.training.rewards import Reward, check_rewards, load_rewards, score

ROWS = ["train.jsonl row 1", "train.jsonl row 2"]


def built_in(function, **kw):
    return load_rewards([RewardConfig(function=function, **kw)])


def values(rewards, completions, answers=None, prompts=None):
    """Score one completion per row; each row's `answer` column taken from answers."""
    n = len(completions)
    columns = [{"answer": a} for a in answers] if answers is not None else [{} for _ in range(n)]
    total, _ = score(rewards, prompts or ["Q?"] * n, completions, columns, step=3, rows=[f"row {i}" for i in range(n)])
    return total.tolist()


def write(tmp_path, name, source):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def one_line_error(match, call, *args, **kw) -> str:
    with pytest.raises(ToolkitError, match=match) as err:
        call(*args, **kw)
    message = str(err.value)
    assert "\n" not in message and "Traceback" not in message, message
    return message


# --- built-ins


def test_exact_match_compares_the_whole_normalised_completion():
    r = built_in("exact_match")
    assert values(r, ["  Paris. ", "PARIS", "paris  france", "The answer is Paris"],
                  ["paris", "Paris.", "Paris France", "Paris"]) == [1.0, 1.0, 1.0, 0.0]
    assert values(r, ["42"], [42]) == [1.0]  # a non-text answer compares as its text


def test_numeric_match_reads_the_last_number():
    r = built_in("numeric_match")
    completions = ["so 3 + 4 = 7", "Total: 1,234 apples", "it is -2.5", "no number here", "7.0000001", "3-5",
                   "12 then 13"]
    answers = [7, "1234", "#### -2.5", 7, "7", 5, 12]
    assert values(r, completions, answers) == [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0]


def test_numeric_match_refuses_an_answer_without_a_number():
    message = one_line_error("holds no number", values, built_in("numeric_match"), ["7"], ["seven"])
    assert "row 0" in message and "numeric_match" in message and "step 3" in message


def test_regex_searches_across_lines():
    r = built_in("regex", pattern=r"<think>.*</think>")
    assert values(r, ["<think>a\nb</think> 4", "4"]) == [1.0, 0.0]


def test_built_ins_read_chat_completions_and_their_column():
    r = built_in("exact_match", column="gold")
    chat = [[{"role": "user", "content": "Capital of France?"}]] * 3
    completions = ["Paris", [{"role": "assistant", "content": "Paris."}], [{"role": "assistant", "content": "Rome"}]]
    total, _ = score(r, chat, completions, [{"gold": "paris"}] * 3, step=0, rows=ROWS + ["row 3"])
    assert total.tolist() == [1.0, 1.0, 0.0]


def test_a_row_without_the_column_names_the_column_the_function_and_the_row():
    r = built_in("numeric_match", column="gold")
    columns = [{"gold": 1}, {"answer": 1}]
    message = one_line_error("no 'gold' column", score, r, ["a", "b"], ["1", "1"], columns, step=5, rows=ROWS)
    assert message.startswith("train.jsonl row 2: reward numeric_match at step 5")
    message = one_line_error("no 'gold' column", check_rewards, r, ["a", "b"], columns, ROWS)
    assert message.startswith("train.jsonl row 2: reward numeric_match at step 0")


# --- loading and TRL's calling convention


def test_a_function_from_a_file_and_one_from_a_module(tmp_path, monkeypatch):
    write(tmp_path, "helper.py", "BONUS = 0.5\n")
    write(tmp_path, "rewards.py", """
        from helper import BONUS  # a module beside the file imports while it loads

        def correct(prompts, completions, answer, **kwargs):
            return [1.0 + BONUS if c == a else 0.0 for c, a in zip(completions, answer)]
    """)
    (tmp_path / "pkg").mkdir()
    write(tmp_path / "pkg", "my_mod.py", "def fmt(completions, **kwargs):\n    return [len(c) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))
    entries = [RewardConfig(function="rewards.py:correct", weight=2.0), RewardConfig(function="my_mod:fmt")]
    rewards = load_rewards(entries)
    assert [r.name for r in rewards] == ["rewards.py:correct", "my_mod:fmt"]
    assert str(tmp_path) not in sys.path  # the file's folder is not left on sys.path
    total, per = score(rewards, ["q", "q"], ["ab", "abc"], [{"answer": "ab"}, {"answer": "x"}], step=1, rows=ROWS)
    assert per["reward_correct"].tolist() == [1.5, 0.0] and per["reward_fmt"].tolist() == [2.0, 3.0]
    assert total.tolist() == [2 * 1.5 + 2, 3.0] and total.dtype == torch.float32


def test_a_trl_reward_function_works_unchanged(tmp_path, monkeypatch):
    write(tmp_path, "trl_rewards.py", """
        def reward_len(completions, **kwargs):
            return [-abs(20 - len(completion)) for completion in completions]
    """)
    monkeypatch.chdir(tmp_path)
    rewards = load_rewards([RewardConfig(function="trl_rewards.py:reward_len")])
    assert values(rewards, ["x" * 20, "x" * 25]) == [0.0, -5.0]


def test_the_keywords_are_those_trl_passes(tmp_path, monkeypatch):
    """TRL 1.16 `_calculate_rewards`: prompts, completions, completion_ids, trainer_state, log_extra, log_metric and
    every other column, one value per completion; chat completions as [{"role": "assistant", "content": ...}]."""
    seen = {}

    def spy(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, **columns):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, step=trainer_state.global_step,
                    columns=columns)
        log_metric("mine", 1.0)
        log_extra("note", ["a", "b"])
        return [0.5, None]

    module = type(sys)("spy_module")
    module.spy = spy
    monkeypatch.setitem(sys.modules, "spy_module", module)
    chat = [[{"role": "user", "content": "hi"}]] * 2
    total, per = score(load_rewards([RewardConfig(function="spy_module:spy")]), chat, ["a", "b"],
                       [{"answer": 1, "level": "easy"}, {"answer": 2, "level": "hard"}], step=7, rows=ROWS,
                       completion_ids=[[1], [2, 3]])
    assert seen == {"prompts": chat, "completions": [[{"role": "assistant", "content": "a"}],
                                                      [{"role": "assistant", "content": "b"}]],
                    "ids": [[1], [2, 3]], "step": 7, "columns": {"answer": [1, 2], "level": ["easy", "hard"]}}
    assert total[0].item() == 0.5 and math.isnan(total[1].item()) and math.isnan(per["reward_spy"][1].item())


def test_none_terms_are_left_out_of_the_weighted_sum_as_trl_nansum(monkeypatch):
    module = type(sys)("none_module")
    module.a = lambda completions, **kw: [1.0, None, None, np.float32(2), True]
    module.b = lambda completions, **kw: [3.0, 4, None, 1, np.int64(0)]
    monkeypatch.setitem(sys.modules, "none_module", module)
    rewards = load_rewards([RewardConfig(function="none_module:a", weight=1.0),
                            RewardConfig(function="none_module:b", weight=0.5)])
    total = values(rewards, ["x"] * 5)
    assert total[:2] == [2.5, 2.0] and math.isnan(total[2]) and total[3:] == [2.5, 1.0]


def test_tensors_arrays_and_async_functions_are_accepted(monkeypatch):
    async def judge(completions, **kw):
        return [1.0] * len(completions)
    module = type(sys)("forms_module")
    module.tensor = lambda completions, **kw: torch.ones(len(completions))
    module.array = lambda completions, **kw: np.zeros(len(completions))
    module.judge = judge
    monkeypatch.setitem(sys.modules, "forms_module", module)
    rewards = load_rewards([RewardConfig(function=f"forms_module:{n}") for n in ("tensor", "array", "judge")])
    assert values(rewards, ["x", "y"]) == [2.0, 2.0]


def test_a_repeated_function_gets_its_own_name():
    rewards = load_rewards([RewardConfig(function="regex", pattern="a"), RewardConfig(function="regex", pattern="b")])
    assert [r.metric for r in rewards] == ["reward_regex", "reward_regex_2"]
    _, per = score(rewards, ["q"], ["a"], [{}], step=0, rows=ROWS[:1])
    assert per["reward_regex"].tolist() == [1.0] and per["reward_regex_2"].tolist() == [0.0]


def test_metric_names_are_unique_and_safe_for_every_tracker(tmp_path, monkeypatch):
    """Issue 69.2: two files each with a function `score` collided in the step metrics, the eval metric and the
    completions table (both `reward_score`), and a repeat's `#2` is refused by MLflow. One rule, used everywhere:
    the bare function name where it is unique, the source before it where not, `_N` for a repeat; only letters,
    digits, _ . - (every tracker's names). A name a function hands log_metric that a tracker refuses is refused
    when the function is first tried, naming it."""
    from toolkit.training.rewards import metric_names

    names = ["a/rewards.py:score", "b/judge.py:score", "exact_match", "my.pkg.mod:fmt", "a/rewards.py:score",
             "mod:réponse", "x.py:reward_regex", "regex"]
    got = metric_names(names)
    assert got == ["reward_rewards_score", "reward_judge_score", "reward_exact_match", "reward_fmt",
                   "reward_rewards_score_2", "reward_r_ponse", "reward_reward_regex", "reward_regex"]
    assert len(set(got)) == len(got) and all(re.fullmatch(r"[A-Za-z0-9_.\-]+", n) for n in got)
    same = metric_names(["a/s.py:score", "b/s.py:score"])  # same stem and function: still unique
    assert same == ["reward_s_score", "reward_s_score_2"]

    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "r.py").write_text(f"def score(completions, **kw):\n    return [{folder!r} == 'a'] * "
                                               "len(completions)\n")
    monkeypatch.chdir(tmp_path)
    rewards = load_rewards([RewardConfig(function="a/r.py:score"), RewardConfig(function="b/r.py:score")])
    _, per = score(rewards, ["q"], ["x"], [{}], step=0, rows=ROWS[:1])
    assert per == {"reward_r_score": per["reward_r_score"], "reward_r_score_2": per["reward_r_score_2"]}
    assert per["reward_r_score"].tolist() == [1.0] and per["reward_r_score_2"].tolist() == [0.0]

    (tmp_path / "m.py").write_text("def score(completions, log_metric, **kw):\n    log_metric('acc#1', 1.0)\n"
                                   "    return [0.0] * len(completions)\n")
    rewards = load_rewards([RewardConfig(function="m.py:score")])
    message = one_line_error("a tracker refuses that name", check_rewards, rewards, ["q"], [{}], ROWS[:1])
    assert "log_metric('acc#1', ...) in m.py:score" in message


def test_a_function_that_changes_its_arguments_changes_nothing_the_next_one_sees(monkeypatch):
    """Each call gets its own copy of prompts, completions and the columns: a function that edits them in place
    (here: clears the completions, rewrites the answers) leaves a second copy of the same check scoring what it
    would alone (issue 52: the second copy logged 0.0 against 0.525)."""
    def spoil(prompts, completions, answer, **kw):
        scores = [1.0 if c[0]["content"] == a else 0.0 for c, a in zip(completions, answer)]
        for c in completions:
            c[0]["content"] = ""
        answer[:] = ["?"] * len(answer)
        prompts.clear()
        return scores
    module = type(sys)("spoil_module")
    module.spoil = spoil
    monkeypatch.setitem(sys.modules, "spoil_module", module)
    rewards = load_rewards([RewardConfig(function="spoil_module:spoil")] * 2)
    prompts, completions = [[{"role": "user", "content": "Q"}]] * 2, ["4", "5"]
    columns = [{"answer": "4"}, {"answer": "4"}]
    _, per = score(rewards, prompts, completions, columns, step=1, rows=ROWS)
    assert per["reward_spoil"].tolist() == per["reward_spoil_2"].tolist() == [1.0, 0.0]
    assert completions == ["4", "5"] and columns[0]["answer"] == "4" and len(prompts) == 2


# --- loading errors: one line naming rl.rewards[i].function and the text


@pytest.mark.parametrize("source, function, match", [
    (None, "missing.py:f", "file not found"),
    ("import no_such_module_here\n", "r.py:f", r"importing r.py: raised ModuleNotFoundError: No module named"),
    ("x = 1 / 0\n", "r.py:f", "importing r.py: raised ZeroDivisionError: division by zero"),
    ("def g(completions, **kw):\n    return []\n", "r.py:f", "r.py has no 'f'"),
    ("f = 3\n", "r.py:f", "f is a int, not a function"),
    ("def f(prompts, completions):\n    return []\n", "r.py:f", r"cannot take the keywords TRL passes .*\*\*kwargs"),
    ("def f(p, c, /, **kw):\n    return []\n", "r.py:f", "cannot take the keywords"),
    (None, "no_such_module_zz:f", "importing no_such_module_zz: raised ModuleNotFoundError"),
])
def test_a_function_that_cannot_load_is_refused_in_one_line(tmp_path, monkeypatch, source, function, match):
    if source is not None:
        write(tmp_path, "r.py", source)
    monkeypatch.chdir(tmp_path)
    entries = [RewardConfig(function="exact_match"), RewardConfig(function=function)]
    message = one_line_error(match, load_rewards, entries)
    assert message.startswith(f"rl.rewards[1].function: {function!r}: ")


# --- scoring errors: one line naming the row, the function, the step and what was wrong


def scoring_error(function, match, rows=ROWS, step=9):
    module = type(sys)("bad_module")
    module.f = function
    sys.modules["bad_module"] = module
    try:
        rewards = load_rewards([RewardConfig(function="bad_module:f")])
        return one_line_error(match, score, rewards, ["q1", "q2"], ["a", "b"], [{"n": 1}, {"n": 2}], step=step,
                              rows=rows)
    finally:
        del sys.modules["bad_module"]


def test_a_function_that_raises_names_the_row_that_fails():
    def f(completions, n, **kw):
        return [1 / (2 - x) for x in n]
    message = scoring_error(f, "raised ZeroDivisionError: division by zero")
    assert message.startswith("train.jsonl row 2: reward bad_module:f at step 9: ")


def test_a_function_that_fails_only_on_the_batch_names_the_batch():
    def f(completions, **kw):
        if len(completions) > 1:
            raise RuntimeError("batch too big\nsecond line")
        return [0.0]
    message = scoring_error(f, "raised RuntimeError: batch too big$")
    assert message.startswith("train.jsonl row 1, train.jsonl row 2: reward bad_module:f at step 9")


@pytest.mark.parametrize("returned, match, row", [
    ([1.0, 2.0, 3.0], "returned 3 values for 2 completions", "train.jsonl row 1, train.jsonl row 2"),
    (0.5, "returned a float; return a list of 2 numbers", "train.jsonl row 1, train.jsonl row 2"),
    ([1.0, float("nan")], "returned nan for completion 1", "train.jsonl row 2"),
    ([float("-inf"), 1.0], "returned -inf for completion 0", "train.jsonl row 1"),
    ([1.0, "0.5"], r"returned '0.5' \(str\) for completion 1; return a real number or None", "train.jsonl row 2"),
    ([[1.0], 1.0], r"returned \[1.0\] \(list\) for completion 0", "train.jsonl row 1"),
])
def test_a_wrong_return_is_refused_in_one_line(returned, match, row):
    message = scoring_error(lambda completions, **kw: returned, match)
    assert message.startswith(f"{row}: reward bad_module:f at step 9: ")


def test_check_rewards_runs_every_function_before_training(tmp_path, monkeypatch):
    write(tmp_path, "r.py", """
        def first_word(completions, **kwargs):
            return [len(c.split()[0]) for c in completions]  # an empty completion has no first word
    """)
    monkeypatch.chdir(tmp_path)
    rewards = load_rewards([RewardConfig(function="numeric_match"), RewardConfig(function="r.py:first_word")])
    prompts, columns = ["q"] * 6, [{"answer": i} for i in range(6)]
    rows = [f"train.jsonl row {i}" for i in range(6)]
    message = one_line_error("raised IndexError: list index out of range", check_rewards, rewards, prompts, columns,
                             rows)
    assert message.startswith("train.jsonl row 0: reward r.py:first_word at step 0: ")
    check_rewards(rewards[:1], prompts, columns, rows)  # the built-in runs on an empty completion


def test_a_reward_is_a_plain_record():
    assert Reward("x", 1.0, len).column is None


def regex_group_rl(**rl):
    """GRPO on one CPU process (groups of 2, a stop after 2 batches that teach nothing, stop token 2), scored by
    the built-in regex."""
    from accelerate import Accelerator

    from toolkit.backends import Backend
    from toolkit.config import RLConfig
    from toolkit.training.online import GroupRL

    backend = Backend()
    backend.accelerator = Accelerator(cpu=True)
    objective = GroupRL(RLConfig(method="grpo", num_generations=2, max_unscored_steps=2, **rl),
                        built_in("regex", pattern="x"), None, backend, 5, ["train"], [])
    objective.stops = [2]
    return objective


def test_a_reward_that_never_scores_is_reported_logged_as_it_is_and_stops_the_run(capsys):
    """Every function says None for every completion (issue 52): the step's reward is NaN (no mean of nothing, not
    0.0), every group counts as without spread, `unscored_completions` is 1; the first such batch is reported in
    one line, and rl.max_unscored_steps of them in a row stop the run in one line naming the functions."""
    objective = regex_group_rl()
    none = torch.full((4,), math.nan)
    completions = [[5, 2], [6, 2], [7, 2], [8, 2]]
    metrics = objective.generation_metrics(none, {"reward_regex": none}, completions, 0.1)
    assert math.isnan(metrics["reward"]) and math.isnan(metrics["reward_regex"]) and math.isnan(metrics["reward_std"])
    assert metrics["zero_std_groups"] == 1.0 and metrics["unscored_completions"] == 1.0
    some = torch.tensor([1.0, math.nan, 0.0, 1.0])  # group 1: one scored (no spread); group 2: spread
    metrics = objective.generation_metrics(some, {"reward_regex": some}, completions, 0.1)
    assert metrics["reward"] == 2 / 3 and metrics["zero_std_groups"] == 0.5 and metrics["unscored_completions"] == 0.25

    objective.generated = objective.generation_metrics(none, {"reward_regex": none}, completions, 0.1)
    objective.check_signal(1)
    assert capsys.readouterr().out.strip() == (
        "rl: at step 1 no completion was scored (regex said None for every one): "
        "this batch teaches nothing; the run stops after 2 such batches in a row")
    # a batch with signal between: the count starts again
    objective.generated = objective.generation_metrics(some, {"reward_regex": some}, completions, 0.1)
    objective.check_signal(2)
    objective.generated = objective.generation_metrics(none, {"reward_regex": none}, completions, 0.1)
    objective.check_signal(3)
    objective.generated = objective.generation_metrics(none, {"reward_regex": none}, completions, 0.1)
    message = one_line_error("2 generated batches in a row taught nothing, up to step 4", objective.check_signal, 4)
    assert message.startswith("rl.rewards: ") and "regex said None for every one" in message
    assert "rl.max_unscored_steps" in message


def test_every_reason_a_batch_teaches_nothing_is_reported_by_one_mechanism(capsys):
    """Issue 69.3: with rl.mask_truncated_completions, a batch whose every completion was cut at max_new_tokens has
    loss 0 and gradient 0: reported as the unscored batch is, and counted toward rl.max_unscored_steps. A batch in
    which every group got one reward (no advantage) is said once and never stops the run; one whose scored
    completions are partly cut teaches, and restarts the count."""
    objective = regex_group_rl(max_new_tokens=2, mask_truncated_completions=True)
    cut = [[5, 6], [6, 7], [7, 8], [8, 9]]  # two tokens, no stop token: every one cut at max_new_tokens
    spread = torch.tensor([1.0, 0.0, 0.0, 1.0])
    objective.generated = objective.generation_metrics(spread, {"reward_regex": spread}, cut, 0.1)
    objective.check_signal(1)
    assert capsys.readouterr().out.strip() == (
        "rl: at step 1 every scored completion was cut at rl.max_new_tokens (2) and is left out of the loss "
        "(rl.mask_truncated_completions): this batch teaches nothing; the run stops after 2 such batches in a row")
    half = [[5, 2], [6, 7], [7, 2], [8, 9]]
    objective.generated = objective.generation_metrics(spread, {"reward_regex": spread}, half, 0.1)
    objective.check_signal(2)
    flat = torch.tensor([1.0, 1.0, 0.0, 0.0])
    for step in (3, 4, 5):
        objective.generated = objective.generation_metrics(flat, {"reward_regex": flat}, half, 0.1)
        objective.check_signal(step)
    assert capsys.readouterr().out.strip() == (
        "rl: at step 3 every group's completions got one reward each: no completion has an advantage, so the policy "
        "term teaches nothing this step (zero_std_groups in the metrics counts such groups)")
    objective.generated = objective.generation_metrics(spread, {"reward_regex": spread}, cut, 0.1)
    objective.check_signal(6)
    objective.generated = objective.generation_metrics(spread, {"reward_regex": spread}, cut, 0.1)
    message = one_line_error("2 generated batches in a row taught nothing, up to step 7", objective.check_signal, 7)
    assert message.startswith("rl.mask_truncated_completions: ") and "raise rl.max_new_tokens" in message


# --- TRL's trainer_state, log_metric, log_extra and async functions


def test_async_functions_run_together_on_one_loop_that_outlives_a_batch(monkeypatch):
    """TRL runs async reward functions together (asyncio.gather) on one event loop for the whole run. Two functions
    that each wait for the other's signal finish only when run together; a lock made at the first batch (a client
    bound to its loop) still works at the second, which a fresh loop per call breaks."""
    import asyncio

    module = type(sys)("async_module")
    module.events, module.loops, module.state = {}, [], {}

    def event(name):
        return module.events.setdefault((id(asyncio.get_running_loop()), name), asyncio.Event())

    async def ping(completions, **kw):
        event("ping").set()
        await asyncio.wait_for(event("pong").wait(), timeout=10)
        return [1.0] * len(completions)

    async def pong(completions, **kw):
        event("pong").set()
        await asyncio.wait_for(event("ping").wait(), timeout=10)
        module.loops.append(asyncio.get_running_loop())
        module.state.setdefault("lock", asyncio.Lock())  # bound to the loop of its first use
        async with module.state["lock"]:
            await asyncio.sleep(0)
        return [2.0] * len(completions)

    module.ping, module.pong = ping, pong
    monkeypatch.setitem(sys.modules, "async_module", module)
    rewards = load_rewards([RewardConfig(function="async_module:ping"), RewardConfig(function="async_module:pong"),
                            RewardConfig(function="exact_match")])
    for step in (1, 2):
        module.events.clear()
        total, per = score(rewards, ["q", "q"], ["a", "b"], [{"answer": "a"}, {"answer": "c"}], step=step, rows=ROWS)
        assert total.tolist() == [4.0, 3.0] and per["reward_pong"].tolist() == [2.0, 2.0]
    assert len(module.loops) == 2 and module.loops[0] is module.loops[1]


def test_an_async_function_that_raises_names_its_row(monkeypatch):
    module = type(sys)("async_bad")

    async def judge(completions, **kw):
        if any(c == "boom" for c in completions):
            raise ConnectionError("judge unreachable")
        return [0.0] * len(completions)
    module.judge = judge
    monkeypatch.setitem(sys.modules, "async_bad", module)
    message = one_line_error("judge unreachable", score, load_rewards([RewardConfig(function="async_bad:judge")]),
                             ["q", "q"], ["fine", "boom"], [{}, {}], step=4, rows=ROWS)
    assert message == "train.jsonl row 2: reward async_bad:judge at step 4: raised ConnectionError: judge unreachable"


def test_trainer_state_log_metric_and_log_extra_are_trls(monkeypatch):
    """trainer_state is a transformers TrainerState (the caller's, global_step as TRL's: optimizer steps done);
    log_metric values and log_extra columns are recorded under the function that logged them; a metric logged
    twice keeps both values, a column needs one value per completion, given once per batch."""
    from transformers import TrainerState

    from toolkit.training.rewards import Logged

    module = type(sys)("logging_module")

    def judge(completions, trainer_state, log_metric, log_extra, **kw):
        assert isinstance(trainer_state, TrainerState)
        log_metric("judge_calls", 1.0)
        log_metric(name="judge_calls", value=torch.tensor(3.0))  # TRL's parameter names
        log_metric("seen_step", trainer_state.global_step)
        log_extra("length", [len(c) for c in completions])
        return [float(trainer_state.max_steps)] * len(completions)

    def wrong_length(completions, log_extra, **kw):
        log_extra("notes", ["only one"])
        return [0.0] * len(completions)

    def twice(completions, log_extra, **kw):
        log_extra("length", [0] * len(completions))
        return [0.0] * len(completions)

    def not_a_number(completions, log_metric, **kw):
        log_metric("score", "high")
        return [0.0] * len(completions)

    for f in (judge, wrong_length, twice, not_a_number):
        setattr(module, f.__name__, f)
    monkeypatch.setitem(sys.modules, "logging_module", module)
    logged = Logged()
    total, _ = score(load_rewards([RewardConfig(function="logging_module:judge")]), ["q", "q"], ["ab", "abc"],
                     [{}, {}], step=5, rows=ROWS, state=TrainerState(global_step=4, max_steps=9), logged=logged)
    assert total.tolist() == [9.0, 9.0]
    assert logged.metrics == {"judge_calls": [1.0, 3.0], "seen_step": [4.0]} and logged.extra == {"length": [2, 3]}
    assert logged.by == {"judge_calls": "logging_module:judge", "seen_step": "logging_module:judge",
                         "length": "logging_module:judge"}
    message = one_line_error("got 1 values for 2 completions", score,
                             load_rewards([RewardConfig(function="logging_module:wrong_length")]), ["q", "q"],
                             ["a", "b"], [{}, {}], step=1, rows=ROWS, logged=Logged())
    assert message.startswith("train.jsonl row 1, train.jsonl row 2: reward logging_module:wrong_length at step 1: "
                              "log_extra('notes', ...)"), message
    message = one_line_error("already", score, load_rewards([RewardConfig(function="logging_module:judge"),
                                                             RewardConfig(function="logging_module:twice")]),
                             ["q"], ["a"], [{}], step=1, rows=ROWS[:1], logged=Logged())
    assert "logging_module:twice" in message and "logging_module:judge" in message, message
    message = one_line_error("give one number", score,
                             load_rewards([RewardConfig(function="logging_module:not_a_number")]), ["q"], ["a"],
                             [{}], step=1, rows=ROWS[:1])
    assert "log_metric('score', 'high')" in message
    message = one_line_error("the completions table has a column of that name", score,
                             load_rewards([RewardConfig(function="logging_module:judge")]), ["q"], ["a"], [{}], step=1,
                             rows=ROWS[:1], logged=Logged(reserved=frozenset({"length"})))
    assert "log_extra('length', ...)" in message
