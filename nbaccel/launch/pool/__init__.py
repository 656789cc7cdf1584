"""`RankPool`: persistent ranks, cell by cell. The pool, its rank loop, calls, results and hang reports."""

from .rank_pool import (
    CollectiveMismatchError,
    RankFailedError,
    RankPool,
    RankPoolError,
    RankResult,
    RankResults,
    RankStartError,
    RankTimeoutError,
    results_equal,
)

__all__ = [
    "CollectiveMismatchError", "RankFailedError", "RankPool", "RankPoolError", "RankResult", "RankResults",
    "RankStartError", "RankTimeoutError", "results_equal",
]
