"""A million-row parquet dataset with inline image bytes: what the data side costs as the row count grows.

For each row count (default 10,000, 100,000 and 1,000,000) a parquet file is written once under ``--work``: one to
three inline PNG images a row (24x24 noise, a pool of 512, stored without dictionary encoding or compression, so
every row really carries its bytes), row groups of 500 rows (the size ``datasets`` writes image datasets in). Then,
each in a fresh process, with ``torch`` pinned to ``--threads`` threads:

- ``data``: the data side alone, as the trainer drives it: the split opened, ``eval_fraction: 0.01`` held out,
  the training view made, 20 generation batches of 64 rows drawn in the trainer's seeded order and decoded. Peak
  RSS growth from just before the split is opened (``/proc/self/clear_refs``), open time and draw time.
- ``train``: ``collage``'s ``Trainer`` for 2 steps on the tiny Qwen2-VL (``dataset.check: auto``: a split over
  100,000 rows is checked by a 2,000-row sample, the rest when drawn): the whole process's peak RSS, time to the
  end of set-up and total wall time.
- ``preview``: ``GET /api/v1/datasets/preview?rows=200`` through the API and its dataset helper: the first
  request (the helper starts) and ``--repeats`` warm ones (median).

    .venv/bin/python bench/large_dataset.py [--rows 10000,100000,1000000] [--repeats 3] [--threads 2]

Writes ``docs/large-dataset.json``; docs/benchmarks.md has the figures of a run.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GROUP = 500

_DATA = """
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[2]))
from collage.training.config import DatasetSettings
from collage.training.data.heldout import load_heldout, training_rows
from collage.training.data.loader import load_dataset

def peak_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")
before = peak_kib()
tic = time.perf_counter()
split = load_dataset(sys.argv[1])
settings = DatasetSettings(source=sys.argv[1], eval_fraction=0.01)
held = load_heldout(settings, split, max_rows=64)
train = training_rows(split, held.held_rows)
opened = time.perf_counter() - tic
tic = time.perf_counter()
n = len(train)
perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
images = 0
for b in range(20):
    for i in perm[b * 64 : (b + 1) * 64].tolist():
        images += train.rows[i].to_sample().num_images
drawn = time.perf_counter() - tic
print(json.dumps({"rows": len(split), "open_s": opened, "draw_s_per_batch": drawn / 20, "images": images,
                  "peak_growth_mib": (peak_kib() - before) / 1024}))
"""

_TRAIN = """
import json, sys, time
tic = time.perf_counter()
import torch
torch.set_num_threads(int(sys.argv[2]))
from collage.training.config import parse_config
from collage.training.trainer import Trainer

def peak_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

config = parse_config({
    "model": {"path": "tiny:qwen2-vl", "dtype": "float32"},
    "dataset": {"source": sys.argv[1], "eval_fraction": 0.01},
    "rewards": [{"name": "accuracy"}],
    "train": {"max_steps": 2, "per_device_train_batch_size": 16, "num_generations": 4, "max_completion_length": 4,
              "eval_max_rows": 16},
    "resources": {"gpus": 0},
})
trainer = Trainer(config, sys.argv[3])
trainer.setup()
setup = time.perf_counter() - tic
result = trainer.train()
assert result.status == "succeeded", result
print(json.dumps({"setup_s": setup, "wall_s": time.perf_counter() - tic, "peak_rss_mib": peak_kib() / 1024,
                  "training_rows": len(trainer.dataset), "sample_check": trainer.draw_check}))
"""


def write_dataset(path: Path, rows: int) -> Path:
    """The benchmark's parquet file (written once; reused when it is there with the right row count)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    if path.exists() and pq.ParquetFile(path).metadata.num_rows == rows:
        return path
    rng = np.random.default_rng(0)
    pool = []
    for _ in range(512):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)).save(buf, format="PNG")
        pool.append(buf.getvalue())
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    tmp = path.with_suffix(".tmp")
    writer = None
    for lo in range(0, rows, GROUP):
        hi = min(rows, lo + GROUP)
        images = [[{"bytes": pool[(i * 31 + k) % 512], "path": None} for k in range(1 + i % 3)] for i in range(lo, hi)]
        table = pa.table({
            "prompt": pa.array([f"Row {i}: how many images are there?" for i in range(lo, hi)]),
            "images": pa.array(images, type=pa.list_(image)),
            "answer": pa.array([str(1 + i % 3) for i in range(lo, hi)]),
        })  # fmt: skip
        if writer is None:
            writer = pq.ParquetWriter(tmp, table.schema, use_dictionary=False, compression="none")
        writer.write_table(table, row_group_size=GROUP)
    assert writer is not None
    writer.close()
    tmp.replace(path)
    return path


