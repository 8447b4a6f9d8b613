"""A real `teralm serve` on 127.0.0.1, driven by the official openai client and raw HTTP."""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from serving import KEY, free_port, greedy, request, wait_until_up

from teralm.index.tokenizer import ByteTokenizer
from teralm.infer.text import TextStream, token_bytes


@pytest.fixture(scope="module")
def served(tiny_run, tmp_path_factory):
    ix, run = tiny_run["ix"], tiny_run["run"]
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = [
        sys.executable,
        "-m",
        "teralm.cli",
        "serve",
        "--index",
        ix.directory,
        "--run",
        run,
        "--port",
        port,
        "--api-key",
        KEY,
        "--max-tokens",
        200,
        "--timeout",
        60,
    ]
    with open(log, "w") as f:
        proc = subprocess.Popen(list(map(str, cmd)), stdout=f, stderr=subprocess.STDOUT, text=True)
    wait_until_up(port, alive=lambda: proc.poll() is None)
    yield {
        "log": log,
        "port": port,
        "ix": ix,
        "run": run,
        "model": tiny_run["model"],
        "name": f"teralm-{run.name}",
    }
    proc.terminate()
    proc.wait(timeout=30)


def test_start_up_summary_and_a_line_per_request(served):
    """``teralm serve`` says once what it runs with, then logs each response: method, path,
    status, the completion's tokens and the time."""
    got = client(served).completions.create(
        model=served["name"], prompt="abc", max_tokens=7, temperature=0
    )
    assert got.usage.completion_tokens == 7
    code, _ = request(served["port"], "GET", "/v1/models", key="wrong")
    assert code == 401
    deadline = time.monotonic() + 30  # a response's line is written once it has been sent
    while '"GET /v1/models" 401' not in served["log"].read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    log = served["log"].read_text()
    head = log.split("\n  address ")[0]
    for words in (
        f"teralm serve: {served['name']}",
        "M parameters, ",
        "torch threads",
        f"{served['ix'].num_tokens:,} tokens (bytes); in memory: nothing",
        "prompts of 4,096 tokens, completions of 200",
    ):
        assert words in head, (words, head)
    assert f"http://127.0.0.1:{served['port']} (API key required on /v1)" in log
    lines = log.splitlines()
    assert any('"POST /v1/completions" 200 prompt 3 completion 7 ' in line for line in lines), log
    assert any('"GET /v1/models" 401 ' in line for line in lines), log


def client(served):
    from openai import OpenAI

    return OpenAI(base_url=f"http://127.0.0.1:{served['port']}/v1", api_key=KEY, max_retries=0)


def reference(served, prompt: str, n: int) -> str:
    return greedy(served["model"], served["ix"], prompt, n)


def test_openai_client_completion_equals_local_greedy(served):
    got = client(served).completions.create(
        model=served["name"], prompt="abcab", max_tokens=30, temperature=0
    )
    assert got.choices[0].text == reference(served, "abcab", 30)
    assert got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == 5 and got.usage.completion_tokens == 30
    # long enough to run past max_seq_len (48): the context shifts and generation goes on
    longer = client(served).completions.create(
        model=served["name"], prompt="e" * 40, max_tokens=60, temperature=0
    )
    assert len(longer.choices[0].text) == 60


