"""How many threads the parallel kernels run on."""

from __future__ import annotations

import numba
import torch


def match_torch_threads() -> None:
    """Run the calling thread's numba parallel loops on as many threads as torch runs its own
    (``torch.set_num_threads``, or the ``OMP_NUM_THREADS=1`` that torchrun gives each process),
    and keep torch's count as it was.

    Both share the process's OpenMP runtime, and numba's, when it starts, sets that runtime's
    thread count to one per core: torch then ran every op on all the cores too. Under torchrun,
    two training processes on 2 cores each ran 2 threads that spun against the other's, and a
    1-layer model's step took 0.3 s instead of 0.045 s.
    """
    threads = torch.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))  # starts numba's pool
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
