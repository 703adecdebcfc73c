"""Shared fixtures of the Python tests (run by ctest, one entry per file, or by hand:
`.venv/bin/python -m pytest tests/python`). ctest points DEPTHKIT_OPS_LIBRARY at the build's
operator library and DEPTHKIT_PROGRAM at its program; by hand they default to build/."""
import importlib.util
import os
import pathlib

import pytest

SOURCE_DIR = pathlib.Path(__file__).resolve().parents[2]


def load_torch_reference():
    """bench/torch_reference.py, the model written a second time in plain PyTorch, as a module."""
    spec = importlib.util.spec_from_file_location("torch_reference", SOURCE_DIR / "bench" / "torch_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def program_path() -> str:
    """The depthkit program the tests compare against."""
    return os.environ.get("DEPTHKIT_PROGRAM") or str(SOURCE_DIR / "build" / "depthkit")


@pytest.fixture(scope="session")
def depthkit_program() -> str:
    path = program_path()
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path}: not built (run scripts/setup, or set DEPTHKIT_PROGRAM)")
    return path


@pytest.fixture(scope="session")
def source_dir() -> pathlib.Path:
    return SOURCE_DIR
