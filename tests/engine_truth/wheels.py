"""The few source files of an engine release, fetched from its wheel on PyPI by HTTP range requests.

A wheel is a zip: its central directory is read once (a few range requests) and kept in `wheel.json` as an
index (where each member lies), then each member is one range request, FETCH_THREADS at a time, checked against
its CRC-32. Files land in `<cache>/engine-wheels/<dist>-<version>/` (the user cache dir: $MXFORGE_CACHE or
~/.cache/mxforge), beside `wheel.json` (which wheel, its sha256 on PyPI, every member name and the index), so a
release is fetched once and later runs need no network. `wheel_metadata` reads a release's METADATA (its
Requires-Dist) the same way; `released_versions` keeps a package's list of releases there too.
"""

from __future__ import annotations

import io
import json
import os
import struct
import time
import urllib.error
import urllib.request
import zipfile
import zlib
from pathlib import Path

from source_imports import imported_modules

from mxforge.cache_dir import cache_root as mxforge_cache_root

SIMPLE = "https://pypi.org/simple"  # PEP 691 JSON; what pip reads, so reachable wherever pip is
TIMEOUT_S = 60
ATTEMPTS = 4
MAX_MEMBER_BYTES = 16 << 20
FETCH_THREADS = 8  # members fetched at once: a cold release is hundreds of small range requests
LOCAL_HEADER = 30  # bytes of a zip local file header before its name and extra field
EXTRA_GUESS = 64  # extra-field bytes asked for with a member (more are fetched when a header has more)


class FetchError(RuntimeError):
    """A release's wheel could not be read (offline, unknown release, or a broken transfer)."""


def cache_root() -> Path:
    return mxforge_cache_root() / "engine-wheels"


def _get(url: str, headers: dict | None = None) -> bytes:
    last = None
    for attempt in range(ATTEMPTS):
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=TIMEOUT_S) as r:
                return r.read()
        except urllib.error.HTTPError as e:
            if e.code == 404:
                raise FetchError(f"{url}: not found") from None
            last = e
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            last = e
        time.sleep(1 + 2 * attempt)
    raise FetchError(f"{url}: {last} (after {ATTEMPTS} attempts; offline? deselect with -m 'not engines')")


def _choose_wheel(dist: str, version: str) -> dict:
    """The release's wheel whose Python sources we read: pure-Python first, else CPython 3.11 / abi3 x86_64."""
    index = json.loads(_get(f"{SIMPLE}/{dist}/", {"Accept": "application/vnd.pypi.simple.v1+json"}))
    prefix = f"{dist.replace('-', '_')}-{version}-"
    wheels = [f for f in index["files"] if f["filename"].endswith(".whl") and f["filename"].startswith(prefix)]
    if not wheels:
        raise FetchError(f"{dist}=={version} has no wheel on PyPI")

    def rank(f: dict) -> tuple:
        n = f["filename"]
        return ("none-any" in n, "x86_64" in n, "cp311" in n or "abi3" in n)

    return max(wheels, key=rank)


def _wheel_versions(dist: str) -> list:
    """Every version of `dist` with a wheel on PyPI that is not yanked, oldest first (pre-releases included)."""
    from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
    from packaging.version import InvalidVersion

    index = json.loads(_get(f"{SIMPLE}/{dist}/", {"Accept": "application/vnd.pypi.simple.v1+json"}))
    found = set()
    for f in index["files"]:
        if not f["filename"].endswith(".whl") or f.get("yanked"):
            continue
        try:
            name, version, _, _ = parse_wheel_filename(f["filename"])
        except (InvalidWheelFilename, InvalidVersion):
            continue
        if name == canonicalize_name(dist):
            found.add(version)
    return sorted(found)


def available_versions(dist: str, first: str, last: str) -> list[str]:
    """The releases of `dist` on PyPI that have a wheel, from `first` to `last` inclusive, oldest first."""
    from packaging.version import Version

    lo, hi = Version(first), Version(last)
    return [str(v) for v in _wheel_versions(dist) if lo <= v <= hi and not v.is_prerelease]


def released_versions(dist: str) -> list[str]:
    """Every final release of `dist` that has a wheel on PyPI, oldest first. Read once, then kept in the cache
    (`<cache>/engine-wheels/<dist>.versions.json`): what a test proves with it ("some release meets both
    ranges") stays true of the releases it saw, so later runs need no network."""
    path = cache_root() / f"{dist}.versions.json"
    if not path.exists():
        versions = [str(v) for v in _wheel_versions(dist) if not v.is_prerelease]
        _write_atomic(path, json.dumps(versions).encode())
    return json.loads(path.read_text())


