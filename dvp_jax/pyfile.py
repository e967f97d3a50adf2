"""Import a Python file by path (config files, experiment files, sibling scripts)."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import types


def load_file(path: str) -> types.ModuleType:
    """Imports the Python file at `path` once per process and returns the module.

    The module is registered in `sys.modules` under a name derived from the absolute path, so
    loading the same file from several places yields the same module object (dataclasses and
    pickling look their module up there), while different files never collide.
    """
    path = os.path.abspath(path)
    name = "dvp_file_" + re.sub(r"\W", "_", os.path.splitext(path)[0])
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
