"""Reliability suite: schemathesis over chatd's OpenAPI schema, against a real ``chatd serve`` (tiny model).

Every operation in /openapi.json gets generated requests (valid and invalid: ids outside the format, huge
offsets, wrong types), once with the admin token and once without. No answer may be a 5xx; without the
token every /admin answer is 401.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.support import ServerProcess, tiny_model_dir


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path_factory.mktemp("schema"), tiny_model_dir(), generation={"max_tokens": 4})
    proc.start()
    yield proc
    proc.stop()


@pytest.mark.parametrize("with_token", [True, False], ids=["admin-token", "no-token"])
def test_no_generated_request_gets_a_5xx(server: ServerProcess, with_token: bool, long_mode: bool,
                                         figures: Callable[..., None]) -> None:
    schema = schemathesis.openapi.from_url(f"{server.http_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8  # admin routes, health, metrics, the OpenAI API
    headers = server.admin_headers if with_token else {}
    per_operation = 150 if long_mode else 25
    tally: dict[str, Any] = {"requests": 0, "5xx": [], "admin_not_401": []}

    def check(operation: Any) -> None:
        path = operation.path

        @settings(max_examples=per_operation, deadline=None, database=None, derandomize=not long_mode,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def call(case: Any) -> None:
            response = case.call(base_url=server.http_url, headers=headers, timeout=60)
            tally["requests"] += 1
            if response.status_code >= 500:
                tally["5xx"].append((case.method, case.formatted_path, response.status_code, response.text[:200]))
            if not with_token and path.startswith("/admin") and response.status_code != 401:
                tally["admin_not_401"].append((case.method, case.formatted_path, response.status_code))

        call()

    for operation in operations:
        check(operation)
    assert "Traceback" not in server.log_text()
    assert tally["5xx"] == [], tally["5xx"][:5]
    assert tally["admin_not_401"] == [], tally["admin_not_401"][:5]
    assert tally["requests"] >= per_operation * len(operations) // 2
    figures("schemathesis", admin_token=with_token, operations=len(operations), requests=tally["requests"],
            server_errors=len(tally["5xx"]))