def test_streaming_equals_the_whole_answer(served):
    c = client(served)
    chunks = list(
        c.completions.create(
            model=served["name"], prompt="dd", max_tokens=25, temperature=0, stream=True
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == reference(served, "dd", 25)
    assert chunks[-1].choices[0].finish_reason == "length"
    with_usage = list(
        c.completions.create(
            model=served["name"], prompt="dd", max_tokens=25, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert not with_usage[-1].choices and with_usage[-1].usage.completion_tokens == 25
    assert with_usage[-1].usage.prompt_tokens == 2 and with_usage[-2].choices[0].finish_reason


def test_chat_completions_say_to_use_completions(served):
    import openai

    with pytest.raises(openai.NotFoundError, match="base model.*/v1/completions"):
        client(served).chat.completions.create(
            model=served["name"], messages=[{"role": "user", "content": "hi"}]
        )


def test_echo_logprobs_score_the_prompt(served):
    ix, model = served["ix"], served["model"]
    prompt = "abcdeabcde"
    got = client(served).completions.create(
        model=served["name"], prompt=prompt, max_tokens=0, echo=True, logprobs=2
    )
    lp = got.choices[0].logprobs
    assert got.choices[0].text == prompt and lp.tokens == list(prompt)
    tokens = torch.from_numpy(ix.encode(prompt).astype(np.int64))[None]
    from teralm.index.query import OnlineMatcher

    feats = OnlineMatcher(ix).extend(tokens[0].tolist())
    with torch.no_grad():
        logits, gate = model(
            tokens,
            torch.tensor([[f[1] for f in feats]]),
            torch.tensor([[f[0] for f in feats]]),
            with_gate=True,
        )
    p_model = torch.softmax(logits[0].double(), -1).numpy()
    want = []
    for i in range(1, len(prompt)):  # the model mixed with the ∞-gram of the text before i
        p = p_model[i - 1, tokens[0, i]]
        nxt, counts = ix.query.next_token_distribution([tokens[0, :i].numpy()])[0]
        if gate is not None and counts.sum():
            with torch.no_grad():
                logit = model.gate_logit(gate[0, i - 1], torch.tensor(int(counts.sum())))
            g = 1 / (1 + np.exp(-float(logit)))
            share = counts[nxt == int(tokens[0, i])].sum() / counts.sum()
            p = g * p + (1 - g) * share
        want.append(np.log(p))
    assert lp.token_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:], want, atol=1e-4)
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])


def test_stop_n_seed_and_lists_of_prompts(served):
    c = client(served)
    full = reference(served, "ab", 40)
    stop = full[5:7]
    got = c.completions.create(
        model=served["name"], prompt="ab", max_tokens=40, temperature=0, stop=[stop]
    )
    assert (
        got.choices[0].text == full[: full.index(stop)] and got.choices[0].finish_reason == "stop"
    )
    a = c.completions.create(model=served["name"], prompt=["ab", "cd"], max_tokens=12, n=2, seed=7)
    b = c.completions.create(model=served["name"], prompt=["ab", "cd"], max_tokens=12, n=2, seed=7)
    assert [x.text for x in a.choices] == [x.text for x in b.choices]
    assert [x.index for x in a.choices] == [0, 1, 2, 3]


def test_concurrent_clients_all_get_their_answers(served):
    prompts = ["a", "bb", "ccc", "dddd", "abcde", "eeeee", "cab", "bad"]
    results = {}

    def ask(p):
        got = client(served).completions.create(
            model=served["name"], prompt=p, max_tokens=20, temperature=0
        )
        results[p] = got.choices[0].text

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {p: reference(served, p, 20) for p in prompts}


def test_vllm_tokenizer_routes_and_many_stop_strings(served):
    port = served["port"]
    code, info = request(port, "GET", "/tokenizer_info")
    assert code == 200 and info["bos_token"] == "\n" and "eos_token" in info
    text = "abc é日本"  # characters of 2 and 3 bytes
    code, tokenized = request(port, "POST", "/tokenize", {"prompt": text})
    assert code == 200 and tokenized["tokens"] == list(text.encode())
    assert tokenized["count"] == len(text.encode())
    code, detokenized = request(port, "POST", "/detokenize", {"tokens": tokenized["tokens"]})
    assert code == 200 and detokenized["prompt"] == text
    code, answer = request(port, "POST", "/detokenize", {"tokens": [97, 256]})
    assert code == 400 and answer["error"]["param"] == "tokens"
    for path in ("/tokenizer_info", "/metrics", "/openapi.json"):  # as vLLM: only /v1 is guarded
        assert request(port, "GET", path, key=None)[0] == 200

    full = reference(served, "ab", 40)
    stops = ["zz", "yy", "xx", "ww", "vv", full[5:7]]  # lm-eval tasks send up to 5
    body = {"prompt": "ab", "max_tokens": 40, "temperature": 0, "stop": stops}
    code, answer = request(port, "POST", "/v1/completions", body)
    assert code == 200 and answer["choices"][0]["text"] == full[: full.index(full[5:7])]
    assert answer["choices"][0]["finish_reason"] == "stop"
    code, answer = request(port, "POST", "/v1/completions", {**body, "stop": ["q"] * 17})
    assert code == 400 and answer["error"]["param"] == "stop"


