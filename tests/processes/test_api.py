"""Dataset check and preview through the REST API, answered by the real dataset helper process, on SQLite and
PostgreSQL; `collage db upgrade` and `collage token create` run as processes (a token only once the database is
migrated); and a fresh interpreter that imports the web app loads none of the training stack."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support import API, ROOT
from tests.support.api import png
from tests.support.waiting import scaled


def test_dataset_check_and_preview(api, tmp_path):
    client, _, _, _ = api
    (tmp_path / "ok.png").write_bytes(png((9, 9, 9)))
    rows = [{"prompt": "look", "images": ["ok.png"]}, {"prompt": "gone", "images": ["missing.png"]}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = client.post(API + "/datasets/check", json={"source": str(tmp_path)}).json()
    assert report["ok"] is False and report["rows"] == 2
    assert report["errors"][0]["row"] == 1 and "file not found" in report["errors"][0]["message"]
    synth = client.post(
        API + "/datasets/check",
        json={
            "source": "synth:same-shape",
            "rows": 6,
            "min_images": 2,
            "max_images": 3,
            "model": "tiny:llava",
            "max_prompt_length": 256,
        },  # fmt: skip
    ).json()
    assert synth["ok"] is True and synth["image_tokens_per_row"]["min"] >= 8
    assert client.post(API + "/datasets/check", json={"source": "/no/such/place"}).status_code == 400
    assert client.post(API + "/datasets/check", json={"source": "x", "bogus": 1}).status_code == 422

    preview = client.get(API + "/datasets/preview", params={"source": str(tmp_path), "rows": 2}).json()
    first, second = preview["rows"]
    assert len(first["images"]) == 1 and client.get(first["images"][0]["url"]).status_code == 200
    assert second["error"] and "file not found" in second["error"]


def test_db_upgrade_and_token_create_cli(tmp_path):
    import os

    env = {**os.environ, "COLLAGE_HOME": str(tmp_path), "COLLAGE_DATABASE_URL": f"sqlite:///{tmp_path / 'c.db'}"}

    def run(*a):
        return subprocess.run([sys.executable, "-m", "collage.app.cli", *a], capture_output=True, text=True, env=env)

    early = run("token", "create", "me")
    assert early.returncode == 2 and "collage db upgrade" in early.stderr
    from collage.app.store.engine import head_revision

    up = run("db", "upgrade")
    assert up.returncode == 0 and f"is at migration {head_revision()}" in up.stdout
    assert run("db", "upgrade").returncode == 0  # idempotent
    made = run("token", "create", "me")
    assert made.returncode == 0 and made.stdout.strip().startswith("clg_") and "shown only this once" in made.stderr


def test_the_web_app_does_not_load_the_training_stack():
    code = (
        "import sys, collage.app.main, collage.app.routers.runs, collage.app.routers.samples, collage.app.routers.datasets, collage.app.routers.catalog, collage.app.web.pages;"
        "heavy = [m for m in ('torch', 'transformers', 'accelerate', 'peft', 'collage.training.trainer') if m in sys.modules];"
        "print(heavy)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_memory_plan_of_a_config_is_collage_plan_s_figures(api, tmp_path):
    """``POST /plan`` answers what ``collage plan --json`` prints for the same config (the dataset helper builds the
    model on the meta device); an invalid config is a 422 naming the key, a refused model path a 400."""
    import yaml

    client, _, _, _ = api
    config = yaml.safe_load((ROOT / "examples" / "grpo-count-red.yaml").read_text())
    config["resources"] = {"gpus": 0, "processes": 2, "strategy": "fsdp"}
    answer = client.post(API + "/plan", json={"config": config, "gpu_memory": "1GiB"})
    assert answer.status_code == 200, answer.text
    plan = answer.json()
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    cli = subprocess.run([sys.executable, "-m", "collage.app.cli", "plan", str(tmp_path / "run.yaml"), "--gpu-memory",
                          "1GiB", "--json"], capture_output=True, text=True, cwd=ROOT, timeout=scaled(300))  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    assert plan == json.loads(cli.stdout)
    assert [s["strategy"] for s in plan["strategies"]] == ["ddp", "fsdp", "fsdp+offload"]
    ddp, fsdp = plan["strategies"][:2]
    assert fsdp["parameters"] < ddp["parameters"] and plan["run"]["processes"] == 2 and ddp["fits"] is True
    bad = client.post(API + "/plan", json={"config": {**config, "train": {"learning_rate": -1}}})
    assert bad.status_code == 422 and "learning_rate" in bad.text
    outside = client.post(API + "/plan", json={"config": {**config, "model": {"path": "/etc"}}})
    assert outside.status_code == 400 and "config.model.path" in outside.json()["detail"]
    assert client.post(API + "/plan", json={"config": config, "gpu_memory": "80 furlongs"}).status_code == 422
