"""The server under abuse: extreme sampling values, requests that would starve others, oversized
chunked bodies, clients that leave, input that is not valid, a model that fails, bad flags."""

from __future__ import annotations

import contextlib
import copy
import http.client
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
from serving import KEY, greedy, metric, request, serve_in_thread, wait_until_idle

from teralm.infer.engine import Sequence
from teralm.infer.sampling import Sampling
from teralm.server.protocol import Limits

MAX_SEQUENCES = 32
HEADER_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def server(tiny_run):
    """Two places in the batch, so that long requests keep it full."""
    limits = Limits(max_tokens=400, max_sequences=MAX_SEQUENCES)
    with serve_in_thread(
        tiny_run["model"], tiny_run["ix"], limits, max_batch=2, header_timeout=HEADER_TIMEOUT
    ) as served:
        yield served
        wait_until_idle(served["port"])


@pytest.fixture(scope="module")
def broken(tiny_run):
    """A server whose model gives NaN everywhere: its failures are the server's own."""
    model = copy.deepcopy(tiny_run["model"])
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    with serve_in_thread(model, tiny_run["ix"]) as served:
        yield served


def open_stream(port: int, body: dict) -> http.client.HTTPConnection:
    """Start a streamed completion; ``conn.stream`` is its response."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), headers)
    conn.stream = conn.getresponse()
    assert conn.stream.status == 200
    return conn


def running(port: int, body: dict) -> http.client.HTTPConnection:
    """A streamed completion whose first token came (its sequence is in the batch)."""
    conn = open_stream(port, body)
    assert conn.stream.readline().startswith(b'data: {"id"')
    return conn


def events(response: http.client.HTTPResponse) -> list:
    """The rest of a stream's events, JSON decoded ("[DONE]" as is)."""
    lines = [line.decode().strip() for line in response]
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def hang_up(conn: http.client.HTTPConnection) -> None:
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


def test_tiny_temperature_and_top_p_are_greedy_and_fail_no_one(server):
    port, model, ix = server["port"], server["model"], server["ix"]
    other = running(port, {"prompt": "ab", "max_tokens": 400})
    for extreme in ({"temperature": 1e-300}, {"top_p": 5e-324}, {"temperature": 5e-324}):
        code, answer = request(
            port, "POST", "/v1/completions", {"prompt": "abcab", "max_tokens": 20, **extreme}
        )
        assert code == 200, answer
        assert answer["choices"][0]["text"] == greedy(model, ix, "abcab", 20)
    rest = events(other.stream)
    assert rest[-1] == "[DONE]" and len(rest) == 400  # the first event, 399 more, [DONE]
    assert rest[-2]["choices"][0]["finish_reason"] == "length"


def test_a_failing_sequence_ends_alone(server):
    engine, ix, model = server["engine"], server["ix"], server["model"]
    prompt = [int(t) for t in ix.encode("abcab")]
    good_events, bad_events = [], []
    good = Sequence(prompt, Sampling(max_tokens=20, temperature=0), good_events.append)
    bad = Sequence(prompt, Sampling(max_tokens=20, top_k=-1), bad_events.append)  # topk raises
    engine.submit([good, bad])  # admitted together: both active when bad's sampling fails
    deadline = time.time() + 120
    while not (good.done and bad.done) and time.time() < deadline:
        time.sleep(0.05)
    assert good_events[-1].finish == "length"
    assert ix.decode([e.token for e in good_events]) == greedy(model, ix, "abcab", 20)
    assert bad_events[-1].finish == "error" and "out of range" in bad_events[-1].error


def test_prompts_times_n_is_limited(server):
    port = server["port"]
    for body in (
        {"prompt": ["a"] * (MAX_SEQUENCES + 1)},
        {"prompt": ["a"] * 5, "n": 8},
        {"prompt": ["a"] * 50_000, "n": 2, "max_tokens": 1},  # the report's 100,000 sequences
    ):
        code, answer = request(port, "POST", "/v1/completions", body)
        assert code == 400 and answer["error"]["param"] == "prompt", answer
        assert f"the limit is {MAX_SEQUENCES}" in answer["error"]["message"]
    assert metric(port, "teralm_queue_depth") == 0
    code, answer = request(port, "POST", "/v1/completions", {"prompt": ["a"] * 4, "n": 8})
    assert code == 200 and len(answer["choices"]) == MAX_SEQUENCES