def test_lm_eval_finds_the_remote_tokenizer(served):
    utils = pytest.importorskip("lm_eval.utils", reason="lm-eval is not installed")
    base_url = f"http://127.0.0.1:{served['port']}/v1/completions"
    assert utils.check_remote_tokenizer_support(base_url, auth_token=KEY)
    tokenizer = utils.RemoteTokenizer(base_url, auth_token=KEY)
    assert tokenizer.eos_token_id is None and tokenizer.bos_token_id == ord("\n")
    assert tokenizer.decode(tokenizer.encode("a é")) == "a é"


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"prompt": "ab", "temperature": 5}, 400, "temperature"),
        ({"prompt": "ab", "max_tokens": 5000}, 400, "max_tokens"),
        ({"prompt": "ab", "n": 100}, 400, "n is at most"),
        ({"prompt": [1, 2, 999]}, 400, "prompt tokens"),
        ({"prompt": "ab", "logprobs": 50}, 400, "logprobs"),
        ({"prompt": "ab", "model": "gpt-4"}, 404, "unknown model"),
        ({"prompt": "ab", "max_tokens": -1}, 400, "max_tokens"),
        ({"prompt": "ab", "stop": ["", "x"]}, 400, "stop"),
        ({"prompt": "ab", "stop": ["x" * 257]}, 400, "stop"),
        ({"prompt": "x" * 5000}, 400, "limit"),
        ({"prompt": {"a": 1}}, 400, "prompt"),
        ({"prompt": "ab", "temperature": float("nan")}, 400, "finite"),
        ({"prompt": "ab", "temperature": "0.5"}, 400, "temperature"),
        ({"prompt": "ab", "max_tokens": "3"}, 400, "max_tokens"),
        ({"prompt": "ab", "echo": "yes"}, 400, "echo"),
        ({"prompt": "ab", "stream": 1}, 400, "stream"),
        ({"prompt": "ab", "logit_bias": {"116": -101}}, 400, "[-100, 100]"),
        ({"prompt": "ab", "logit_bias": {"t": 1}}, 400, "token ids"),
        ({"prompt": "ab", "logit_bias": {"999": 1}}, 400, "logit_bias token ids"),
        ({"prompt": "ab", "best_of": 3}, 400, "best_of"),
        ({"prompt": "ab", "suffix": "cd"}, 400, "suffix"),
    ],
)
def test_bad_requests_get_openai_errors(served, body, status, words):
    code, answer = request(served["port"], "POST", "/v1/completions", body)
    assert code == status, answer
    assert words in answer["error"]["message"] and answer["error"]["type"]


def test_echo_with_stop_strings_searches_only_the_generated_text(served):
    """A stop string inside an echoed prompt ends nothing; text and logprobs agree."""
    port, full = served["port"], reference(served, "hello world", 8)
    body = {"prompt": "hello world", "echo": True, "max_tokens": 8, "temperature": 0}
    code, answer = request(port, "POST", "/v1/completions", {**body, "stop": ["world"]})
    choice = answer["choices"][0]
    assert code == 200 and choice["text"] == "hello world" + full, answer
    assert answer["usage"]["completion_tokens"] == 8
    generated = reference(served, "x", 3)
    stop = "x" + generated[0]  # where prompt and output meet; not in the output alone
    assert stop not in generated
    body = {**body, "prompt": "x", "max_tokens": 3, "logprobs": 0, "stop": [stop]}
    code, answer = request(port, "POST", "/v1/completions", body)
    choice = answer["choices"][0]
    assert code == 200 and choice["text"] == "x" + generated, answer
    assert choice["text"] == "".join(choice["logprobs"]["tokens"])
    assert choice["finish_reason"] == "length"
    stop_in_output = full[3:5]
    code, answer = request(
        port, "POST", "/v1/completions", {**body, "prompt": "hello world", "max_tokens": 8,
                                          "stop": [stop_in_output]}
    )  # fmt: skip
    choice = answer["choices"][0]
    assert choice["text"] == "hello world" + full[: full.index(stop_in_output)]
    assert choice["finish_reason"] == "stop"


