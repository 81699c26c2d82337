"""/docs works offline (its assets come from this server) and the OpenAPI document tells the truth: chatd's
400 error body instead of FastAPI's 422, and bearer schemes on the routes that need a token."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from chatd import config
from chatd.engine.model.runner import ModelRunner
from chatd.server.app import create_app


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path, tiny_runner: ModelRunner) -> Iterator[TestClient]:
    settings = config.load(env={}, overrides={
        "data_dir": str(tmp_path_factory.mktemp("docs")), "model": {"source": str(tiny_dir)},
        "cache": {"persist_idle_s": 0, "idle_evict_s": 0},
        "server": {"allowed_hosts": ["testserver"], "admin_token": "t"}})
    with TestClient(create_app(settings, runner=tiny_runner)) as client:
        yield client


def test_docs_page_loads_its_assets_from_this_server(http: TestClient) -> None:
    page = http.get("/docs")
    assert page.status_code == 200
    assert "cdn" not in page.text.lower() and "https://" not in page.text.split("<body>")[0]
    for asset in ("/docs/assets/swagger-ui-bundle.js", "/docs/assets/swagger-ui.css"):
        assert asset in page.text
        answer = http.get(asset)
        assert answer.status_code == 200 and len(answer.content) > 10_000
    assert http.get("/redoc").status_code == 404  # ReDoc needs a CDN: not offered


def _schema(http: TestClient) -> dict[str, Any]:
    schema: dict[str, Any] = http.get("/openapi.json").json()
    return schema


def test_openapi_has_the_real_error_shape(http: TestClient) -> None:
    schema = _schema(http)
    text = str(schema)
    assert "'422'" not in text and "HTTPValidationError" not in text
    listing = schema["paths"]["/admin/sessions"]["get"]["responses"]
    assert listing["400"]["content"]["application/json"]["schema"]["$ref"] == "#/components/schemas/ErrorBody"
    assert "401" in listing and "503" in listing
    chat = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert chat["400"]["content"]["application/json"]["schema"]["$ref"] == "#/components/schemas/OpenAIErrorBody"
    # What the schema promises is what the server sends.
    answer = http.get("/admin/sessions", params={"limit": 0}, headers={"Authorization": "Bearer t"})
    assert answer.status_code == 400
    body = answer.json()
    assert set(body) == {"error"} and set(body["error"]) == set(
        schema["components"]["schemas"]["ErrorDetail"]["properties"])


def test_admin_routes_declare_the_bearer_scheme(http: TestClient) -> None:
    schema = _schema(http)
    schemes = schema["components"]["securitySchemes"]
    assert schemes["adminToken"]["type"] == "http" and schemes["adminToken"]["scheme"] == "bearer"
    for path, operations in schema["paths"].items():
        if path.startswith("/admin/"):
            for operation in operations.values():
                assert operation["security"] == [{"adminToken": []}], path
    assert schema["paths"]["/metrics"]["get"]["security"] == [{"metricsToken": []}]
    assert schema["paths"]["/v1/models"]["get"]["security"] == [{"apiKey": []}]
    # The scheme is what the server checks: the bearer token opens the route.
    assert http.get("/admin/stats").status_code == 401
    assert http.get("/admin/stats", headers={"Authorization": "Bearer t"}).status_code == 200
