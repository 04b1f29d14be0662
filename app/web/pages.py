"""Server-rendered pages (Jinja2). Each page is a shell; its data comes from the JSON API, called from the
browser with the session cookie and a CSRF header."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated
from urllib.parse import quote

import yaml
from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from collage.app.store.tables import ApiToken, Run

from ..auth import may_change
from ..deps import EngineDep, SessionDep, SettingsDep
from ..store.tokens import consume_login_link, verify_token
from .fields import FormField, form_fields, gpus_default, tool_form
from .session import CSRF_FIELD, csrf_ok, csrf_token, current_session, end_session, finish_page, start_session


def _templates_dir() -> Path:
    import collage.templates  # package data: the pages ship inside the wheel

    return Path(collage.templates.__file__).resolve().parent


TEMPLATES = Jinja2Templates(directory=str(_templates_dir()))

router = APIRouter(include_in_schema=False)


def _user(request: Request) -> ApiToken | None:
    live = current_session(request)
    return live[1] if live is not None else None


def _render(request: Request, template: str, status: int = 200, **context) -> HTMLResponse:
    context.update(request=request, csrf=csrf_token(request), user=_user(request))
    response = TEMPLATES.TemplateResponse(request, template, context, status_code=status)
    finish_page(request, response)
    return response


def _login_redirect(request: Request) -> RedirectResponse:
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return RedirectResponse(f"/login?next={quote(target)}", status_code=303)


def _safe_next(value: str | None) -> str:
    # only local paths: never an open redirect
    return value if value and value.startswith("/") and not value.startswith("//") else "/runs"


@router.get("/login")
def login_page(request: Request, next: str | None = None) -> Response:
    # an API token in the URL (``?token=``) no longer logs in: URLs end up in logs, history and Referer headers
    return _render(request, "login.html", error=None, next=next)


@router.post("/login")
def login(
    request: Request,
    engine: EngineDep,
    token: Annotated[str, Form()] = "",
    csrf_token_field: Annotated[str, Form(alias=CSRF_FIELD)] = "",
    next: Annotated[str, Form()] = "",
) -> Response:
    if not csrf_ok(request, csrf_token_field):
        return _render(request, "login.html", 403, error="The form expired: please try again.", next=next)
    found = verify_token(engine, token.strip()) if token.strip() else None
    if found is None:
        return _render(request, "login.html", 401, error="That API token is not valid.", next=next)
    response = RedirectResponse(_safe_next(next), status_code=303)
    start_session(request, response, found)
    return response


@router.get("/login/link/{code}")
def login_link_page(request: Request, code: str) -> Response:
    """A one-time login link opens a page with one button: the link is spent by the POST, so a link preview
    (chat apps, mail scanners) fetching the URL does not use it up."""
    return _render(request, "login_link.html", error=None, code=code)


@router.post("/login/link/{code}")
def login_link(
    request: Request, code: str, engine: EngineDep, csrf_token_field: Annotated[str, Form(alias=CSRF_FIELD)] = ""
) -> Response:
    if not csrf_ok(request, csrf_token_field):
        return _render(request, "login_link.html", 403, error="The form expired: please try again.", code=code)
    found = consume_login_link(engine, code) if len(code) <= 100 else None
    if found is None:
        return _render(
            request,
            "login_link.html",
            401,
            error="This login link was already used, has expired, or its token was revoked. Ask for a new one "
            "(`collage token link NAME`) or log in with an API token.",
            code=None,
        )
    response = RedirectResponse("/runs", status_code=303)
    start_session(request, response, found)
    return response


@router.post("/logout")
def logout(request: Request, csrf_token_field: Annotated[str, Form(alias=CSRF_FIELD)] = "") -> Response:
    if not csrf_ok(request, csrf_token_field):
        return Response("CSRF check failed", status_code=403)
    response = RedirectResponse("/login", status_code=303)
    end_session(request, response)  # the session row is deleted: the old cookie is worthless from now on
    return response


@router.get("/")
def home(request: Request) -> Response:
    return RedirectResponse("/runs", status_code=303)


@router.get("/runs")
def runs_page(request: Request) -> Response:
    if _user(request) is None:
        return _login_redirect(request)
    return _render(request, "runs.html", page="runs")


@router.get("/launch")
def launch_page(request: Request, engine: EngineDep, settings: SettingsDep, clone: str | None = None) -> Response:
    if _user(request) is None:
        return _login_redirect(request)
    from collage.app.datasets.client import warm_up
    from collage.app.store.workers import live_workers

    from ..routers.workers import live_within

    warm_up()  # the dataset helper imports the training stack now, not when *Preview and check* is pressed
    try:
        workers = live_workers(engine, within=live_within(settings))
    except Exception:  # noqa: BLE001 - the store is briefly unavailable: the schema's default
        workers = []
    fields = form_fields(gpus=gpus_default(workers))
    sections: dict[str, list[FormField]] = {}
    for field in fields:
        sections.setdefault(field.section, []).append(field)
    return _render(request, "launch.html", page="launch", sections=sections, clone=clone or "",
                   tools=tool_form(settings.tool_modules))  # fmt: skip


@router.get("/runs/{run_id}")
def run_page(request: Request, run_id: str, session: SessionDep) -> Response:
    user = _user(request)
    if user is None:
        return _login_redirect(request)
    run = session.get(Run, run_id) if len(run_id) <= 32 else None
    if run is None:
        return _render(request, "error.html", 404, message=f"No run with id {run_id}.")
    parent = session.get(Run, run.parent_id) if run.parent_id else None
    creator = session.get(ApiToken, run.created_by) if run.created_by is not None else None
    config_yaml = yaml.safe_dump(run.config, sort_keys=False)
    # what this user may do to the run, decided as the API decides it: the buttons it may not use are disabled
    # with the reason shown, instead of failing after the confirmation
    mine = may_change(user, run)
    who = f"{creator.name} (who created it) or an admin" if creator is not None else "an admin"
    refusal = None if mine else f"Only {who} can cancel, resume, delete or edit this run. You can clone it."
    return _render(request, "run.html", page="runs", run=run, config_yaml=config_yaml, parent=parent,
                   may_change=mine, refusal=refusal)  # fmt: skip


@router.get("/runs/{run_id}/rollouts")
def rollouts_page(request: Request, run_id: str, session: SessionDep) -> Response:
    if _user(request) is None:
        return _login_redirect(request)
    run = session.get(Run, run_id) if len(run_id) <= 32 else None
    if run is None:
        return _render(request, "error.html", 404, message=f"No run with id {run_id}.")
    from ..store.queries import reward_names

    return _render(request, "rollouts.html", page="runs", run=run, reward_names=reward_names(run.config))


@router.get("/workers")
def workers_page(request: Request) -> Response:
    if _user(request) is None:
        return _login_redirect(request)
    return _render(request, "workers.html", page="workers")


@router.get("/compare")
def compare_page(request: Request, session: SessionDep, ids: str = "") -> Response:
    if _user(request) is None:
        return _login_redirect(request)
    run_ids = [i for i in ids.split(",") if i][:8]
    runs = [r for r in (session.get(Run, i) for i in run_ids if len(i) <= 32) if r is not None]
    if len(runs) < 2:
        return _render(request, "error.html", 400, message="Pick two or more runs to compare (from the runs page).")
    return _render(request, "compare.html", page="compare", runs=runs)


@router.get("/playground")
def playground_page(request: Request, settings: SettingsDep, run: str = "") -> Response:
    """Try one or two models (a run's checkpoint, a base model) on a prompt with uploaded images (docs/playground.md);
    ``?run=<id>`` starts with that run picked."""
    if _user(request) is None:
        return _login_redirect(request)
    return _render(request, "playground.html", page="playground", run=run[:32], settings=settings)