def test_logit_bias_bans_and_forces_tokens(served):
    """-100 on the greedy token takes the next best (the reference with that token banned);
    +100 on a token makes every generated token that one; logprobs stay the model's."""
    port, full = served["port"], reference(served, "abcab", 4)
    body = {"prompt": "abcab", "max_tokens": 4, "temperature": 0}
    banned = ord(full[0])
    code, answer = request(
        port, "POST", "/v1/completions", {**body, "logit_bias": {str(banned): -100}}
    )
    assert code == 200 and chr(banned) not in answer["choices"][0]["text"], answer
    code, answer = request(
        port, "POST", "/v1/completions",
        {**body, "temperature": 1.0, "logit_bias": {"122": 100}, "logprobs": 0},
    )  # fmt: skip
    assert code == 200 and answer["choices"][0]["text"] == "zzzz", answer
    assert all(lp < 0 for lp in answer["choices"][0]["logprobs"]["token_logprobs"])


def test_the_index_view_of_a_token_prompt_looks_up_the_tokens_as_given(served):
    """A token-id prompt that is not valid UTF-8 is looked up as its tokens, not re-encoded."""
    port, ix = served["port"], served["ix"]
    prompt = [195, 169, 255]
    body = {"prompt": prompt, "max_tokens": 1, "index": True}
    code, answer = request(port, "POST", "/v1/completions", body)
    assert code == 200, answer
    match = ix.query.longest_match([np.array(prompt)])
    assert answer["index"]["longest_match"]["tokens"] == 3
    assert answer["index"]["longest_match"]["length"] == int(match.length[0])


def test_malformed_oversized_and_unauthorised(served):
    port = served["port"]
    code, answer = request(port, "POST", "/v1/completions", raw=b'{"prompt": "ab",')
    assert code == 400 and "error" in answer
    code, answer = request(port, "POST", "/v1/completions", raw=b"x" * (2 << 20))
    assert code == 413 and "error" in answer
    code, answer = request(port, "POST", "/v1/completions", {"prompt": "ab"}, key=None)
    assert code == 401 and answer["error"]["code"] == "invalid_api_key"
    assert "Authorization: Bearer" in answer["error"]["message"]
    code, answer = request(port, "GET", "/v1/models", key="wrong")
    assert code == 401
    assert request(port, "GET", "/health", key=None)[0] == 200
    code, models = request(port, "GET", "/v1/models")
    assert code == 200 and models["data"][0]["id"] == served["name"]


def test_lookup_metrics_and_disconnect(served):
    port, ix = served["port"], served["ix"]
    text = ix.decode(ix.tokens(40, 60))
    code, answer = request(port, "POST", "/v1/lookup", {"text": text, "top_k": 3})
    match = ix.query.longest_match([ix.encode(text)])
    assert code == 200 and answer["longest_match"]["length"] == int(match.length[0])
    assert answer["longest_match"]["count"] == int(match.count[0])
    assert answer["sources"] and len(answer["continuations"]) <= 3
    body = {"prompt": text, "max_tokens": 2}
    code, answer = request(port, "POST", "/v1/completions", {**body, "index": True})
    assert code == 200 and answer["index"]["longest_match"]["length"] == int(match.length[0])
    assert "index" not in request(port, "POST", "/v1/completions", body)[1]

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = json.dumps({"prompt": "ab", "max_tokens": 200, "stream": True}).encode()
    conn.request(
        "POST",
        "/v1/completions",
        body=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    response = conn.getresponse()
    response.readline()
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.time() + 30
    while time.time() < deadline:
        _, text = request(port, "GET", "/metrics")
        if "teralm_active_sequences 0" in text:
            break
        time.sleep(0.2)
    assert "teralm_active_sequences 0" in text
    assert (
        'teralm_requests_total{code="200"}' in text and "teralm_index_lookup_seconds_total" in text
    )


@pytest.mark.skipif(
    not (shutil.which("chromium") and shutil.which("chromedriver")),
    reason="needs chromium and chromedriver (apt install chromium chromium-driver)",
)
def test_playground_renders_and_streams_in_headless_chromium(served):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    options.binary_location = shutil.which("chromium")
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    try:
        driver.get(f"http://127.0.0.1:{served['port']}/?prompt=abc")
        assert "teralm" in driver.title
        driver.find_element(By.ID, "key").send_keys(KEY)
        driver.find_element(By.ID, "go").click()
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: d.find_element(By.ID, "status").text == "done")
        generated = driver.find_element(By.CSS_SELECTOR, "#output .generated").text
        assert len(generated) > 0
        wait.until(lambda d: "tokens match" in d.find_element(By.ID, "match").text)

        # token by token: the chips and their details are the API's per-token records
        for field, value in (("temperature", "0"), ("max_tokens", "20")):
            driver.find_element(By.ID, field).clear()
            driver.find_element(By.ID, field).send_keys(value)
        driver.find_element(By.ID, "go").click()
        wait.until(lambda d: d.find_element(By.ID, "status").text == "done")
        body = {"prompt": "abc", "max_tokens": 20, "temperature": 0, "index": "tokens"}
        code, answer = request(served["port"], "POST", "/v1/completions", body)
        want = answer["choices"][0]["index_tokens"]
        assert code == 200 and len(want) == 20
        assert driver.execute_script("return views;") == want
        chips = driver.find_elements(By.CSS_SELECTOR, "#tokens .token")
        assert len(chips) == 20
        assert [c.get_attribute("class") == "token taken" for c in chips] == [
            v["proposed"] is not None and v["proposed"]["token"] == v["token"] for v in want
        ]
        chips[2].click()
        details = driver.find_element(By.ID, "token").text
        assert f"token 3: {json.dumps(want[2]['text'])}" in details
        assert f"longest match: {want[2]['match_length']} tokens" in details
    finally:
        driver.quit()


