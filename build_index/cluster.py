"""The build's units as tasks of a Ray cluster (``build-index --cluster ADDRESS``).

The contract is the local runner's (``builder._run_units``): a unit is a picklable top-level function
with picklable arguments, its files go to the shared ``--out`` folder, and ``on_done`` runs here, in
the driver, which alone writes the catalog, in order of completion. Ray runs a unit again when its
worker or node dies; a unit's own error ends the build as itself, and the units still running are
killed (unrecorded, so the next run does them again).
"""

from __future__ import annotations

import itertools
import socket
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from teralm.errors import BuildError

MAX_RETRIES = 3  # tries after the first, for a unit whose worker or node died
CONNECT_TIMEOUT_S = 10.0

Runner = Callable[[Callable, Iterable[tuple], int, Callable], None]


@contextmanager
def connect(address: str) -> Iterator[Runner]:
    """Connect to the Ray cluster at ``address`` (``host:port`` of its head, ``auto``, ``local``,
    ``ray://host:port``) for the block, and yield a runner with ``_run_units``'s interface."""
    try:
        import ray
    except ImportError:
        raise BuildError("--cluster needs Ray: pip install teralm[cluster]") from None
    _check_reachable(address)
    try:
        ray.init(address=address)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise BuildError(
            f"cannot connect to the Ray cluster at {address}: {e} (a cluster with token "
            "authentication needs RAY_AUTH_MODE=token and its token here too)"
        ) from None
    try:
        yield run_units
    finally:
        ray.shutdown()


def _check_reachable(address: str) -> None:
    """Fail at once where ``ray.init`` would wait minutes for a head that is not there."""
    host, colon, port = address.removeprefix("ray://").rpartition(":")
    if not colon or not port.isdigit():  # "auto", "local": Ray answers those itself
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise BuildError(
            f"cannot reach the Ray cluster at {address} ({e}); start its head with "
            "`ray start --head` there, or check the address"
        ) from None


def run_units(fn: Callable, args: Iterable[tuple], workers: int, on_done: Callable) -> None:
    """Run ``fn(*a)`` for each ``a`` as Ray tasks, at most ``workers`` at once (Ray places them on
    the cluster's CPUs), calling ``on_done(result)`` here as each one finishes."""
    import ray

    # retried when its worker dies, never for its own exception (retry_exceptions=False)
    task = ray.remote(max_retries=MAX_RETRIES, retry_exceptions=False)(fn)
    waiting = iter(args)
    running = [task.remote(*a) for a in itertools.islice(waiting, max(workers, 1))]
    try:
        while running:
            [done], running = ray.wait(running, num_returns=1)
            on_done(_result(done))
            running += [task.remote(*a) for a in itertools.islice(waiting, 1)]
    except BaseException:
        for ref in running:
            ray.cancel(ref, force=True)  # kills its worker; unrecorded, it is redone next run
        raise


def _result(ref):
    """The task's result; its own exception raised as itself, a lost task as a BuildError."""
    import ray

    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        raise e.cause from e
    except ray.exceptions.RayError as e:
        raise BuildError(
            f"a task on the Ray cluster was lost ({type(e).__name__}) after {MAX_RETRIES} "
            "retries; run the same command again to resume"
        ) from e
