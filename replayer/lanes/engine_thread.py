"""The one OS thread an in-process engine lives on: it is built there and every call to it runs there.

OpenMP keeps its thread count per calling thread. An in-process vLLM engine built on a thread where
``torch.set_num_threads(n)`` ran, then stepped from another thread (the service replays in asyncio's worker
threads, whichever is free), builds its CPU attention metadata for one count and runs the kernels with another,
and vLLM aborts the step ("Check failed: input->metadata->thread_num == thread_num"). Keeping the engine on one
thread keeps the count the lane set for it: the one-at-a-time lane's, and each schedule lane its production
engine's.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

_P = ParamSpec("_P")
_T = TypeVar("_T")


class EngineThread:
    """A single worker thread; `call` runs a function on it and returns its result (or raises its error)."""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def call(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        return self._pool.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def set_torch_threads(torch: Any, count: int) -> None:
    """``torch.set_num_threads(count)`` for the calling thread, also in a process where a vLLM engine already ran.

    vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op in whatever process it starts, because a
    multi-process server binds its worker's OpenMP threads to cores. An in-process engine binds none, so a lane
    started later in the same process (the service's, a test session's) still sets its own count, through
    torch's C entry point, which vLLM leaves in place. Without it the first engine's count would hold for every
    later lane, and a CPU matmul's reduction order depends on it.
    """
    torch._C.set_num_threads(count)
