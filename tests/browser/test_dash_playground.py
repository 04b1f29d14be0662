"""The playground end to end (issue 18): a real `collage serve` (embedded broker, one real Celery worker, SQLite
store), a run trained on it for its checkpoint and rollouts, and the /playground page in Chromium: an image
uploaded through the page, the run's checkpoint beside a base model, completions and rewards side by side; the
model stays loaded for the next generation and its process exits after the idle time; a rollout row of the run
taken as the prompt; cancel (at 390 px, keyboard only); a generation waiting behind a training, and a training
that starts stopping the playground process.
"""

from __future__ import annotations

import io
import json
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
    from collage.app.store.engine import engine_for
    from collage.app.store.tables import Job

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


# ------------------------------------------------------------------------------------------------------- tools
MARKER = "zoom-test"  # the scripted model of the tools server answers only prompts holding it
FIRST, SECOND = [8, 6, 72, 54], [4, 4, 40, 36]  # the first crop, on the prompt's image; the second, on the first
ERROR = "image must be an image number from 0 to 2"


def _board(path: Path) -> Path:
    """96 x 72, a red and a blue square over a colour ramp: every crop of it looks like no other."""
    image = Image.new("RGB", (96, 72), (240, 240, 240))
    for x in range(0, 96, 8):
        image.paste((x * 2, 120, 255 - x * 2), (x, 60, x + 8, 72))
    image.paste((230, 20, 20), (10, 10, 40, 40))
    image.paste((20, 20, 230), (50, 20, 90, 50))
    image.save(path, format="PNG")
    return path


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory):
    """A `collage serve` of its own whose processes have a scripted model (tests/support/scripted.py): a prompt
    holding MARKER zooms on its image, zooms on that crop, names an image that is not there, and answers; the
    tests' tool module allowed (COLLAGE_TOOL_MODULES)."""
    from tests.support import ROOT
    from tests.support.scripted import call, scripted_env
    from tests.support.serve import Serve, serve_env

    turns = [call("image_zoom_in", image=0, bbox_2d=FIRST), call("image_zoom_in", image=1, bbox_2d=SECOND),
             call("image_zoom_in", image=7, bbox_2d=SECOND), "<answer>1</answer>"]  # fmt: skip
    home = tmp_path_factory.mktemp("tools-serve-home")
    env = serve_env(home, COLLAGE_TOOL_MODULES="tests.support.tool_env", **scripted_env(MARKER, turns, str(ROOT)))
    serve = Serve(home, env=env).start()
    try:
        serve.wait_up(workers=1)
        client = serve.client()
        yield {"base": serve.base, "token": serve.token, "home": home, "client": client, "serve": serve}
        client.close()
    finally:
        serve.interrupt()


def _tool_run(server) -> str:
    """A run (in the store only: it never trains) whose config has the zoom tool and 3 tool calls."""
    from collage.training.config import parse_config
    from tests.support.serve import store_writer

    config = small_config("zoom-run", max_tool_calling_iterations=3)
    config["tools"] = [{"name": "image_zoom_in"}]
    engine, writer = store_writer(server)
    run = writer.create_run(parse_config(config).model_dump(mode="json"))
    engine.dispose()
    return run.id


def _checked(page) -> dict[str, bool]:
    return page.evaluate(
        "Object.fromEntries([...document.querySelectorAll('#tools-list input')].map(i => [i.value, i.checked]))"
    )


def _box_and_thumb(frame) -> tuple[list[float], list[float]]:
    box = frame.locator(".crop-box").bounding_box()
    thumb = frame.locator("img.source-thumb").bounding_box()
    return [box["x"], box["y"], box["width"], box["height"]], [thumb["x"], thumb["y"], thumb["width"], thumb["height"]]


