"""The HTTP client huggingface_hub uses for mxforge: a timeout on every request, the token only to HF_ENDPOINT,
bounded waits, retries of what is safe to retry, and fresh connections per stage.

huggingface_hub (1.x) makes one shared httpx client with no timeout (and some calls, e.g. repo info, pass
`timeout=None` explicitly), so an API call to a Hub that stops answering waits forever; and when it
follows a redirect of a file's metadata request it compares host names only, so the `Authorization`
header follows a redirect to another port of the same host. `use_hub_limits` installs, through
huggingface_hub's supported `set_client_factory`, a client whose request hook gives every request
without a timeout the API timeout and drops `Authorization` from every request whose origin (scheme,
host, port) is not exactly HF_ENDPOINT's (redirects included: httpx runs the hook for each hop), and whose
response hook caps a `Retry-After` (or `RateLimit` reset) at the API timeout (at most `BACKOFF_MAX_S`):
huggingface_hub's own http_backoff (preupload, LFS) sleeps as long as the server says.

`retrying` repeats an idempotent call after a transient failure (`is_transient`: a dropped or silent
connection, or one of the statuses huggingface_hub's http_backoff retries) within `HubLimits`; the
timed-out connection is closed by httpx, so the next attempt opens another. `fresh_connections` starts a
stage on new connections, so a connection an earlier stage left idle (one a server keeps open and never
answers on again) cannot make this stage's first request time out.
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable, TypeVar
from urllib.parse import urlsplit

from huggingface_hub import close_session, constants, set_client_factory
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import httpx  # the HTTP module huggingface_hub uses: httpx on 1.x, httpx2 on 2.x

from mxforge.errors import MxforgeError

TIMEOUT_ENV, RETRIES_ENV = "MXFORGE_HUB_TIMEOUT", "MXFORGE_HUB_RETRIES"
DEFAULT_API_TIMEOUT_S = 60.0
DEFAULT_RETRIES = 5
BACKOFF_START_S, BACKOFF_MAX_S = 0.5, 15.0
# A retry may follow these: a connection that dropped or went silent, and the statuses huggingface_hub's own
# http_backoff retries (huggingface_hub.utils._http: 408 timeout, 429 rate limit, 500, 502, 503, 504).
TRANSIENT = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
CANCEL = threading.Event()  # set on Ctrl-C: transfers stop at their next chunk, retries at their next wait
T = TypeVar("T")


@dataclass(frozen=True)
class HubLimits:
    """How long mxforge waits for the Hub, and how often it tries a file again.

    `api_timeout`: any API call (repo info, create, preupload, LFS, commit); `metadata_timeout` / `data_timeout`:
    a file's HEAD request / each read of its bytes. `retries`: consecutive failed attempts at one file that
    brought no new byte. A file that gets no new byte for `no_progress_deadline` seconds is given up too.
    """

    api_timeout: float
    metadata_timeout: float
    data_timeout: float
    retries: int

    @property
    def no_progress_deadline(self) -> float:
        """As long as `retries` + 1 attempts that each time out, with their backoff, can take."""
        return (self.retries + 1) * self.data_timeout + sum(self.backoff(k) for k in range(1, self.retries + 1))

    @property
    def api_deadline(self) -> float:
        """How long one API call (or one listing, all its pages) may take over all its attempts: as long as
        `retries` + 1 attempts that each time out, with their backoff."""
        return (self.retries + 1) * self.api_timeout + sum(self.backoff(k) for k in range(1, self.retries + 1))

    def backoff(self, failures: int) -> float:
        """Seconds to wait before the next attempt after `failures` consecutive failed ones."""
        return min(BACKOFF_MAX_S, BACKOFF_START_S * 2 ** max(failures - 1, 0))

    @classmethod
    def resolve(cls, timeout: float | None = None, retries: int | None = None) -> "HubLimits":
        """The limits for this run: explicit values (--timeout, --retries), else MXFORGE_HUB_TIMEOUT /
        MXFORGE_HUB_RETRIES, else huggingface_hub's own HF_HUB_ETAG_TIMEOUT / HF_HUB_DOWNLOAD_TIMEOUT for
        file requests and 60 s for API calls, 5 retries.

        Raises:
            MxforgeError: a value that is not a positive number (retries: a whole number >= 0).
        """
        timeout = timeout if timeout is not None else _env_number(TIMEOUT_ENV, float)
        retries = retries if retries is not None else _env_number(RETRIES_ENV, int)
        if timeout is not None and not timeout > 0:
            raise MxforgeError(f"--timeout / {TIMEOUT_ENV} must be a positive number of seconds, got {timeout}")
        if retries is not None and retries < 0:
            raise MxforgeError(f"--retries / {RETRIES_ENV} must be 0 or more, got {retries}")
        return cls(
            api_timeout=timeout or DEFAULT_API_TIMEOUT_S,
            metadata_timeout=timeout or float(constants.HF_HUB_ETAG_TIMEOUT),
            data_timeout=timeout or float(constants.HF_HUB_DOWNLOAD_TIMEOUT),
            retries=DEFAULT_RETRIES if retries is None else retries,
        )


def _env_number(name: str, kind: type):
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        return kind(raw)
    except ValueError:
        raise MxforgeError(
            f"{name}={raw!r} is not a {'whole ' if kind is int else ''}number; fix or unset it"
        ) from None


def _origin(url: str | httpx.URL) -> tuple[str, str, int | None]:
    parts = urlsplit(str(url))
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or {"http": 80, "https": 443}.get(scheme)


def is_hub_origin(url: str | httpx.URL) -> bool:
    """Whether `url` has exactly the scheme, host and port of the configured Hub endpoint (HF_ENDPOINT)."""
    return _origin(url) == _origin(constants.ENDPOINT)


def _request_guard(timeout: float):
    def guard(request: httpx.Request) -> None:
        if not is_hub_origin(request.url):
            request.headers.pop("authorization", None)
        limits = request.extensions.get("timeout") or {}
        request.extensions["timeout"] = {
            k: timeout if limits.get(k) is None else limits[k] for k in ("connect", "read", "write", "pool")
        }

    return guard


def _bounded_waits(timeout: float):
    """A response hook capping the waits a server asks for (`Retry-After`, the `RateLimit` reset) at the API timeout
    (at most BACKOFF_MAX_S): huggingface_hub's http_backoff sleeps that long before its next attempt, however long."""
    limit = max(1, int(min(BACKOFF_MAX_S, timeout)))

    def cap(response: httpx.Response) -> None:
        retry_after = response.headers.get("retry-after")
        if retry_after is not None and not (retry_after.strip().isdigit() and int(retry_after) <= limit):
            response.headers["retry-after"] = str(limit)
        ratelimit = response.headers.get("ratelimit")
        if ratelimit is not None:
            response.headers["ratelimit"] = re.sub(
                r"\bt=(\d+)", lambda m: f"t={min(int(m.group(1)), limit)}", ratelimit
            )

    return cap