def test_a_large_request_does_not_hold_back_a_small_one(server):
    port = server["port"]
    large = running(port, {"prompt": ["ab"] * 16, "n": 2, "max_tokens": 400})
    code, answer = request(port, "POST", "/v1/completions", {"prompt": "cd", "max_tokens": 1})
    assert code == 200, answer
    # the small request did not wait for all 32 sequences of the large one to get their turn
    assert metric(port, "teralm_queue_depth") > 0
    hang_up(large)
    wait_until_idle(port)


def test_a_small_request_beside_a_large_one_takes_about_as_long_as_alone(server):
    """While a large request would fill the batch for hundreds of steps, a 16-token request
    gets its place at once: its latency (the median of five) stays within 3x its latency
    alone, with or without drafts."""
    port = server["port"]

    def latency() -> float:
        began = time.perf_counter()
        code, answer = request(port, "POST", "/v1/completions", small)
        assert code == 200 and answer["usage"]["completion_tokens"] == 16, answer
        return time.perf_counter() - began

    small = {"prompt": "cd", "max_tokens": 16, "temperature": 0.8}
    alone = sorted(latency() for _ in range(5))[2]
    large = running(port, {"prompt": ["ab", "ba"] * 4, "n": 4, "max_tokens": 400})
    beside = sorted(latency() for _ in range(5))[2]
    hang_up(large)
    wait_until_idle(port)
    assert beside < 3 * alone, (beside, alone)


def closed_by_server(sock: socket.socket, trickle: bytes, seconds: float = 30) -> bool:
    """Send ``trickle`` a byte every 0.2 s (then nothing): whether the server closes the
    connection within ``seconds``."""
    sock.settimeout(0.2)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if sock.recv(1) == b"":
                return True
        except TimeoutError:
            pass
        except ConnectionResetError:
            return True
        if trickle:
            with contextlib.suppress(OSError):
                sock.send(trickle[:1])
            trickle = trickle[1:]
    return False


@pytest.mark.parametrize("trickle", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x" * 20])
def test_idle_and_slow_header_sockets_are_closed(server, trickle):
    """A socket that sends no request, or sends its headers a byte at a time, is closed once
    the header deadline passes; a request within it is answered as usual."""
    with socket.create_connection(("127.0.0.1", server["port"])) as sock:
        began = time.monotonic()
        assert closed_by_server(sock, trickle)
        assert time.monotonic() - began >= HEADER_TIMEOUT * 0.9
    assert request(server["port"], "GET", "/health", key=None)[0] == 200


def test_a_chunked_body_over_the_limit_is_refused_as_it_arrives(server):
    body = json.dumps({"prompt": "ab", "max_tokens": 1, "padding": "x" * (2 << 20)}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=60)
    conn.request(
        "POST",
        "/v1/completions",
        body=(body[i : i + 65536] for i in range(0, len(body), 65536)),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
        encode_chunked=True,
    )
    response = conn.getresponse()
    answer = json.loads(response.read())
    assert response.status == 413 and "over 1048576 bytes" in answer["error"]["message"]


def count(port: int, code: str) -> float:
    """Responses counted with status ``code`` by /metrics (0 before the first)."""
    _, text = request(port, "GET", "/metrics")
    name = f'teralm_requests_total{{code="{code}"}}'
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_a_client_that_leaves_before_a_whole_answer_stops_its_generation(server):
    port = server["port"]
    before = metric(port, "teralm_generated_tokens_total")
    left = count(port, "499")
    asked = {"prompt": ["ab"] * 8, "n": 4, "max_tokens": 400}  # 32 sequences of 400 tokens
    payload = json.dumps(asked).encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        deadline = time.time() + 60
        while metric(port, "teralm_active_sequences") == 0 and time.time() < deadline:
            time.sleep(0.05)
        assert metric(port, "teralm_active_sequences") > 0
    wait_until_idle(port)
    assert metric(port, "teralm_generated_tokens_total") - before < 32 * 400
    deadline = time.time() + 30  # counted as the client's hang-up, not as an answer
    while time.time() < deadline and count(port, "499") == left:
        time.sleep(0.05)
    assert count(port, "499") == left + 1


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
        ("/v1/completions", {"prompt": ["ab", "\udfff"]}, "prompt"),
        ("/v1/completions", {"prompt": "ab", "stop": ["\ud800"]}, "stop"),
        ("/v1/completions", {"prompt": "ab", "model": "\ud800"}, "model"),
        ("/v1/completions", {"prompt": "ab", "seed": 2**70}, "seed"),
        ("/v1/completions", {"prompt": "ab", "seed": 2**70, "stream": True}, "seed"),
        ("/v1/completions", {"prompt": "ab", "seed": -(2**63) - 1}, "seed"),
        ("/v1/lookup", {"text": "a\ud800"}, "text"),
    ],
)
def test_input_that_is_not_valid_is_a_400(server, path, body, param):
    code, answer = request(server["port"], "POST", path, body)
    assert code == 400, answer
    assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["param"] == param


