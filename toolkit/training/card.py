"""`final/README.md`: the run's model card, in the Hub's format (YAML metadata between `---` lines, then
Markdown), written with final/ and read back with it. It says what a reader of the model needs and the
run knows: the base model, the objective and how it trained, the data (each entry and the content
fingerprint a resume compares), the steps and tokens, the last metrics, the recipe as resolved, the
toolkit and library versions, and the base's license where the base's own card states one. Nothing
is sent anywhere: `hf upload USER/NAME RUN/final` publishes the folder (docs/after-training.md)."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import yaml

from ..config import DataSource, Recipe, dump_recipe
from ..config.methods import method_of
from ..model.hub import is_hub_id


def model_card(recipe: Recipe, state, rows: list[dict], base_folder: Path | None) -> str:
    """The card's text. `state`: the run's TrainerState at its end; `rows`: metrics.jsonl's rows;
    `base_folder`: the base model's local folder (None for a preset)."""
    m, lora = recipe.model, recipe.lora
    base = m.path if m.path and is_hub_id(m.path) else None
    scorer = method_of(recipe).scorer
    meta = {"library_name": "peft" if lora.enabled else "transformers",
            "pipeline_tag": "text-classification" if scorer else "text-generation",
            "tags": ["toolkit", method_of(recipe).name] + (["lora"] if lora.enabled else [])
            + (["qlora"] if m.load_in_4bit else [])}
    if base:
        meta["base_model"] = base
    if (license_ := base_license(base_folder)) is not None:
        meta["license"] = license_
    hub_data = [e.path if isinstance(e, DataSource) else e for e in recipe.data.train_files]
    if hub_data := [p for p in hub_data if is_hub_id(p)]:
        meta["datasets"] = hub_data
    name = Path(recipe.output_dir).name
    targets = lora.target_modules if isinstance(lora.target_modules, str) else ", ".join(lora.target_modules)
    how = (f"with LoRA (r={lora.r}, alpha={lora.alpha:g}, {targets})" if lora.enabled else "of all weights") + (
        " over a 4-bit NF4 base (QLoRA)" if m.load_in_4bit else "")
    lines = ["---", yaml.safe_dump(meta, sort_keys=False).strip(), "---", "", f"# {name}", "",
             f"Fine-tuned from {f'[{base}](https://huggingface.co/{base})' if base else base_text(recipe)} with "
             f"toolkit {version('toolkit')}: {method_of(recipe).card(recipe)} {how}, {state.step:,} optimizer steps "
             f"of a global batch of {state.global_batch} ({state.tokens_seen:,} tokens), {recipe.train.precision}, "
             f"on {state.world_size} process(es) ({state.launch}).", "", "## Data", "",
             "| entry | format | rows used |", "|---|---|---|"]
    for e in recipe.data.train_files:
        e = e if isinstance(e, DataSource) else DataSource(path=e)
        lines.append(f"| `{e.path}`{f' ({e.split})' if is_hub_id(e.path) else ''} | {e.format or recipe.data.format} | "
                     f"{e.max_rows if e.max_rows is not None else 'all'} |")
    lines += ["", f"Training data content fingerprint: `{state.data_content or state.data_fingerprint}` "
              "(the same data, wherever its files are, gives the same one)."]
    if state.inputs:
        lines.append("Inputs by content: " + ", ".join(f"{k} `{v}`" for k, v in sorted(state.inputs.items())) + ".")
    lines += ["", "## Results", "", results(rows), "", "## Use", "", usage(recipe, base), "",
              "## Recipe", "", "```yaml", dump_recipe(recipe).rstrip(), "```", "",
              "Versions: " + ", ".join(f"{p} {version(p)}" for p in ("torch", "transformers", "peft", "accelerate",
                                                                     "datasets", "deepspeed")) + "."]
    return "\n".join(lines) + "\n"


def base_text(recipe: Recipe) -> str:
    m = recipe.model
    return f"the built-in preset `{m.preset}`" if m.preset else f"`{Path(m.path).name}` (a local folder)"


def base_license(folder: Path | None) -> str | None:
    """The `license` of the base's own card (README.md metadata), where it states one."""
    card = folder / "README.md" if folder is not None else None
    if card is None or not card.is_file():
        return None
    text = card.read_text(errors="replace")
    if not text.startswith("---"):
        return None
    try:
        meta = yaml.safe_load(text.split("---", 2)[1]) or {}
    except (yaml.YAMLError, IndexError):
        return None
    value = meta.get("license") if isinstance(meta, dict) else None
    return str(value) if value is not None else None


def results(rows: list[dict]) -> str:
    """The last value of each metric a reader compares runs by, at the step it was logged."""
    names = ("loss", "eval_loss", "reward", "eval_reward", "reward_accuracy", "eval_reward_accuracy")
    last = {n: r for r in rows for n in names if r.get(n) is not None}
    if not last:
        return "No metrics were logged."
    table = ["| metric | value | step |", "|---|---|---|"]
    table += [f"| {n} | {last[n][n]:.4g} | {last[n].get('step', '?')} |" for n in names if n in last]
    return "\n".join(table)


PLAIN_USE = ("A plain Hugging Face folder with its tokenizer and chat template:\n\n```python\n"
             "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
             "model = AutoModelForCausalLM.from_pretrained(FOLDER)\n"
             "tokenizer = AutoTokenizer.from_pretrained(FOLDER)\n```")


def merged_card(text: str) -> str | None:
    """A LoRA run's card (`model_card`) for its adapter merged into the base (`toolkit merge`): a plain model's
    metadata (library transformers, no `lora` tag, `merged` added) and use; None for a card of another kind."""
    if not text.startswith("---\nlibrary_name: peft\n") or "\n## Use\n" not in text or "\n## Recipe\n" not in text:
        return None
    head, _, body = text[4:].partition("\n---\n")
    meta = yaml.safe_load(head)
    meta["library_name"] = "transformers"
    meta["tags"] = [t for t in meta.get("tags", []) if t != "lora"] + ["merged"]
    before, rest = body.split("\n## Use\n", 1)
    after = rest[rest.index("\n## Recipe\n"):]
    return ("---\n" + yaml.safe_dump(meta, sort_keys=False).strip() + "\n---\n" + before
            + "\n## Use\n\nMerged into its base by `toolkit merge`. " + PLAIN_USE + "\n" + after)


def usage(recipe: Recipe, base: str | None) -> str:
    if method_of(recipe).scorer:
        return ("A reward model: a Hugging Face sequence-classification folder of one score, with its tokenizer. "
                "As a reward of online RL: `rl.rewards: [{model: FOLDER}]`; in Python:\n\n```python\n"
                "from transformers import AutoModelForSequenceClassification, AutoTokenizer\n"
                "model = AutoModelForSequenceClassification.from_pretrained(FOLDER)\n"
                "tokenizer = AutoTokenizer.from_pretrained(FOLDER)\n"
                "score = model(**tokenizer(TEXT, return_tensors='pt')).logits[0, 0]\n```")
    if recipe.lora.enabled:
        return ("A LoRA adapter (peft): `toolkit generate FOLDER` and `toolkit eval` load it over its base, "
                "`toolkit merge FOLDER --out MERGED` makes a plain model; in Python:\n\n```python\n"
                "from peft import AutoPeftModelForCausalLM\n"
                "model = AutoPeftModelForCausalLM.from_pretrained(FOLDER)\n```")
    return PLAIN_USE


def version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"


def read_rows(path: Path) -> list[dict]:
    """metrics.jsonl's rows (a line cut by a kill is skipped)."""
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows
