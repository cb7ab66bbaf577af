"""Models from the Hugging Face Hub by name: `attnlab download ORG/NAME`, `--ckpt hf:ORG/NAME@REV`.

    hf:google-t5/t5-small          the repository's default branch (main)
    hf:google-t5/t5-small@v1.0     a branch, a tag or a commit hash

A repository is fetched with `huggingface_hub`'s `snapshot_download` into huggingface_hub's own
cache (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub: a model another tool
downloaded is not downloaded again), with its progress bars, and only the files attnlab reads:
config.json, the safetensors weights (and their index), tokenizer files and
generation_config.json (never pickled `*.bin` weights, which loading would have to unpickle).
The returned path is an HF directory, which `open_checkpoint` opens as any other.

The environment is read on every call, not once at import as huggingface_hub reads it:
HF_ENDPOINT names the server (tests point it at a loopback one) and HF_HUB_OFFLINE=1 reads the
cache only. What goes wrong is one ValueError saying what to do: a repository or revision the
Hub does not have (404), an offline cache without the model, a Hub that cannot be reached.
"""

import os
import re
from pathlib import Path
from urllib.parse import unquote

PREFIX = "hf:"
DEFAULT_ENDPOINT = "https://huggingface.co"  # huggingface_hub's own default
# What attnlab reads from a model repository (fnmatch patterns, as huggingface_hub takes them).
ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
]
TRUE = {"1", "on", "yes", "true"}  # how huggingface_hub reads a boolean variable


def is_hub_name(spec: str | Path) -> bool:
    """Whether a --ckpt value names a Hub repository ("hf:ORG/NAME[@REV]")."""
    return str(spec).startswith(PREFIX)


def parse_hub_name(spec: str) -> tuple[str, str | None]:
    """hf:ORG/NAME@REV (or ORG/NAME@REV, without the prefix) -> ("ORG/NAME", "REV" or None)."""
    name = spec.removeprefix(PREFIX)
    repo, _, revision = name.partition("@")
    if not repo or (_ and not revision):
        raise ValueError(f"{spec!r} is not a Hub model name: write hf:ORG/NAME or hf:ORG/NAME@REV")
    return repo, revision or None


def hub_cache() -> Path:
    """huggingface_hub's cache directory, by its rules, read now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "huggingface" / "hub"


def is_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set to a true value, read now."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in TRUE


def download(repo: str, revision: str | None = None, progress: bool = True) -> Path:
    """Fetch (or find in the cache) the files attnlab reads of the model repository `repo`.

    Args:
        repo: "ORG/NAME" (or "NAME") on the Hub named by HF_ENDPOINT.
        revision: a branch, tag or commit hash (None: the default branch).
        progress: show huggingface_hub's progress bars.

    Returns:
        the snapshot directory in the cache (an HF checkpoint directory).

    Raises:
        ValueError: one line saying what to do (unknown repository or revision, offline or
            unreachable with nothing cached, a malformed name).
    """
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.utils import (
            are_progress_bars_disabled,
            disable_progress_bars,
            enable_progress_bars,
        )
    except ImportError:
        raise ValueError(
            f"hf:{repo} needs the huggingface_hub package: pip install 'attnlab[hf]'"
        ) from None

    endpoint = os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT
    constants.HF_HUB_OFFLINE = is_offline()  # huggingface_hub read it once, at its import
    shown = not are_progress_bars_disabled()
    if not progress:
        disable_progress_bars()
    try:
        path = snapshot_download(
            repo,
            revision=revision,
            cache_dir=hub_cache(),
            endpoint=endpoint,
            allow_patterns=ALLOW_PATTERNS,
            local_files_only=is_offline(),
        )
    except Exception as e:  # huggingface_hub's errors, translated in one place
        raise ValueError(_what_to_do(e, repo, revision, endpoint)) from None
    finally:
        if shown and not progress:
            enable_progress_bars()
    return Path(path)


def resolve_hub_name(spec: str) -> Path:
    """The local directory of "hf:ORG/NAME[@REV]", downloaded first if not cached; asked
    again in the same process (a command that resolves, then opens), it asks the Hub once."""
    repo, revision = parse_hub_name(spec)
    key = (repo, revision, os.environ.get("HF_ENDPOINT"), hub_cache(), is_offline())
    if key not in _RESOLVED or not _RESOLVED[key].is_dir():
        _RESOLVED[key] = download(repo, revision)
    return _RESOLVED[key]


_RESOLVED: dict[tuple, Path] = {}  # resolve_hub_name's answers in this process


def _what_to_do(error: Exception, repo: str, revision: str | None, endpoint: str) -> str:
    """One line for a failed snapshot_download: what went wrong and the way out."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    name = repo + (f"@{revision}" if revision else "")
    if isinstance(error, HFValidationError):
        return f"hf:{name} is not a valid repository name ({error}): write hf:ORG/NAME"
    listing = _failed_listing(error, endpoint)
    if listing is not None:
        return f"hf:{name}: {listing}"
    if isinstance(error, RevisionNotFoundError):
        return (
            f"hf:{repo} has no revision {revision!r} on {endpoint}: give a branch, tag or "
            "commit hash that exists, or leave out @REV for the default branch"
        )
    if isinstance(error, GatedRepoError):
        return (
            f"hf:{repo} is gated on {endpoint}: accept its terms on the model's page and log "
            "in (`hf auth login`), then try again"
        )
    if isinstance(error, RepositoryNotFoundError):
        return (
            f"hf:{repo}: no such model repository on {endpoint} (404): check the spelling "
            "(ORG/NAME, as on the model's page); a private one needs `hf auth login`"
        )
    if isinstance(error, LocalEntryNotFoundError) and is_offline():
        return (
            f"hf:{name} is not in the cache ({hub_cache()}) and HF_HUB_OFFLINE is set: run "
            f"`attnlab download {name.replace('@', ' --revision ')}` once with the network "
            "(HF_HUB_OFFLINE unset), or give a local directory"
        )
    if isinstance(error, LocalEntryNotFoundError):
        return (
            f"hf:{name} is not in the cache and {endpoint} cannot be reached: check the "
            "network (or HF_ENDPOINT), or give a local directory"
        )
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"hf:{name}: download from {endpoint} failed ({type(error).__name__}: {first})"


def _failed_listing(error: Exception, endpoint: str) -> str | None:
    """What to say when the revision request was answered but the file-tree request was not
    (huggingface_hub then raises RepositoryNotFoundError, or LocalEntryNotFoundError from its
    HTTP error, as if the repository did not exist or the Hub could not be reached); else None."""
    for e in (error, error.__cause__):
        response = getattr(e, "response", None)
        try:
            url = str(response.request.url)
        except (AttributeError, RuntimeError):  # no HTTP response, or one without its request
            continue
        match = re.search(r"/api/models/(.+?)/tree/([^/]+)", url)
        if match is None:
            continue
        repo, rev = unquote(match[1]), unquote(match[2].split("?")[0])
        code = response.headers.get("X-Error-Code") or getattr(response, "reason_phrase", "")
        return (
            f"listing the files of {repo} at {rev} failed ({response.status_code} {code}) "
            f"although {endpoint} answered the revision request: the Hub (HF_ENDPOINT) must "
            f"serve GET /api/models/{repo}/tree/REV"
        )
    return None
