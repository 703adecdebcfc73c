"""Shared fixtures of the Python tests (run by ctest, one entry per file, or by hand:
`.venv/bin/python -m pytest tests/python`). ctest points DEPTHKIT_OPS_LIBRARY at the build's
operator library and DEPTHKIT_PROGRAM at its program; by hand they default to build/."""
import importlib.util
import os
import pathlib
import struct

import pytest

SOURCE_DIR = pathlib.Path(__file__).resolve().parents[2]


def load_torch_reference():
    """bench/torch_reference.py, the model written a second time in plain PyTorch, as a module."""
    spec = importlib.util.spec_from_file_location("torch_reference", SOURCE_DIR / "bench" / "torch_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_shard(path):
    """The token ids of an llm.c shard: a 1024-byte header of int32s (magic, version, token count),
    then the ids, uint16 (magic 20240520) or uint32 (20240801); the size must match the header."""
    raw = pathlib.Path(path).read_bytes()
    magic, _, count = struct.unpack("<3i", raw[:12])
    width = {20240520: 2, 20240801: 4}[magic]
    assert len(raw) == 1024 + count * width, f"{path}: {len(raw)} bytes, its header says {count} ids"
    return list(struct.unpack(f"<{count}{'H' if width == 2 else 'I'}", raw[1024:]))


def split_documents(ids, eos):
    """Token ids cut into documents at each end-of-document id (which every document ends with)."""
    docs, cur = [], []
    for i in ids:
        if i == eos:
            docs.append(cur)
            cur = []
        else:
            cur.append(i)
    assert not cur, "the ids end inside a document"
    return docs


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
