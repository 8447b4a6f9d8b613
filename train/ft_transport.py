"""How a DiLoCo worker that joins late takes the current state from a live peer, without pickle.

torchft hands a recovering worker the state of a peer through a ``CheckpointTransport``; its
HTTP one unpickles what it receives, which would let any peer on the network run code in the
worker. Here the state travels as safetensors: tensors as they are, and everything else (steps,
optimizer settings) as JSON in the safetensors header, where each tensor's place in the state is
marked ``{"tensor": NAME}``. A peer stages its state when the Manager asks it to send, and a
small HTTP server gives it to whoever asks for that step.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torchft.checkpointing.transport import CheckpointTransport

TREE_KEY = "tree"  # the safetensors metadata entry that holds the JSON skeleton


def encode_state(state) -> bytes:
    """A nested state (dicts with string keys, lists, tensors and JSON values) as safetensors."""
    tensors: dict[str, torch.Tensor] = {}

    def skeleton(node, path: str):
        if torch.is_tensor(node):
            tensors[path] = node.detach().cpu().contiguous().clone()
            return {"tensor": path}
        if isinstance(node, dict):
            if not all(isinstance(k, str) for k in node):
                raise TypeError(f"state keys must be strings (at {path or 'the top'})")
            return {"dict": {k: skeleton(v, f"{path}/{k}") for k, v in node.items()}}
        if isinstance(node, (list, tuple)):
            return {"list": [skeleton(v, f"{path}/{i}") for i, v in enumerate(node)]}
        if node is None or isinstance(node, (bool, int, float, str)):
            return {"value": node}
        raise TypeError(f"cannot send a {type(node).__name__} (at {path or 'the top'})")

    tree = skeleton(state, "")
    return save_tensors(tensors, metadata={TREE_KEY: json.dumps(tree)})


def decode_state(data: bytes):
    """The state ``encode_state`` wrote; ValueError when ``data`` is not such a message."""
    try:
        tensors = load_tensors(data)
        header_size = int.from_bytes(data[:8], "little")
        tree = json.loads(json.loads(data[8 : 8 + header_size])["__metadata__"][TREE_KEY])
    except (SafetensorError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"not a teralm state message ({e})") from None

    def build(node):
        (kind, value), *_ = node.items()
        if kind == "tensor":
            return tensors[value]
        if kind == "dict":
            return {k: build(v) for k, v in value.items()}
        if kind == "list":
            return [build(v) for v in value]
        return value

    return build(tree)


class SafetensorsTransport(CheckpointTransport):
    """Serves this worker's staged state at ``http://HOST:PORT/checkpoint/STEP`` and fetches a
    peer's. A request for a step not staged yet waits for it, up to ``timeout``."""

    def __init__(self, host: str, timeout: timedelta):
        self._staged: tuple[int, bytes] | None = None
        self._changed = threading.Condition()
        self._timeout = timeout.total_seconds()
        transport = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                parts = self.path.strip("/").split("/")
                if len(parts) != 2 or parts[0] != "checkpoint" or not parts[1].isdigit():
                    self.send_error(404, "expected /checkpoint/STEP")
                    return
                payload = transport._wait_for(int(parts[1]))
                if payload is None:
                    self.send_error(409, f"step {parts[1]} is not staged here")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args) -> None:  # requests are not news
                pass

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self._host = host
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _wait_for(self, step: int) -> bytes | None:
        with self._changed:
            self._changed.wait_for(
                lambda: self._staged is not None and self._staged[0] >= step, self._timeout
            )
            if self._staged is None or self._staged[0] != step:
                return None
            return self._staged[1]

    def metadata(self) -> str:
        return f"http://{self._host}:{self._server.server_address[1]}/checkpoint/"

    def send_checkpoint(self, dst_ranks, step: int, state_dict, timeout: timedelta) -> None:
        payload = encode_state(state_dict)
        with self._changed:
            self._staged = (step, payload)
            self._changed.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._changed:
            self._staged = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta):
        with urllib.request.urlopen(f"{metadata}{step}", timeout=timeout.total_seconds()) as r:
            return decode_state(r.read())

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join()
