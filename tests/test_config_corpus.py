"""Configs users already have (tests/config_corpus, copied verbatim from public projects; see
INDEX.yaml for each file's repository, path and commit): each one trains or is refused in one
line naming the file and key, never a traceback.

- every file is resolved against an agreeing recipe, with the code a launch and `toolkit config
  show` run (fast, no training), and the outcome is the one INDEX.yaml records;
- every file is launched for real (2 processes, a few optimizer steps, final/ reloaded with plain
  transformers): `slow`, run by hand before a release; one file of each class runs in CI.
"""

import math
import re
import sys

import pytest

from corpus import CORPUS, STEPS, agreeing_recipe, entries, launch_args, launch_yaml, resolve_outcome
from helpers import read_metrics, run_toolkit, write_recipe

ENTRIES = entries()
IDS = [e["file"].split("/", 1)[1] for e in ENTRIES]
# One file of each class the configs issue listed, launched in every CI run.
# (By hand since 2026-11-28, within CI's 60 minutes: accelerate__ds_config_zero2_model_only.json (no optimizer,
# offload: test_backends.py's zero2_offload covers CPU Adam), stanford_alpaca__default_offload_opt_param.json
# (WarmupDecayLR), llava__zero3_offload.json, accelerate__multi_node.yaml (test_backends.py rehearses multi-node);
# and llama_factory__ds_z0_config.json (ZeRO-0: test_deepspeed_config.py trains ZeRO-0 in CI).)
REPRESENTATIVE = {
    "glm__config_blocklm_10B.json",                  # 1: optimizer without scheduler (fp16: refused on CPU)
    "qwen__ds_config_zero2.json",                    # 2: WarmupLR with "auto" values
    "axolotl__zero1_torch_compile.json",             # 4: pre-0.17 compile section
    "trl__fsdp1.yaml",                               # 5: FSDP1 (refused on a CPU-only host, says how to convert)
    "trl__fsdp2.yaml",                               # 5: FSDP2
    "accelerate__cp.yaml",                           # 6: parallelism_config (context parallel)
    "llama_factory__ds_z2_autotp_config.json",       # 6: AutoTP
    "accelerate__zero_stage1_config.json",           # 7: fp16 fixed true (refused on CPU)
    "trl__deepspeed_zero3.yaml",                     # inline deepspeed_config in the YAML
}


def test_index_is_complete_and_wide():
    on_disk = {str(p.relative_to(CORPUS)) for p in CORPUS.rglob("*") if p.suffix in (".json", ".yaml")} - {"INDEX.yaml"}
    listed = [e["file"] for e in ENTRIES]
    assert sorted(listed) == sorted(on_disk)
    assert len(listed) >= 40 and len({e["repo"] for e in ENTRIES}) >= 10
    for e in ENTRIES:
        assert re.fullmatch(r"[0-9a-f]{40}", str(e["commit"])) and e["path"] and "/" in e["repo"], e
        assert e["expected"] == "trains" or e["expected"].startswith(("refused: ", "launcher: ")), e
    assert sum(e["expected"] == "trains" for e in ENTRIES) >= 25


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_corpus_file_resolves_as_recorded(entry, tmp_path):
    outcome = resolve_outcome(entry, tmp_path)
    expected = entry["expected"]
    if expected == "trains":
        assert outcome == "trains", outcome
    else:
        assert outcome.startswith("refused: ") and "\n" not in outcome, outcome
        assert expected.split(": ", 1)[1] in outcome, outcome


def launch(entry, tmp_path):
    recipe = write_recipe(tmp_path / "recipe.yaml", **agreeing_recipe(entry, tmp_path))
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(launch_yaml(entry, tmp_path)),
                *launch_args(entry), "--main_process_port", "0", "-m"]
    return run_toolkit("train", recipe, launcher=launcher, timeout=900)


def check_launch(entry, tmp_path, proc):
    rank_lines = [line for line in proc.stderr.splitlines() if line.startswith("[rank")]
    assert not any("Traceback" in line for line in rank_lines), proc.stderr[-3000:]
    expected = entry["expected"]
    if expected.startswith("launcher: "):  # accelerate's own launcher stops before any worker exists
        assert (proc.returncode != 0 and not rank_lines
                and expected.split(": ", 1)[1] in proc.stderr), proc.stderr[-2000:]
        return
    if expected.startswith("refused: "):
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
        assert expected.split(": ", 1)[1] in errors[0], errors[0]
        assert "Traceback" not in proc.stderr.split("error: ", 1)[0], proc.stderr[-3000:]
        assert not (tmp_path / "run" / "metrics.jsonl").exists()
        # every rank exits 2, whichever found the reason: the one the launcher ends is no preemption (75) and
        # no SIGTERM death (-15) (issue 52: TRL's fsdp1.yaml)
        codes = re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)
        assert set(codes) <= {"2"}, codes
        return
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    rows = read_metrics(tmp_path / "run")
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == STEPS and all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in steps), rows
    assert steps[-1]["skipped_steps"] == 0, rows
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"], rows  # same eval set before and after: it learned
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    assert all(p.numel() > 0 and bool(p.isfinite().all()) for p in model.parameters())
    print(f"\n{entry['file']}: loss {steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f}, eval_loss "
          f"{rows[0]['eval_loss']:.4f} -> {rows[-1]['eval_loss']:.4f}")


def needs_ops(entry, request):
    from helpers import require_op

    text = (CORPUS / entry["file"]).read_text()
    if entry.get("references"):
        text += (CORPUS / entry["references"]).read_text()
    if entry["expected"] == "trains" and re.search(r'"?(offload_optimizer|offload_param|cpu_offload)', text) \
            and re.search(r'"device"\s*:\s*"cpu"|offload_\w+_device:\s*cpu|"cpu_offload"\s*:\s*true', text):
        require_op(request.getfixturevalue("deepspeed_ops"), "cpu_adam")


@pytest.mark.launch
@pytest.mark.parametrize("entry", [e for e in ENTRIES if e["file"].split("/", 1)[1] in REPRESENTATIVE],
                         ids=lambda e: e["file"].split("/", 1)[1])
def test_representative_corpus_launch(entry, tmp_path, request):
    needs_ops(entry, request)
    check_launch(entry, tmp_path, launch(entry, tmp_path))


@pytest.mark.launch
@pytest.mark.slow
@pytest.mark.parametrize("entry", [e for e in ENTRIES if e["file"].split("/", 1)[1] not in REPRESENTATIVE],
                         ids=lambda e: e["file"].split("/", 1)[1])
def test_every_corpus_file_launches(entry, tmp_path, request):
    needs_ops(entry, request)
    check_launch(entry, tmp_path, launch(entry, tmp_path))