def test_a_tool_calling_model_runs_turn_by_turn_and_the_page_shows_its_crops(browser, tools_server, tmp_path):
    server = tools_server
    run_id = _tool_run(server)
    context, page = login(browser, server)
    page.goto(f"{server['base']}/playground?run={run_id}")
    # the picker: every built-in tool, checked as the chosen run has them, and the run's tool-call limit
    wait_js(page, "document.querySelectorAll('#tools-list input').length >= 2", what="the tools picker")
    wait_for(lambda: _checked(page), "the run's tools checked", timeout=60,
             until=lambda c: c == {"image_rotate": False, "image_zoom_in": True})  # fmt: skip
    assert page.input_value("#max_tool_calling_iterations") == "3"
    assert "Zoom in on a region of an image" in page.inner_text("#tools-list")  # each tool says what it does
    assert "tests.support.tool_env" in page.inner_text("#tool-extra-help")
    # a base model has no tools of its own: none checked, the default limit
    page.check('input[name="kind-0"][value="path"]')
    wait_for(lambda: _checked(page), "no tools checked", timeout=60, until=lambda c: not any(c.values()))
    assert page.input_value("#max_tool_calling_iterations") == "4"
    page.fill("#path-0", "tiny:qwen2-vl")
    page.set_input_files("#files", str(_board(tmp_path / "board.png")))
    page.wait_for_selector(".pg-thumb img")
    page.fill("#prompt", f"{MARKER}: how many red squares?")
    page.fill("#answer", "1")
    page.fill("#num_generations", "1")
    page.fill("#max_new_tokens", "900")
    page.fill("#seed", "3")
    # a tool this server does not allow: refused, next to the tools
    page.fill("#tool-extra", "tests.support.rewards:starts_with_digit")
    page.click("#tool-add")
    page.check('#tools-list input[value="image_zoom_in"]')
    page.click("#generate")
    page.wait_for_selector('[data-error-for="tools"]:not(:empty)')
    error = page.inner_text('[data-error-for="tools"]')
    assert error.startswith("tools[1]:") and "not allowlisted for tools" in error, error
    assert [e for e in page.errors if "status of 422" not in e] == [], page.errors
    page.errors.clear()  # the browser's own note of that 422
    page.uncheck('#tools-list input[value="tests.support.rewards:starts_with_digit"]')
    page.fill("#max_tool_calling_iterations", "3")
    page.click("#generate")
    job = _finished(page, server)
    assert job["status"] == "succeeded", job
    assert job["sampling"]["tools"] == ["image_zoom_in"] and job["sampling"]["max_tool_calling_iterations"] == 3
    # the completion's turns, unfolded: zoom, its crop; zoom on the crop, its crop; a refused call; the answer
    completion = page.locator(".pg-completion")
    assert completion.count() == 1
    page.wait_for_selector(".pg-completion details.trajectory[open] figure.tool-image.crop")
    assert completion.locator("details.trajectory > summary").inner_text() == (
        "trajectory: 7 turns · 3 tool calls · 1 tool error"
    )
    turns = completion.locator("li.turn")
    assert turns.count() == 7
    assert turns.nth(0).locator(".tool-name").inner_text() == "image_zoom_in"
    assert turns.nth(0).locator(".tool-args").inner_text() == json.dumps(
        {"image": 0, "bbox_2d": FIRST}, separators=(",", ":")
    )
    assert f"Zoomed in on {FIRST} of image 0." in turns.nth(1).inner_text()
    assert ERROR in completion.locator("li.turn.has-error .tool-error").inner_text()
    assert completion.locator(".badge.tool-errors").inner_text() == "1 tool error"
    wait_js(
        page,
        "[...document.querySelectorAll('.pg-completion details.trajectory img')].every(i => i.complete && i.naturalWidth > 0)",
    )
    crops = completion.locator("figure.tool-image.crop")
    assert crops.count() == 2
    # each crop is image 1, 2 of the completion, beside the image it was cut from (the prompt's, then the first crop)
    # with the crop's box drawn where its bbox_2d says, and its own pixels' size
    sizes = {0: (96, 72), 1: (64, 48)}
    for k, (bbox, source, crop_size) in enumerate([(FIRST, 0, (64, 48)), (SECOND, 1, (36, 32))]):
        crop = crops.nth(k)
        assert crop.get_attribute("data-image") == str(k + 1)
        assert crop.locator(".box-frame").get_attribute("data-image") == str(source)
        assert crop.locator("img.crop-thumb").evaluate("i => [i.naturalWidth, i.naturalHeight]") == list(crop_size)
        box, thumb = _box_and_thumb(crop.locator(".box-frame"))
        width, height = sizes[source]
        x1, y1, x2, y2 = bbox
        sx, sy = thumb[2] / width, thumb[3] / height
        want = [thumb[0] + x1 * sx, thumb[1] + y1 * sy, (x2 - x1) * sx, (y2 - y1) * sy]
        assert thumb[2] > 0 and all(abs(a - b) <= 1.0 for a, b in zip(box, want, strict=True)), (bbox, box, want)
    assert "cropped from image 1 at [4, 4, 40, 36]" in crops.nth(1).inner_text()
    assert "tools: image_zoom_in · at most 3 tool calls" in page.inner_text(".pg-asked")
    shoot(page, "playground-tools")
    # on a phone-sized screen the turns and crops fit
    page.set_viewport_size({"width": 390, "height": 844})
    wait_js(page, "document.documentElement.scrollWidth <= 390", what="the page to fit 390 px")
    assert page.errors == [], page.errors
    context.close()
