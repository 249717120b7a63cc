"""The HTTP client huggingface_hub uses for mxforge: a timeout on every request, the token only to HF_ENDPOINT.

huggingface_hub (1.x) makes one shared httpx client with no timeout (and some calls, e.g. repo info, pass
`timeout=None` explicitly), so an API call to a Hub that stops answering waits forever; and when it
follows a redirect of a file's metadata request it compares host names only, so the `Authorization`
header follows a redirect to another port of the same host. `use_hub_limits` installs, through
huggingface_hub's supported `set_client_factory`, a client whose request hook gives every request
without a timeout the API timeout and drops `Authorization` from every request whose origin (scheme,
host, port) is not exactly HF_ENDPOINT's (redirects included: httpx runs the hook for each hop).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import urlsplit

from huggingface_hub import constants, set_client_factory
from huggingface_hub.utils import httpx  # the HTTP module huggingface_hub uses: httpx on 1.x, httpx2 on 2.x

from mxforge.errors import MxforgeError

TIMEOUT_ENV, RETRIES_ENV = "MXFORGE_HUB_TIMEOUT", "MXFORGE_HUB_RETRIES"
DEFAULT_API_TIMEOUT_S = 60.0
DEFAULT_RETRIES = 5
BACKOFF_START_S, BACKOFF_MAX_S = 0.5, 15.0


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


def _client_factory(timeout: float):
    def make() -> httpx.Client:
        try:  # huggingface_hub's own client (its request hook: offline mode, request ids), then ours on top
            from huggingface_hub.utils._http import default_client_factory

            client = default_client_factory()
        except ImportError:
            client = httpx.Client(follow_redirects=True)
        client.timeout = httpx.Timeout(timeout)
        hooks = client.event_hooks
        client.event_hooks = {**hooks, "request": [*hooks.get("request", []), _request_guard(timeout)]}
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
