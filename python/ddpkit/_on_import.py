"""``when_imported(name, callback)``: run ``callback(module)`` once module ``name`` has been imported.

ddpkit's torch.compile support (Note [Compile support waits for Dynamo], comm.py) registers itself with
``torch._dynamo``, whose import costs about as much as importing torch itself; a process that never
compiles (a rank of a benchmark, a launcher, a short job) should not pay for it. Dynamo is imported
before anything is compiled, so registering when it is imported is early enough.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType

_waiting: dict[str, list[Callable[[ModuleType], None]]] = {}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module that callbacks wait for, it lets the other finders find it
    and wraps the loader so that the callbacks run after the module's own code."""

    def find_spec(self, fullname, path, target=None):
        callbacks = _waiting.pop(fullname, None)
        if callbacks is None:
            return None
        spec = importlib.util.find_spec(fullname)  # this finder no longer waits for it: no recursion
        if spec is None or spec.loader is None:
            _waiting[fullname] = callbacks
            return None
        exec_module = spec.loader.exec_module

        def exec_then_call_back(module: ModuleType) -> None:
            exec_module(module)
            for callback in callbacks:
                callback(module)

        spec.loader.exec_module = exec_then_call_back  # this spec's own loader object
        return spec


_finder = _AfterImport()


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Calls ``callback(module)`` now if ``name`` is imported already, else right after its import."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    _waiting.setdefault(name, []).append(callback)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
