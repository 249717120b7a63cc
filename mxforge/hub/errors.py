"""huggingface_hub's exceptions, each turned into one clear line that says what to do. Never shows the token."""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

from huggingface_hub import constants, get_token
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import httpx  # httpx on huggingface_hub 1.x, httpx2 on 2.x

from mxforge.checkpoint import repo_id_problem
from mxforge.errors import HubError, MxforgeError
from mxforge.hub.session import attempts_note
from mxforge.redaction import redact

COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


def checked_commit(sha: object, where: str) -> str:
    """The commit id the Hub answered for `where` (repo@revision), which must be a 40-hex sha.

    Raises:
        HubError: anything else (a broken or hostile server).
    """
    if not isinstance(sha, str) or not COMMIT_RE.match(sha):
        raise HubError(f"{where}: the Hub answered commit id {str(sha)[:60]!r}, not a sha; check HF_ENDPOINT")
    return sha


def check_repo_id(repo_id: str) -> None:
    """Refuse a malformed repo id before any request, in one short line (a 300-character id is cut short).

    Raises:
        HubError: not owner/name, or longer than the Hub allows.
    """
    why = repo_id_problem(repo_id)
    if why is not None:
        shown = repo_id if len(repo_id) <= 60 else f"{repo_id[:60]}..."
        raise HubError(f"{shown!r}: not a valid Hub repo id: {why}; pass an existing owner/name")


def hub_endpoint() -> str:
    """The Hub endpoint in use (HF_ENDPOINT or the default), without any user:password part."""
    parts = urlsplit(constants.ENDPOINT)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, netloc, parts.path, "", "")).rstrip("/")


def _token_hint() -> str:
    return "HF_TOKEN is set" if get_token() else "no token is configured (set HF_TOKEN or run `hf auth login`)"


def _server_says(e: HfHubHTTPError) -> str:
    msg = getattr(e, "server_message", None) or ""
    return f" (the Hub says: {msg.strip().splitlines()[0]})" if msg.strip() else ""


def as_hub_error(
    e: BaseException, *, repo_id: str, revision: str | None = None, filename: str | None = None, action: str = "reach"
) -> MxforgeError | None:
    """The MxforgeError for a huggingface_hub / network exception, or None if `e` is not one of those; it carries
    repo_id, revision, filename and the HTTP status (None when no answer came) as fields.

    `action` is what was being done, as a verb phrase whose object is the repo (or its file): "download",
    "push to", "read the file list of"; every message puts it after "to" (tests/hub/test_hostile_hub.py renders
    each one with every action the code passes, looking for doubled words)."""
    mapped = _hub_error(e, repo_id=repo_id, revision=revision, filename=filename, action=action)
    if mapped is None:
        return None
    status = getattr(getattr(e, "response", None), "status_code", None)
    return mapped.with_message(
        str(mapped),
        repo_id=repo_id,
        revision=revision,
        filename=filename,
        status=status if isinstance(status, int) else None,
    )


def _hub_error(
    e: BaseException, *, repo_id: str, revision: str | None, filename: str | None, action: str
) -> MxforgeError | None:
    endpoint = hub_endpoint()
    where = f"{repo_id}" + (f"@{revision}" if revision else "") + (f" file {filename!r}" if filename else "")
    tries = attempts_note(e)
    if isinstance(e, GatedRepoError):  # a subclass of RepositoryNotFoundError: test it first
        if get_token():
            msg = (
                f"{repo_id} is gated and your token has no access: accept its conditions at {endpoint}/{repo_id} "
                "with the account the token belongs to, then rerun"
            )
        else:
            msg = (
                f"{repo_id} is gated and no token is configured: accept its conditions at {endpoint}/{repo_id}, "
                "then set HF_TOKEN (or run `hf auth login`) and rerun"
            )
        return HubError(msg)
    if isinstance(e, RevisionNotFoundError):
        return HubError(
            f"{repo_id}: revision {revision!r} not found at {endpoint}: pass an existing branch, tag or "
            "commit sha to --revision"
        )
    if isinstance(e, RemoteEntryNotFoundError):
        return HubError(f"{where}: not found at {endpoint}: the file was removed or renamed; rerun without it")
    if isinstance(e, RepositoryNotFoundError):
        return HubError(
            f"{repo_id}: repository not found at {endpoint} (or it is private and {_token_hint()}): "
            "check the repo id and HF_ENDPOINT, and that your token can read it"
        )
    if isinstance(e, OfflineModeIsEnabled):
        return HubError(f"cannot {action} {where}: HF_HUB_OFFLINE is set; unset it to use the Hub")
    if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
        return HubError(
            f"cannot reach the Hub at {endpoint} to {action} {where}{tries} ({type(e).__name__}): "
            "check the network, proxy settings and HF_ENDPOINT, then rerun"
        )
    if isinstance(e, httpx.TimeoutException):
        return HubError(
            f"the Hub at {endpoint} stopped answering when asked to {action} {where}{tries} ({type(e).__name__}): "
            "rerun the same command to resume; on a slow link raise --timeout (MXFORGE_HUB_TIMEOUT)"
        )
    if isinstance(e, (httpx.RemoteProtocolError, httpx.NetworkError)):
        return HubError(
            f"the connection to {endpoint} dropped when asked to {action} {where}{tries} ({type(e).__name__}): "
            "rerun the same command to resume where it stopped"
        )
    if isinstance(e, HfHubHTTPError):
        status = e.response.status_code if e.response is not None else None
        if status == 401:
            return HubError(
                f"{endpoint} refused the credentials to {action} {where} "
                f"(HTTP 401, {_token_hint()}){_server_says(e)}: "
                "set HF_TOKEN to a valid token with the needed (write, for push) access"
            )
        if status == 403:
            return HubError(
                f"{endpoint} does not allow you to {action} {where} (HTTP 403){_server_says(e)}: use a token "
                "with write access to this namespace, or another repo id"
            )
        return HubError(
            f"the Hub at {endpoint} answered HTTP {status}{tries} when asked to {action} {where}{_server_says(e)}: "
            "rerun later; if it persists, check the Hub's status"
        )
    return None


def raise_as_hub_error(e: BaseException, **context) -> None:
    """Raise the MxforgeError for `e` (token masked) if it is a Hub/network failure; otherwise return."""
    mapped = as_hub_error(e, **context)
    if mapped is not None:
        raise mapped.with_message(redact(str(mapped))) from None
