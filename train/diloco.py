"""DiLoCo on torchft: workers that train apart for a while, agree seldom, and come and go.

Each worker is one process with its own copy of the model. It trains ``inner_steps`` steps with
its inner optimizer (AdamW, or GaLore's), then all workers meet for a round: each computes its
pseudo-gradient ``global - local`` (how far it moved from the round's starting weights), they
average the pseudo-gradients, and every worker steps the global weights with the outer optimizer
(SGD with Nesterov momentum, DiLoCo's) and starts the next round from them. A round's average
is weighted by the inner steps each worker trained in it (TScale's batch counts), so a worker
that has just joined, with nothing to add yet, counts for nothing.

torchft supplies what makes this survive the internet: a Lighthouse forms a quorum of the live
workers at every round, the process group between them is rebuilt when the quorum changes, and
a worker whose step is behind the quorum's (a new one, or one restarted after a crash) takes the
current state from a live peer (teralm.train.ft_transport, without pickle) before the round. A
worker that dies drops out of the next quorum once the Lighthouse stops hearing its heartbeat;
a round whose exchange fails is not committed, and the workers redo it from its start. Nothing
is lost but the unfinished inner steps.

Pseudo-gradients travel as ``outer_compress`` says, with the same wire formats as the
synchronous exchanges (teralm.train.compression): ``none`` (one all-reduce of fp32 values),
``onebit`` (signs with one scale per block, in the synchronous ``onebit``'s two stages: an
all-to-all of shards, an all-gather of each worker's 1-bit mean of its shard) or ``demo`` (each
tensor's top-k DCT components per chunk, e4m3 values, Elias-Fano indices, one message per worker
all-gathered). The compressed ones keep what their messages missed (error feedback), to add to
their next pseudo-gradient.

With ``outer_async`` = s > 0 (TScale's asynchronous mode) a round's exchange runs while the next
round trains: at each boundary a worker applies the previous round's average, scaled by s
(``global -= s * mean``, no momentum), then sends this round's. The exchange's latency hides
behind a round of compute; the price is that every update is one round stale.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlparse

import torch
from torch.distributed import TCPStore
from torch.distributed.distributed_c10d import AllgatherOptions, AllToAllOptions, ReduceOp

from teralm.errors import ConfigError
from teralm.model import checkpoint
from teralm.train.compression import DCTMessage, DCTTopK, ShardedSignMean
from teralm.train.config import TrainConfig
from teralm.train.distributed import Traffic

HEADER_BYTES = 4  # a message's first bytes: the sender's weight (fp32)


def _torchft():
    """torchft's Manager and gloo process group; ConfigError when it is not installed."""
    os.environ.setdefault("RUST_LOG", "error")  # its Rust side's notes of every quorum
    try:
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo
    except ImportError:
        raise ConfigError(
            "mode diloco runs on torchft: pip install 'teralm[ft]' (or pip install torchft)"
        ) from None
    logging.getLogger("torchft").setLevel(logging.ERROR)  # its per-step notes are not news
    return Manager, ProcessGroupGloo


class Receipt:
    """An exchange in flight: ``wait()`` gives the weighted mean of the pseudo-gradients, or
    None when the exchange failed or no worker trained in the round."""

    def __init__(self, finish: Callable[[], list[torch.Tensor] | None]):
        self._finish, self._done, self._mean = finish, False, None

    def wait(self) -> list[torch.Tensor] | None:
        if not self._done:
            self._mean, self._done = self._finish(), True
        return self._mean


