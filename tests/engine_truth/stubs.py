"""Import an engine's real modules with inert stand-ins for everything else (GPU kernels, distributed state).

Used only inside a probe subprocess (one per release), so nothing here leaks into the test process:
- modules named in `real` are executed from the release's fetched sources;
- packages above them are empty namespaces (their `__init__` is not executed);
- every other module of the engine, and every third-party module that is not installed, is a stub: any
  attribute is a stub class; calling a stub gives a falsy stub; a stub called with just a function or a
  class returns it unchanged, so stubbed decorators leave the real code they decorate intact;
- `overrides` pin chosen attributes of stub modules (the platform: "is_hip" -> True, ...).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import re
import sys
import types
from abc import ABCMeta
from pathlib import Path


def _passthrough(args: tuple, kwargs: dict):
    """A stub used as a bare decorator returns what it decorates."""
    if (
        len(args) == 1
        and not kwargs
        and (
            inspect.isfunction(args[0])
            or inspect.isclass(args[0])
            or inspect.ismethod(args[0])
            or isinstance(args[0], (staticmethod, classmethod))
        )
    ):
        return args[0]
    return None


class StubMeta(ABCMeta):
    """Metaclass of stub classes: class-level attributes are stubs too, and `Stub[...]` is the class itself."""

    def __getattr__(cls, name: str):
        if (name.startswith("__") and name.endswith("__")) or "_stub" not in cls.__dict__:
            raise AttributeError(name)  # a real class deriving from a stub has only what it defines
        return stub_class(f"{cls.__name__}.{name}")

    def __getitem__(cls, item):
        return cls

    def register(cls, *args, **kwargs):
        """ABCMeta's virtual-subclass registration for a class; otherwise a stub registry's decorator factory
        (vLLM's `@CustomOp.register("name")`), which leaves what it decorates as it is."""
        if len(args) == 1 and not kwargs and isinstance(args[0], type):
            return super().register(args[0])
        return lambda obj: obj

    def __iter__(cls):  # without it, iteration would go through __getitem__ and never end
        return iter(())

    def __call__(cls, *args, **kwargs):
        decorated = _passthrough(args, kwargs)
        if decorated is not None:
            return decorated
        return super().__call__(*args, **kwargs)

    def __or__(cls, other):
        return cls

    __ror__ = __or__

    def __bool__(cls):
        return False


class StubBase(metaclass=StubMeta):
    """An inert instance: it takes any arguments, and any use of it gives another inert value."""

    _stub = True

    def __init__(self, *args, **kwargs):
        # Keyword arguments become attributes, as for the record types stubbed bases stand for
        # (msgspec.Struct, dataclass-like configs): `Stubbed(num=1).num == 1`.
        self.__dict__.update(kwargs)
        self._stub_args, self._stub_kwargs = args, kwargs
        if _ON_BUILD:
            _ON_BUILD[-1](self)

    def __init_subclass__(cls, **kwargs):
        pass

    def __getattr__(self, name: str):
        if (name.startswith("__") and name.endswith("__")) or "_stub" not in type(self).__dict__:
            raise AttributeError(name)
        return StubBase()

    def __call__(self, *args, **kwargs):
        decorated = _passthrough(args, kwargs)
        return decorated if decorated is not None else StubBase()

    def __bool__(self):
        return False

    def __iter__(self):
        return iter(())

    def __len__(self):
        return 0

    def __int__(self):
        return 0

    __index__ = __int__

    def __float__(self):
        return 0.0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __getitem__(self, key):
        return StubBase()

    def __setitem__(self, key, value):
        pass

    def __contains__(self, item):
        return False

    def __repr__(self):
        return f"<stub {type(self).__name__}>"

    def __mro_entries__(self, bases):
        return (stub_class("Base"),)

    def _arith(self, *other):
        return StubBase()

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __floordiv__ = _arith
    __mod__ = __neg__ = __or__ = __ror__ = __and__ = __rand__ = _arith

    def __lt__(self, other):
        return False

    __le__ = __gt__ = __ge__ = __lt__
    __hash__ = object.__hash__


_CLASSES: dict[str, type] = {}
_ON_BUILD: list = []  # the innermost `recording` callback


@contextlib.contextmanager
def recording(callback):
    """Call `callback(instance)` for every stub instance constructed meanwhile (the engine's layers built as
    stand-ins, with the arguments the engine's code gave them: `instance._stub_kwargs`)."""
    _ON_BUILD.append(callback)
    try:
        yield
    finally:
        _ON_BUILD.pop()


def stub_class(name: str) -> type:
    """The stub class for a dotted name (one class per name, so `from m import A` twice gives the same A)."""
    cls = _CLASSES.get(name)
    if cls is None:
        cls = _CLASSES[name] = StubMeta(
            name.rsplit(".", 1)[-1], (StubBase,), {"__module__": "stub", "__qualname__": name, "_stub": True}
        )
    return cls


class StubModule(types.ModuleType):
    """A stubbed module, or an empty namespace above real modules: a missing attribute is the real
    submodule of that name where one is fetched, else a stub class."""

    def __init__(self, name: str, real_children: set[str], pinned: dict | None = None):
        super().__init__(name)
        self.__path__ = []  # a package: submodules resolve through the finder
        self.__file__ = f"<stub {name}>"
        self._real_children = real_children
        self.__dict__.update(pinned or {})

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        if full in self._real_children:
            value = importlib.import_module(full)
        elif name in STATE_ACCESSORS:
            value = _accessor(STATE_ACCESSORS[name])
        else:
            value = stub_class(full)
        setattr(self, name, value)
        return value


class _StubLoader(importlib.abc.Loader):
    def __init__(self, real_children: set[str], pinned: dict | None):
        self.real_children, self.pinned = real_children, pinned

    def create_module(self, spec):
        return StubModule(spec.name, self.real_children, self.pinned)

    def exec_module(self, module):
        pass


# An installed library's input preprocessing that an engine's multimodal model modules import (vLLM's qwen3_vl:
# transformers' Qwen2-VL image processor, which needs torchvision and PIL, absent here, and its Qwen3-VL processor):
# a stub in a probe process, where no image or video is ever processed and nothing of it decides quantization.
PREPROCESSING = re.compile(r"^transformers\.models\.\w+\.((image|video)_)?processing_\w+$")


class EngineFinder(importlib.abc.MetaPathFinder):
    """Resolves the engine's package from fetched sources and stubs; stubs missing third-party modules."""

    def __init__(
        self,
        package: str,
        sources: dict[str, Path],
        overrides: dict[str, dict] | None = None,
        absent: tuple[str, ...] = (),
    ):
        self.package = package
        self.sources = sources  # module -> fetched file (the real modules)
        self.overrides = overrides or {}
        self.absent = absent  # third-party top-level names that must raise ImportError
        self.parents: set[str] = set()
        self.real: set[str] = set()  # fetched modules and the packages above them; live: stubs see later adds
        self.stubbed: set[str] = set()
        self.add(sources)
        # A stub module with overrides is a submodule, not a stub class, where a stub package's attribute names it
        # (`from vllm.distributed import utils as dist_utils`)
        self.real |= {m for m in self.overrides if self._is_engine(m)}

    def add(self, sources: dict[str, Path]) -> None:
        """More fetched modules (a model's, learned when the registry names it), importable from now on."""
        self.sources.update(sources)
        self.parents |= {m.rsplit(".", i)[0] for m in sources for i in range(1, m.count(".") + 1)}
        self.real |= set(sources) | self.parents

    def import_model(self, release, module: str, within: tuple[str, ...], pristine: dict[type, dict]):
        """`module` imported from `release`'s source, once per process, with the modules under `within` that it
        imports (Release.import_closure, fetched now); the packed mappings of the classes that brings in are kept
        in `pristine` before any case can change them (restore_packed_mappings)."""
        if module not in sys.modules:
            closure = release.import_closure([module], within)
            self.add(release.fetch([m for m in closure if m not in self.sources]))
            importlib.import_module(module)
            for cls, mapping in packed_mappings(self.package).items():
                pristine.setdefault(cls, mapping)
        return sys.modules[module]

    def _is_engine(self, name: str) -> bool:
        return name == self.package or name.startswith(self.package + ".")

    def find_spec(self, name, path=None, target=None):
        if PREPROCESSING.match(name) and name not in sys.modules:
            return self._stub(name)
        if self._is_engine(name):
            src = self.sources.get(name)
            if src is not None:
                is_pkg = src.name == "__init__.py"
                return importlib.util.spec_from_file_location(
                    name, src, submodule_search_locations=[str(src.parent)] if is_pkg else None
                )
            return self._stub(name)
        return None

    def _stub(self, name: str):
        if name not in self.parents:
            self.stubbed.add(name)
        return importlib.machinery.ModuleSpec(name, _StubLoader(self.real, self.overrides.get(name)), is_package=True)


def _importer() -> str:
    """The module whose code runs the import statement being resolved."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(("importlib", "_frozen_importlib")):
        frame = frame.f_back
    return frame.f_globals.get("__name__", "") if frame is not None else ""


class MissingFinder(importlib.abc.MetaPathFinder):
    """Last on sys.meta_path: a third-party module that is not installed, imported by the engine's own code,
    becomes a stub (unless listed absent). Installed libraries probing for optional packages still see
    them missing."""

    def __init__(self, engine: EngineFinder):
        self.engine = engine

    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if isinstance(sys.modules.get(top), StubModule):
            return self.engine._stub(name)  # below a stubbed package, for every importer
        if not self.engine._is_engine(_importer()):
            return None
        if top in self.engine.absent or top in sys.stdlib_module_names or top.startswith("_"):
            return None  # optional stdlib/platform modules stay missing, as on a real Linux host
        if top != name:
            return None  # a missing submodule of an installed package is a real ImportError
        return self.engine._stub(name)


def install(
    package: str, sources: dict[str, Path], overrides: dict[str, dict] | None = None, absent: tuple[str, ...] = ()
) -> EngineFinder:
    """Route imports of `package` (and of missing third-party modules) through stubs; for a probe process only."""
    finder = EngineFinder(package, sources, overrides, absent)
    sys.meta_path.insert(0, finder)
    sys.meta_path.append(MissingFinder(finder))
    return finder


def assigned(body: list, name: str):
    """The expression a list of statements (a module's or a class's body, as ast parsed it) assigns to `name`
    (`name = ...` or `name: T = ...`); None where none does."""
    import ast

    for node in body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == name for t in targets) and node.value is not None:
            return node.value
    return None


def literal_from_source(source: str | None, name: str) -> dict:
    """The dict a module assigns to top-level `name`, read from its source without executing it: a dict literal,
    or a call with constant keyword arguments (`LazyConfigDict(glm5_next="Glm5NextConfig", ...)`); empty where the
    module or the assignment is absent (a release before it)."""
    import ast

    value = assigned(ast.parse(source or "").body, name)
    if value is None:
        return {}
    if isinstance(value, ast.Call):
        return {k.arg: ast.literal_eval(k.value) for k in value.keywords if k.arg is not None}
    return ast.literal_eval(value)


def functions_from_source(path: Path, names: tuple[str, ...], module: str | None = None) -> dict:
    """The release's own definitions of `names` (plain functions, or static methods named "Class.method")
    from `path`, without executing that module: for small utilities (`add_prefix`) that live in modules
    too heavy to import. With `module` (the dotted name of `path`), the module's top-level imports are
    executed first (through the stubs), so the functions see the names they import.
    """
    import ast

    tree = ast.parse(path.read_text(), str(path))
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    found, missing = {}, []
    for name in names:
        owner, _, fn = name.rpartition(".")
        body = classes[owner].body if owner in classes else [] if owner else tree.body
        node = next((n for n in body if isinstance(n, ast.FunctionDef) and n.name == fn), None)
        if node is None:
            missing.append(name)
        else:
            found[name] = node
    if missing:
        raise LookupError(f"{path}: no top-level function or static method {sorted(missing)}")
    for node in found.values():
        node.decorator_list = []
        node.returns = None
        for arg in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs):
            arg.annotation = None
    namespace: dict = {"__name__": module or f"source:{path.name}"}
    if module:
        namespace["__package__"] = module if path.name == "__init__.py" else module.rpartition(".")[0]
        imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
        exec(compile(ast.Module(body=imports, type_ignores=[]), str(path), "exec"), namespace)
    out = {}
    for name, node in found.items():
        exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
        out[name] = namespace[node.name]
    return out


class State(StubBase):
    """Server-wide settings and flags left at their defaults: every attribute is unset (falsy, compares
    False) until the engine's code writes one, which then reads back."""

    _stub = True

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = self.__dict__[name] = State()
        return value

    def __setattr__(self, name, value):
        self.__dict__[name] = value


# The engine's process-wide state, one store per kind, kept apart as the releases keep them: the published server
# arguments (get_global_server_args, get_server_args), the runtime-flags tier (get_flags), each resolved-config bag
# (get_exec, get_model, get_spec: snapshots of the server arguments taken at publish, not written through afterwards)
# and the parallel topology (get_parallel). One store for all would let a value the engine writes into one (a model's
# fusion decision, a runtime flag) be read back from another (the user's configured intent), as no release does.
STATE_ACCESSORS = {
    "get_global_server_args": "server_args",
    "get_server_args": "server_args",
    "get_flags": "flags",
    "get_exec": "exec",
    "get_model": "model",
    "get_spec": "spec",
    "get_parallel": "parallel",
}
SERVER_STATE: dict[str, State] = {}


def server_state(kind: str) -> State:
    """The store of one kind (a key of SERVER_STATE: "server_args", "flags", "exec", ...), created unset."""
    return SERVER_STATE.setdefault(kind, State())


def _accessor(kind: str):
    return lambda *args, **kwargs: server_state(kind)


class Namespace(types.SimpleNamespace):
    """A stand-in object with the given attributes; any other attribute is None."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return None


def packed_mappings(package: str) -> dict[type, dict]:
    """Every real class of `package` with its own `packed_modules_mapping` dict, and a copy of it: loaders and
    model constructors mutate these class attributes, so a probe restores them before each case."""
    import copy

    out = {}
    for mod in list(sys.modules.values()):
        if (
            not mod.__name__.startswith(package + ".")
            or isinstance(mod, StubModule)
            or not isinstance(getattr(mod, "__file__", None), str)
        ):
            continue
        for cls in vars(mod).values():
            if isinstance(cls, type) and isinstance(cls.__dict__.get("packed_modules_mapping"), dict):
                out[cls] = copy.deepcopy(cls.__dict__["packed_modules_mapping"])
    return out


def restore_packed_mappings(pristine: dict[type, dict]) -> None:
    import copy

    for cls, mapping in pristine.items():
        cls.packed_modules_mapping = copy.deepcopy(mapping)


def walk(obj, path: str = "", seen=None):
    """(runtime name, object) for every module and stand-in layer reachable from a built model."""
    import torch

    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    yield path, obj
    if not isinstance(obj, torch.nn.Module):
        return
    children = {**{k: v for k, v in vars(obj).items() if isinstance(v, StubBase)}, **obj._modules}
    for name, child in children.items():
        if child is not None:
            yield from walk(child, f"{path}.{name}" if path else name, seen)
