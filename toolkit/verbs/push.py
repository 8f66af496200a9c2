"""`toolkit push MODEL_DIR USER/NAME`: a model folder (a run's final/, a merged model, a LoRA adapter)
onto the Hugging Face Hub as one commit, with its model card (`training/card.py` wrote final/README.md).

Everything that can be judged without the network is judged first, each a line of its own: the
folder holds a model (not a training checkpoint), the repository id is one the Hub accepts, the
Hub is not switched off (HF_HUB_OFFLINE), and a token is there (`hf auth login` or HF_TOKEN).
`--dry-run` lists what would go instead, and says what a push would still lack. The upload is huggingface_hub's
`upload_folder`: one commit, so an interrupted push leaves the repository as it was. A refusal, an
unreachable Hub or one that does not answer within `--timeout` seconds is one line naming the repository and
the endpoint.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

from ..errors import ToolkitError, command


def add_arguments(p) -> None:
    p.add_argument("model", metavar="MODEL_DIR",
                   help="a model folder: a run's final/, a merged model or a LoRA adapter folder")
    p.add_argument("repo", metavar="USER/NAME", help="the Hub repository (created when it does not exist)")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument("--revision", default=None, metavar="BRANCH",
                   help="push to this branch, made from main when it does not exist (default: main)")
    p.add_argument("--message", default=None, metavar="TEXT", help="the commit message")
    p.add_argument("--dry-run", action="store_true",
                   help="check the folder, the id and the token, list the files, and push nothing")
    p.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                   help="how long a request to the Hub may go without an answer before the push gives up (default 60)")


def run(args) -> int:
    if not (0 < args.timeout < float("inf")):
        raise ToolkitError(f"push: --timeout {args.timeout:g}: give the seconds a request may wait, above 0")
    folder = Path(args.model).expanduser()
    files = model_files(folder)
    repo = checked_repo_id(args.repo)
    from huggingface_hub import constants, get_token

    endpoint = constants.ENDPOINT
    size = sum(f.stat().st_size for f in files)
    card = "" if (folder / "README.md").is_file() else " (no README.md: the Hub shows an empty model card)"
    print(f"push: {len(files)} files, {size / 1e6:.1f} MB from {folder} to {endpoint}/{repo}{card}")
    offline = "HF_HUB_OFFLINE is set, so nothing can reach the Hub; unset it to push"
    token = get_token()
    if args.dry_run:
        for f in files:
            print(f"  {f.relative_to(folder)}  {f.stat().st_size / 1e6:.1f} MB")
        print(f"dry run: nothing pushed ({'a token is set' if token else 'no token is set yet'}"
              f"{'; ' + offline if constants.HF_HUB_OFFLINE else ''})")
        return 0
    if constants.HF_HUB_OFFLINE:
        raise ToolkitError(f"push: {offline}")
    if not token:
        raise ToolkitError(f"push: no Hugging Face token: run `{command('hf auth login')}`, or set HF_TOKEN")
    from huggingface_hub import HfApi

    from ..model.hub import network_timeouts

    network_timeouts(args.timeout)  # every request: an endpoint that never answers ends the push, as one that refuses
    api = HfApi(token=token)
    try:
        api.create_repo(repo, repo_type="model", private=args.private, exist_ok=True)
        if args.revision:
            api.create_branch(repo, branch=args.revision, repo_type="model", exist_ok=True)
        commit = api.upload_folder(repo_id=repo, folder_path=folder, repo_type="model", revision=args.revision,
                                   commit_message=args.message or f"Upload {folder.name} with toolkit push",
                                   allow_patterns=[glob.escape(str(f.relative_to(folder))) for f in files])
    except Exception as e:  # huggingface_hub's HTTP and connection errors: many kinds, each ends the push
        raise ToolkitError(f"push: {endpoint}/{repo}: {hub_problem(e, args.timeout)}") from None
    print(f"pushed {len(files)} files to {getattr(commit, 'repo_url', f'{endpoint}/{repo}')} "
          f"(commit {getattr(commit, 'oid', '?')[:10]})")
    return 0


def model_files(folder: Path) -> list[Path]:
    """The files a push sends: every file under the folder but hidden ones (a temporary file of a
    write in progress, a probe). The folder must hold a model or an adapter, and not be a checkpoint."""
    if not folder.is_dir():
        raise ToolkitError(f"push: {folder} is not a folder (push a run's final/, a merged model or an adapter)")
    if (folder / "trainer_state.json").is_file():
        raise ToolkitError(f"push: {folder} is a training checkpoint; make it a model folder first with "
                           f"`toolkit checkpoint convert {folder} --out DIR`")
    if not ((folder / "config.json").is_file() or (folder / "adapter_config.json").is_file()):
        raise ToolkitError(f"push: {folder} holds no model (no config.json or adapter_config.json)")
    files = sorted(p for p in folder.rglob("*") if p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    if not any(f.suffix in (".safetensors", ".bin") for f in files):
        raise ToolkitError(f"push: {folder} holds no weights (no .safetensors or .bin file)")
    return files


def checked_repo_id(repo: str) -> str:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        raise ToolkitError(f"push: {repo!r} is not a Hub repository id: {str(e).splitlines()[0]}") from None
    if "/" not in repo:
        raise ToolkitError(f"push: {repo!r}: name the owner too, as USER/NAME or ORG/NAME")
    return repo


def hub_problem(e: Exception, answer_s: float) -> str:
    from ..model.hub import timed_out

    status = getattr(getattr(e, "response", None), "status_code", None)
    if status in (401, 403):
        return f"the Hub refused the token (HTTP {status}); log in again with `{command('hf auth login')}`"
    text = str(e).strip().splitlines()
    waited = timed_out(e, answer_s)
    line = f"{waited}; --timeout sets the wait" if waited else text[0] if text else type(e).__name__
    if os.environ.get("HF_ENDPOINT"):
        line += f" (HF_ENDPOINT={os.environ['HF_ENDPOINT']})"
    return line
