"""The launch form's layout and its dataset preview in a real browser: sections with the seldom-changed settings
collapsed (what matters above the fold at 1400x900), the synthetic task's fields only for a synth: source, the
check's conversions by kind, the preview's other columns readable (image structs as an image marker, long values
shortened, wrapping on a phone), the held-out split checked and its refusal shown at its field, and a bad reward
name marking that field alone.

One `collage serve` for the module (tests/support/serve.py); nothing here trains.
"""

from __future__ import annotations

import io
import json

import yaml
from PIL import Image

from tests.support.browser import login, shoot, wait_js
from tests.support.waiting import scaled

SYNTH_ONLY = ("rows", "min_images", "max_images", "seed")
# the old form (every field open, one card after the other) was 4,802 px long at 1400x900; this one is about 1,300
MAX_HEIGHT = 2400


def _png(mode: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (220, 30, 30)).convert(mode).save(buf, format="PNG")
    return buf.getvalue()


def _local_dataset(server):
    """train.jsonl and test.jsonl: images of three modes (two converted to RGB), a column holding an image struct
    ({bytes, path}, as a Hugging Face Image column stores one), and a long text column."""
    folder = server["home"] / "launch-data"
    folder.mkdir(exist_ok=True)
    for name, mode in (("red.png", "RGB"), ("grey.png", "L"), ("clear.png", "RGBA")):
        (folder / name).write_bytes(_png(mode))
    rows = [
        {
            "prompt": f"How many red squares? ({i})",
            "images": ["red.png", "grey.png" if i % 2 else "clear.png"],
            "answer": str(i),
            "photo": {"bytes": None, "path": "red.png"},
            "notes": "a long note " * 40,
        }
        for i in range(4)
    ]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    return folder


def _bottom(page, selector: str) -> float:
    box = page.locator(selector).first.bounding_box()
    assert box is not None, selector
    return box["y"] + box["height"]


def test_the_form_is_grouped_and_what_matters_is_above_the_fold(browser, server):
    context, page = login(browser, server, 1400, 900)
    try:
        page.goto(server["base"] + "/launch")
        page.wait_for_selector(".reward")
        page.wait_for_load_state("networkidle")
        height = page.evaluate("document.documentElement.scrollHeight")
        assert height <= MAX_HEIGHT, f"the launch form is {height} px long at 1400x900"
        # dataset, model, rewards, steps and the Launch button without scrolling
        for selector in ('[name="dataset.source"]', '[name="model.path"]', '.reward [name="reward.name"]',
                         '[name="train.max_steps"]', "#launch-btn", "#preview-btn"):  # fmt: skip
            assert page.is_visible(selector) and _bottom(page, selector) <= 900, selector
        legends = page.locator("#launch fieldset > legend").all_inner_texts()
        assert legends == ["Data", "Model", "Rewards", "Training", "Evaluation and checkpoints",
                           "Name, logging and resources"], legends  # fmt: skip
        # the advanced groups are collapsed: their fields are out of sight, and one button shows them all
        groups = page.locator("#launch details.group")
        assert groups.count() >= 6 and page.evaluate(
            "[...document.querySelectorAll('#launch details')].every(d => !d.open)"
        )
        for name in ("train.loss_type", "train.eval_strategy", "dataset.eval_split", "dataset.prompt_template",
                     "model.freeze_vision", "train.warmup_steps"):  # fmt: skip
            assert page.is_hidden(f'[name="{name}"]'), name
        shoot(page, "launch-form", full_page=False)
        page.click("#expand-all")
        assert page.evaluate("[...document.querySelectorAll('#launch details')].every(d => d.open)")
        # a checkbox sits right before its label's text, in the value column like the other inputs
        beside = {
            "train.gradient_checkpointing": "train.max_steps",
            "model.freeze_vision": "model.dtype",
            "train.eval_on_start": "train.eval_steps",
        }  # an input of the same card
        for name, other in beside.items():
            box = page.locator(f'[name="{name}"]').bounding_box()
            label = page.locator(f'[data-path="{name}"] .check-label').bounding_box()
            assert label["x"] <= box["x"] <= label["x"] + 6 and label["width"] < 400, (name, box, label)
            assert abs(box["x"] - page.locator(f'[name="{other}"]').bounding_box()["x"]) < 6, name
        # the mapping's dropdowns are in the value column, not under the label
        value_x = page.locator('[name="dataset.split"]').bounding_box()["x"]
        for key in ("prompt", "images", "answer", "system"):
            assert page.locator(f"#map-{key}").bounding_box()["x"] >= value_x - 1, key
        shoot(page, "launch-form-expanded")
        page.click("#expand-all")
        assert page.evaluate("[...document.querySelectorAll('#launch details')].every(d => !d.open)")
        assert not page.errors, page.errors
    finally:
        context.close()


