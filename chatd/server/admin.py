"""Session admin API: list, inspect, evict, restore, delete, stats. Bearer admin token on every route.

Routes call the core's operations and render what they return; the JSON shapes are the contract in
docs/protocol.md."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel

from chatd.domain import Tier
from chatd.errors import NotFound, Unauthorized
from chatd.protocol import Message, SessionInfo
from chatd.server import wiremap
from chatd.server.security import bearer_matches
from chatd.service.core import MAX_PAGE_LIMIT, MAX_PAGE_OFFSET, Chatd, SessionSummary
from chatd.service.stats import Stats


def _core(request: Request) -> Chatd:
    core: Chatd = request.app.state.core
    return core


ADMIN_BEARER = HTTPBearer(auto_error=False, scheme_name="adminToken",
                          description="the admin token: [server] admin_token, or the one generated into "
                                      "<data_dir>/admin_token")


def require_admin(request: Request,
                  _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(ADMIN_BEARER)]) -> None:
    """401 unless ``Authorization: Bearer <admin token>`` (the bearer scheme also documents it in OpenAPI)."""
    expected: str = request.app.state.admin_token
    if not bearer_matches(request.headers.get("authorization"), expected):
        raise Unauthorized("admin token required (Authorization: Bearer <token>)")


router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)])
CoreDep = Annotated[Chatd, Depends(_core)]


class AdminSession(SessionInfo):
    kv_bytes: int
    snapshot_bytes: int
    last_active: datetime
    generating: bool


class SessionPage(BaseModel):
    sessions: list[AdminSession]
    total: int
    limit: int
    offset: int


class MessageDetail(Message):
    num_tokens: int
    token_span: tuple[int, int]
    """[start, end) of the message's ids in the conversation's ids."""
    content_span: tuple[int, int]
    """[start, end) of the content ids (without the template's header and footer)."""


class SessionDetail(AdminSession):
    messages: list[MessageDetail]
    cached_tokens: int
    """How many leading conversation ids the resident cache holds (0 when not resident)."""


class ActionResult(BaseModel):
    session_id: str
    done: bool
    tier: Tier


def _admin_session(summary: SessionSummary) -> AdminSession:
    return AdminSession(**wiremap.session_info(summary.info).model_dump(), kv_bytes=summary.kv_bytes,
                        snapshot_bytes=summary.snapshot_bytes, last_active=summary.last_active,
                        generating=summary.generating)


@router.get("/sessions", response_model=SessionPage)
async def list_sessions(core: CoreDep, tier: Tier | None = None,
                        limit: Annotated[int, Query(ge=1, le=MAX_PAGE_LIMIT)] = 50,
                        offset: Annotated[int, Query(ge=0, le=MAX_PAGE_OFFSET)] = 0) -> SessionPage:
    """Sessions, most recently active first; ``tier`` filters by where their cache is now."""
    listing = await core.list_sessions(tier, limit=limit, offset=offset)
    return SessionPage(sessions=[_admin_session(s) for s in listing.sessions], total=listing.total, limit=limit,
                       offset=offset)


@router.get("/sessions/{session_id}", response_model=SessionDetail)
async def get_session(session_id: str, core: CoreDep) -> SessionDetail:
    detail = await core.session_detail(session_id)
    messages = [MessageDetail(**wiremap.message(m.message).model_dump(), num_tokens=m.num_tokens,
                              token_span=m.token_span, content_span=m.content_span) for m in detail.messages]
    return SessionDetail(**_admin_session(detail.summary).model_dump(), messages=messages,
                         cached_tokens=detail.cached_tokens)


@router.post("/sessions/{session_id}/evict", response_model=ActionResult)
async def evict_session(session_id: str, core: CoreDep) -> ActionResult:
    """Snapshot the session's cache to disk now and free its memory (409 while it generates)."""
    outcome = await core.evict(session_id)
    return ActionResult(session_id=session_id, done=outcome.done, tier=outcome.tier)


@router.post("/sessions/{session_id}/restore", response_model=ActionResult)
async def restore_session(session_id: str, core: CoreDep) -> ActionResult:
    """Load the session's cache now (from its snapshot, or recomputed when there is none)."""
    outcome = await core.restore(session_id)
    return ActionResult(session_id=session_id, done=outcome.done, tier=outcome.tier)


@router.delete("/sessions/{session_id}", status_code=204)
async def delete_session(session_id: str, core: CoreDep) -> Response:
    """Delete the session, its messages, edit history and snapshot."""
    if not await core.delete(session_id):
        raise NotFound("no such session")
    return Response(status_code=204)


@router.get("/stats")
async def stats(core: CoreDep) -> dict[str, Any]:
    """Budget and use per tier, session counts, turn and cache totals, engine counters."""
    return render_stats(await core.stats())


def render_stats(stats: Stats) -> dict[str, Any]:
    """The JSON of ``GET /admin/stats``."""
    c = stats.counters
    restore_ms_mean = stats.restore_ms_mean
    return {
        "model": {"name": stats.model.name, "dtype": stats.model.dtype, "device": stats.model.device,
                  "max_context": stats.model.max_context, "kv_bytes_per_token": stats.model.kv_bytes_per_token,
                  "weights": stats.model.weights, "cpu_features": list(stats.model.cpu_features),
                  "kernels": stats.model.kernels, "architecture": stats.model.architecture,
                  "parameters": stats.model.parameters, "weights_from": stats.model.weights_from},
        "tiers": {use.tier: {"budget_bytes": use.budget_bytes, "used_bytes": use.used_bytes,
                             "sessions": use.num_sessions} for use in stats.tiers},
        "pool": {"block_size": stats.pool.block_size, "blocks": stats.pool.num_blocks,
                 "used_blocks": stats.pool.used_blocks, "cached_blocks": stats.pool.cached_blocks,
                 "shared_blocks": stats.pool.shared_blocks, "unique_bytes": stats.pool.unique_bytes,
                 "logical_bytes": stats.pool.logical_bytes, "hit_ratio": round(stats.pool.hit_ratio, 4),
                 "populated": stats.pool.populated},
        "sessions": {"total": stats.num_sessions, "resident": stats.tier_use("device").num_sessions,
                     "evicted": stats.tier_use("disk").num_sessions, "generating": stats.num_generating},
        "turns": c.num_turns,
        "cached_tokens": c.num_cached_tokens,
        "prefilled_tokens": c.num_prefill_tokens,
        "cached_token_ratio": round(stats.cached_token_ratio, 4),
        "evictions": c.num_evictions,
        "evictions_idle": c.num_evictions_idle,
        "evictions_for_room": c.num_evictions_for_room,
        "restores": c.num_restores,
        "restore_failures": c.num_restore_failures,
        "restore_ms_mean": round(restore_ms_mean, 2) if restore_ms_mean is not None else None,
        "snapshot_writes": c.num_snapshot_writes,
        "snapshot_write_failures": c.num_snapshot_write_failures,
        "snapshot_bytes_written": c.num_snapshot_bytes_written,
        "snapshots_deleted_for_disk_budget": c.num_snapshots_deleted_for_budget,
        "prefix_shares": c.num_prefix_shares,
        "prefix_shared_tokens": c.num_prefix_shared_tokens,
        "resumes_from_pool": c.num_resumes_from_pool,
        "engine": {"decode_steps": c.num_engine_decode_steps, "decoded_tokens": c.num_engine_decode_tokens,
                   "prefilled_tokens": c.num_engine_prefill_tokens},
    }