def wheel_metadata(dist: str, version: str) -> str:
    """The core metadata (`*.dist-info/METADATA`: Requires-Python, Requires-Dist) of `dist`==`version`, from the
    wheel `Release` would read; fetched once into that release's cache folder."""
    path = cache_root() / f"{dist}-{version}" / "METADATA"
    if not path.exists():
        wheel = _choose_wheel(dist, version)
        with Release._zip(wheel["url"], wheel["size"]) as z:
            found = [n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
            if len(found) != 1:
                raise FetchError(f"{wheel['filename']}: {len(found)} .dist-info/METADATA members, expected 1")
            if z.getinfo(found[0]).file_size > MAX_MEMBER_BYTES:
                raise FetchError(f"{wheel['filename']}: {found[0]} is over {MAX_MEMBER_BYTES} bytes; refusing")
            data = z.read(found[0])
        _write_atomic(path, data)
    return path.read_text()


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")  # several test runs may share the user cache
    tmp.write_bytes(data)
    tmp.replace(path)


class _RangeFile(io.RawIOBase):
    """A read-only, seekable view of a remote file; each read is one HTTP range request."""

    def __init__(self, url: str, size: int):
        self.url, self.size, self.pos = url, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def readinto(self, buf) -> int:
        n = min(len(buf), self.size - self.pos)
        if n <= 0:
            return 0
        data = _get(self.url, {"Range": f"bytes={self.pos}-{self.pos + n - 1}"})
        if len(data) != n:
            raise FetchError(f"{self.url}: asked for {n} bytes at {self.pos}, got {len(data)} (no Range support?)")
        buf[:n] = data
        self.pos += n
        return n


class Release:
    """One engine release's sources: `path(module)` gives the local file of a module, fetching it if needed."""

    def __init__(self, dist: str, version: str):
        self.dist, self.version = dist, version
        self.root = cache_root() / f"{dist}-{version}"
        meta = self.root / "wheel.json"
        self.meta = json.loads(meta.read_text()) if meta.exists() else {}
        if "index" not in self.meta:  # first use (or a cache written before the index was kept)
            wheel = _choose_wheel(dist, version)
            with self._zip(wheel["url"], wheel["size"]) as z:
                infos = [i for i in z.infolist() if i.filename.endswith(".py")]
            self.meta = {
                "dist": dist,
                "version": version,
                "wheel": wheel["filename"],
                "url": wheel["url"],
                "size": wheel["size"],
                "sha256": wheel["hashes"]["sha256"],
                "members": [i.filename for i in infos],
                # where each member lies: [local header offset, compressed size, size, method, CRC-32], so a member
                # is one range request, without reading the central directory again
                "index": {
                    i.filename: [i.header_offset, i.compress_size, i.file_size, i.compress_type, i.CRC] for i in infos
                },
            }
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = meta.with_name(f"{meta.name}.{os.getpid()}.partial")  # probes of one release may fetch at once
            tmp.write_text(json.dumps(self.meta))
            tmp.replace(meta)
        self.members = set(self.meta["members"])

    @staticmethod
    def _zip(url: str, size: int) -> zipfile.ZipFile:
        return zipfile.ZipFile(io.BufferedReader(_RangeFile(url, size), buffer_size=256 << 10))

    def member_of(self, module: str) -> str | None:
        """The wheel member holding `module` (a dotted name), or None when this release has no such module."""
        base = module.replace(".", "/")
        for cand in (base + ".py", base + "/__init__.py"):
            if cand in self.members:
                return cand
        return None

    def package_modules(self, package: str) -> list[str]:
        """Every module of `package` (dotted) in this release, the package itself included."""
        base = package.replace(".", "/") + "/"
        return sorted(
            m[:-3].removesuffix("/__init__").replace("/", ".")
            for m in self.members
            if m.startswith(base) and m.count("/") == base.count("/")
        )

    def modules_under(self, paths: tuple[str, ...] | list[str]) -> list[str]:
        """The modules of this release whose file is one of `paths` (wheel paths) or lies below one of them."""
        out = []
        for member in sorted(self.members):
            if any(member == p or member.startswith(p.rstrip("/") + "/") for p in paths):
                out.append(member[:-3].removesuffix("/__init__").replace("/", "."))
        return out

    def import_closure(self, roots: list[str], within: tuple[str, ...]) -> list[str]:
        """`roots` and every module of this release under one of the `within` prefixes that they import, directly or
        through each other, with the packages above each (executed by an import): a model's modules, learned from
        its source rather than listed (fetched). Typing-only imports are left out, conditional ones kept (a
        platform's branch is chosen when the code runs)."""
        known = {m[:-3].removesuffix("/__init__").replace("/", ".") for m in self.members}
        seen: set[str] = set()
        todo = set(roots)
        while todo:  # one import level at a time, each level's files fetched together
            level = sorted(m for m in todo - seen if m in known)
            seen.update(level)
            paths = self.fetch(level)
            todo = set()
            for module in level:
                parent = module.rpartition(".")[0]
                todo |= {parent} if parent.startswith(within) else set()
                todo |= {m for m in imported_modules(module, paths[module], known) if m.startswith(within)}
        return sorted(seen)

    def fetch(self, modules: list[str]) -> dict[str, Path]:
        """Local paths of the modules this release has (fetched once, FETCH_THREADS members at a time); absent
        modules are left out."""
        from concurrent.futures import ThreadPoolExecutor

        wanted = {m: self.member_of(m) for m in modules}
        missing = sorted({mem for mem in wanted.values() if mem and not (self.root / mem).exists()})
        if missing:
            with ThreadPoolExecutor(min(FETCH_THREADS, len(missing))) as pool:
                list(pool.map(self._fetch_member, missing))
        return {m: self.root / mem for m, mem in wanted.items() if mem}

    def _fetch_member(self, mem: str) -> None:
        """One member from the wheel, by the range its index entry gives, checked (size, CRC-32) and written
        atomically."""
        offset, packed, size, method, crc = self.meta["index"][mem]
        if size > MAX_MEMBER_BYTES or packed > MAX_MEMBER_BYTES:
            raise FetchError(f"{self.meta['wheel']}: {mem} is {size} bytes; refusing")
        remote = _RangeFile(self.meta["url"], self.meta["size"])  # each read one range request, its length checked
        remote.seek(offset)
        raw = remote.read(LOCAL_HEADER + len(mem.encode()) + EXTRA_GUESS + packed)
        if len(raw) < LOCAL_HEADER or raw[:4] != b"PK\x03\x04":
            raise FetchError(f"{self.meta['wheel']}: no local header for {mem} at {offset}")
        name_len, extra_len = struct.unpack("<HH", raw[26:30])
        start = LOCAL_HEADER + name_len + extra_len
        if start + packed > len(raw):  # a longer extra field than guessed: the rest of the member
            raw += remote.read(start + packed - len(raw))
        body = raw[start : start + packed]
        if method == zipfile.ZIP_DEFLATED:
            inflate = zlib.decompressobj(-zlib.MAX_WBITS)
            data = inflate.decompress(body, size + 1) + inflate.flush()
        elif method == zipfile.ZIP_STORED:
            data = body
        else:
            raise FetchError(f"{self.meta['wheel']}: {mem} is compressed with method {method}; not read")
        if len(data) != size or zlib.crc32(data) != crc:
            raise FetchError(f"{self.meta['wheel']}: {mem} fails its size or CRC-32 check (a broken transfer)")
        _write_atomic(self.root / mem, data)

    def source(self, module: str) -> str | None:
        paths = self.fetch([module])
        return paths[module].read_text() if module in paths else None

    def functions(self, module: str, names: tuple[str, ...], namespace: dict, owner: str | None = None) -> dict:
        """The release's own definitions of `names` (module-level functions, or methods of class `owner`) in
        `module`, executed from its wheel's source with a copy of `namespace` as their shared globals (so one may
        call another; annotations and decorators dropped: they would name the engine's other modules)."""
        import ast

        path = self.fetch([module])[module]
        body = ast.parse(path.read_text(), str(path)).body
        if owner is not None:
            body = next(n.body for n in body if isinstance(n, ast.ClassDef) and n.name == owner)
        scope, found = dict(namespace), {}
        for node in body:
            if isinstance(node, ast.FunctionDef) and node.name in names:
                node.decorator_list, node.returns = [], None
                for arg in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs):
                    arg.annotation = None
                exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), scope)
                found[node.name] = scope[node.name]
        missing = set(names) - set(found)
        if missing:
            raise FetchError(f"{self.dist}=={self.version}: {module} defines no {sorted(missing)}")
        return found
