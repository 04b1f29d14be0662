"""The playground end to end (issue 18): a real `collage serve` (embedded broker, one real Celery worker, SQLite
store), a run trained on it for its checkpoint and rollouts, and the /playground page in Chromium: an image
uploaded through the page, the run's checkpoint beside a base model, completions and rewards side by side; the
model stays loaded for the next generation and its process exits after the idle time; a rollout row of the run
taken as the prompt; cancel (at 390 px, keyboard only); a generation waiting behind a training, and a training
that starts stopping the playground process.
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

import pytest
from PIL import Image

from tests.support.browser import login, shoot, small_config, wait_done, wait_js
from tests.support.waiting import scaled, wait_for

# seconds the worker's playground process keeps its models without a request: short for the test, but long enough
# that a loaded machine's gaps between two requests (or before the next training starts) never reach it
TTL = round(scaled(45))


@pytest.fixture(scope="module", autouse=True)
def playground_env():
    """The server of this module (tests/support/serve.py, started after this) gets a short idle time and the
    tests' reward module."""
    saved = {k: os.environ.get(k) for k in ("COLLAGE_PLAYGROUND_TTL", "COLLAGE_REWARD_MODULES")}
    os.environ["COLLAGE_PLAYGROUND_TTL"] = str(TTL)
    os.environ["COLLAGE_REWARD_MODULES"] = "tests.support.rewards"
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def trained(server):
    """A run trained on the server's worker: a checkpoint at its end, rollout rows with images."""
    config = small_config("playground-run", max_steps=2)
    config["dataset"].update(min_images=1, max_images=2)
    run_id = server["client"].post("/runs", json=config).json()["id"]
    run = wait_done(server["client"], run_id, timeout=600)
    assert run["status"] == "succeeded", run
    return run_id


def _job(server, job_id: str):
    from collage.app.db import engine_for
    from collage.app.models import Job

    engine = engine_for(f"sqlite:///{server['home'] / 'collage.db'}")
    try:
        from sqlmodel import Session

        with Session(engine) as session:
            return session.get(Job, job_id)
    finally:
        engine.dispose()


def _red_png(path: Path) -> Path:
    image = Image.new("RGB", (64, 48), (30, 30, 200))
    image.paste((230, 20, 20), (8, 8, 30, 30))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    path.write_bytes(buf.getvalue())
    return path


def _problems(page) -> str:
    """What the page shows as wrong (its error box, the errors next to fields, its console)."""
    shown = page.evaluate(
        "[...document.querySelectorAll('#pg-error, .pg-field-error')].map(e => e.textContent).filter(Boolean)"
    )
    return "; ".join(shown + page.errors)


def _generation_id(page) -> str:
    def created():
        if (problems := _problems(page)) != "":
            raise AssertionError(f"the page shows: {problems}")
        return "id=" in page.url

    wait_for(created, "the page to show the generation's id", timeout=300)
    return re.search(r"[?&]id=([0-9a-f]+)", page.url).group(1)


def _finished(page, server, timeout: float = 600) -> dict:
    job_id = _generation_id(page)
    status = page.locator("#pg-status")
    # the status box of this generation (the previous one's stays shown until the page has the new one's)
    wait_for(lambda: (status.get_attribute("data-job"), status.get_attribute("data-status")),
             f"generation {job_id} to end", timeout=timeout,
             until=lambda shown: shown[0] == job_id and shown[1] in ("succeeded", "failed", "cancelled"))  # fmt: skip
    return server["client"].get(f"/generate/{job_id}").json()


