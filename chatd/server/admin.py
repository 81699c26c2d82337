"""Session admin API: list, inspect, evict, restore, delete, stats. Bearer admin token on every route."""

from __future__ import annotations

import hmac
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from pydantic import BaseModel

from chatd.core import Chatd
from chatd.domain import Tier
from chatd.errors import NotFound, Unauthorized
from chatd.protocol import Message, SessionInfo
from chatd.sessions import to_message
from chatd.store.repo import SessionRecord


def _core(request: Request) -> Chatd:
    core: Chatd = request.app.state.core
    return core


def require_admin(request: Request) -> None:
    expected: str = request.app.state.admin_token
    header = request.headers.get("authorization", "")
    token = header[7:].strip() if header.lower().startswith("bearer ") else ""
    if not token or not hmac.compare_digest(token.encode(), expected.encode()):
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


async def _admin_session(core: Chatd, record: SessionRecord) -> AdminSession:
    snapshot = await core.snapshots.record(record.session_id)
    tier: Tier = "device" if core.kv.is_resident(record.session_id) else ("disk" if snapshot else "none")
    info = await core.sessions.session_info(record, tier)
    return AdminSession(**info.model_dump(), kv_bytes=core.kv.kv_bytes(record.session_id),
                        snapshot_bytes=snapshot.file_bytes if snapshot else 0, last_active=record.updated_at,
                        generating=core.sessions.is_generating(record.session_id))


@router.get("/sessions", response_model=SessionPage)
async def list_sessions(core: CoreDep, tier: Tier | None = None,
                        limit: Annotated[int, Query(ge=1, le=500)] = 50,
                        offset: Annotated[int, Query(ge=0)] = 0) -> SessionPage:
    """Sessions, most recently active first; ``tier`` filters by where their cache is now."""
    ids: list[str] | None = None
    if tier is not None:
        resident = set(core.kv.resident_ids())
        on_disk = set(core.snapshots.records()) - resident
        if tier == "device":
            ids = sorted(resident)
        elif tier == "disk":
            ids = sorted(on_disk)
        elif tier == "none":
            ids = [s for s in await core.repo.all_session_ids() if s not in resident and s not in on_disk]
        else:
            ids = []
    records = await core.repo.list_sessions(limit=limit, offset=offset, session_ids=ids)
    total = await core.repo.count_sessions(ids)
    return SessionPage(sessions=[await _admin_session(core, r) for r in records], total=total, limit=limit,
                       offset=offset)


@router.get("/sessions/{session_id}", response_model=SessionDetail)
async def get_session(session_id: str, core: CoreDep) -> SessionDetail:
    record = await core.repo.get_session(session_id)
    if record is None:
        raise NotFound("no such session")
    template = core.sessions.template
    messages = []
    position = 0
    for m in await core.repo.get_messages(session_id):
        start, end = template.content_span(m.role, m.index, m.token_ids)
        messages.append(MessageDetail(
            **to_message(m, with_usage=True).model_dump(), num_tokens=len(m.token_ids),
            token_span=(position, position + len(m.token_ids)), content_span=(position + start, position + end)))
        position += len(m.token_ids)
    base = await _admin_session(core, record)
    return SessionDetail(**base.model_dump(), messages=messages,
                         cached_tokens=len(core.kv.cached_ids(session_id) or []))


@router.post("/sessions/{session_id}/evict", response_model=ActionResult)
async def evict_session(session_id: str, core: CoreDep) -> ActionResult:
    """Snapshot the session's cache to disk now and free its memory (409 while it generates)."""
    done = await core.sessions.evict(session_id)
    return ActionResult(session_id=session_id, done=done, tier=await core.sessions.tier_of(session_id))


@router.post("/sessions/{session_id}/restore", response_model=ActionResult)
async def restore_session(session_id: str, core: CoreDep) -> ActionResult:
    """Load the session's cache now (from its snapshot, or recomputed when there is none)."""
    tier = await core.sessions.restore(session_id)
    return ActionResult(session_id=session_id, done=tier == "device", tier=await core.sessions.tier_of(session_id))


@router.delete("/sessions/{session_id}", status_code=204)
async def delete_session(session_id: str, core: CoreDep) -> Response:
    """Delete the session, its messages, edit history and snapshot."""
    if not await core.sessions.delete(session_id):
        raise NotFound("no such session")
    return Response(status_code=204)


@router.get("/stats")
async def stats(core: CoreDep) -> dict[str, Any]:
    kv, snaps, svc = core.kv, core.snapshots, core.sessions
    resident = set(kv.resident_ids())
    on_disk = set(snaps.records()) - resident
    total_sessions = await core.repo.count_sessions()
    prompt_tokens = svc.num_cached_tokens + svc.num_prefill_tokens
    restore_s = kv.stats.restore_seconds
    return {
        "model": {"name": core.runner.info.name, "dtype": core.runner.info.dtype_name,
                  "device": str(core.runner.info.device), "max_context": core.runner.info.max_context,
                  "kv_bytes_per_token": core.runner.info.bytes_per_token},
        "tiers": {
            "device": {"budget_bytes": kv.budget_bytes, "used_bytes": kv.resident_bytes, "sessions": len(resident)},
            "disk": {"budget_bytes": snaps.disk_budget_bytes, "used_bytes": snaps.disk_bytes,
                     "sessions": len(on_disk)},
        },
        "sessions": {"total": total_sessions, "resident": len(resident), "evicted": len(on_disk),
                     "generating": svc.num_generating},
        "turns": svc.num_turns,
        "cached_tokens": svc.num_cached_tokens,
        "prefilled_tokens": svc.num_prefill_tokens,
        "cached_token_ratio": round(svc.num_cached_tokens / prompt_tokens, 4) if prompt_tokens else 0.0,
        "evictions": kv.stats.evictions,
        "evictions_idle": kv.stats.evictions_idle,
        "evictions_for_room": kv.stats.evictions_for_room,
        "restores": kv.stats.restores,
        "restore_failures": kv.stats.restore_failures,
        "restore_ms_mean": round(1000 * sum(restore_s) / len(restore_s), 2) if restore_s else None,
        "snapshot_writes": kv.stats.snapshot_writes,
        "snapshot_write_failures": kv.stats.snapshot_write_failures,
        "snapshot_bytes_written": snaps.bytes_written,
        "snapshots_deleted_for_disk_budget": snaps.num_deleted_for_budget,
        "engine": {"decode_steps": core.worker.num_decode_steps, "decoded_tokens": core.worker.num_decode_tokens,
                   "prefilled_tokens": core.worker.num_prefill_tokens},
    }
