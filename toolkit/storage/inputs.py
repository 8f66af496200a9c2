"""What a run learns from besides its data, identified by content: the base model (its weights and
config, and under trust_remote_code its Python code), the reward functions' code and the reward
models. Recorded in every checkpoint (`trainer_state.json` `inputs`, made by `model.base_identity.identities`) and the
manifest. A resume, or `checkpoint convert`, that finds one changed is refused in one line naming it
(`resume_accept_changed` lets a resume go on); where the content is the same, its path does not
matter (a model copied to where this machine keeps models). The data is compared by its own
fingerprint without its files' paths (`data_content`; it covers the tokenizer and the chat template)."""

from __future__ import annotations

from pathlib import Path

from ..config.recipe import CHANGEABLE_INPUTS
from ..errors import ToolkitError

WHAT = CHANGEABLE_INPUTS  # each input by name, in words; the names resume_accept_changed takes
# Recipe keys that only say where an input is: not compared on resume where the input is compared by content.
PATH_KEYS = {"model.path": "model", "rl.teacher": "teacher"}


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
