"""What a run learns from besides its data, identified by content: the base model (its weights and
config, and under trust_remote_code its Python code) and the reward functions' code. Recorded in
every checkpoint (`trainer_state.json` `inputs`) and the manifest. A resume, or `checkpoint convert`,
that finds one changed is refused in one line naming it (`resume_accept_changed` lets a resume go
on); where the content is the same, its path does not matter (a model copied to where this machine
keeps models). The data is the data fingerprint's (it covers the tokenizer and the chat template)."""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path

from ..errors import ToolkitError

WHAT = {"model": "the base model (model.path: its weights and config)",
        "rewards": "the reward functions' code (rl.rewards)"}
# Recipe keys that only say where an input is: not compared on resume where the input is compared by content.
PATH_KEYS = {"model.path": "model"}


def identities(recipe, rewards: list = ()) -> dict[str, str]:
    """{input: content fingerprint} of this run's inputs that exist (a preset model is its name and
    seed, already in the recipe; built-in rewards are the toolkit's)."""
    from ..config import BUILT_IN_REWARDS
    from ..model import base_identity
    from ..model.hub import resolve_model

    out = {}
    m = recipe.model
    if m.preset is None and m.path:
        folder = Path(resolve_model(m.path, m.revision))
        h = hashlib.sha256(base_identity.fingerprint(folder).encode())
        for f in sorted(folder.glob("*.py")) if m.trust_remote_code else []:
            h.update(f.name.encode() + f.read_bytes())
        out["model"] = h.hexdigest()[:16]
    code = hashlib.sha256()
    files = sorted({(r.name, f) for r in rewards if r.name.partition("#")[0] not in BUILT_IN_REWARDS
                    and (f := _source_file(r.function)) is not None})
    for name, f in files:
        code.update(name.rpartition(":")[2].encode() + Path(f).read_bytes())  # not its path: files may move
    if files:
        out["rewards"] = code.hexdigest()[:16]
    return out


def _source_file(function) -> str | None:
    try:
        f = inspect.getsourcefile(function)
    except TypeError:  # a built-in or C function
        return None
    return f if f and Path(f).is_file() else None


def check_unchanged(saved: dict | None, now: dict | None, path: Path, accept=(), verb: str = "resume") -> None:
    """Refuse when an input recorded in checkpoint `path` has other content now, unless `accept` lists it.
    A checkpoint of an older toolkit recorded none: nothing to compare."""
    for name in sorted(set(saved or {}) & set(now or {})):
        if saved[name] != now[name] and name not in accept:
            remedy = (f"put the original back, or set resume_accept_changed=[{name}] to continue with this one"
                      if verb == "resume" else "put the original back at model.path, or convert from final/")
            raise ToolkitError(f"{verb}: {WHAT[name]} changed since {path} was written (content fingerprint "
                               f"{saved[name]} then, {now[name]} now); {remedy}")


def recorded_both(saved: dict | None, now: dict | None, name: str) -> bool:
    return name in (saved or {}) and name in (now or {})