def test_serve_refuses_another_tokenizer_and_loads_fp8_exports(served, tmp_path):
    from conftest import write_jsonl

    from teralm.build_index import BuildConfig, build

    ix = served["ix"]
    run = served["run"]
    docs = [ix.decode(ix.tokens(*ix.document_range(d))) for d in range(ix.num_documents)]
    source = write_jsonl(tmp_path / "docs.jsonl", docs)
    build(
        BuildConfig(source=str(source), out=tmp_path / "bpe", tokenizer="bpe:300", progress=False)
    )
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "teralm.cli",
            "serve",
            "--index",
            str(tmp_path / "bpe"),
            "--run",
            str(run),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 1 and "another tokenizer" in refused.stderr

    export = tmp_path / "fp8"
    assert (
        subprocess.run(
            [sys.executable, "-m", "teralm.cli", "export-fp8", str(run), "--out", str(export)],
            capture_output=True,
            timeout=120,
        ).returncode
        == 0
    )
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "teralm.cli",
            "serve",
            "--index",
            str(ix.directory),
            "--run",
            str(export),
            "--port",
            str(port),
            "--quiet",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until_up(port, 120, alive=lambda: proc.poll() is None)
        code, answer = request(
            port, "POST", "/v1/completions", {"prompt": "ab", "max_tokens": 8}, key=None
        )
        assert code == 200 and answer["usage"]["completion_tokens"] == 8
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "POST /v1/completions" not in err, err  # --quiet: no access log


BYTES = token_bytes(ByteTokenizer())
pieces = st.one_of(st.binary(max_size=4), st.text(max_size=4).map(str.encode))  # split UTF-8


@given(st.lists(pieces, max_size=24).map(b"".join), st.lists(st.text(min_size=1, max_size=3)))
def test_incremental_detokenization_equals_a_full_decode(data, stops):
    full = ByteTokenizer().decode(list(data))
    cuts = [at for at in (full.find(s) for s in stops) if at >= 0]
    stream, out = TextStream(BYTES, stops), []
    for byte in data:
        out.append(stream.push(byte))
        if stream.stopped:
            break
    out.append(stream.finish())
    assert "".join(out) == full[: min(cuts, default=len(full))]
    assert stream.stopped == bool(cuts)


def test_a_byte_level_bpe_decodes_incrementally_as_a_whole():
    from teralm.index.tokenizer import BPETokenizer

    texts = ["naïve café, 日本語 and € signs\n" * 8, "def __init__(self):\n    pass\n" * 8]
    bpe = BPETokenizer.train(texts, 300)
    table = token_bytes(bpe)
    for text in texts:
        tokens = [int(t) for t in bpe.encode(text)]
        assert b"".join(table[t] for t in tokens) == text.encode()
        stream = TextStream(table, [])
        assert "".join(map(stream.push, tokens)) + stream.finish() == bpe.decode(tokens) == text
