"""Check a push target before any work is done for it: the repo id, the token, and that the token may write there.

`mxforge run ... --push REPO` finds a bad target only when it pushes, after download, quantize, fixup and
validate (47 minutes on GLM-5.2 by the runbook's plan), and `mxforge push` after hashing every file and
writing the model card. `check_push_target` asks the Hub first, with the requests huggingface_hub itself
uses: `whoami` (who the token belongs to, its organizations and their roles, a read-only token), then, for a
repo that exists, its info (public or private) and `auth_check(write=True)` (the Hub's own answer to "may
this token write here"). A repo that does not exist yet is created by the push in the token's own namespace
or one of its organizations'.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from huggingface_hub import HfApi, get_token
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

from mxforge.errors import HubError
from mxforge.hub.errors import check_repo_id, hub_endpoint, raise_as_hub_error
from mxforge.hub.session import HubLimits, retrying, use_hub_limits
from mxforge.redaction import redact


@dataclass(frozen=True)
class PushTarget:
    """What the Hub said about a push target: whose token, and whether the repo exists already."""

    repo_id: str
    user: str
    exists: bool
    private: bool | None  # of the existing repo (None: it will be created)

    def as_dict(self) -> dict:
        return {"repo_id": self.repo_id, "user": self.user, "exists": self.exists, "private": self.private}


def check_push_target(repo_id: str, *, private: bool = False, limits: HubLimits | None = None) -> PushTarget:
    """Refuse, in one line and before any work, a push to `repo_id` that cannot succeed or would not do what
    was asked. Sends only read requests.

    Raises:
        HubError: a malformed repo id; no token, or one the Hub refuses; a read-only token; a namespace that is
            neither the token's user nor one of its organizations (or one where it may only read); an existing
            repo the token may not write to; `private` asked of an existing public repo (the push would publish
            there); the Hub unreachable.
    """
    check_repo_id(repo_id)
    namespace = repo_id.split("/")[0]
    fail = f"cannot push to {repo_id} at {hub_endpoint()}"
    if not get_token():
        raise HubError(
            f"{fail}: no Hub token is configured; set HF_TOKEN (or run `hf auth login`) to a token with write "
            f"access to {namespace!r}, then rerun (nothing was uploaded)"
        )
    limits = limits or HubLimits.resolve()
    use_hub_limits(limits)
    api = HfApi()
    try:  # every request here is a read: retried after a transient failure (session.retrying)
        me = retrying(api.whoami, limits)
    except Exception as e:
        raise_as_hub_error(e, repo_id=repo_id, action="check the token for a push to")
        raise
    user = str(me.get("name") or "")
    orgs = {str(o.get("name")): o for o in me.get("orgs") or [] if isinstance(o, dict)}
    role = ((me.get("auth") or {}).get("accessToken") or {}).get("role")
    if role == "read":
        raise HubError(
            f"{fail}: the token of {user!r} is read-only; create a token with write access (a write or "
            "fine-grained token) and set HF_TOKEN to it (nothing was uploaded)"
        )
    if namespace != user and namespace not in orgs:
        belongs = f"{user!r}" + (f" (organizations: {', '.join(sorted(orgs))})" if orgs else " (no organizations)")
        raise HubError(
            f"{fail}: the token belongs to {belongs}, which cannot create or write repos under {namespace!r}; "
            f"push to {user}/{repo_id.split('/', 1)[1]}, or use a token of {namespace!r} (nothing was uploaded)"
        )
    if namespace in orgs and orgs[namespace].get("roleInOrg") == "read":
        raise HubError(
            f"{fail}: {user!r} may only read in the organization {namespace!r}; ask its admins for the write "
            "role, or push to your own namespace (nothing was uploaded)"
        )
    target = PushTarget(repo_id, user, exists=False, private=None)
    try:
        info = retrying(lambda: api.model_info(repo_id), limits)
    except GatedRepoError:  # exists, and the token may not even read it
        raise HubError(f"{fail}: the repo exists and is gated; the token of {user!r} has no access to it") from None
    except RepositoryNotFoundError:
        return target  # the push creates it
    except Exception as e:
        raise_as_hub_error(e, repo_id=repo_id, action="read the repo info of")
        raise
    target = PushTarget(repo_id, user, exists=True, private=bool(info.private))
    if private and not info.private:
        raise HubError(
            f"{fail} --private: {repo_id} exists and is public, and a push does not change that: the files "
            "would be public. Make it private on the Hub first, or push without --private (nothing was uploaded)"
        )
    if "write" in inspect.signature(api.auth_check).parameters:  # huggingface_hub versions that can ask
        try:
            retrying(lambda: api.auth_check(repo_id, write=True), limits)
        except Exception as e:
            raise_as_hub_error(e, repo_id=repo_id, action="push to")
            raise HubError(redact(f"{fail}: the Hub refused write access ({type(e).__name__})")) from None
    return target
