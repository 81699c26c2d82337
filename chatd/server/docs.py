"""The API documentation pages and the OpenAPI document, true to what the server does.

* ``/docs`` is Swagger UI 5 (it reads OpenAPI 3.1) with its JS and CSS served from the installed
  ``swagger-ui-bundle-v2`` package (under ``/docs/assets``), so it works without internet; ReDoc (CDN
  only) is not offered.
* The OpenAPI document lists the error answers the server really gives: 400 (not FastAPI's 422) with
  chatd's ``{"error": {"code", "message"}}`` body, or OpenAI's error body under ``/v1``; 401 where a token
  is needed; 503 ``unavailable`` while the server starts.
* Admin routes (and /metrics, /v1) declare a bearer scheme, so "Authorize" on the page lets them be tried.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel

DOCS_PATH = "/docs"
ASSETS_PATH = "/docs/assets"


class ErrorDetail(BaseModel):
    code: str
    """A stable wire code (docs/protocol.md): bad_request, not_found, unauthorized, busy, unavailable, ..."""
    message: str


class ErrorBody(BaseModel):
    """Every chatd error answer outside /v1."""

    error: ErrorDetail


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIErrorBody(BaseModel):
    """Every error answer under /v1, in OpenAI's shape."""

    error: OpenAIErrorDetail


_DESCRIPTIONS = {
    "400": "bad request (a malformed or invalid parameter or body)",
    "401": "a valid bearer token is required",
    "503": "the server is starting (see /readyz) or its engine has stopped",
}


def swagger_assets() -> Path | None:
    """The folder of Swagger UI's files inside the installed ``swagger-ui-bundle-v2`` package; None without it."""
    if importlib.util.find_spec("swagger_ui_bundle") is None:
        return None
    import swagger_ui_bundle  # an optional package: imported only when installed

    path = Path(swagger_ui_bundle.swagger_ui_path)
    return path if (path / "swagger-ui-bundle.js").is_file() else None


def install(app: FastAPI) -> None:
    """Add ``/docs`` (when swagger-ui-bundle-v2 is installed) and the corrected OpenAPI document to ``app``,
    which must have been created with ``docs_url=None, redoc_url=None``."""
    assets = swagger_assets()
    if assets is not None:
        app.mount(ASSETS_PATH, StaticFiles(directory=assets), name="docs-assets")

        @app.get(DOCS_PATH, include_in_schema=False)
        async def swagger_ui() -> HTMLResponse:
            return get_swagger_ui_html(
                openapi_url=app.openapi_url or "/openapi.json", title=f"{app.title} API",
                swagger_js_url=f"{ASSETS_PATH}/swagger-ui-bundle.js", swagger_css_url=f"{ASSETS_PATH}/swagger-ui.css",
                swagger_favicon_url=f"{ASSETS_PATH}/favicon-32x32.png",
                swagger_ui_parameters={"persistAuthorization": True})

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            app.openapi_schema = fix_error_responses(schema)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def fix_error_responses(schema: dict[str, Any]) -> dict[str, Any]:
    """Replace FastAPI's 422 validation answers with the 400 / 401 / 503 answers chatd gives."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in (ErrorBody, OpenAIErrorBody):
        model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(model_schema.pop("$defs", {}))
        components[model.__name__] = model_schema
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for path, operations in schema.get("paths", {}).items():
        body = "OpenAIErrorBody" if path == "/v1" or path.startswith("/v1/") else "ErrorBody"
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            had_validation = responses.pop("422", None) is not None
            codes = ["503"]
            if had_validation or path.startswith("/v1/"):
                codes.append("400")
            if operation.get("security"):
                codes.append("401")
            for code in sorted(codes):
                responses.setdefault(code, {
                    "description": _DESCRIPTIONS[code],
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{body}"}}},
                })
    return schema