def test_the_synthetic_tasks_fields_are_shown_and_sent_only_for_a_synth_source(browser, server):
    folder = _local_dataset(server)
    context, page = login(browser, server)
    try:
        page.goto(server["base"] + "/launch")
        page.wait_for_selector(".reward")
        assert all(page.is_visible(f'[name="dataset.{k}"]') for k in SYNTH_ONLY)
        page.fill('[name="dataset.rows"]', "40")
        page.click("#yaml-btn")
        sent = yaml.safe_load(page.inner_text("#yaml"))["dataset"]
        assert sent["rows"] == 40 and all(k in sent for k in SYNTH_ONLY)
        page.click("#yaml-btn")
        page.fill('[name="dataset.source"]', str(folder))
        assert not any(page.is_visible(f'[name="dataset.{k}"]') for k in SYNTH_ONLY)
        page.click("#yaml-btn")
        sent = yaml.safe_load(page.inner_text("#yaml"))["dataset"]
        assert sent["source"] == str(folder) and not any(k in sent for k in SYNTH_ONLY), sent
        page.click("#yaml-btn")
        page.fill('[name="dataset.source"]', "synth:odd-one-out")
        assert page.is_visible('[name="dataset.rows"]') and page.input_value('[name="dataset.rows"]') == "40"
        assert not page.errors, page.errors
    finally:
        context.close()


def test_the_preview_of_a_local_dataset_conversions_columns_and_the_held_out_split(browser, server):
    folder = _local_dataset(server)
    context, page = login(browser, server)
    try:
        page.goto(server["base"] + "/launch")
        page.wait_for_selector(".reward")
        page.fill('[name="dataset.source"]', str(folder))
        page.click("#heldout-group > summary")
        page.fill('[name="dataset.eval_split"]', "test")
        page.click("#preview-btn")
        wait_js(page, "!!document.querySelector('#preview').dataset.done && "
                      "!!document.querySelector('#preview .preview-eval-report p.ok')", timeout=120)  # fmt: skip
        report = page.inner_text("#preview .preview-report")
        assert "4 rows, 0 bad" in report, report
        # the conversions by kind, each with its count: 2 RGBA (rows 0, 2) and 2 L (rows 1, 3)
        kinds = page.evaluate(
            "Object.fromEntries([...document.querySelectorAll('#preview .preview-report .conversions li')]"
            ".map(li => [li.querySelector('.kind').textContent, li.querySelector('.count').textContent]))"
        )
        assert kinds == {"RGBA to RGB": "2 images", "L to RGB": "2 images"}, kinds
        # the held-out split is checked too, from the same folder
        held = page.inner_text("#preview .preview-eval-report")
        assert "Held-out split test" in held and "2 rows, 0 bad" in held, held
        # the other columns: the image struct as an image marker, the long note shortened
        cell = page.locator("#preview .preview-rows tbody tr").first.locator("td.columns")
        text = cell.inner_text()
        assert "{" not in text and "bytes" not in text, text
        assert cell.locator(".col-image").inner_text() == "image"
        note = cell.locator(".col-value").filter(has_text="a long note").inner_text()
        assert len(note) <= 80 and note.endswith("…"), note
        assert page.locator("#preview .error").count() == 0
        shoot(page, "launch-preview-local")

        # a held-out split that names no file there: refused at submit, at its field (its group open)
        page.fill('[name="dataset.eval_split"]', "validation")
        page.click("#heldout-group > summary")  # closed again: the error opens it
        assert not page.is_visible('[name="dataset.eval_split"]')
        page.fill('[name="name"]', "launch-bad-eval-split")
        page.click("#launch-btn")
        slot = '[data-error-for="dataset.eval_split"]'
        page.wait_for_selector(f"{slot}:not(:empty)")
        assert page.is_visible(slot) and "validation" in page.inner_text(slot)
        assert page.get_attribute('[name="dataset.eval_split"]', "aria-invalid") == "true"
        assert page.evaluate("document.activeElement.name") == "dataset.eval_split"
        assert server["client"].get("/runs", params={"q": "launch-bad-eval-split"}).json()["items"] == []
        shoot(page, "launch-eval-split-error", full_page=False)
        assert [e for e in page.errors if "status of 422" not in e] == [], page.errors
    finally:
        context.close()


