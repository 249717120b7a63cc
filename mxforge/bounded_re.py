"""Regular expressions from outside (a checkpoint's `re:` exclude entries, a recipe's `names`), matched in bounded
time with exactly Python's `re` answers.

Python's `re` backtracks: `re:(.|.)*Z` against a 40-character module name takes longer than the universe. The
engines match `re:` entries with `re.match`, so mxforge must give `re`'s answers, but not at `re`'s price. Every
question asked here is yes/no (does the pattern match at the start, the whole, or anywhere of a name?), and for a
yes/no question backtracking's order is irrelevant: the answer is whether any path through the pattern fits.
So a pattern is read by Python's own parser (`re._parser`: same syntax, same errors), turned into an automaton,
and run one character at a time over the set of places the pattern can be in (a lazily built DFA): time linear in
the name and in the pattern. Each piece of the pattern that tests one character (a literal, a class, `.`) or one
position (`^`, `$`, `\\b` ...) is compiled by Python's own compiler, with the flags in force there, and asked
about that character or position: so case folding, Unicode classes and anchors are `re`'s own
(tests/ground/test_bounded_re.py checks the answers against `re` on a corpus of patterns and names).

Bounds: a pattern of at most MAX_PATTERN_CHARS, nesting groups at most MAX_NESTING deep, of at most MAX_STATES
automaton states once counted repeats are unrolled (`a{1000}` is 1000 states), spending at most MAX_WORK steps of
automaton construction over its life; at most MAX_PATTERNS in one list. What cannot be matched this way is
refused, naming the entry: backreferences (`\\1`, `(?P=x)`), conditionals (`(?(1)a|b)`), atomic groups and
possessive repeats (their answers depend on the backtracking order). Lookaheads and lookbehinds are matched
exactly, by running their own automaton at the position.
"""

from __future__ import annotations

import importlib
import re
from typing import Any, Iterator

from mxforge.errors import ConfigError

_parser: Any = importlib.import_module("re._parser" if hasattr(re, "_parser") else "sre_parse")
_compiler: Any = importlib.import_module("re._compiler" if hasattr(re, "_compiler") else "sre_compile")
_c: Any = importlib.import_module("re._constants" if hasattr(re, "_constants") else "sre_constants")

MAX_PATTERN_CHARS = 1_000
MAX_NESTING = 100  # groups within groups (Python's own parser recurses per level: 500 levels exhaust its stack)
MAX_STATES = 2_000
MAX_WORK = 2_000_000  # automaton states visited while building its DFA states and transitions, over its life
MAX_PATTERNS = 256  # in one list (an exclude list's `re:` entries, a recipe's names): real ones hold a handful
_ONE_CHAR = {_c.LITERAL, _c.NOT_LITERAL, _c.ANY, _c.IN}
_REPEATS = {_c.MAX_REPEAT, _c.MIN_REPEAT}
_UNSUPPORTED = {
    _c.GROUPREF: "a backreference",
    _c.GROUPREF_EXISTS: "a conditional group",
    **{getattr(_c, op): what for op, what in (("ATOMIC_GROUP", "an atomic group"),) if hasattr(_c, op)},
    **{getattr(_c, op): what for op, what in (("POSSESSIVE_REPEAT", "a possessive repeat"),) if hasattr(_c, op)},
}
_CHAR, _SPLIT, _ASSERT, _MATCH = range(4)
_ANSWERS = 100_000  # answers remembered per pattern
_NONE: frozenset[int] = frozenset()


class _TooComplex(Exception):
    pass