def test_the_playground_page_generates_with_a_checkpoint_and_a_base_model_side_by_side(
    browser, server, trained, tmp_path
):
    context, page = login(browser, server)
    page.goto(f"{server['base']}/playground?run={trained}")
    wait_js(page, f"document.getElementById('run-0').value === '{trained}'")
    # the checkpoint: from the run's list of checkpoints, or (no such route on this server) a step typed in
    wait_js(page, "!document.getElementById('step-0').hidden || !document.getElementById('step-text-0').hidden")
    # the prompt box starts with the run's own prompt (its newest rollout row's text, no image markers), not a demo's
    newest = server["client"].get(f"/runs/{trained}/samples", params={"limit": 1, "sort": "-step"}).json()["items"][0]
    texts = [p["text"] for m in newest["prompt"] for p in (m["content"] if isinstance(m["content"], list) else [])
             if p.get("type") == "text"]  # fmt: skip
    wait_js(page, "document.getElementById('prompt').value !== ''", what="the run's prompt in the prompt box")
    assert page.input_value("#prompt") == "".join(texts).strip()
    # the file input's "No file chosen" never shows: its label is the button
    assert page.is_visible("label.pg-add-images") and page.evaluate(
        "getComputedStyle(document.getElementById('files')).opacity === '0'"
    )
    page.check("#second-on")
    page.check('input[name="kind-1"][value="path"]')
    page.fill("#path-1", "tiny:qwen2-vl")
    page.set_input_files("#files", str(_red_png(tmp_path / "red.png")))
    page.wait_for_selector(".pg-thumb img")
    assert page.locator(".pg-thumb .image-marker").inner_text() == "[image 1]"
    page.fill("#prompt", "Look at [image 1]. How many red squares? Answer with a number.")
    page.fill("#answer", "1")
    page.fill("#num_generations", "2")
    page.fill("#max_new_tokens", "8")
    page.fill("#seed", "7")
    page.click("#generate")
    job = _finished(page, server)
    assert job["status"] == "succeeded", job
    # the completions side by side, each with its rewards: the run's own, and accuracy + format for the base model
    page.wait_for_selector(".pg-column")
    columns = page.locator(".pg-column")
    assert columns.count() == 2
    assert (
        columns.nth(0).locator(".pg-completion").count() == 2 and columns.nth(1).locator(".pg-completion").count() == 2
    )
    assert set(columns.nth(0).locator("dd[data-reward]").evaluate_all("n => n.map(x => x.dataset.reward)")) == {
        "accuracy",
        "numeric",
    }
    assert set(columns.nth(1).locator("dd[data-reward]").evaluate_all("n => n.map(x => x.dataset.reward)")) == {
        "accuracy",
        "format",
    }
    assert columns.nth(0).locator(".pg-total").count() == 2  # the weighted total of each completion
    for head in columns.nth(0).locator(".pg-completion header").all_inner_texts():  # "1 token", "8 tokens"
        count = int(re.search(r"(\d+) tokens?\b", head).group(1))
        assert re.search(rf"\b{count} token{'' if count == 1 else 's'}\b", head), head
    run_result, base_result = job["results"]
    assert run_result["model"]["run"] == trained and run_result["model"]["step"] == 2
    assert run_result["image_tokens"] > 0 and run_result["prompt_tokens"] == base_result["prompt_tokens"]
    assert [c["text"] for c in run_result["completions"]] == columns.nth(0).locator("pre.completion").all_inner_texts()
    assert job["images"][0]["width"] == 64 and job["prompt"][0]["content"][1] == {"type": "image"}
    shoot(page, "playground")

    # again: the worker's playground process still has both models loaded, and answers the same for the same seed
    page.click("#generate")
    wait_for(lambda: _generation_id(page) != job["id"], "the second generation", timeout=300)
    again = _finished(page, server)
    assert again["status"] == "succeeded" and all(r["reused"] for r in again["results"]), again
    assert [c["text"] for c in again["results"][0]["completions"]] == [c["text"] for c in run_result["completions"]]
    assert "model already loaded" in page.locator(".pg-column .pg-meta").first.inner_text()
    pid = _job(server, again["id"]).result["pid"]
    assert pid == _job(server, job["id"]).result["pid"]
    # idle for the TTL: the process exits (its memory goes back)
    wait_for(lambda: not Path(f"/proc/{pid}").exists(), "the idle playground process to exit", timeout=TTL + 120)

    # a rollout row of the run as the prompt: its conversation, images and answer, sent as stored
    page.click("#rows-load")
    page.wait_for_selector("#rows:not([hidden])")
    offered = page.locator("#rows option").all_inner_texts()[1:]
    assert len(set(offered)) == len(offered), offered  # each row told apart (step, group, answer, reward, images)
    assert all(" · answer " in o and " · reward " in o for o in offered), offered  # before the (same) prompt text
    page.select_option("#rows", index=1)
    sample = server["client"].get(f"/runs/{trained}/samples", params={"limit": 50, "sort": "-step"}).json()["items"][0]
    wait_js(page, f"document.querySelectorAll('.pg-thumb').length === {len(sample['images'])}")
    assert page.input_value("#answer") == str(sample["columns"]["answer"])
    page.uncheck("#second-on")
    page.click("#generate")
    wait_for(lambda: _generation_id(page) != again["id"], "the third generation", timeout=300)
    from_row = _finished(page, server)
    assert from_row["status"] == "succeeded", from_row
    assert from_row["prompt"] == sample["prompt"] and [i["sha256"] for i in from_row["images"]] == [
        i["sha256"] for i in sample["images"]
    ]
    assert from_row["answer"] == sample["columns"]["answer"] and len(from_row["results"]) == 1
    assert page.errors == [], page.errors
    context.close()


