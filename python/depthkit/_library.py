"""Finds and loads libdepthkit_ops.so, which registers the torch.ops.depthkit operators."""
import os
import pathlib

import torch

LIBRARY_NAME = "libdepthkit_ops.so"


def library_path() -> pathlib.Path:
    """The operator library: $DEPTHKIT_OPS_LIBRARY when set (a build tree's, for its tests), else
    the one installed with this package."""
    explicit = os.environ.get("DEPTHKIT_OPS_LIBRARY")
    if explicit:
        path = pathlib.Path(explicit)
        if not path.is_file():
            raise ImportError(f"DEPTHKIT_OPS_LIBRARY={explicit}: no such file")
        return path
    for folder in map(pathlib.Path, _package_path()):
        if (folder / LIBRARY_NAME).is_file():
            return folder / LIBRARY_NAME
    raise ImportError(f"{LIBRARY_NAME} is not installed with the depthkit package "
                      f"(looked in {', '.join(_package_path())}): reinstall it (docs/python.md)")


def _package_path():
    import depthkit
    return list(depthkit.__path__)


def load() -> pathlib.Path:
    path = library_path()
    torch.ops.load_library(str(path))
    return path
