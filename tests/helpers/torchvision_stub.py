"""A stand-in for ``torchvision`` where its wheel cannot load beside the installed torch.

PyPI's torchvision for torch 2.13 fails to import beside the CPU build of torch 2.13 on this project's
machines ("operator torchvision::nms does not exist"); timm imports it at module level (transforms,
``FrozenBatchNorm2d``) although its VisionTransformer never calls it. :func:`install` leaves a working
torchvision alone; otherwise every ``torchvision`` name resolves to a placeholder that raises if called,
so timm's model code imports and runs as it is.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class _Anything(type):
    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})

    def __call__(cls, *args: object, **kwargs: object) -> object:
        raise RuntimeError(f"torchvision is not available here ({cls.__name__} was called)")


class _Module(types.ModuleType):
    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install() -> bool:
    """Make ``import torchvision`` work; returns whether the stand-in was needed."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return True
    try:
        import torchvision  # noqa: F401

        return False
    except Exception:  # noqa: BLE001  (an ImportError, or the operator registration failing)
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        sys.meta_path.insert(0, _Finder())
        return True
