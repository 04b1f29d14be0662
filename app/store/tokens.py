"""API tokens: random, shown once, stored only as a SHA-256 hash, compared in constant time."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import timedelta

from sqlalchemy import select, update
from sqlalchemy.engine import Engine
from sqlmodel import Session

from ..db import session_scope
from ..models import ApiToken, utcnow

PREFIX = "clg_"


def hash_token(token: str) -> str:
    # tokens carry 256 random bits, so a plain (fast) hash is enough: there is nothing to brute-force
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(engine: Engine, name: str) -> str:
    token = PREFIX + secrets.token_urlsafe(32)
    with session_scope(engine) as session:
        session.add(ApiToken(name=name, token_hash=hash_token(token), prefix=token[:10]))
    return token


def verify_token(engine: Engine, token: str) -> ApiToken | None:
    digest = hash_token(token)
    with Session(engine, expire_on_commit=False) as session:
        found = session.scalars(select(ApiToken).where(ApiToken.token_hash == digest)).first()
        if found is None or found.revoked or not hmac.compare_digest(found.token_hash, digest):
            return None
        now = utcnow()
        if found.last_used_at is None or now - found.last_used_at > timedelta(minutes=1):
            session.execute(update(ApiToken).where(ApiToken.id == found.id).values(last_used_at=now))
            session.commit()
        return found
