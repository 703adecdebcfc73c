"""The package as a user meets it: installed into the environment (not found through a path),
`import depthkit` loading the operator library and nothing heavy, errors as Python exceptions."""
import importlib.metadata
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import SOURCE_DIR


def run_python(code, env_update=None, cwd="/"):
    """A fresh interpreter, started away from the checkout so that only the installed package can
    be imported."""
    env = dict(os.environ, **(env_update or {}))
    env.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True)


def test_installed_into_the_environment():
    dist = importlib.metadata.distribution("depthkit")
    assert dist.version == "0.1.0"
    # The package's Python files are the checkout's (an editable install, scripts/setup).
    r = run_python("import depthkit, sys; print(depthkit.__file__); print(depthkit.OPS_LIBRARY)",
                   {"DEPTHKIT_OPS_LIBRARY": ""})
    assert r.returncode == 0, r.stderr
    init_file, library = r.stdout.split()
    assert pathlib.Path(init_file).resolve() == SOURCE_DIR / "python" / "depthkit" / "__init__.py"
    # Without DEPTHKIT_OPS_LIBRARY the installed copy of the library is loaded, from the environment.
    assert pathlib.Path(library).resolve().is_relative_to(pathlib.Path(sys.prefix).resolve()), library


def test_import_registers_the_operators_and_nothing_heavy():
    code = ("import sys, torch, depthkit\n"
            "ops = {s.name for s in torch._C._jit_get_all_schemas() if s.name.startswith('depthkit::')}\n"
            "heavy = [m for m in ('lm_eval', 'transformers', 'datasets', 'matplotlib')"
            " if m in sys.modules]\n"
            "print(len(ops), heavy)")
    r = run_python(code)
    assert r.returncode == 0, r.stderr
    count, heavy = r.stdout.split(" ", 1)
    # 14 fused operators, their 14 backward operators, shared_source
    assert int(count) == 29 and heavy.strip() == "[]", r.stdout


def test_a_missing_library_is_an_import_error():
    r = run_python("import depthkit", {"DEPTHKIT_OPS_LIBRARY": "/nonexistent/libdepthkit_ops.so"})
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last == "ImportError: DEPTHKIT_OPS_LIBRARY=/nonexistent/libdepthkit_ops.so: no such file", last


def test_operator_errors_are_python_exceptions():
    import torch
    import depthkit  # noqa: F401

    # A rank-3 query where the operator takes [M, d]: the kernel's own one-line message, raised.
    with pytest.raises(RuntimeError) as e:
        torch.ops.depthkit.depth_read(torch.zeros(2, 3, 8), [torch.zeros(3, 4)], [], 1e-6)
    assert str(e.value) == "depth_read: expected queries [M, d], keys and values [P, d] each"
