"""API tokens, their roles, one-time login links, the audit log and the installation's shared secrets.

A token is random (256 bits), shown once and stored only as its SHA-256 (nothing to brute-force, so a fast
hash is enough); a login link's code likewise. Revoking a token ends its API access and its browser sessions
at once; an expired token is refused like a revoked one.

Everything here lives in the store, nothing in a process or in ``COLLAGE_HOME``: a login link made through one web
replica logs a browser in on another, a session started on one is live on every one, logging out on one ends it
on all of them (docs/scaling.md, Web replicas).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import queue
import secrets
import threading
import time
from concurrent.futures import Future
from datetime import datetime, timedelta, timezone
from enum import Enum

from sqlalchemy import delete, or_, select, update
from sqlalchemy.engine import Engine
from sqlmodel import Session, col

from collage.app.store.engine import engine_for, session_scope
from collage.app.store.errors import StoreError
from collage.app.store.tables import ApiToken, AuditEntry, InstallationSecret, LoginLink, WebSession, table_of, utcnow

from .sql import changed_rows, dialect_insert

log = logging.getLogger("collage.auth")

PREFIX = "clg_"
LINK_LIFETIME = timedelta(minutes=10)


class TokenRole(str, Enum):
    ADMIN = "admin"  # manages tokens, changes any run
    MEMBER = "member"  # creates runs, reads all runs, cancels/resumes/deletes only its own

    def __str__(self) -> str:
        return self.value


class TokenError(StoreError):
    pass


def hash_secret(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def _aware(value: datetime | None) -> datetime | None:
    # SQLite hands datetimes back naive; every stored time is UTC
    return value.replace(tzinfo=timezone.utc) if value is not None and value.tzinfo is None else value


def usable(token: ApiToken | None, now: datetime | None = None) -> bool:
    if token is None or token.revoked:
        return False
    expires = _aware(token.expires_at)
    return expires is None or expires > (now or utcnow())


def audit(session: Session, actor: str, action: str, target: str, detail: str | None = None) -> None:
    session.add(AuditEntry(actor=actor, action=action, target=target[:200], detail=detail))


def audit_entries(session: Session, limit: int) -> list[AuditEntry]:
    """The newest ``limit`` entries of the audit log, newest first."""
    return list(session.scalars(select(AuditEntry).order_by(col(AuditEntry.id).desc()).limit(limit)).all())


def create_token(
    engine: Engine,
    name: str,
    role: TokenRole | str = TokenRole.MEMBER,
    expires_days: float | None = None,
    actor: str = "cli",
) -> str:
    """A new token, returned once. Names are unique among tokens that are not revoked (revoke goes by name)."""
    role = TokenRole(role)
    name = name.strip()
    if not name or len(name) > 100:
        raise TokenError("a token name must be 1 to 100 characters")
    if expires_days is not None and not 0 < expires_days <= 3650:
        raise TokenError("--expires must be between 0 and 3650 days")
    token = PREFIX + secrets.token_urlsafe(32)
    expires = utcnow() + timedelta(days=expires_days) if expires_days is not None else None
    with session_scope(engine) as session:
        taken = session.scalars(
            select(col(ApiToken.id)).where(col(ApiToken.name) == name, col(ApiToken.revoked).is_(False))
        ).first()
        if taken is not None:
            raise TokenError(f"a token named {name!r} already exists: revoke it first or choose another name")
        session.add(
            ApiToken(name=name, token_hash=hash_secret(token), prefix=token[:10], role=role.value, expires_at=expires)
        )
        audit(
            session, actor, "token.create", name, f"role {role}" + (f", expires {expires:%Y-%m-%d}" if expires else "")
        )
    return token


def verify_token(engine: Engine, token: str) -> ApiToken | None:
    """The live token of this secret, or None. A read and nothing else: ``last_used_at`` is noted off the request's
    path (:func:`note_use`), so a store that is locked for writing still answers reads."""
    digest = hash_secret(token)
    with Session(engine, expire_on_commit=False) as session:
        found = session.scalars(select(ApiToken).where(col(ApiToken.token_hash) == digest)).first()
    if found is None or not hmac.compare_digest(found.token_hash, digest) or not usable(found):
        return None
    note_use(engine, found)
    return found


USE_RESOLUTION = timedelta(minutes=1)  # last_used_at is written at most this often per token
USE_LOCK_TIMEOUT = 0.25  # seconds a note waits for a lock, then is skipped
_use_lock = threading.Lock()
_use_noted: dict[tuple[int, str], float] = {}  # (engine, token hash) -> monotonic time of this process's last note
_use_queue: queue.SimpleQueue[tuple[Future[None], Engine, int, datetime]] = queue.SimpleQueue()
_use_thread: threading.Thread | None = None


def note_use(engine: Engine, token: ApiToken) -> Future[None] | None:
    """Record that ``token`` was used, at most once a minute, best effort: on a background thread, waiting at most
    :data:`USE_LOCK_TIMEOUT` s for a lock; a failure is logged and forgotten. Never delays or fails a request.
    Returns the pending write (tests wait for it), or None when none was needed."""
    assert token.id is not None
    now = utcnow()
    last = _aware(token.last_used_at)
    if last is not None and now - last < USE_RESOLUTION:
        return None
    key = (id(engine), token.token_hash)  # not the id: a store emptied and filled again reuses ids
    with _use_lock:
        noted = _use_noted.get(key)
        if noted is not None and time.monotonic() - noted < USE_RESOLUTION.total_seconds():
            return None
        _use_noted[key] = time.monotonic()
        global _use_thread
        if _use_thread is None or not _use_thread.is_alive():
            # a daemon: a note still pending when the process exits is simply not written
            _use_thread = threading.Thread(target=_use_writer, name="collage-token-use", daemon=True)
            _use_thread.start()
    done: Future[None] = Future()
    _use_queue.put((done, engine, token.id, now))
    return done


def _use_writer() -> None:
    while True:
        done, engine, token_id, now = _use_queue.get()
        _write_use(engine, token_id, now)
        done.set_result(None)


def _write_use(engine: Engine, token_id: int, now: datetime) -> None:
    try:
        # an engine of the same store whose statements wait at most USE_LOCK_TIMEOUT for a lock (SQLite's busy
        # timeout, PostgreSQL's lock_timeout); this thread holds at most one of its connections
        quick = engine_for(engine.url.render_as_string(hide_password=False), USE_LOCK_TIMEOUT)
        with session_scope(quick) as session:
            session.execute(
                update(ApiToken)
                .where(
                    col(ApiToken.id) == token_id,
                    or_(col(ApiToken.last_used_at).is_(None), col(ApiToken.last_used_at) < now - USE_RESOLUTION),
                )
                .values(last_used_at=now)
            )
    except Exception:  # a lost "last used" time must never matter: logged; the next use after a minute tries again
        log.warning("could not note the use of token %s (the store is busy): skipped", token_id, exc_info=True)


def active_token(engine: Engine, token_id: int) -> ApiToken | None:
    with Session(engine, expire_on_commit=False) as session:
        found = session.get(ApiToken, token_id)
    return found if usable(found) else None


def list_tokens(engine: Engine) -> list[ApiToken]:
    with Session(engine, expire_on_commit=False) as session:
        return list(session.scalars(select(ApiToken).order_by(col(ApiToken.created_at), col(ApiToken.id))))


def revoke_token(engine: Engine, name: str, actor: str = "cli") -> int:
    """Revoke every live token of that name; its sessions and unused login links end with it."""
    with session_scope(engine) as session:
        ids = list(
            session.scalars(
                select(col(ApiToken.id)).where(col(ApiToken.name) == name, col(ApiToken.revoked).is_(False))
            )
        )
        if not ids:
            raise TokenError(f"no live token named {name!r} (`collage token list` shows them)")
        session.execute(update(ApiToken).where(col(ApiToken.id).in_(ids)).values(revoked=True))
        session.execute(delete(WebSession).where(col(WebSession.token_id).in_(ids)))
        session.execute(delete(LoginLink).where(col(LoginLink.token_id).in_(ids)))
        audit(session, actor, "token.revoke", name)
    return len(ids)


def create_login_link(engine: Engine, name: str, actor: str = "cli") -> str:
    """A one-time code (single use, :data:`LINK_LIFETIME`) that logs a browser in as token ``name``."""
    with session_scope(engine) as session:
        token = session.scalars(
            select(ApiToken).where(col(ApiToken.name) == name, col(ApiToken.revoked).is_(False))
        ).first()
        if not usable(token):
            raise TokenError(f"no live token named {name!r} (`collage token list` shows them)")
        assert token is not None and token.id is not None
        code = secrets.token_urlsafe(32)
        session.add(LoginLink(code_hash=hash_secret(code), token_id=token.id, expires_at=utcnow() + LINK_LIFETIME))
        audit(session, actor, "token.link", name)
    return code


def consume_login_link(engine: Engine, code: str) -> ApiToken | None:
    """The token a login code stands for, once: a used, expired or unknown code gives ``None``."""
    now = utcnow()
    with session_scope(engine) as session:
        digest = hash_secret(code)
        link = session.get(LoginLink, digest)
        if link is None or link.used_at is not None or _aware(link.expires_at) <= now:  # type: ignore[operator]
            return None
        # conditional: of two browsers racing for one link, exactly one wins
        won = changed_rows(
            session,
            update(LoginLink)
            .where(col(LoginLink.code_hash) == digest, col(LoginLink.used_at).is_(None))
            .values(used_at=now),
        )
        if not won:
            return None
        token = session.get(ApiToken, link.token_id)
    return token if usable(token) else None


SIGNING_SECRET = "signing"  # the key that signs the API's pagination cursors (HMAC)


def installation_secret(engine: Engine, name: str = SIGNING_SECRET) -> str:
    """The installation's secret ``name``, the same for every process of the store: made by the first process that
    asks (an insert that does nothing when another process's insert came first, then a read of the row that won),
    so replicas starting at the same moment agree. Kept in the store, not in ``COLLAGE_HOME``: web replicas on
    machines of their own share the database and nothing else."""
    with Session(engine) as session:
        found = session.get(InstallationSecret, name)
        if found is not None:
            return found.value
    with session_scope(engine) as session:
        row = {"name": name, "value": secrets.token_urlsafe(48), "created_at": utcnow()}
        insert = dialect_insert(session, table_of(InstallationSecret)).on_conflict_do_nothing(index_elements=["name"])
        session.execute(insert, [row])
        # read in the same transaction: on PostgreSQL an insert that met a concurrent one waited for its commit,
        # and each statement of a READ COMMITTED transaction sees what was committed before it began
        value = session.scalar(select(col(InstallationSecret.value)).where(col(InstallationSecret.name) == name))
    assert value is not None
    return value