def _client_factory(timeout: float):
    def make() -> httpx.Client:
        try:  # huggingface_hub's own client (its request hook: offline mode, request ids), then ours on top
            from huggingface_hub.utils._http import default_client_factory

            client = default_client_factory()
        except ImportError:
            client = httpx.Client(follow_redirects=True)
        client.timeout = httpx.Timeout(timeout)
        hooks = client.event_hooks
        client.event_hooks = {
            **hooks,
            "request": [*hooks.get("request", []), _request_guard(timeout)],
            "response": [*hooks.get("response", []), _bounded_waits(timeout)],
        }
        return client

    return make


_installed: float | None = None


def use_hub_limits(limits: HubLimits) -> None:
    """Make every request huggingface_hub sends from now on use `limits.api_timeout` by default and carry
    the token only to HF_ENDPOINT's exact origin."""
    global _installed
    if _installed != limits.api_timeout:
        set_client_factory(_client_factory(limits.api_timeout))
        _installed = limits.api_timeout


def fresh_connections() -> None:
    """Make the stage about to start open its own connections: close huggingface_hub's shared client (it is made
    again, with these limits, on the next request). An idle connection an earlier stage left, which a server may
    keep open without ever answering on it again, would otherwise make this stage's first request wait out its
    timeout and be blamed for it. Call it only where no other Hub transfer of this process is in flight."""
    close_session()


def is_transient(e: BaseException) -> bool:
    """Whether a request that failed with `e` may succeed when sent again: a dropped or silent connection, or
    an HTTP status in RETRY_STATUSES."""
    if isinstance(e, TRANSIENT):
        return True
    response = getattr(e, "response", None) if isinstance(e, HfHubHTTPError) else None
    return response is not None and response.status_code in RETRY_STATUSES


def failed_attempt(e: BaseException) -> str:
    """A transient failure in a few words, for the error that reports the last attempt: the HTTP status, or the
    transport error."""
    response = getattr(e, "response", None) if isinstance(e, HfHubHTTPError) else None
    if response is not None:
        return f"HTTP {response.status_code}"
    return f"{type(e).__name__}: {e}"


def attempts_note(e: BaseException) -> str:
    """' after N attempts' for an error `retrying` gave up on ('' otherwise), for the message that reports it."""
    n = getattr(e, "mxforge_attempts", None)
    return f" after {n} attempts" if n and n > 1 else ""


def retrying(call: Callable[[], T], limits: HubLimits) -> T:
    """`call()`, sent again after a transient failure (is_transient) with `limits.backoff` between attempts, at
    most `limits.retries` more times and within `limits.api_deadline`. Only for requests that a second attempt
    cannot turn into a second effect: reads (repo info, file metadata, listings), and creating what may exist
    already (exist_ok).

    Raises:
        the last attempt's exception (its `mxforge_attempts` says how many were made; see attempts_note), or any
        non-transient one at once.
        KeyboardInterrupt: CANCEL was set during a wait.
    """
    end = time.monotonic() + limits.api_deadline
    failures = 0
    while True:
        try:
            return call()
        except Exception as e:
            if not is_transient(e):
                raise
            failures += 1
            wait = limits.backoff(failures)
            if failures > limits.retries or time.monotonic() + wait > end:
                setattr(e, "mxforge_attempts", failures)
                raise
        if CANCEL.wait(wait):
            raise KeyboardInterrupt
