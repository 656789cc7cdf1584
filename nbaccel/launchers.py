"""`accelerate.launchers` under its Accelerate name: `from nbaccel.launchers import notebook_launcher` works.

The launchers live in `nbaccel.launch`; this module only gives them the import path Accelerate scripts use.
"""

from __future__ import annotations

from .launch import debug_launcher, notebook_launcher

__all__ = ["debug_launcher", "notebook_launcher"]
