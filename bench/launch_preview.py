"""The launch form's *Preview and check* for a 200-row dataset: time to answer, through the API routes.

On a fresh COLLAGE_HOME (the tiny Qwen2-VL is built first, not timed), times `POST /datasets/check` (200 rows of
`synth:count-red`, model `tiny:qwen2-vl`, max_prompt_length 256) and `GET /datasets/preview` (5 rows) as the
launch form sends them:

- `before`: the way the routes worked before issue 13, one `collage data check --json` child per request;
- `cold`: the first request to a web process (the dataset helper is started and imports the training stack);
- `warm`: after the launch page warmed the helper up (a new dataset: the rows are generated, decoded and
  tokenised; the check cache misses);
- `cached`: the same request again (the check cache hits).

    .venv/bin/python bench/launch_preview.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=200)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="collage-preview-bench-"))
    os.environ.update(COLLAGE_HOME=str(home), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    for key in ("COLLAGE_DATABASE_URL", "COLLAGE_BROKER_URL", "COLLAGE_ARTIFACTS"):
        os.environ.pop(key, None)
    sys.path.insert(0, str(ROOT))
    from fastapi.testclient import TestClient

    from collage.app.core.settings import Settings
    from collage.app.main import create_app
    from collage.app.routers import datasets
    from collage.app.store.engine import engine_for, upgrade
    from collage.app.store.tokens import create_token

    subprocess.run([sys.executable, "-m", "collage.app.cli", "models", "build-tiny", "qwen2-vl", "--out",
                    str(home / "unused")], check=True, capture_output=True)  # fmt: skip
    from collage.training.models.loading import resolve_model_path

    resolve_model_path("tiny:qwen2-vl")  # built into the cache once, before any timing

    class NoDispatcher:
        def submit(self, run_id, queue): ...
        def cancel(self, run_id): ...
        def health(self):
            return {"broker": {"ok": True}, "workers": []}

    settings = Settings.from_env()
    upgrade(settings.database_url)
    engine = engine_for(settings.database_url)
    client = TestClient(create_app(settings, NoDispatcher()),
                        headers={"Authorization": f"Bearer {create_token(engine, 'bench')}"})  # fmt: skip
    seed = iter(range(1000, 2000))

    def check(new_dataset: bool = True, same: int | None = None) -> tuple[float, int]:
        body = {"source": "synth:count-red", "model": "tiny:qwen2-vl", "max_prompt_length": 256, "rows": args.rows,
                "min_images": 0, "max_images": 3, "seed": same if same is not None else next(seed)}  # fmt: skip
        started = time.perf_counter()
        response = client.post("/api/v1/datasets/check", json=body)
        assert response.status_code == 200 and response.json()["rows"] == args.rows, response.text
        return time.perf_counter() - started, body["seed"]

    def old_check() -> float:
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "collage.app.cli", "data", "check", "--json", "--model=tiny:qwen2-vl",
             "--max-prompt-length", "256", "--rows", str(args.rows), "--min-images", "0", "--max-images", "3",
             "--seed", str(next(seed)), "--", "synth:count-red"],
            capture_output=True, text=True, cwd=tempfile.gettempdir(), check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        return time.perf_counter() - started

    def preview() -> float:
        started = time.perf_counter()
        params = {"source": "synth:count-red", "rows": 5, "dataset_rows": args.rows, "seed": next(seed)}
        response = client.get("/api/v1/datasets/preview", params=params)
        assert response.status_code == 200 and len(response.json()["rows"]) == 5, response.text
        return time.perf_counter() - started

    results: dict[str, list[float]] = {"before": [], "cold": [], "warm": [], "cached": [], "preview": []}
    for _ in range(args.repeats):
        results["before"].append(old_check())
        datasets.data_helper().close()
        results["cold"].append(check()[0])
        datasets.data_helper().close()
        datasets.data_helper().call({"op": "warm", "wait": True})  # what opening the launch page starts
        warm, used = check()
        results["warm"].append(warm)
        results["cached"].append(check(same=used)[0])
        results["preview"].append(preview())
    datasets.data_helper().close()
    print(f"{args.rows} rows of synth:count-red, model tiny:qwen2-vl, {args.repeats} repeats, median (min-max):")
    for name, values in results.items():
        print(f"  {name:8s} {statistics.median(values):6.2f} s  ({min(values):.2f}-{max(values):.2f})")


if __name__ == "__main__":
    main()
