"""Schemathesis fuzzes the running server from its own OpenAPI document: valid and invalid
requests to every route must get no 5xx, and only the statuses, content types and schemas the
document shows."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from serving import KEY, serve_in_thread

from teralm.server.protocol import Limits

AUTH = {"Authorization": f"Bearer {KEY}"}
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def api(tiny_run):
    """A server with small limits, so that every request is quick to answer (max_tokens keeps
    its default: requests without it get past the limits to the engine)."""
    limits = Limits(max_prompt_tokens=64, max_tokens=16, max_n=2, max_sequences=4, timeout_s=30)
    with serve_in_thread(tiny_run["model"], tiny_run["ix"], limits) as served:
        yield schemathesis.openapi.from_url(
            f"http://127.0.0.1:{served['port']}/openapi.json", headers=AUTH
        )


@pytest.mark.parametrize("mode", list(GenerationMode))
def test_fuzzed_requests_get_documented_answers(api, mode):
    @given(case=api.as_strategy(mode))
    @settings(
        max_examples=100,
        deadline=None,
        derandomize=True,  # the same requests on every run
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def answered_as_documented(case):
        case.call_and_validate(headers=AUTH, checks=CHECKS, timeout=60)

    answered_as_documented()