def test_the_largest_seeds_work(server):
    for seed in (2**63 - 1, -(2**63)):
        body = {"prompt": ["ab", "cd"], "max_tokens": 3, "seed": seed, "n": 2}
        assert request(server["port"], "POST", "/v1/completions", body)[0] == 200


def test_a_failing_model_is_a_server_error_and_a_stream_says_so(broken):
    port = broken["port"]
    code, answer = request(port, "POST", "/v1/completions", {"prompt": "ab", "max_tokens": 5})
    assert code == 500 and answer["error"]["type"] == "server_error"
    assert answer["error"]["message"].startswith("generation failed")
    streamed = events(open_stream(port, {"prompt": "ab", "max_tokens": 5, "n": 2}).stream)
    assert "[DONE]" not in streamed
    assert streamed[-1]["error"]["type"] == "server_error"
    assert all(e["choices"][0]["finish_reason"] is None for e in streamed[:-1])


def test_a_body_that_is_not_json_is_named_so(server):
    code, answer = request(server["port"], "POST", "/v1/completions", raw=b'{"prompt": "ab",')
    assert code == 400 and answer["error"]["param"] is None
    assert "not valid JSON" in answer["error"]["message"]


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer"])
def test_the_bearer_scheme_is_case_insensitive(server, scheme):  # RFC 7235
    headers = {"Authorization": f"{scheme} {KEY}"}
    assert request(server["port"], "GET", "/v1/models", key=None, headers=headers)[0] == 200


def test_a_405_says_which_methods_are_allowed(server):
    conn = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=60)
    conn.request("PUT", "/v1/completions", headers={"Authorization": f"Bearer {KEY}"})
    response = conn.getresponse()
    assert response.status == 405 and response.getheader("Allow") == "POST"


def test_the_openapi_document_shows_what_the_server_sends(server):
    _, document = request(server["port"], "GET", "/openapi.json")
    for path, operations in document["paths"].items():
        for operation in operations.values():
            assert "422" not in operation["responses"], path
            for errors in ("4XX", "5XX"):
                assert list(operation["responses"][errors]["content"]) == ["application/json"]
    metrics = document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    completion = document["paths"]["/v1/completions"]["post"]
    sent = completion["responses"]["200"]["content"]["application/json"]["schema"]
    assert sent == {"$ref": "#/components/schemas/Completion"}
    assert document["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert completion["security"] == [{"HTTPBearer": []}]
    assert "security" not in document["paths"]["/health"]["get"]


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--api-key", ""], "--api-key is empty"),
        (["--api-key", "env"], "TERALM_API_KEY"),
        (["--max-tokens", "-5"], "--max-tokens: -5 is not above 0"),
        (["--max-sequences", "0"], "--max-sequences: 0 is not above 0"),
        (["--max-batch", "0"], "--max-batch: 0 is not above 0"),
        (["--timeout", "0"], "--timeout: 0 is not above 0"),
        (["--index-memory", "lots"], "--index-memory 'lots' is not a size such as 2G"),
        (["--index-memory=-1G"], "--index-memory '-1G' must be more than 0"),
    ],
)
def test_serve_refuses_bad_flags_at_start(tmp_path, flags, words):
    refused = subprocess.run(
        [sys.executable, "-m", "teralm.cli", "serve", "--index", "none", "--run", "none", *flags],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "TERALM_API_KEY": ""},
    )
    assert refused.returncode != 0 and words in refused.stderr, refused.stderr
