"""depthkit from Python: Transformer residual pathways that retrieve across depth.

- ``torch.ops.depthkit.*``: the fused operators (CPU, and CUDA where built), each with its
  hand-written backward and a fake implementation, so torch.compile and torch.export trace them.
- ``depthkit.nn``: one module per pathway kind, owning the depth loop over your own branches.
- ``depthkit.load(path)``: a trained depthkit run or checkpoint as a torch module with its tokenizer.
- ``depthkit.lm_eval``: the model lm-evaluation-harness scores (imported on its own: it loads lm_eval).

docs/python.md has the three uses in full.
"""
from . import _library

OPS_LIBRARY = _library.load()

from . import _fake  # noqa: E402  (registers the fake implementations on the loaded operators)
from . import nn  # noqa: E402
from .model import DepthkitModel, load  # noqa: E402
from .tokenizer import Tokenizer  # noqa: E402

__version__ = "0.1.0"
__all__ = ["OPS_LIBRARY", "DepthkitModel", "Tokenizer", "load", "nn", "__version__"]