def _child(code: str, *argv: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def preview_times(files: dict[int, Path], repeats: int) -> dict[int, dict[str, float]]:
    from fastapi.testclient import TestClient

    from collage.app.core.settings import Settings
    from collage.app.main import create_app
    from collage.app.routers import datasets
    from collage.app.store.engine import engine_for, upgrade
    from collage.app.store.tokens import create_token

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
    out: dict[int, dict[str, float]] = {}
    for rows, file in files.items():

        def once(file: Path = file, rows: int = rows) -> float:
            tic = time.perf_counter()
            response = client.get("/api/v1/datasets/preview", params={"source": str(file), "rows": 200})
            elapsed = time.perf_counter() - tic
            body = response.json()
            assert response.status_code == 200 and len(body["rows"]) == 200 and body["total_rows"] == rows, body
            return elapsed

        datasets.data_helper().close()
        cold = once()
        warm = [once() for _ in range(repeats)]
        out[rows] = {"cold_s": cold, "warm_median_s": statistics.median(warm), "warm_max_s": max(warm)}
    datasets.data_helper().close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="10000,100000,1000000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "collage-large-dataset-bench")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "large-dataset.json")
    args = parser.parse_args()
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="collage-large-bench-home-"))
    os.environ.update(COLLAGE_HOME=str(home), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                      OMP_NUM_THREADS=str(args.threads))  # fmt: skip
    for key in ("COLLAGE_DATABASE_URL", "COLLAGE_BROKER_URL", "COLLAGE_ARTIFACTS"):
        os.environ.pop(key, None)
    os.environ["COLLAGE_DATA_ROOTS"] = str(args.work)  # the datasets' folder, as an operator would set it
    sys.path.insert(0, str(ROOT))
    from collage.training.models.loading import resolve_model_path

    resolve_model_path("tiny:qwen2-vl")  # built once, before any timing
    counts = [int(n) for n in args.rows.split(",")]
    files = {}
    for n in counts:
        tic = time.perf_counter()
        files[n] = write_dataset(args.work / f"rows-{n}.parquet", n)
        print(f"{n} rows: {files[n].stat().st_size / 1e9:.2f} GB ({time.perf_counter() - tic:.0f} s to have it)")
    results: dict[str, dict] = {"data": {}, "train": {}}
    for n in counts:
        results["data"][n] = _child(_DATA, str(files[n]), str(args.threads))
        results["train"][n] = _child(_TRAIN, str(files[n]), str(args.threads), str(home / f"run-{n}"))
        print(n, json.dumps(results["data"][n]), json.dumps(results["train"][n]))
    results["preview"] = preview_times(files, args.repeats)
    results["files_gb"] = {n: files[n].stat().st_size / 1e9 for n in counts}
    results["settings"] = {"threads": args.threads, "repeats": args.repeats, "row_group": GROUP, "cpus": os.cpu_count()}
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"{'rows':>9} {'file GB':>8} {'data MiB':>9} {'open s':>7} {'draw s/b':>9} {'train MiB':>10} "
          f"{'setup s':>8} {'wall s':>7} {'preview warm s':>15}")  # fmt: skip
    for n in counts:
        d, t, p = results["data"][n], results["train"][n], results["preview"][n]
        print(f"{n:>9} {results['files_gb'][n]:>8.2f} {d['peak_growth_mib']:>9.1f} {d['open_s']:>7.2f} "
              f"{d['draw_s_per_batch']:>9.3f} {t['peak_rss_mib']:>10.0f} {t['setup_s']:>8.1f} {t['wall_s']:>7.1f} "
              f"{p['warm_median_s']:>15.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