class MeanExchange:
    """``outer_compress = "none"``: the weighted mean in one all-reduce of fp32 values, the
    weight riding as the last value."""

    def __init__(self, manager, pg, traffic: Traffic):
        self.manager, self.pg, self.traffic = manager, pg, traffic

    def send(self, deltas: list[torch.Tensor], weight: float) -> Receipt:
        flat = torch.cat([d.reshape(-1) * weight for d in deltas] + [torch.tensor([weight])])
        workers = self.manager.num_participants()
        work = self.manager.allreduce(flat, reduce_op=ReduceOp.SUM)
        self.traffic.all_reduced(flat.numel() * flat.element_size(), workers)

        def finish():
            work.wait()
            if self.manager.errored() or flat[-1] <= 0:
                return None
            return _unflatten(flat[:-1] / flat[-1], deltas)

        return Receipt(finish)

    def _all_gather(self, message: torch.Tensor) -> tuple[list[torch.Tensor], object]:
        """Start an all-gather of one ``message`` (uint8) a worker: the parts it fills, and its
        work (None when a peer is gone)."""
        workers = self.manager.num_participants()
        parts = [torch.empty_like(message) for _ in range(workers)]
        opts = AllgatherOptions()
        work = self._start(lambda: self.pg.allgather([parts], [message], opts))
        self.traffic.all_gathered(message.numel(), workers)
        return parts, work

    def _all_to_all(self, rows: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Start an all-to-all of ``rows`` [workers, n] (uint8; row ``j`` to worker ``j``): the
        rows it fills (row ``r`` from worker ``r``), and its work."""
        out = torch.empty_like(rows)
        work = self._start(lambda: self.pg.alltoall_base(out, rows, [], [], AllToAllOptions()))
        self.traffic.all_to_all(rows.numel(), rows.shape[0])
        return out, work

    def _start(self, collective: Callable[[], object]):
        if self.manager.errored():
            return None
        try:
            return collective()
        except Exception as e:  # a peer gone while the collective starts
            self.manager.report_error(e)
            return None

    def _finished(self, work) -> bool:
        """Wait for ``work``: whether it completed (a failure is reported to the manager)."""
        if work is None:
            return False
        try:
            work.wait()
        except Exception as e:
            self.manager.report_error(e)
            return False
        return True

    def commit(self) -> None:
        """The round counted: keep what this worker's message missed (compressed exchanges)."""

    def discard(self) -> None:
        """The round is redone: forget what this round's message missed."""


class GatheredExchange(MeanExchange):
    """A compressed exchange: every worker all-gathers one message (its weight, then its
    compressed pseudo-gradient plus the residual of earlier messages) and averages the
    decoded messages by weight. ``encode``/``decode`` are the compression's."""

    def __init__(self, manager, pg, traffic: Traffic):
        super().__init__(manager, pg, traffic)
        self.residual: list[torch.Tensor] | None = None
        self._pending: list[torch.Tensor] | None = None

    def encode(self, corrected: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The message of ``corrected`` and what it stands for, tensor by tensor."""
        raise NotImplementedError

    def decode(self, message: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
        raise NotImplementedError

    def send(self, deltas: list[torch.Tensor], weight: float) -> Receipt:
        corrected = deltas if self.residual is None else [
            d + r for d, r in zip(deltas, self.residual)
        ]  # fmt: skip
        body, sent = self.encode(corrected)
        self._pending = [c - s for c, s in zip(corrected, sent)] if weight else self.residual
        message = torch.cat([_header(weight), body])
        parts, work = self._all_gather(message)

        def finish():
            if not self._finished(work):
                return None
            weights = [_weight(p) for p in parts]
            return self.average([p[HEADER_BYTES:] for p in parts], weights, deltas)

        return Receipt(finish)

    def average(
        self, messages: list[torch.Tensor], weights: list[float], like: list[torch.Tensor]
    ) -> list[torch.Tensor] | None:
        """The mean of what ``messages`` stand for, each weighted by its sender's inner steps
        (None when no sender trained)."""
        total = sum(weights)
        if total <= 0:
            return None
        mean = [torch.zeros_like(d) for d in like]
        for w, message in zip(weights, messages):
            if w:
                for m, x in zip(mean, self.decode(message, like)):
                    m += x * (w / total)
        return mean

    def commit(self) -> None:
        self.residual = self._pending

    def discard(self) -> None:
        self._pending = None


class SignExchange(MeanExchange):
    """``onebit``: the pseudo-gradients' mean in 1-bit messages of two stages, as the
    synchronous ``onebit`` sends gradients (``ShardedSignMean``): an all-to-all of every
    worker's message of each shard (its weight riding with each), then an all-gather of each
    worker's reply for its shard. Error feedback on both sides: a worker keeps what its own
    message missed, and what its reply missed for as long as the quorum (its size and this
    worker's place in it, which fix the shards) stays the same."""

    def __init__(self, manager, pg, traffic: Traffic, block: int):
        super().__init__(manager, pg, traffic)
        self.block = block
        self.residual: torch.Tensor | None = None
        self.shard_residual: tuple[tuple[int, int], torch.Tensor] | None = None  # with its place
        self._pending: dict = {}

    def send(self, deltas: list[torch.Tensor], weight: float) -> Receipt:
        flat = torch.cat([d.reshape(-1) for d in deltas])
        corrected = flat if self.residual is None else flat + self.residual
        place = (self.manager.num_participants(), self.manager.participating_rank())
        mean = ShardedSignMean(flat.numel(), place[0], self.block)
        outgoing = mean.encode(corrected)
        if weight:
            self._pending["residual"] = corrected - mean.decode(outgoing)
        rows = torch.cat([_header(weight).expand(place[0], HEADER_BYTES), outgoing], 1)
        incoming, work = self._all_to_all(rows)

        def finish():
            if not self._finished(work):
                return None
            weights = [_weight(r) for r in incoming]
            if sum(weights) <= 0:
                return None
            held = self.shard_residual
            residual = held[1] if held and held[0] == place else torch.zeros(mean.length)
            reply, missed = mean.reply(incoming[:, HEADER_BYTES:], weights, place[1], residual)
            replies, work2 = self._all_gather(reply)
            if not self._finished(work2):
                return None
            self._pending["shard_residual"] = (place, missed)
            return _unflatten(mean.decode(replies), deltas)

        return Receipt(finish)

    def commit(self) -> None:
        self.residual = self._pending.pop("residual", self.residual)
        self.shard_residual = self._pending.pop("shard_residual", self.shard_residual)

    def discard(self) -> None:
        self._pending.clear()


class DCTExchange(GatheredExchange):
    """``demo``: each tensor's ``k`` largest DCT components per chunk, as DeMo sends them."""

    def __init__(self, manager, pg, traffic: Traffic, chunk: int, k: int):
        super().__init__(manager, pg, traffic)
        self.compression = DCTTopK(chunk, k)
        self.wire: DCTMessage | None = None

    def encode(self, corrected):
        if self.wire is None:
            self.wire = DCTMessage(self.compression, [c.shape for c in corrected])
        parts, sent = [], []
        for c in corrected:
            index, values = self.compression.encode(c)
            q, scale = DCTMessage.quantize(values)
            parts.append((index, q, scale))
            sent.append(self.compression.decode(index, DCTMessage.dequantize(q, scale), c.shape))
        return self.wire.encode(parts), sent

    def decode(self, message, like):
        tiles = self.wire.coefficients(message)
        return [self.compression.inverse(t, d.shape) for t, d in zip(tiles, like)]


def _header(weight: float) -> torch.Tensor:
    """A message's first bytes: the sender's weight."""
    return torch.tensor([weight], dtype=torch.float32).view(torch.uint8)


def _weight(message: torch.Tensor) -> float:
    return float(message[:HEADER_BYTES].view(torch.float32))


def _unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    return [part.view_as(d) for part, d in zip(flat.split([d.numel() for d in like]), like)]


class Outer:
    """One worker's side of DiLoCo (see the module's docstring): the global weights (fp32, in
    host memory) and their outer optimizer, the torchft Manager, and the exchange.

    ``round(step, weight)`` is called at every round boundary (``weight``: the inner steps this
    worker trained since the last one) and returns the step to go on from: the same one, the
    round's start when the round failed and is to be redone, or the quorum's when this worker
    took the state of a peer. ``main`` says whether this worker writes the run (the quorum's
    first)."""

    def __init__(
        self,
        model: torch.nn.Module,
        inner: torch.optim.Optimizer,
        cfg: TrainConfig,
        replica: int,
        lighthouse: str,
        host: str,
        timeout: timedelta,
    ):
        Manager, ProcessGroupGloo = _torchft()
        from teralm.train.ft_transport import SafetensorsTransport

        self.model, self.inner, self.cfg, self.replica = model, inner, cfg, replica
        self.names, self.params = zip(*model.named_parameters())
        self.globals = [p.detach().to("cpu", torch.float32, copy=True) for p in self.params]
        for g in self.globals:
            g.requires_grad_(True)
        self.outer = torch.optim.SGD(
            self.globals, lr=cfg.outer_lr, momentum=cfg.outer_momentum,
            nesterov=cfg.outer_momentum > 0,
        )  # fmt: skip
        self.traffic = Traffic()
        self.boundary = self.committed = 0  # this round's step, and the last committed one
        self.healed: int | None = None  # the step a peer's state put this worker at
        self.pending: Receipt | None = None  # the exchange in flight (outer_async)
        self.rounds, self.round_sent = 0, 0  # rounds this process took part in; its last's bytes
        self.store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        self.pg = ProcessGroupGloo(timeout=timeout)
        try:
            self.manager = Manager(
                pg=self.pg, load_state_dict=self._load, state_dict=self._state,
                min_replica_size=cfg.min_replicas, use_async_quorum=False,
                replica_id=f"teralm-{replica}", store_addr=host, store_port=self.store.port,
                rank=0, world_size=1, lighthouse_addr=lighthouse, hostname=host,
                init_sync=False, timeout=timeout, quorum_timeout=timeout,
                connect_timeout=timeout,
                checkpoint_transport=SafetensorsTransport(host, timeout),
            )  # fmt: skip
        except RuntimeError as e:
            raise ConfigError(f"cannot reach the lighthouse at {lighthouse} ({e})") from None
        self.exchange = make_exchange(cfg, self.manager, self.pg, self.traffic)
        self.lighthouse, self.timeout = lighthouse, timeout

    @property
    def main(self) -> bool:
        return self.manager.participating_rank() == 0

    @property
    def workers(self) -> int:
        return self.manager.num_participants()

    def round(self, step: int, weight: float) -> int:
        sent_before = self.traffic.sent
        step = self._round(step, weight)
        self.round_sent, self.rounds = self.traffic.sent - sent_before, self.rounds + 1
        return step

    def _round(self, step: int, weight: float) -> int:
        deltas = [g.detach() - p.detach().cpu().float() for g, p in zip(self.globals, self.params)]
        if self.cfg.outer_async:
            self._apply_pending()
        self.boundary, self.healed = step, None
        self._quorum()
        self._agree()
        if self.healed is not None:  # this worker holds a peer's state now: nothing to add
            step, weight = self.healed, 0.0
            deltas = [torch.zeros_like(d) for d in deltas]
        receipt = self.exchange.send(deltas, weight)
        if self.cfg.outer_async:
            self.pending = receipt
            self.exchange.commit()  # nothing is redone in this mode
        else:
            mean = receipt.wait()  # before should_commit: a failed exchange fails the round
            if self.manager.should_commit():
                self.exchange.commit()
                if mean is not None:
                    self._outer_step(mean)
                self.committed = step
            else:
                self.exchange.discard()
                step = self.committed
        self._reset_model()
        return step

    def finish(self) -> None:
        """Apply the exchange still in flight (``outer_async``), so the run ends agreed."""
        if self.pending is not None:
            self._apply_pending()
            self._reset_model()

    def _apply_pending(self) -> None:
        if self.pending is None:
            return
        mean = self.pending.wait()
        self.pending = None
        if self.manager.should_commit() and mean is not None:
            with torch.no_grad():
                for g, m in zip(self.globals, mean):
                    g -= self.cfg.outer_async * m

    def _quorum(self) -> None:
        try:
            self.manager.start_quorum()
        except Exception as e:  # the Lighthouse gone, or too few workers for too long
            raise ConfigError(
                f"no quorum from the lighthouse at {self.lighthouse} within "
                f"{self.timeout.total_seconds():.0f} s ({type(e).__name__}: {e}); is it "
                "running, and are at least min_replicas workers up?"
            ) from None

    def _agree(self) -> None:
        """Make every worker of the quorum start the round from the same global weights.

        torchft heals a worker whose step is behind; it cannot see workers that reached the same
        step apart (each in a quorum of its own while the others were away, as when one starts
        late with ``min_replicas`` 1), whose weights differ. A 16-byte all-reduce compares the
        workers' digests; when they differ, the main worker broadcasts its global weights, outer
        momentum and step, and a worker that held others counts as healed: nothing to add this
        round."""
        workers = self.manager.num_participants()
        if workers < 2 or self.manager.errored():
            return
        mark = float(int(self.digest()[:12], 16))  # 48 bits of the digest: exact in fp64
        try:
            marks = torch.tensor([mark, -mark], dtype=torch.float64)
            self.pg.allreduce([marks], ReduceOp.MAX).wait()
            self.traffic.all_reduced(marks.numel() * marks.element_size(), workers)
            if marks[0] == -marks[1]:
                return
            main = self.main
            head = torch.tensor([mark, self.boundary], dtype=torch.float64)
            flat = torch.cat([t.reshape(-1) for t in self._outer_tensors()])
            for t in (head, flat):
                self.pg.broadcast_one(t, 0).wait()
                self.traffic.broadcast(t.numel() * t.element_size(), workers, root=main)
        except Exception as e:  # a peer gone: the round fails and is redone
            self.manager.report_error(e)
            return
        if float(head[0]) != mark:
            mine = self._outer_tensors()
            with torch.no_grad():
                for t, part in zip(mine, _unflatten(flat, mine)):
                    t.copy_(part)
            self.healed = self.committed = int(head[1])
            print(
                f"worker {self.replica}: the quorum's global weights differed from this worker's "
                f"(it trained apart); took the main worker's, at step {self.healed}",
                file=sys.stderr, flush=True,
            )  # fmt: skip

    def _outer_tensors(self) -> list[torch.Tensor]:
        """The global weights, then the outer momentum (zeros before the first outer step)."""
        weights = [g.detach() for g in self.globals]
        if not self.cfg.outer_momentum:
            return weights
        buffers = []
        for g in self.globals:
            state = self.outer.state[g]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(g)
            buffers.append(state["momentum_buffer"])
        return weights + buffers

    def _outer_step(self, mean: list[torch.Tensor]) -> None:
        for g, m in zip(self.globals, mean):
            g.grad = m
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)

    def _reset_model(self) -> None:
        with torch.no_grad():
            for p, g in zip(self.params, self.globals):
                p.copy_(g)

    # -- what a peer that joins late takes from this worker -----------------------------------

    def _state(self) -> dict:
        return {
            "globals": dict(zip(self.names, (g.detach() for g in self.globals))),
            "outer": _optimizer_state(self.outer),
            "inner": _optimizer_state(self.inner),
            "step": self.boundary,
            "committed": self.committed,
        }

    def _load(self, state: dict) -> None:
        with torch.no_grad():
            for name, g in zip(self.names, self.globals):
                g.copy_(state["globals"][name])
        _restore_optimizer(self.outer, state["outer"])
        _restore_optimizer(self.inner, state["inner"])
        self._reset_model()
        self.healed, self.committed = int(state["step"]), int(state["committed"])

    # -- checkpoints ------------------------------------------------------------------------

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps beside the model (whose weights are the global ones at a
        round boundary) and the inner optimizer: the outer optimizer's momentum."""
        tensors, _ = checkpoint.optimizer_tensors(self.outer)
        return {f"outer/{k}": v for k, v in tensors.items()}

    def checkpoint_state(self) -> dict:
        _, rest = checkpoint.optimizer_tensors(self.outer)
        return {"outer": rest, "manager": self.manager.state_dict(), "committed": self.committed}

    def restore(self, tensors: dict[str, torch.Tensor], state: dict, step: int) -> None:
        """Continue from a checkpoint of step ``step`` (the model already loaded)."""
        with torch.no_grad():
            for g, p in zip(self.globals, self.params):
                g.copy_(p.detach().cpu().float())
        outer = {k[len("outer/") :]: v for k, v in tensors.items() if k.startswith("outer/")}
        checkpoint.restore_optimizer(self.outer, outer, state["outer"])
        self.manager.load_state_dict(state["manager"])
        self.boundary = self.committed = step

    def digest(self) -> str:
        """The sha256 of the global weights: the same on every worker once they agree."""
        h = hashlib.sha256()
        for g in self.globals:
            h.update(g.detach().contiguous().numpy().tobytes())
        return h.hexdigest()

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def _optimizer_state(optimizer) -> dict:
    tensors, rest = checkpoint.optimizer_tensors(optimizer)
    return {"tensors": tensors, "rest": rest}


def _restore_optimizer(optimizer, state: dict) -> None:
    checkpoint.restore_optimizer(optimizer, state["tensors"], state["rest"])


@dataclass(frozen=True)
class WorkerPlace:
    """Where a DiLoCo worker stands: the Lighthouse's URL, its replica number, the address its
    peers reach it at, and how long it waits for a quorum or an exchange (seconds)."""

    lighthouse: str
    replica: int
    host: str
    timeout_s: float = 120.0


@contextlib.contextmanager
def open_worker(place: WorkerPlace, model, inner, cfg: TrainConfig) -> Iterator[Outer]:
    """This process as DiLoCo worker ``place.replica`` of ``model``, until the block ends."""
    outer = Outer(
        model, inner, cfg, place.replica, place.lighthouse, place.host,
        timedelta(seconds=place.timeout_s),
    )  # fmt: skip
    try:
        yield outer
    finally:
        outer.close()


def make_exchange(cfg: TrainConfig, manager, pg, traffic: Traffic) -> MeanExchange:
    """The pseudo-gradient exchange for ``cfg.outer_compress``."""
    if cfg.outer_compress == "onebit":
        return SignExchange(manager, pg, traffic, cfg.onebit_block)
    if cfg.outer_compress == "demo":
        return DCTExchange(manager, pg, traffic, cfg.demo_chunk, cfg.demo_topk)
    return MeanExchange(manager, pg, traffic)


def is_round_end(cfg: TrainConfig, step: int) -> bool:
    """Whether a round ends after ``step`` steps (every ``inner_steps``, and at the end)."""
    return step % cfg.inner_steps == 0 or step == cfg.max_steps


def advertised_host(lighthouse: str, host: str | None) -> str:
    """The address peers reach this worker at: ``host``, or 127.0.0.1 when the Lighthouse is
    on this machine's loopback, else this machine's name."""
    if host:
        return host
    if urlparse(lighthouse).hostname in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    return socket.gethostname()


@contextlib.contextmanager
def lighthouse_server(bind: str, min_replicas: int, join_timeout_s: float = 10.0):
    """A torchft Lighthouse on ``bind`` (``HOST:PORT``; port 0: any), yielding its URL."""
    os.environ.setdefault("RUST_LOG", "error")
    try:
        from torchft._torchft import LighthouseServer
    except ImportError:
        raise ConfigError(
            "the lighthouse comes with torchft: pip install 'teralm[ft]' (or pip install torchft)"
        ) from None
    server = LighthouseServer(
        bind=bind, min_replicas=min_replicas, join_timeout_ms=int(join_timeout_s * 1000),
        heartbeat_timeout_ms=5000,
    )  # fmt: skip
    host = bind.rsplit(":", 1)[0].strip("[]")
    port = server.address().rsplit(":", 1)[1]
    reachable = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
    try:
        yield f"http://{reachable}:{port}"
    finally:
        server.shutdown()


def worker_threads(replicas: int) -> int:
    """Threads for each of ``replicas`` workers on this machine: its share of the cores."""
    return max(1, (os.cpu_count() or 1) // replicas)


def launch_local(
    argv: list[str], replicas: int, min_replicas: int, quiet: bool, env: dict[str, str]
) -> int:
    """``teralm train ... --lighthouse auto``: a Lighthouse on 127.0.0.1 and ``replicas``
    worker processes of the same command, each with its ``--replica-id``; waits for them all.
    A worker that dies leaves the others training; its exit is reported at the end."""
    with lighthouse_server("127.0.0.1:0", min_replicas) as url:
        if not quiet:
            print(f"lighthouse {url}; {replicas} workers", file=sys.stderr, flush=True)
        workers = []
        for replica in range(replicas):
            args = [*argv, "--lighthouse", url, "--replica-id", str(replica)]
            if replica and "--quiet" not in args:
                args.append("--quiet")  # one progress bar, the first worker's
            command = [sys.executable, "-m", "teralm.cli", *args]
            workers.append(subprocess.Popen(command, env=env))
        try:
            codes = [w.wait() for w in workers]
        except BaseException:
            for w in workers:
                w.kill()
            raise
    failed = [(r, c) for r, c in enumerate(codes) if c]
    for replica, code in failed:
        how = f"signal {-code}" if code < 0 else f"exit code {code}"
        print(f"teralm train: worker {replica} ended with {how}", file=sys.stderr)
    return 1 if len(failed) == replicas else 0


def worker_env_problem() -> str | None:
    """Why this process cannot be a DiLoCo worker (it was started by torchrun), or None."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return (
            "a DiLoCo worker is one process of its own: start the workers with --lighthouse "
            "(auto, or an address), not under torchrun"
        )
    return None
