"""Dashboard read latency while runs train on the same machine, with and without a lower CPU priority for the
training (``COLLAGE_TRAIN_NICE``).

For each setting, `collage serve --workers K` starts on a COLLAGE_HOME shared by the repetitions (the tiny model
and the synthetic data are built once), K long CPU runs are submitted and, once every one of them trains,
``--clients`` concurrent clients read what the dashboard reads (the runs list, a run, its metrics, its rollout
table, its events: each client picks one at random, request after request) for ``--seconds``; then the runs are
cancelled and serve stops. Settings alternate within each repetition (nice 0, nice 10, nice 0, ...), so a change
in the machine's load hits both; the table gives, per setting, the median over repetitions of each
repetition's p50 and p95, and every repetition's own figures.

    .venv/bin/python bench/dashboard_load.py [--runs 2] [--clients 30] [--seconds 15] [--repeats 3] [--nice 0,10]

The clients run in this process (one asyncio loop, httpx), on the same CPUs: as a browser on the same machine
would. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
API = "/api/v1"
NO_TRAINING = -1  # the baseline setting: serve without workers, nothing training


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(name: str) -> dict:
    """A CPU run that trains for longer than the measurement (cancelled afterwards)."""
    return {
        "name": name,
        "model": {"path": "tiny:qwen2-vl", "dtype": "float32"},
        "dataset": {"source": "synth:count-red", "rows": 64, "min_images": 0, "max_images": 3},
        "rewards": [{"name": "numeric"}, {"name": "accuracy"}],
        "train": {"max_steps": 100_000, "per_device_train_batch_size": 8, "num_generations": 4,
                  "max_completion_length": 16, "max_prompt_length": 256, "learning_rate": 1e-4, "save_steps": 0},
        "resources": {"gpus": 0},
    }  # fmt: skip


@dataclass
class Measure:
    nice: int
    latencies: list[float] = field(default_factory=list)
    by_route: dict[str, list[float]] = field(default_factory=dict)
    errors: int = 0

    def add(self, route: str, seconds: float) -> None:
        self.latencies.append(seconds)
        self.by_route.setdefault(route, []).append(seconds)

    def pct(self, q: float, route: str | None = None) -> float:
        ordered = sorted(self.latencies if route is None else self.by_route.get(route, [0.0]))
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


ROUTES = {"": "GET /runs", "run": "GET /runs/{id}", "metrics": "GET /runs/{id}/metrics",
          "samples": "GET /runs/{id}/samples", "events": "GET /runs/{id}/events"}  # fmt: skip


class Serve:
    def __init__(self, home: Path, runs: int, nice: int):
        self.workers = runs
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "COLLAGE_HOME": str(home), "COLLAGE_TRAIN_NICE": str(nice),
               "COLLAGE_CANCEL_GRACE": "5"}  # fmt: skip
        for key in ("COLLAGE_DATABASE_URL", "COLLAGE_BROKER_URL", "COLLAGE_ARTIFACTS"):
            env.pop(key, None)
        self.log = home / f"serve-{self.port}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "collage.app.cli", "serve", "--port", str(self.port), "--workers", str(runs)],
            env=env, cwd=ROOT, stdout=self.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        token_file = home / "token"
        self.headers = self._wait(lambda: token_file.exists() and self._healthy(token_file.read_text().strip()), 180)

    def _healthy(self, token: str) -> dict[str, str] | None:
        headers = {"Authorization": f"Bearer {token}"}
        try:
            body = httpx.get(f"{self.base}{API}/health", headers=headers, timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return None
        return headers if body.get("ok") and (body.get("workers") or not self.workers) else None

    def _wait(self, predicate, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.5)
        raise RuntimeError(f"timed out; serve log:\n{self.log.read_text()[-3000:]}")

    def start_runs(self, count: int) -> list[str]:
        ids = []
        for i in range(count):
            answer = httpx.post(
                f"{self.base}{API}/runs", json=run_config(f"load-{i}"), headers=self.headers, timeout=30
            )
            answer.raise_for_status()
            ids.append(answer.json()["id"])

        def all_training() -> bool:
            runs = [httpx.get(f"{self.base}{API}/runs/{r}", headers=self.headers, timeout=30).json() for r in ids]
            failed = [r for r in runs if r["status"] not in ("queued", "running")]
            if failed:
                raise RuntimeError(f"a run ended: {failed[0]['status']} {failed[0].get('error')}")
            return all(r["progress"]["step"] >= 1 for r in runs)

        self._wait(all_training, 600)
        return ids

    def stop(self, ids: list[str]) -> None:
        for run_id in ids:
            httpx.post(f"{self.base}{API}/runs/{run_id}/cancel", headers=self.headers, timeout=30)
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


async def load(serve: Serve, ids: list[str], clients: int, seconds: float, interval: float, measure: Measure) -> None:
    paths = [("", f"{API}/runs?limit=50")]
    if not ids:  # nothing training: read the runs earlier repetitions left (cancelled, with metrics and rows)
        listed = httpx.get(f"{serve.base}{API}/runs?limit=2", headers=serve.headers, timeout=30).json()["items"]
        ids = [r["id"] for r in listed]
    for run_id in ids:
        paths += [
            ("run", f"{API}/runs/{run_id}"),
            ("metrics", f"{API}/runs/{run_id}/metrics?keys=reward,loss,kl,entropy&max_points=500"),
            ("samples", f"{API}/runs/{run_id}/samples?limit=50"),
            ("events", f"{API}/runs/{run_id}/events"),
        ]
    deadline = time.monotonic() + seconds
    rng = random.Random(0)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=serve.base, headers=serve.headers, timeout=60, limits=limits) as client:

        async def one_client() -> None:
            await asyncio.sleep(rng.uniform(0, interval))  # the clients' reads spread out, as browsers' are
            while time.monotonic() < deadline:
                route, path = rng.choice(paths)
                tic = time.perf_counter()
                try:
                    ok = (await client.get(path)).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    measure.add(route, time.perf_counter() - tic)
                else:
                    measure.errors += 1
                if interval:
                    await asyncio.sleep(rng.uniform(0.5, 1.5) * interval)

        await asyncio.gather(*(one_client() for _ in range(clients)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=2, help="runs training at once (one embedded worker each)")
    parser.add_argument("--clients", type=int, default=30)
    parser.add_argument("--interval", type=float, default=1.0,
                        help="seconds between one client's reads (x0.5-1.5, random); 0: back to back")  # fmt: skip
    parser.add_argument("--seconds", type=float, default=15.0, help="measurement per repetition and setting")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nice", default="0,10", help="the COLLAGE_TRAIN_NICE values to compare")
    parser.add_argument("--baseline", action="store_true", help="also measure with no run training")
    parser.add_argument("--home", default=None, help="COLLAGE_HOME to use (default: a new temporary one)")
    args = parser.parse_args()
    home = Path(args.home or tempfile.mkdtemp(prefix="collage-dashboard-load-"))
    settings = [int(n) for n in args.nice.split(",")] + ([NO_TRAINING] if args.baseline else [])
    results: dict[int, list[Measure]] = {n: [] for n in settings}
    for repeat in range(args.repeats):
        for nice in settings if repeat % 2 == 0 else settings[::-1]:
            runs = 0 if nice == NO_TRAINING else args.runs
            serve = Serve(home, runs, max(nice, 0))
            ids: list[str] = []
            try:
                ids = serve.start_runs(runs)
                measure = Measure(nice)
                asyncio.run(load(serve, ids, args.clients, args.seconds, args.interval, measure))
            finally:
                serve.stop(ids)
            results[nice].append(measure)
            print(f"repeat {repeat + 1} {label(nice)}: {len(measure.latencies)} reads, p50 {measure.pct(0.5):.0f} ms, "
                  f"p95 {measure.pct(0.95):.0f} ms, {measure.errors} errors", file=sys.stderr, flush=True)  # fmt: skip
    print(f"\n{args.runs} runs training, {args.clients} clients (a read every {args.interval:g} s each), "
          f"{args.seconds:.0f} s x {args.repeats} repetitions, {os.cpu_count()} CPUs\n")  # fmt: skip
    print("| training | p50 (median) | p95 (median) | reads/s (median) | errors | each repetition p50 / p95 |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for nice, measures in results.items():
        p50 = statistics.median(m.pct(0.5) for m in measures)
        p95 = statistics.median(m.pct(0.95) for m in measures)
        rate = statistics.median(len(m.latencies) / args.seconds for m in measures)
        each = ", ".join(f"{m.pct(0.5):.0f} / {m.pct(0.95):.0f}" for m in measures)
        errors = sum(m.errors for m in measures)
        print(f"| {label(nice)} | {p50:.0f} ms | {p95:.0f} ms | {rate:.0f} | {errors} | {each} |")
    print("\np95 by route (median over repetitions):\n")
    print("| training | " + " | ".join(ROUTES.values()) + " |")
    print("| --- |" + " ---: |" * len(ROUTES))
    for nice, measures in results.items():
        cells = [f"{statistics.median(m.pct(0.95, route) for m in measures):.0f} ms" for route in ROUTES]
        print(f"| {label(nice)} | " + " | ".join(cells) + " |")


def label(nice: int) -> str:
    return "none (no run training)" if nice == NO_TRAINING else f"{nice} (COLLAGE_TRAIN_NICE)"


if __name__ == "__main__":
    main()
