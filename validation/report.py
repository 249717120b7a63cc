"""Validation findings and the report that carries them: a verdict per engine release."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from mxforge.validation.profiles import Selection, release_runs

MAX_LISTED = 60  # problems listed in the human summary; the JSON report has every one


@dataclass(frozen=True)
class Problem:
    """One disagreement: which check found it, for which engine profile (None: every engine), about what."""

    check: str  # "integrity" | "quant_config" | "mtp" | "layout" | "engine" | "hash"
    subject: str  # the file, tensor, module or config entry at fault
    message: str  # what is wrong, expected vs found
    remedy: str  # what to do about it
    engine: str | None = None
    server_flag: str | None = None  # a serving flag that avoids it: the release loads with that flag set

    def format(self) -> str:
        who = f"{self.engine}: " if self.engine else ""
        return f"{who}{self.subject}: {self.message}: {self.remedy}"


@dataclass
class ValidationReport:
    path: str
    selections: list[Selection]
    problems: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)  # found, but no engine fails on them
    requirements: list[Problem] = field(default_factory=list)  # avoided by a serving flag (Problem.server_flag)
    checked: dict = field(default_factory=dict)  # counts of what was checked, per check / engine
    notes: list[str] = field(default_factory=list)  # plain-words diagnosis (what kind of export this is)
    serve: list[dict] = field(default_factory=list)  # per release range: the serving command and its flags

    @property
    def ok(self) -> bool:
        return not self.problems

    def engine_ok(self, profile: str) -> bool:
        return not any(p.engine in (None, profile) for p in self.problems)

    def flags(self, profile: str) -> list[str]:
        """The serving flags `profile`'s releases need to load the checkpoint."""
        return sorted({p.server_flag for p in self.requirements if p.engine == profile and p.server_flag})

    def add(self, found: list[Problem]) -> None:
        """File each finding as a problem, or as a requirement when a serving flag avoids it."""
        self.problems += [p for p in found if not p.server_flag]
        self.requirements += [p for p in found if p.server_flag]

    def releases(self) -> list[dict]:
        """One entry per engine release: its profile, whether it loads the checkpoint, and with which flags."""
        out = []
        for s in self.selections:
            found = [p for p in self.problems if p.engine in (None, s.profile.name)]
            out += [
                {
                    "engine": s.profile.engine,
                    "version": v,
                    "profile": s.profile.name,
                    "ok": not found,
                    "problems": len(found),
                    "flags": self.flags(s.profile.name),
                }
                for v in s.releases
            ]
        return out

    def as_dict(self) -> dict:
        releases = self.releases()
        return {
            "stage": "validate",
            "path": self.path,
            "ok": self.ok,
            "engines": {f"{r['engine']}=={r['version']}": r["ok"] for r in releases},
            "releases": releases,
            "verdict": self.verdict(),
            "problems": [asdict(p) for p in self.problems],
            "warnings": [asdict(p) for p in self.warnings],
            "requirements": [asdict(p) for p in self.requirements],
            "checked": self.checked,
            "notes": self.notes,
            "serve": self.serve,
        }

    def verdict(self) -> str:
        """`loads: sglang 0.5.16-0.5.23, vllm 0.30.0-0.33.0; FAILS: sglang 0.5.9-0.5.15.post1 (2 modules: ...)`."""
        runs = release_runs(self.selections, lambda s: (self.engine_ok(s.profile.name), self.flags(s.profile.name)))
        loads = [label + (f" (with {' '.join(flags)})" if flags else "") for label, (ok, flags), _ in runs if ok]
        failing = [s for s in self.selections if not self.engine_ok(s.profile.name)]
        # Release ranges that fail alike are listed together, once: a problem every release shares (a damaged
        # shard) is said once, not once per range.
        grouped: dict[tuple, list[str]] = {}
        for label, how, _ in release_runs(failing, self._failure):
            grouped.setdefault(how, []).append(label)
        fails = []
        for (subjects, remedy), labels in grouped.items():
            shown = ", ".join(subjects[:3]) + (", ..." if len(subjects) > 3 else "")
            fails.append(f"{', '.join(labels)} ({len(subjects)} problem(s): {shown}; {remedy})")
        parts = []
        if loads:
            parts.append("loads: " + ", ".join(loads))
        if fails:
            parts.append("FAILS: " + "; ".join(fails))
        return "; ".join(parts) or "no engine release selected"

    def _failure(self, s: Selection) -> tuple[tuple[str, ...], str]:
        """What fails in `s`'s releases: the subjects at fault (its own and every engine's) and the first remedy."""
        own = [p for p in self.problems if p.engine == s.profile.name]
        found = own + [p for p in self.problems if p.engine is None]
        return tuple(dict.fromkeys(p.subject for p in found)), found[0].remedy

    def _requirement_lines(self) -> list[str]:
        """Each requirement once, with the release ranges that have it."""
        grouped: dict[tuple, list[str]] = {}
        labels: dict[str | None, str] = {s.profile.name: s.label for s in self.selections}
        for p in self.requirements:
            grouped.setdefault((p.server_flag, p.subject, p.message), []).append(labels.get(p.engine, str(p.engine)))
        return [
            f"  needs {flag} in {', '.join(who)}: {subject}: {message}"
            for (flag, subject, message), who in list(grouped.items())[:MAX_LISTED]
        ]

    def format(self) -> str:
        head = f"{self.path}: OK" if self.ok else f"{self.path}: {len(self.problems)} problem(s)"
        lines = [head, f"  {self.verdict()}"] + [f"  note: {n}" for n in self.notes]
        if "fetched" in self.checked:  # a Hub repo, read through its headers
            from mxforge.progress import fetched_line

            lines.append(f"  {fetched_line(self.checked['fetched'])}")
        lines += [f"  warning: {w.subject}: {w.message}: {w.remedy}" for w in self.warnings]
        lines += self._requirement_lines()
        lines += [f"  - {p.format()}" for p in self.problems[:MAX_LISTED]]
        if len(self.problems) > MAX_LISTED:
            lines.append(f"  ... and {len(self.problems) - MAX_LISTED} more (all of them in --json)")
        loadable = [s for s in self.serve if s["ok"]]
        if loadable:
            lines.append(
                "  serve with MTP speculative decoding:"
                if all(s.get("speculative", True) for s in loadable)
                else "  serve (config.json declares no MTP layer, so without speculative decoding):"
            )
            lines += [f"    {s['releases']}: {s['command']}" for s in loadable]
        return "\n".join(lines)
