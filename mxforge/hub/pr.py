"""`mxforge fixup REPO_ID --create-pr`: propose fixup's config.json to a Hub repo as a pull request.

The fixup is computed from the repo's headers (hub_source), exactly as for a local directory. The pull
request changes only `config.json` and adds/updates `mxforge_fixups.json` (the record); no weight is
touched. Its description lists each entry, the engine releases it fixes and validate's verdict before and
after. Idempotent: an open pull request by mxforge whose config.json is the one computed now is reported
instead of opening another, and a repo with nothing to fix is said to be fixed.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from functools import partial

from huggingface_hub import CommitOperationAdd

from mxforge.checkpoint import Checkpoint
from mxforge.errors import MxforgeError
from mxforge.fixups.fixup import FixupResult, add_to_record, fixup_checkpoint
from mxforge.hub.api import ListingBudget, open_pull_requests
from mxforge.hub.errors import raise_as_hub_error
from mxforge.hub.session import CANCEL, HubLimits, fresh_connections, is_transient, retrying
from mxforge.hub.source import HubSource
from mxforge.models import layout_of
from mxforge.provenance import FIXUPS_NAME, read_fixups_record, recorded_command
from mxforge.records import fields_of
from mxforge.validation.profiles import select
from mxforge.validation.validate import validate_checkpoint

PR_TITLE = "mxforge fixup: quantization_config.exclude entries every engine release needs"
MAX_DESCRIBED = 200  # entries listed in the description; the record in the PR holds every one


@dataclass
class PrResult:
    repo_id: str
    revision: str
    commit: str
    fixup: FixupResult
    before: dict  # validate's report on the repo as it is
    after: dict | None = None  # ... on the repo with the proposed config.json
    status: str = ""  # opened | exists | fixed | unfixable | dry-run
    pr_num: int | None = None
    pr_url: str | None = None
    description: str = ""
    fetched: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "stage": "fixup",
            "repo": self.repo_id,
            **fields_of(self, "revision", "commit", "status", "pr_num", "pr_url"),
            "verdict_before": self.before["verdict"],
            "verdict_after": self.after["verdict"] if self.after else None,
            "fixup": self.fixup.as_dict(),
            "fetched": self.fetched,
            "ok": not self.fixup.remaining,
        }

    def format(self) -> str:
        from mxforge.progress import fetched_line

        head = {
            "opened": f"opened pull request #{self.pr_num}: {self.pr_url}",
            "exists": f"pull request #{self.pr_num} by mxforge already proposes this config.json: {self.pr_url} "
            "(nothing new opened)",
            "fixed": "already fixed: config.json needs no change for the selected releases (no pull request)",
            "unfixable": "no pull request: editing config.json cannot make any more release load it",
            "dry-run": "dry run: this pull request would be opened (nothing sent)",
        }[self.status]
        lines = [f"{self.repo_id}@{self.revision} ({self.commit[:12]}): {head}", f"  before: {self.before['verdict']}"]
        if self.after:
            lines.append(f"  after:  {self.after['verdict']}")
        lines.append(f"  {fetched_line(self.fetched)}")
        lines += ["  " + line for line in self.fixup.format().splitlines()[1:]]
        if self.status == "dry-run":
            lines += ["", "--- pull request description ---", self.description]
        return "\n".join(lines)


def config_bytes(config: dict) -> bytes:
    """config.json as fixup writes it locally (write_json_atomic's format)."""
    return (json.dumps(config, indent=2) + "\n").encode()


def describe(fixup: FixupResult, labels: dict[str, str], before: str, after: str, command: str | None) -> str:
    """The pull request's description: what changes, for which releases, and validate before/after."""
    lines = [
        "This pull request was opened by `mxforge fixup --create-pr`. It changes only "
        "`quantization_config.exclude` in `config.json` and adds `mxforge_fixups.json`, the record of what "
        "changed; no weight is touched. Engines build the MTP layer under other names than the checkpoint "
        "stores it (sglang: `model.decoder.*`, `model.eh_proj`) and match `exclude` entries exactly or by "
        "`re:` regex, never as globs, so each release needs its own names for the modules stored in bf16.",
        "",
        f"**validate before:** {before}",
        "",
        f"**validate after:** {after}",
        "",
        "| change | entry | fixes | why |",
        "|---|---|---|---|",
    ]
    shown = fixup.applied[:MAX_DESCRIBED]
    for a in shown:
        releases = ", ".join(dict.fromkeys(labels.get(p, p) for p in a.get("engines", []))) or "every release"
        if a["fixup"] == "glob_rewrite":
            lines.append(
                f"| glob rewritten | `{a['entry']}` -> {len(a['replaced_by'])} exact name(s) | every release "
                f"| {a['why']} |"
            )
        elif a["fixup"] == "block_entry_rewrite":
            lines.append(f"| rewritten | `{a['entry']}` -> `{a['replaced_by'][0]}` | {releases} | {a['why']} |")
        else:
            lines.append(f"| added | `{a['entry']}` | {releases} | {a['why']} |")
    if len(fixup.applied) > len(shown):
        lines.append(f"| ... | {len(fixup.applied) - len(shown)} more | | all of them in `mxforge_fixups.json` |")
    lines += [f"- warning: {w}" for w in fixup.warnings]
    lines += ["", f"Command: `{command}`"] if command else []
    return "\n".join(lines)


def create_fixup_pr(
    repo_id: str,
    revision: str | None = None,
    engines=None,
    *,
    dry_run: bool = False,
    limits: HubLimits | None = None,
    command: str | None = None,
) -> PrResult:
    """Compute fixup from the repo's headers at `revision` and open (unless `dry_run`, or an open one by
    mxforge already proposes the same config.json, or there is nothing to fix) one pull request against it.

    Raises:
        HubError: the repo or revision cannot be read, or the Hub refuses the pull request (no write access...).
        MxforgeError: `revision` is a pull request (open the fix against a branch), or fixup cannot run.
    """
    command = recorded_command(command)
    revision = revision or "main"
    if revision.startswith("refs/pr/"):
        raise MxforgeError(
            f"{repo_id}: --revision {revision} is a pull request; open the fix against a branch (default main)",
            repo_id=repo_id,
        )
    fresh_connections()
    source = HubSource(repo_id, revision, limits)
    ckpt = Checkpoint.open(source)
    selections = select(engines, layout_of(ckpt.config).family)
    labels = {s.profile.name: s.label for s in selections}
    fixup = fixup_checkpoint(source, engines, dry_run=True, command=command)
    fixup.dry_run = dry_run
    before = validate_checkpoint(ckpt, engines)
    result = PrResult(repo_id, revision, source.commit, fixup, before.as_dict())
    if fixup.new_config is None:
        result.status = "fixed" if before.ok else "unfixable"
        result.fetched = source.stats()
        return result
    after = validate_checkpoint(dataclasses.replace(ckpt, config=fixup.new_config), engines)
    result.after = after.as_dict()
    applied = [a for a in fixup.applied if a["fixup"] != "index_total_size"]  # the index is not part of the PR
    fixup.applied = applied
    result.description = describe(fixup, labels, before.verdict(), after.verdict(), command)
    existing = _open_pr_with(source, fixup.new_config)
    result.fetched = source.stats()
    if existing is not None:
        result.status, (result.pr_num, result.pr_url) = "exists", existing
        return result
    if dry_run:
        result.status = "dry-run"
        return result
    record = add_to_record(read_fixups_record(source), applied, fixup.engines, command)
    files = {"config.json": config_bytes(fixup.new_config), FIXUPS_NAME: config_bytes(record)}
    result.status = "opened"
    result.pr_num, result.pr_url = _open_pr(source, files, result.description, fixup.new_config)
    return result


def _open_pr(source: HubSource, files: dict[str, bytes], description: str, config: dict) -> tuple[int, str]:
    """Open the pull request (one commit of `files` against the source's revision); returns its number and URL.

    A commit that failed transiently (is_transient) is sent again only when the repo's open pull requests show
    that it did not land: a commit whose answer was lost must not open a second pull request (huggingface_hub
    never retries a commit by itself for that reason).

    Raises:
        HubError: the Hub refused it, or it still failed after `limits.retries` more attempts.
    """
    limits, failures = source.limits, 0
    while True:
        try:
            info = source.api.create_commit(
                source.repo_id,
                [CommitOperationAdd(name, data) for name, data in files.items()],
                commit_message=PR_TITLE,
                commit_description=description,
                revision=source.revision,
                create_pr=True,
                parent_commit=source.commit,
            )
            assert info.pr_num is not None and info.pr_url is not None, "create_pr=True makes a pull request"
            return info.pr_num, info.pr_url
        except Exception as e:
            failures += 1
            if not is_transient(e) or failures > limits.retries:
                setattr(e, "mxforge_attempts", failures)
                raise_as_hub_error(e, repo_id=source.repo_id, revision=source.revision, action="open a pull request on")
                raise
        if CANCEL.wait(limits.backoff(failures)):
            raise KeyboardInterrupt
        landed = _open_pr_with(source, config)
        if landed is not None:
            return landed


def _open_pr_with(source: HubSource, config: dict) -> tuple[int, str] | None:
    """(number, URL) of the open pull request by mxforge (its title) whose config.json equals `config`, or None.
    The scan of the open pull requests is bounded as a listing (api.ListingBudget), the time spent reading each
    candidate's config.json included.

    Raises:
        HubError: the list cannot be read, or it passes a bound.
    """
    api, repo_id = source.api, source.repo_id
    budget = ListingBudget(f"{repo_id}: the list of its open pull requests", source.limits)
    for pr in open_pull_requests(api, repo_id, budget):
        budget.check()
        if pr.title != PR_TITLE:
            continue
        try:
            details = retrying(partial(api.get_discussion_details, repo_id, pr.num), source.limits)
        except Exception as e:
            raise_as_hub_error(e, repo_id=repo_id, action=f"read pull request #{pr.num} of")
            raise
        if details.target_branch not in (source.revision, f"refs/heads/{source.revision}"):
            continue
        theirs = HubSource(repo_id, pr.git_reference, source.limits).read_json("config.json", "config.json")
        if theirs == config:
            return pr.num, f"{source.endpoint}/{repo_id}/discussions/{pr.num}"
    return None
