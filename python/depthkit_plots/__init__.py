"""depthkit's figures: one function per figure, each reading the JSON a depthkit command wrote.

Run as ``python -m depthkit_plots FIGURE DATA.json OUT.png`` (the depthkit commands do this).
The data formats are documented in docs/analysis.md.
"""
from .figures import FIGURES, render

__all__ = ["FIGURES", "render"]
