"""Validation findings and the report that carries them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


MAX_LISTED = 60  # problems listed in the human summary; the JSON report has every one


@dataclass(frozen=True)
class Problem:
    """One disagreement: which check found it, for which engine (None: engine-independent), about what."""

    check: str      # "integrity" | "quant_config" | "mtp" | "engine" | "hash"
    subject: str    # the file, tensor, module or config entry at fault
    message: str    # what is wrong, expected vs found
    remedy: str     # what to do about it
    engine: str | None = None

    def format(self) -> str:
        who = f"{self.engine}: " if self.engine else ""
        return f"{who}{self.subject}: {self.message}: {self.remedy}"


@dataclass
class ValidationReport:
    path: str
    engines: list[str]
    problems: list[Problem] = field(default_factory=list)
    checked: dict = field(default_factory=dict)  # counts of what was checked, per check / engine
    notes: list[str] = field(default_factory=list)  # plain-words diagnosis (what kind of export this is)

    @property
    def ok(self) -> bool:
        return not self.problems

    def engine_ok(self, engine: str) -> bool:
        return not any(p.engine in (None, engine) for p in self.problems)

    def as_dict(self) -> dict:
        return {"stage": "validate", "path": self.path, "ok": self.ok, "engines": {e: self.engine_ok(e) for e in self.engines},
                "problems": [asdict(p) for p in self.problems], "checked": self.checked, "notes": self.notes}

    def format(self) -> str:
        if self.ok:
            engines = ", ".join(self.engines) or "integrity only"
            return "\n".join([f"{self.path}: OK ({engines})"] + [f"  note: {n}" for n in self.notes])
        verdicts = ", ".join(f"{e} {'ok' if self.engine_ok(e) else 'FAILS'}" for e in self.engines)
        lines = [f"{self.path}: {len(self.problems)} problem(s) ({verdicts})"] + [f"  note: {n}" for n in self.notes]
        lines += [f"  - {p.format()}" for p in self.problems[:MAX_LISTED]]
        if len(self.problems) > MAX_LISTED:
            lines.append(f"  ... and {len(self.problems) - MAX_LISTED} more (all of them in --json)")
        return "\n".join(lines)