class BoundedPattern:
    """One compiled pattern: `match`, `fullmatch` and `search` answer as `re`'s do (is not None), in bounded time.

    Raises (each method): ConfigError naming the entry, once the pattern has spent MAX_WORK steps."""

    def __init__(self, pattern: str, where: str):
        self.pattern, self.where = pattern, where
        parsed = _parser.parse(pattern, 0)
        self._states: list[tuple] = []
        self._leaves: list[Any] = []  # compiled one-character patterns
        # ("at", compiled) or ("look", ahead, negate, width, start, its own tests): each automaton (the pattern's,
        # each lookaround's) is run with the truth of its own position tests at each position
        self._asserts: list[tuple] = []
        self._owners: list[list[int]] = [[]]
        self._leaf_answers: dict[tuple[int, str], bool] = {}
        self._expanded: dict[tuple, tuple[tuple[tuple[int, int], ...], bool]] = {}
        self._steps: dict[tuple, frozenset[int]] = {}
        self._relevant: dict[frozenset[int], tuple[int, ...]] = {}
        self._answers: dict[tuple[str, str], bool] = {}
        # places without position tests that do not accept: character -> the places after it
        self._plain: dict[frozenset[int], dict[str, frozenset[int]]] = {}
        self.work = 0
        try:
            end = self._new((_MATCH,))
            self.start = self._build(parsed.data, parsed.state.flags, end)
            self.tests = tuple(self._owners.pop())
        except _TooComplex as e:
            raise self._refuse(str(e)) from None

    def __reduce__(self):
        """Pickled as its source (a recipe travels to quantize's worker processes); rebuilt where it lands."""
        return BoundedPattern, (self.pattern, self.where)

    # --- answers ----------------------------------------------------------------------------------------
    def match(self, subject: str) -> bool:
        """re.match(pattern, subject) is not None."""
        return self._answer("match", subject, True, False)

    def fullmatch(self, subject: str) -> bool:
        """re.fullmatch(pattern, subject) is not None."""
        return self._answer("fullmatch", subject, True, True)

    def search(self, subject: str) -> bool:
        """re.search(pattern, subject) is not None."""
        return self._answer("search", subject, False, False)

    def _answer(self, mode: str, subject: str, anchored: bool, whole: bool) -> bool:
        """The answer, remembered: validate asks each release's view the same module names."""
        key = (mode, subject)
        answer = self._answers.get(key)
        if answer is None:
            if len(self._answers) >= _ANSWERS:
                self._answers.clear()
            answer = self._answers[key] = self._run(self.start, self.tests, subject, 0, anchored, whole)
        return answer

    def _refuse(self, why: str) -> ConfigError:
        shown = self.pattern if len(self.pattern) <= 80 else self.pattern[:77] + "..."
        return ConfigError(
            f"{self.where}: regular expression {shown!r} {why}; mxforge matches regular expressions from "
            "checkpoints and recipes in bounded time: simplify it or list the names it should match"
        )

    # --- building the automaton ------------------------------------------------------------------------
    def _new(self, state: tuple) -> int:
        if len(self._states) >= MAX_STATES:
            raise _TooComplex(f"needs more than {MAX_STATES:,} automaton states (counted repeats unrolled)")
        self._states.append(state)
        return len(self._states) - 1

    def _leaf(self, node: tuple, flags: int) -> Any:
        state = _parser.State()
        state.flags = flags
        return _compiler.compile(_parser.SubPattern(state, [node]), 0)

    def _test(self, test: tuple) -> int:
        self._asserts.append(test)
        self._owners[-1].append(len(self._asserts) - 1)
        return len(self._asserts) - 1

    def _build(self, items, flags: int, nxt: int) -> int:
        start = nxt
        for op, av in reversed(list(items)):
            start = self._node(op, av, flags, start)
        return start

    def _node(self, op, av, flags: int, nxt: int) -> int:
        if op in _ONE_CHAR:
            self._leaves.append(self._leaf((op, av), flags))
            return self._new((_CHAR, len(self._leaves) - 1, nxt))
        if op is _c.AT:
            return self._new((_ASSERT, self._test(("at", self._leaf((op, av), flags))), nxt))
        if op is _c.SUBPATTERN:
            _group, add, remove, sub = av
            return self._build(sub.data, _compiler._combine_flags(flags, add, remove), nxt)
        if op is _c.BRANCH:
            starts = [self._build(alt.data, flags, nxt) for alt in av[1]]
            start = starts[-1]
            for other in reversed(starts[:-1]):
                start = self._new((_SPLIT, other, start))
            return start
        if op in _REPEATS:
            return self._repeat(av, flags, nxt)
        if op in (_c.ASSERT, _c.ASSERT_NOT):
            direction, sub = av
            end = self._new((_MATCH,))
            self._owners.append([])
            start = self._build(sub.data, flags, end)
            own = tuple(self._owners.pop())
            width = 0 if direction > 0 else sub.getwidth()[0]
            test = ("look", direction > 0, op is _c.ASSERT_NOT, width, start, own)
            return self._new((_ASSERT, self._test(test), nxt))
        raise _TooComplex(f"uses {_UNSUPPORTED.get(op, f'the construct {op}')}, which cannot be matched that way")

    def _repeat(self, av, flags: int, nxt: int) -> int:
        low, high, sub = av
        before = len(self._states), len(self._leaves), len(self._asserts), len(self._owners[-1])
        self._build(sub.data, flags, nxt)
        if len(self._states) == before[0]:  # the body is empty: repeating it is empty too
            return nxt
        del self._states[before[0] :], self._leaves[before[1] :], self._asserts[before[2] :]
        del self._owners[-1][before[3] :]
        start = nxt
        if high == _c.MAXREPEAT:
            loop = self._new((_SPLIT, -1, nxt))
            self._states[loop] = (_SPLIT, self._build(sub.data, flags, loop), nxt)
            start = loop
        else:
            for _ in range(high - low):
                start = self._new((_SPLIT, self._build(sub.data, flags, start), nxt))
        for _ in range(low):
            start = self._build(sub.data, flags, start)
        return start

    # --- running it --------------------------------------------------------------------------------------
    def _spend(self, n: int) -> None:
        self.work += n
        if self.work > MAX_WORK:
            raise self._refuse(f"needs more than {MAX_WORK:,} automaton steps to match the names it was given")

    def _context(self, tests: tuple[int, ...], subject: str, pos: int, memo: dict) -> frozenset[int]:
        """Which of an automaton's position `tests` hold at `pos` (what its DFA states' meaning depends on)."""
        out = []
        for i in tests:
            value = memo.get((i, pos))
            if value is None:
                test = self._asserts[i]
                if test[0] == "at":
                    value = test[1].match(subject, pos) is not None
                else:
                    _, ahead, negate, width, start, own = test
                    if ahead:
                        value = self._run(start, own, subject, pos, anchored=True, whole=False, memo=memo)
                    else:
                        value = pos >= width and self._run(
                            start, own, subject, pos - width, anchored=True, whole=False, memo=memo, stop=pos
                        )
                    value = value != negate
                memo[(i, pos)] = value
            if value:
                out.append(i)
        return frozenset(out)

    def _reach(self, core: frozenset[int], context: frozenset[int] | None) -> Iterator[tuple]:
        """Each state reachable from `core` without consuming, once: splits followed, and a position test where
        `context` holds it (every one where `context` is None). The walk is charged to the budget when it ends."""
        seen: set[int] = set()
        todo = list(core)
        while todo:
            i = todo.pop()
            if i in seen:
                continue
            seen.add(i)
            state = self._states[i]
            yield state
            if state[0] == _SPLIT:
                todo += (state[1], state[2])
            elif state[0] == _ASSERT and (context is None or state[1] in context):
                todo.append(state[2])
        self._spend(len(seen))

    def _tests_from(self, core: frozenset[int]) -> tuple[int, ...]:
        """The position tests the places in `core` can reach without consuming (all that its meaning depends on)."""
        found = self._relevant.get(core)
        if found is not None:
            return found
        tests = [state[1] for state in self._reach(core, None) if state[0] == _ASSERT]
        found = self._relevant[core] = tuple(sorted(tests))
        return found

    def _expand(self, core: frozenset[int], context: frozenset[int]) -> tuple[tuple[tuple[int, int], ...], bool]:
        """The character tests reachable from `core` without consuming (position tests as `context` says), and
        whether the pattern's end is among the places reached."""
        key = (core, context)
        found = self._expanded.get(key)
        if found is not None:
            return found
        chars: list[tuple[int, int]] = []
        accepting = False
        for state in self._reach(core, context):
            if state[0] == _CHAR:
                chars.append((state[1], state[2]))
            elif state[0] not in (_SPLIT, _ASSERT):
                accepting = True
        found = (tuple(sorted(chars)), accepting)
        self._expanded[key] = found
        return found

    def _accepts(self, leaf: int, char: str) -> bool:
        key = (leaf, char)
        answer = self._leaf_answers.get(key)
        if answer is None:
            answer = self._leaf_answers[key] = self._leaves[leaf].match(char) is not None
        return answer

    def _run(
        self,
        start: int,
        tests: tuple[int, ...],
        subject: str,
        pos: int,
        anchored: bool,
        whole: bool,
        memo: dict | None = None,
        stop: int | None = None,
    ) -> bool:
        """Whether the automaton from `start`, entered at `pos` (and at every later position unless `anchored`),
        reaches its end: anywhere, at the end of `subject` (`whole`), or exactly at `stop`."""
        memo = {} if memo is None else memo
        begin = frozenset((start,))
        core = begin
        n = len(subject)
        plain = self._plain
        while True:
            if anchored and pos < n and (stop is None or pos < stop) and (fast := plain.get(core)) is not None:
                # A place with no position test to consult, seen before: one lookup per character.
                following = fast.get(subject[pos])
                if following is not None:
                    if not following:
                        return False
                    core = following
                    pos += 1
                    continue
            relevant = self._tests_from(core) if tests else ()
            context = self._context(relevant, subject, pos, memo) if relevant else _NONE
            chars, accepting = self._expand(core, context)
            if accepting and (pos == stop if stop is not None else (pos == n or not whole)):
                return True
            if pos == n or (stop is not None and pos >= stop):
                return False
            char = subject[pos]
            key = (core, context, char)
            following = self._steps.get(key)
            if following is None:
                following = frozenset(nxt for leaf, nxt in chars if self._accepts(leaf, char))
                self._spend(len(chars) + 1)
                self._steps[key] = following
            if not relevant and not accepting:
                plain.setdefault(core, {})[char] = following
            core = following if anchored else following | begin
            if not core:
                return False
            pos += 1