def test_the_preview_wraps_on_a_phone(browser, server):
    folder = _local_dataset(server)
    context, page = login(browser, server, 390, 844)
    try:
        page.goto(server["base"] + "/launch")
        page.wait_for_selector(".reward")
        page.fill('[name="dataset.source"]', str(folder))
        page.click("#preview-btn")
        wait_js(page, "!!document.querySelector('#preview').dataset.done", timeout=120)
        assert page.locator("#preview .preview-rows tbody tr").count() == 4
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, f"/launch is {width} px wide at 390 with the preview"
        cell = page.locator("#preview .preview-rows tbody tr").first.locator("td.columns")
        box = cell.bounding_box()
        assert box["x"] >= 0 and box["x"] + box["width"] <= 390, box
        # nothing scrolls sideways inside the preview either: the cell wraps
        assert page.evaluate("(() => { const t = document.querySelector('#preview table.preview-rows'); "
                             "return t.scrollWidth <= t.clientWidth + 1; })()")  # fmt: skip
        page.locator("#preview .preview-rows").scroll_into_view_if_needed()
        shoot(page, "launch-preview-390", full_page=False)
        assert not page.errors, page.errors
    finally:
        context.close()


def test_a_bad_reward_name_marks_that_field_alone(browser, server):
    context, page = login(browser, server)
    try:
        page.goto(server["base"] + "/launch")
        page.wait_for_selector(".reward")
        first = page.locator(".reward").first
        first.locator('[name="reward.name"]').fill("no_such_reward")
        page.click("#launch-btn")
        page.wait_for_selector('[data-error-for="rewards[0].name"]:not(:empty)')
        marked = page.evaluate("[...document.querySelectorAll('#launch [aria-invalid=\"true\"]')].map(e => e.name)")
        assert marked == ["reward.name"], marked
        assert page.locator("#launch .field.invalid").count() == 0
        name_border = first.locator('[name="reward.name"]').evaluate("e => getComputedStyle(e).borderColor")
        for other in ('[name="reward.weight"]', '[name="reward.on_images"]'):
            assert first.locator(other).evaluate("e => getComputedStyle(e).borderColor") != name_border, other
        assert page.locator(".reward").nth(1).locator('[aria-invalid="true"]').count() == 0
        shoot(page, "launch-reward-error", full_page=False)
        assert [e for e in page.errors if "status of 422" not in e] == [], page.errors
    finally:
        context.close()


def test_the_tools_group_sends_the_tools_and_a_refused_one_is_marked_at_its_input(browser, server):
    """Tools (collapsed): the checked built-ins (image_zoom_in with its coords), then the import paths, with the
    multi-turn limits; this server allowlists no tool module, so the import path's refusal (tools[1].name) shows at
    the import paths' input, the group opened, and the checkbox of tools[0] stays unmarked."""
    context, page = login(browser, server)
    try:
        page.goto(server["base"] + "/launch")
        page.wait_for_selector(".reward")
        assert page.is_hidden("#tool-image_zoom_in") and page.is_hidden('[name="train.max_tool_calling_iterations"]')
        page.click("#tools-group > summary")
        page.check("#tool-image_zoom_in")
        page.select_option("#tool-coords", "normalised")
        page.fill("#tool-imports", "evil.module:fn")
        page.fill('[name="train.max_tool_calling_iterations"]', "3")
        page.click("#yaml-btn")
        sent = yaml.safe_load(page.inner_text("#yaml"))
        assert sent["tools"] == [{"name": "image_zoom_in", "coords": "normalised"}, {"name": "evil.module:fn"}], sent
        assert sent["train"]["max_tool_calling_iterations"] == 3 and sent["environment"] is None
        page.click("#yaml-btn")
        page.evaluate("document.getElementById('tools-group').open = false")
        page.click("#launch-btn")
        slot = '[data-error-for="tools[1].name"]'
        page.wait_for_selector(f"{slot}:not(:empty)")
        assert "COLLAGE_TOOL_MODULES" in page.inner_text(slot) and page.is_visible(slot)
        marked = page.evaluate("[...document.querySelectorAll('#launch [aria-invalid=\"true\"]')].map(e => e.id)")
        assert marked == ["tool-imports"], marked
        assert [e for e in page.errors if "status of 422" not in e] == [], page.errors
    finally:
        context.close()


def test_the_memory_plan_of_the_form_s_config_is_shown_per_strategy(browser, server):
    """The launch form's Memory plan asks POST /plan for the config the form would launch: one column per
    strategy (DDP, and FSDP2 with and without offload once the run has two processes), and whether each fits."""
    context, page = login(browser, server)
    try:
        page.goto(server["base"] + "/launch")
        page.wait_for_selector(".reward")
        page.click("#plan-group > summary")
        page.fill("#plan-memory", "1GiB")
        page.click("#plan-btn")
        page.wait_for_selector("#plan table.plan-table", timeout=scaled(120_000))
        heads = page.locator("#plan thead th").all_inner_texts()
        assert heads == ["per process", "ddp"], heads  # the form's default: one process
        rows = page.locator("#plan tbody th").all_inner_texts()
        assert rows[0] == "parameters" and rows[-1] == "fits 1.00 GiB", rows
        assert "parameters" in page.inner_text("#plan p") and not page.errors, page.errors
    finally:
        context.close()
