"""(being written for issue 13)"""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter(tags=["workers"])