def check_pattern_count(n: int, where: str) -> None:
    """Raises: ConfigError: more than MAX_PATTERNS regular expressions in one list (named `where`)."""
    if n > MAX_PATTERNS:
        raise ConfigError(
            f"{where}: {n:,} regular expressions, more than the {MAX_PATTERNS} mxforge matches in one list "
            "(a real one holds a handful); list exact names instead"
        )


_CACHE: dict[str, BoundedPattern] = {}
_CACHE_SIZE = 4_096


def compile_bounded(pattern: str, *, where: str) -> BoundedPattern:
    """`pattern`, ready to be matched in bounded time (compiled patterns are shared, with what they have learnt).

    Raises:
        re.error: not a valid regular expression (exactly as re.compile raises).
        ConfigError: longer than MAX_PATTERN_CHARS, or a construct or size that cannot be matched in bounded
            time; named `where` (e.g. "config.json: quantization_config.exclude[3]").
    """
    if len(pattern) > MAX_PATTERN_CHARS:
        shown = pattern[:60] + "..."
        raise ConfigError(
            f"{where}: regular expression {shown!r} has {len(pattern):,} characters, more than the "
            f"{MAX_PATTERN_CHARS:,} mxforge matches; simplify it or list the names it should match"
        )
    if _nesting(pattern) > MAX_NESTING:
        raise ConfigError(
            f"{where}: regular expression {pattern[:60]!r}... nests groups more than {MAX_NESTING} deep; "
            "simplify it or list the names it should match"
        )
    re.compile(pattern)  # the engines' verdict on its validity, and their error
    cached = _CACHE.get(pattern)
    if cached is not None:
        cached.where = where
        return cached
    compiled = BoundedPattern(pattern, where)
    if len(_CACHE) >= _CACHE_SIZE:
        _CACHE.clear()
    _CACHE[pattern] = compiled
    return compiled


def _nesting(pattern: str) -> int:
    """How deep parentheses nest outside character classes and escapes (an upper bound of the group nesting)."""
    deepest = level = 0
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 1
        elif c == "[":
            i += 1
            if i < n and pattern[i] == "^":
                i += 1
            if i < n and pattern[i] == "]":
                i += 1
            while i < n and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
        elif c == "(":
            level += 1
            deepest = max(deepest, level)
        elif c == ")":
            level -= 1
        i += 1
    return deepest