def test_cancel_from_the_keyboard_on_a_phone_sized_screen(browser, server):
    context, page = login(browser, server, width=390, height=844)
    page.goto(f"{server['base']}/playground")
    wait_js(page, "document.getElementById('run-0').options.length > 0")
    page.check('input[name="kind-0"][value="path"]')
    page.fill("#path-0", "tiny:qwen2-vl")
    page.fill("#num_generations", "16")
    page.fill("#max_new_tokens", "1024")
    page.focus("#generate")
    page.keyboard.press("Enter")
    wait_for(lambda: "generating" in page.locator("#pg-message").inner_text(), "the generation to start", timeout=300)
    shoot(page, "playground-390")
    assert page.evaluate("document.documentElement.scrollWidth") <= 390  # nothing wider than the phone
    page.focus("#cancel")
    page.keyboard.press("Enter")
    job = _finished(page, server, timeout=120)
    assert job["status"] == "cancelled" and job["message"].startswith("cancelled while generating"), job
    assert page.locator("#pg-state").inner_text() == "cancelled"
    assert page.errors == [], page.errors
    context.close()


def test_a_generation_waits_behind_training_and_a_training_stops_the_playground_process(server):
    client = server["client"]
    busy = small_config("busy", max_steps=200)
    busy["rewards"] = [{"name": "tests.support.rewards:sleepy", "args": {"delay": 0.5}}]
    run_id = client.post("/runs", json=busy).json()["id"]
    wait_for(lambda: client.get(f"/runs/{run_id}").json()["progress"]["step"] >= 1, "the training to run", timeout=300)
    body = {"models": [{"path": "tiny:qwen2-vl"}], "prompt": "Say a number.", "max_new_tokens": 4}
    job_id = client.post("/generate", json=body).json()["id"]
    waiting = client.get(f"/generate/{job_id}").json()
    assert waiting["status"] == "queued" and waiting["queue_position"] == 1, waiting
    assert "waiting behind training" in waiting["message"] and f"run {run_id}" in waiting["message"], waiting
    assert client.post(f"/runs/{run_id}/cancel").status_code == 200
    done = wait_for(lambda: client.get(f"/generate/{job_id}").json(), "the generation to run once the worker is free",
                    until=lambda job: job["status"] in ("succeeded", "failed"), timeout=600)  # fmt: skip
    assert done["status"] == "succeeded", done
    pid = _job(server, job_id).result["pid"]
    assert Path(f"/proc/{pid}").exists()
    # a training starting on this worker gets the memory: the playground process is stopped at once
    short = client.post("/runs", json=small_config("after", max_steps=1)).json()["id"]
    wait_for(lambda: not Path(f"/proc/{pid}").exists(), "the playground process to stop", timeout=300)
    log = server["serve"].log.read_text()
    assert f"collage playground {pid}: the worker closed its pipe: exiting" in log  # stopped, not idle
    assert f"collage playground {pid}: no request for" not in log
    assert wait_done(client, short, timeout=600)["status"] == "succeeded"
