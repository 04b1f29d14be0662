"""The record `collage serve` leaves of where it listens (issue 17): a recycled pid is not taken for the serve, and the
recorded URL is one a local client can use, whatever host the serve bound."""

from __future__ import annotations

import os

import pytest

from collage.app.cli import serve_record


def test_a_recycled_pid_is_not_taken_for_the_serve(tmp_path):
    rec = serve_record.ServeRecord(url="http://127.0.0.1:9", pid=os.getpid(), started="1", since=1.0, workers=0,
                                   ready=True)  # fmt: skip
    path = serve_record.write(tmp_path, rec)
    if serve_record.process_start(os.getpid()) is not None:  # Linux: the start time tells another process apart
        assert serve_record.find(tmp_path) is None and not path.exists()


@pytest.mark.parametrize(
    "host,url",
    [("127.0.0.1", "http://127.0.0.1:5"), ("0.0.0.0", "http://127.0.0.1:5"), ("::", "http://[::1]:5"),
     ("::1", "http://[::1]:5"), ("example.org", "http://example.org:5")],
)  # fmt: skip
def test_the_recorded_url_is_one_a_local_client_can_use(host, url):
    assert serve_record.client_url(host, 5) == url
