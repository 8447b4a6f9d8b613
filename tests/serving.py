"""Helpers for the server tests: real uvicorn servers on 127.0.0.1 (a `teralm serve` process, or
an app in a thread of the test), raw HTTP, and what /metrics says."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import uvicorn

from teralm.index import Index
from teralm.index.query import OnlineMatcher
from teralm.infer.engine import Engine
from teralm.infer.followers import Span, online_followers
from teralm.infer.mixture import infgram_probs, next_token_logp
from teralm.model import Transformer
from teralm.model.transformer import FollowerInput
from teralm.server.app import create_app
from teralm.server.guard import HEADER_TIMEOUT_S, http_config
from teralm.server.protocol import Limits

KEY = "test-key-123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(port, method, path, body=None, key=KEY, raw: bytes | None = None, headers=None):
    """One HTTP request; returns the status and the JSON answer (or its text)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    h = {"Content-Type": "application/json", **(headers or {})}
    if key:
        h["Authorization"] = f"Bearer {key}"
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers=h)
    response = conn.getresponse()
    payload = response.read()
    conn.close()
    try:
        return response.status, json.loads(payload)
    except ValueError:
        return response.status, payload.decode()


def wait_until_up(port: int, seconds: float = 180, alive=lambda: True) -> None:
    """Wait for /health to answer (``alive`` false: the server died; fail at once)."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        assert alive(), "the server exited"
        try:
            if request(port, "GET", "/health", key=None)[0] == 200:
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"no server on port {port} after {seconds} s")


@contextmanager
def serve_in_thread(
    model: Transformer,
    ix: Index,
    limits: Limits | None = None,
    max_batch: int = 16,
    api_key: str | None = KEY,
    knn=None,
    header_timeout: float = HEADER_TIMEOUT_S,
) -> Iterator[dict]:
    """``create_app`` over a real Engine (mixing in the kNN datastore ``knn``, if any), served
    by uvicorn on 127.0.0.1 in a thread."""
    engine = Engine(model, ix, max_batch=max_batch, knn=knn)
    app = create_app(engine, "teralm-test", limits, api_key)
    port = free_port()
    server = uvicorn.Server(http_config(app, "127.0.0.1", port, header_timeout))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until_up(port, alive=thread.is_alive)
        yield {"port": port, "engine": engine, "ix": ix, "model": model}
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.close()


def metric(port: int, name: str) -> float:
    """One value from /metrics."""
    _, text = request(port, "GET", "/metrics")
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name)))


def wait_until_idle(port: int, seconds: float = 120) -> None:
    """Wait for the engine to have nothing active or waiting (fails on a hang, not on speed)."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        if metric(port, "teralm_active_sequences") == metric(port, "teralm_queue_depth") == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"the engine still works after {seconds} s")


@torch.no_grad()
def greedy(model: Transformer, ix: Index, prompt: str, n: int) -> str:
    """The greedy continuation the server must reproduce, by the plainest route: a full
    forward of the whole text for every token (no cache), features from the online matcher
    (and the index's followers, for a model that reads them), and the ∞-gram mixture."""
    matcher = OnlineMatcher(ix)
    tokens = [int(t) for t in ix.encode(prompt)]
    features = matcher.extend(tokens)
    for _ in range(n):
        recent, feats = tokens[-model.cfg.max_seq_len :], features[-model.cfg.max_seq_len :]
        row = lambda xs: torch.tensor([xs])  # noqa: E731
        followers = None
        if model.cfg.index_followers:
            rows = online_followers(
                ix, model.cfg, [Span(tokens, len(tokens) - len(recent), len(tokens))]
            )
            followers = FollowerInput(*(t[None] for t in vars(rows).values()))
        logits, gate = model(
            row(recent), row([f[1] for f in feats]), row([f[0] for f in feats]), with_gate=True,
            followers=followers,
        )  # fmt: skip
        infgram = infgram_probs(ix, [tokens]) if gate is not None else None
        gate = None if gate is None else gate[0, -1:]
        token = int(next_token_logp(model, logits[0, -1:], gate, infgram)[0].argmax())
        tokens.append(token)
        features.append(matcher.push(token))
    return ix.decode(tokens[-n:] if n else [])
