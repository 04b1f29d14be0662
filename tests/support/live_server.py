"""A real HTTP server (uvicorn, in a thread of the test process) around an app, for tests that need real
connections: streams that must end, concurrent requests, cookies over the wire."""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from .waiting import scaled, wait_for


@contextmanager
def serving(app) -> Iterator[str]:
    """Serve ``app`` on 127.0.0.1 (a free port) until the block ends; yields the base URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2, access_log=False)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="test-uvicorn")
    thread.start()
    wait_for(lambda: server.started, "the test server to start", interval=0.02,
             gone=lambda: None if thread.is_alive() else "its thread ended")  # fmt: skip
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(scaled(30))
        sock.close()


def browser_login(base: str, token: str) -> httpx.Client:
    """An httpx client logged in through the login form, as a browser is (its session cookie in the jar)."""
    client = httpx.Client(base_url=base, timeout=scaled(30))
    page = client.get("/login")
    match = re.search(r'name="csrf_token" value="([^"]+)"', page.text)
    assert match, page.text[:500]
    done = client.post(
        "/login", data={"token": token, "csrf_token": match.group(1), "next": "/runs"}, headers={"Origin": base}
    )
    assert done.status_code == 303 and "collage_session" in client.cookies, done.text
    return client


def page_csrf(client: httpx.Client) -> str:
    """The CSRF token a logged-in page carries."""
    match = re.search(r'name="csrf_token" value="([^"]+)"', client.get("/runs").text)
    assert match
    return match.group(1)


def at_once(calls: list, timeout: float = 120) -> list:
    """Run every call on a thread of its own, released together by a barrier: what each returned, in order (a
    concurrent burst, as many clients at the same moment). A call that has not returned by the (scaled) ``timeout``
    fails the test."""
    barrier = threading.Barrier(len(calls))
    results: list = [None] * len(calls)
    errors: list[BaseException] = []

    def run(k: int) -> None:
        barrier.wait()
        try:
            results[k] = calls[k]()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(scaled(timeout))
    assert not [t for t in threads if t.is_alive()], "a call of the burst hung"
    if errors:
        raise errors[0]
    return results
