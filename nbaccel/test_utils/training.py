"""A tiny regression problem for testing training code (Accelerate's `accelerate.test_utils.training`):
`RegressionDataset` (y = a*x + b + noise, seeded) and `RegressionModel` (two scalar parameters)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["RegressionDataset", "RegressionModel", "mocked_dataloaders", "mocked_dataloaders_for_autoregressive_models"]


class RegressionDataset:
    """`length` items {"x": float32, "y": a*x + b + N(0, 0.1)}, drawn from numpy's default_rng(seed): the
    same numbers as Accelerate's for the same seed."""

    def __init__(self, a: float = 2, b: float = 3, length: int = 64, seed: int | None = None) -> None:
        rng = np.random.default_rng(seed)
        self.length = length
        self.x = rng.normal(size=(length,)).astype(np.float32)
        self.y = a * self.x + b + rng.normal(scale=0.1, size=(length,)).astype(np.float32)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"x": self.x[index], "y": self.y[index]}


class RegressionModel(torch.nn.Module):
    """`x * a + b` with scalar parameters `a`, `b`; prints the dtypes it sees on its first batch (which shows
    whether mixed precision reached the model)."""

    def __init__(self, a: float = 0, b: float = 0, double_output: bool = False) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(a).float())
        self.b = torch.nn.Parameter(torch.tensor(b).float())
        self.first_batch = True

    def forward(self, x=None):
        if self.first_batch:
            print(f"Model dtype: {self.a.dtype}, {self.b.dtype}. Input dtype: {x.dtype}")
            self.first_batch = False
        return x * self.a + self.b


def _needs_hub(name: str):
    def refused(*args: Any, **kwargs: Any):
        raise ImportError(f"{name} builds GLUE MRPC loaders with a BERT tokenizer from the Hub, from Accelerate's "
                          "own test files: it needs datasets and transformers (pip install datasets transformers), "
                          "network access and Accelerate's source tree; use RegressionDataset here.")

    refused.__name__ = name
    return refused


mocked_dataloaders = _needs_hub("mocked_dataloaders")
mocked_dataloaders_for_autoregressive_models = _needs_hub("mocked_dataloaders_for_autoregressive_models")
