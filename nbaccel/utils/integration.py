"""Names of Accelerate integrations that nbaccel does not drive (Megatron-LM, DeepSpeed, bitsandbytes loading,
Transformer Engine, SageMaker): they import, so code that only mentions them runs, and raise on use.

Using one raises ImportError naming what to install when the library is absent, and NotImplementedError
saying that nbaccel does not drive it when the library is there (installing it alone would not help).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any


class Integration:
    """One integration: its name, the module it needs, the pip line that installs it, what else it needs."""

    def __init__(self, title: str, module: str | None, install: str | None, needs: str = "") -> None:
        self.title, self.module, self.install, self.needs = title, module, install, needs

    def refuse(self, what: str) -> None:
        """Raise the error for using `what`."""
        if self.module is not None and importlib.util.find_spec(self.module) is None:
            extra = f" and {self.needs}" if self.needs else ""
            raise ImportError(f"{what} needs {self.title} ({self.install}){extra}; nbaccel does not drive "
                              f"{self.title} itself (see docs/compat.md), Accelerate does.")
        raise NotImplementedError(f"{what} is part of Accelerate's {self.title} integration, which nbaccel does not "
                                  f"drive (see docs/compat.md); use Accelerate for {self.title}.")

    def function(self, name: str) -> Callable[..., Any]:
        """A function `name` that refuses when called."""

        def refused(*args: Any, **kwargs: Any) -> Any:
            self.refuse(name)

        refused.__name__ = refused.__qualname__ = name
        refused.__doc__ = f"Accelerate's `{name}` ({self.title}): raises, see `nbaccel.utils.integration`."
        return refused

    def cls(self, name: str, module: str) -> type:
        """A class `name` that refuses when instantiated (it can still be named, subclassed and isinstance'd)."""
        integration = self

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            integration.refuse(name)

        return type(name, (), {"__init__": __init__, "__module__": module,
                               "__doc__": f"Accelerate's `{name}` ({self.title}): raises when created."})


MEGATRON_LM = Integration("Megatron-LM", "megatron", "pip install megatron-core", "NVIDIA GPUs")
DEEPSPEED = Integration("DeepSpeed", "deepspeed", "pip install deepspeed", "a GPU")
BITSANDBYTES = Integration("bitsandbytes quantized loading", "bitsandbytes", "pip install bitsandbytes", "a GPU")
TRANSFORMER_ENGINE = Integration("Transformer Engine", "transformer_engine", "pip install transformer-engine",
                                 "an NVIDIA Hopper or newer GPU")
SAGEMAKER = Integration("SageMaker", None, None)


def refuses(integration: Integration) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator for a function with Accelerate's signature whose use `integration` refuses."""

    def wrap(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def refused(*args: Any, **kwargs: Any) -> Any:
            integration.refuse(func.__name__)

        return refused

    return wrap
