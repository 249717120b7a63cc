"""The Hub API reads mxforge makes, each bounded and retried: repo info (the file list) and the pull-request list.

A Hub is not trusted to behave (docs/security.md, "The Hub"): every read here is retried after a transient
failure within `HubLimits` (session.retrying), a file list may hold at most `MAX_LISTED_FILES` entries, and a
listing that comes in pages (the pull requests) ends after `MAX_PAGES` pages, `MAX_ITEMS` entries or
`HubLimits.api_deadline` seconds, whichever comes first, with one error naming the listing and the repo.
huggingface_hub's own `get_repo_discussions` asks for pages for as long as the server's `count` says there are
more, so a server answering `{"count": 1e12, "discussions": []}` made it ask forever; the pages are read here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

from huggingface_hub import HfApi, ModelInfo
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

from mxforge.errors import HubError
from mxforge.hub.errors import raise_as_hub_error
from mxforge.hub.session import HubLimits, retrying

MAX_LISTED_FILES = 50_000  # files in one repo's list (GLM-5.2: 290; the largest model repos: a few thousand)
MAX_PAGES = 100  # pages of one listing (the Hub's pull requests: 50 a page, so 5,000)
MAX_ITEMS = 5_000  # entries of one listing
BROKEN = "the Hub is broken or hostile: check HF_ENDPOINT"


def repo_info(
    api: HfApi, repo_id: str, revision: str, limits: HubLimits, *, files_metadata: bool = False, action: str
) -> ModelInfo:
    """The repo's info at `revision` (its commit sha and file list), retried after a transient failure.

    `action` says what it is read for, as a verb phrase taking the repo (errors.as_hub_error).

    Raises:
        HubError: missing/gated repo, unknown revision, unreachable Hub or still failing after the retries, or a
            file list longer than MAX_LISTED_FILES.
    """
    try:
        info = retrying(lambda: api.model_info(repo_id, revision=revision, files_metadata=files_metadata), limits)
    except Exception as e:
        raise_as_hub_error(e, repo_id=repo_id, revision=revision, action=action)
        raise
    listed = len(info.siblings or [])
    if listed > MAX_LISTED_FILES:
        raise HubError(
            f"{repo_id}@{revision}: the Hub lists {listed:,} files, more than the {MAX_LISTED_FILES:,} mxforge "
            f"reads for one repo; {BROKEN}"
        )
    return info


@dataclass
class ListingBudget:
    """The bounds of one paginated listing: `MAX_PAGES` pages, `MAX_ITEMS` entries, `limits.api_deadline` seconds
    from its creation (time the caller spends on each entry counts: `check` there too)."""

    what: str  # names the listing and the repo in the error, e.g. "the open pull requests of owner/name"
    limits: HubLimits
    max_pages: int = MAX_PAGES
    max_items: int = MAX_ITEMS
    pages: int = 0
    items: int = 0
    deadline: float = field(init=False)

    def __post_init__(self) -> None:
        self.deadline = time.monotonic() + self.limits.api_deadline

    def next_page(self) -> None:
        """Before asking for one more page.

        Raises:
            HubError: `max_pages` pages were read already, or the time is up.
        """
        self._refuse(f"{self.max_pages} pages" if self.pages >= self.max_pages else None)
        self.check()
        self.pages += 1

    def add_items(self, n: int) -> None:
        """After a page of `n` entries.

        Raises:
            HubError: more than `max_items` entries in all.
        """
        self.items += n
        self._refuse(f"{self.max_items:,} entries" if self.items > self.max_items else None)

    def check(self) -> None:
        """Anywhere in the listing or in the work on its entries.

        Raises:
            HubError: the deadline has passed.
        """
        late = time.monotonic() > self.deadline
        self._refuse(f"{self.limits.api_deadline:.0f} s" if late else None)

    def _refuse(self, passed: str | None) -> None:
        if passed:
            raise HubError(
                f"{self.what}: the Hub's listing did not end within {passed} ({self.pages} page(s), "
                f"{self.items:,} entries read); {BROKEN}. Nothing was changed; on a slow link raise --timeout"
            )


@dataclass(frozen=True)
class PullRequestRef:
    num: int
    title: str

    @property
    def git_reference(self) -> str:
        return f"refs/pr/{self.num}"


def open_pull_requests(api: HfApi, repo_id: str, budget: ListingBudget) -> Iterator[PullRequestRef]:
    """The repo's open pull requests, newest first, page by page within `budget`. The list ends at the count the
    Hub announces or at its first empty page, whichever comes first.

    Raises:
        HubError: a bound of `budget` passed, a page that is not the Hub's discussion list, or a Hub error
            (mapped, after the retries).
    """
    url = f"{api.endpoint}/api/models/{repo_id}/discussions"
    headers = build_hf_headers(token=api.token)
    page = 0
    while True:
        budget.next_page()
        params = {"type": "pull_request", "status": "open", "p": page}
        try:
            data = retrying(lambda: _get_json(url, headers, params, budget.limits), budget.limits)
        except HubError:
            raise
        except Exception as e:
            raise_as_hub_error(e, repo_id=repo_id, action="list the pull requests of")
            raise
        entries, count = _discussion_page(data, budget.what, page)
        budget.add_items(len(entries))
        for entry in entries:
            if entry.get("isPullRequest", True) and entry.get("status", "open") == "open":
                yield PullRequestRef(entry["num"], entry["title"])
        if not entries or budget.items >= count:
            return
        page += 1


def _get_json(url: str, headers: dict, params: dict, limits: HubLimits) -> object:
    response = get_session().get(url, headers=headers, params=params, timeout=limits.api_timeout)
    hf_raise_for_status(response)
    try:
        return response.json()
    except ValueError:
        raise HubError(f"{url}: the Hub's answer is not JSON; {BROKEN}") from None


def _discussion_page(data: object, what: str, page: int) -> tuple[list[dict], float]:
    """(entries, announced count) of one page of the Hub's discussion list.

    Raises:
        HubError: not the shape the Hub answers (an object with a numeric count and a list of entries, each
            with a whole-number num and a title).
    """
    entries = data.get("discussions") if isinstance(data, dict) else None
    count = data.get("count") if isinstance(data, dict) else None
    ok = (
        isinstance(entries, list)
        and isinstance(count, (int, float))
        and not isinstance(count, bool)
        and all(
            isinstance(e, dict)
            and isinstance(e.get("num"), int)
            and not isinstance(e.get("num"), bool)
            and isinstance(e.get("title"), str)
            for e in entries
        )
    )
    if not ok:
        raise HubError(f"{what}: page {page} of the Hub's answer is not a discussion list; {BROKEN}")
    assert isinstance(entries, list) and isinstance(count, (int, float))
    return entries, count
