"""The run page's Checkpoints panel in Chromium against a real `collage serve` (embedded broker and worker): a LoRA
run's checkpoints appear while it trains, the best one carries a badge, Download saves the checkpoint's model folder
as a tar, Export runs on the worker with its progress and ends in a download link, a refused export (one at a
time per token) is shown in the panel, and the finished export is still listed, with its download, after a
reload."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from tests.support import API
from tests.support.browser import shoot, small_config, wait_done, wait_js
from tests.support.checkpoints import LORA, files_of
from tests.support.waiting import wait_for


def _rows(page) -> list[str]:
    return page.eval_on_selector_all("#checkpoints-table tbody tr", "rows => rows.map(r => r.dataset.step)")


def test_the_checkpoints_panel_lists_downloads_and_exports(server, page, tmp_path):
    client = server["client"]
    config = small_config("checkpoints-panel", save_steps=1, metric_for_best_model="reward", learning_rate=5e-3)
    config["model"]["lora"] = LORA
    config["train"]["max_steps"] = 3
    run_id = client.post("/runs", json=config).json()["id"]
    page.goto(f"{server['base']}/runs/{run_id}")
    assert page.inner_text("#checkpoints-note") == "No checkpoint yet."
    # live: the rows come while the run trains, without a reload
    wait_for(lambda: len(_rows(page)) >= 1, "a first checkpoint row", timeout=240)  # the training starts first
    assert wait_done(client, run_id)["status"] == "succeeded"
    wait_for(lambda: _rows(page) == ["1", "2", "3"], "every checkpoint", timeout=180)

    # the best checkpoint by reward (the values a worker records with each checkpoint)
    from sqlalchemy import update

    from collage.app.store.engine import engine_for
    from collage.app.store.tables import Checkpoint

    engine = engine_for(f"sqlite:///{server['home'] / 'collage.db'}")
    try:
        with engine.begin() as connection:
            for step, value in ((1, 0.25), (2, 0.75), (3, 0.5)):
                connection.execute(
                    update(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.step == step).values(metric=value)
                )
    finally:
        engine.dispose()
    page.reload()
    wait_for(lambda: page.is_visible("tr[data-step='2'] .best-badge"), "the best badge", timeout=180)
    assert page.locator(".best-badge").count() == 1
    assert page.inner_text("#checkpoints-metric") == "reward"
    assert "Best by reward (greater is better)" in page.inner_text("#checkpoints-note")
    assert page.inner_text("tr[data-step='2'] td:nth-child(5)") == "adapter"
    assert page.inner_text("tr[data-step='2'] td:nth-child(2)") == "1"  # the attempt that wrote it
    assert page.is_visible("#merge-lora-label")

    # Download: the checkpoint's model folder, byte for byte
    with page.expect_download() as download:
        page.click("tr[data-step='2'] button.download")
    saved = tmp_path / "step-2.tar"
    download.value.save_as(saved)
    with tarfile.open(saved) as archive:
        archive.extractall(tmp_path / "x", filter="data")
    on_disk = Path(server["home"]) / "artifacts" / "runs" / run_id / "attempt-1" / "checkpoints" / "step-2" / "model"
    assert files_of(tmp_path / "x" / f"{run_id}-step-2") == files_of(on_disk)

    # a download the server refuses is said in the panel (here: the checkpoint's files went away)
    import shutil

    shutil.rmtree(on_disk.parent.parent / "step-3")
    page.click("tr[data-step='3'] button.download")
    wait_for(lambda: page.is_visible("#checkpoints-error"), "the download's refusal", timeout=180)
    assert "Not downloaded: checkpoint step 3 of run" in page.inner_text("#checkpoints-error")
    assert "its files are gone" in page.inner_text("#checkpoints-error")

    # Export, merged: progress, then a download link; a second export at once is refused and says why
    page.check("#merge-lora")
    page.click("tr[data-step='2'] button.export")
    wait_js(page, "!document.getElementById('export-box').hidden")
    assert "Export of step 2 (LoRA merged)" in page.inner_text("#export-title")
    assert page.is_hidden("#checkpoints-error")  # a new action clears the last refusal
    page.click("tr[data-step='1'] button.export")
    wait_for(
        lambda: "one export at a time per token" in page.inner_text("#checkpoints-error"), "the refusal", timeout=180
    )
    wait_for(lambda: page.is_visible("#export-download"), "the export's download link", timeout=240)
    assert page.inner_text("#export-state") == "succeeded"
    shoot(page, "run-checkpoints")
    href = page.get_attribute("#export-download", "href")
    exported = client.get(href.removeprefix(API))
    assert exported.status_code == 200
    with tarfile.open(fileobj=io.BytesIO(exported.content)) as archive:
        names = {Path(n).name for n in archive.getnames()}
    assert {"config.json", "model.safetensors", "generation_config.json"} <= names

    # the export is the server's, not the tab's: after a reload the run's exports list it, with its download
    export_id = href.removeprefix(f"{API}/exports/").removesuffix("/download")
    (listed,) = [e for e in client.get(f"/runs/{run_id}/exports").json()["items"] if e["id"] == export_id]
    page.reload()
    row = f"#exports-table tr[data-export='{export_id}']"
    wait_for(lambda: page.is_visible(row), "the export listed after a reload", timeout=180)
    assert page.inner_text(f"{row} td:nth-child(1)") == "2"
    assert page.inner_text(f"{row} .weights") == "LoRA merged"
    assert page.inner_text(f"{row} .who") == listed["created_by"]
    assert page.get_attribute(f"{row} a.download-export", "href") == href
    # the browser logs the refused requests themselves (the 410 and 429 the panel showed); nothing else went wrong
    assert [e for e in page.errors if not ("status of 429" in e or "status of 410" in e)] == [], page.errors
