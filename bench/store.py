"""Run-store latency at scale: p50/p95 of the rollout table and metrics routes on a store of a million rows.

Fills a fresh store (SQLite and/or PostgreSQL) with ``--rows`` rollout rows over ``--runs`` runs, 3 images each
(links into a pool of 2,000 images), plus 20 metric keys x 10,000 steps for ``--metric-runs`` of the runs; then
times ``GET /api/v1/runs/{id}/samples`` (pages of 50) and ``GET /api/v1/runs/{id}/metrics`` through the real app
(FastAPI TestClient, bearer token), each request on a random run.

    .venv/bin/python bench/store.py [--rows 1000000] [--runs 200] [--db sqlite|postgresql|both]

Rows are written with bulk SQL (sqlite3 ``executemany`` / PostgreSQL ``COPY``), shaped exactly like what
``StoreWriter.append_samples`` writes; image files are not written (only JSON routes are timed). The PostgreSQL
database (``collage_bench_<random>`` at ``--pg-admin-url``'s server) is dropped at the end, even on failure,
unless ``--keep-db``; ``--reuse-db NAME`` times a kept one again (``--only TEXT``: only the queries named so).
``--bulk`` (PostgreSQL) loads ten million rows in reasonable time: the rollout tables lose their secondary
indexes and constraints for the COPY and get them back after, from the definitions the migrations made.
Prints a Markdown table.

    nice -n 10 .venv/bin/python bench/store.py --db postgresql --rows 10000000 --bulk
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sqlalchemy import insert, update  # noqa: E402

from collage.app.store.engine import engine_for, upgrade  # noqa: E402
from collage.app.store.images import relative_path  # noqa: E402
from collage.app.store.tables import Image, Run  # noqa: E402
from collage.app.store.writer import NULL_REWARD, StoreWriter, prompt_text  # noqa: E402

API = "/api/v1"
PAGE = 50  # rows per samples page
PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/test"
GROUP_SIZE = 4
IMAGES_PER_ROW = 3
IMAGE_POOL = 2_000
DATASET_ROWS = 1_000
COMPLETION_POOL = 4_096
MAX_COMPLETION_LENGTH = 256
METRIC_STEPS = 10_000
METRIC_KEYS = [
    "loss", "kl", "entropy", "grad_norm", "learning_rate", "step_time", "reward", "reward_std",
    "frac_reward_zero_std", "rewards/accuracy/mean", "rewards/accuracy/std", "rewards/format/mean",
    "rewards/format/std", "completions/mean_length", "completions/min_length", "completions/max_length",
    "completions/clipped_ratio", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
]  # fmt: skip
RARE_WORD = "zebra"  # in about 2% of completions: the text search has to read ~2,500 rows for a page of 50
# in about 2% of the completions of every other run and in none of the rest: searched for in a run without it, the
# worst case of a table-wide text index (common in the store, so not worth using; absent here, so every row read)
NEEDLE_WORD = "giraffe"
SAMPLE_COLUMNS = (
    "id", "run_id", "step", "group", "index", "prompt", "prompt_text", "completion", "rewards", "reward",
    "reward_sort", "advantage", "completion_length", "truncated", "num_images", "group_mean", "group_std",
    "zero_std", "dataset_row",
)  # fmt: skip
WORDS = (
    "the image shows a red square blue circle green triangle on left right top bottom of each picture there are "
    "two three four five six seven I count first second third so answer is total number objects shapes colour "
    "looking at carefully we see one more than in and then which means final"
).split()
QUESTIONS = [
    "How many red squares are there across the {n} images?",
    "Which image has the most circles? Answer with its number.",
    "Count the triangles in image {k} and in image {j}; what is the sum?",
    "Is the blue shape in image {k} larger than the one in image {j}?",
    "What colour is the largest shape in the images?",
]


# ------------------------------------------------------------------------------------------------ data


@dataclass
class Pools:
    """What rows are drawn from: images, dataset rows (prompt + its images) and completions."""

    images: list[dict[str, Any]]
    dataset: list[tuple[str, str, list[str]]]  # (prompt JSON, prompt_text, image hashes)
    completions: list[tuple[str, int]]  # (text, completion_length in tokens)


def make_pools(rng: random.Random) -> Pools:
    images = []
    for i in range(IMAGE_POOL):
        sha = hashlib.sha256(f"bench-image-{i}".encode()).hexdigest()
        width, height = rng.choice((224, 256, 320, 384, 448, 512)), rng.choice((224, 256, 320, 384, 448, 512))
        images.append(
            {"sha256": sha, "width": width, "height": height, "format": "png",
             "size_bytes": int(width * height * rng.uniform(0.3, 1.2)), "path": relative_path(sha)}
        )  # fmt: skip
    dataset = []
    for _ in range(DATASET_ROWS):
        shas = [img["sha256"] for img in rng.sample(images, IMAGES_PER_ROW)]
        k, j = rng.sample(range(1, IMAGES_PER_ROW + 1), 2)
        question = rng.choice(QUESTIONS).format(n=IMAGES_PER_ROW, k=k, j=j)
        content = [{"type": "image"} for _ in shas] + [{"type": "text", "text": question}]
        prompt = [{"role": "user", "content": content}]
        dataset.append((json.dumps(prompt), prompt_text(prompt), shas))
    completions = []
    for _ in range(COMPLETION_POOL):
        words = rng.choices(WORDS, k=rng.randint(20, 160))
        if rng.random() < 0.02:
            words.insert(rng.randrange(len(words)), RARE_WORD)
        words += ["<answer>", str(rng.randint(0, 12)), "</answer>"]
        completions.append((" ".join(words), int(len(words) * 1.3)))
    return Pools(images=images, dataset=dataset, completions=completions)


def run_rows(
    rng: random.Random, pools: Pools, run_id: str, first_id: int, rows: int, rows_per_step: int, needle: bool = False
) -> Iterator[tuple[tuple[Any, ...], list[str]]]:
    """One run's rows (in ``SAMPLE_COLUMNS`` order) with their image hashes, written step by step, group by
    group, as the trainer logs them: about 1% unscorable (NULL reward), 5% truncated, zero-std groups as they
    come (rewards are discrete), accuracy rising over the run. ``needle``: ``NEEDLE_WORD`` ends about 2% of the
    completions (drawn from a generator of its own, so the other columns are the same either way)."""
    steps = math.ceil(rows / rows_per_step)
    needles = random.Random(f"{run_id}-{NEEDLE_WORD}")
    sample_id = first_id
    for step in range(1, steps + 1):
        p_correct = 0.15 + 0.7 * step / steps
        in_step = min(rows_per_step, rows - (step - 1) * rows_per_step)
        for group in range(math.ceil(in_step / GROUP_SIZE)):
            row = rng.randrange(DATASET_ROWS)
            prompt, ptext, shas = pools.dataset[row]
            members = []
            for _ in range(min(GROUP_SIZE, in_step - group * GROUP_SIZE)):
                fmt = 1.0 if rng.random() < 0.9 else 0.0
                acc = None if rng.random() < 0.01 else (1.0 if rng.random() < p_correct else 0.0)
                members.append((acc, fmt, None if acc is None else acc + 0.5 * fmt))
            scored = [r for _, _, r in members if r is not None]
            mean = statistics.fmean(scored) if scored else None
            std = statistics.stdev(scored) if len(scored) > 1 else (0.0 if scored else None)
            for index, (acc, fmt, reward) in enumerate(members):
                completion, length = rng.choice(pools.completions)
                if needle and needles.random() < 0.02:
                    completion = f"{completion} {NEEDLE_WORD}"
                truncated = rng.random() < 0.05
                if truncated:
                    length = MAX_COMPLETION_LENGTH
                advantage = 0.0 if reward is None or std is None else (reward - mean) / (std + 1e-4)
                yield (
                    (sample_id, run_id, step, group, index, prompt, ptext, completion,
                     json.dumps({"accuracy": acc, "format": fmt}), reward,
                     NULL_REWARD if reward is None else reward, advantage, length, truncated, len(shas), mean, std,
                     std is not None and abs(std) < 1e-8, row),
                    shas,
                )  # fmt: skip
                sample_id += 1


def metric_rows(rng: random.Random, run_id: str) -> Iterator[tuple[str, str, int, float | None]]:
    for k, key in enumerate(METRIC_KEYS):
        level, noise = 1.0 + k, 0.05 * (1 + k % 5)
        for step in range(1, METRIC_STEPS + 1):
            value = level * (1 - 0.5 * step / METRIC_STEPS) + rng.gauss(0, noise)
            yield run_id, key, step, None if rng.random() < 0.0005 else value  # a few NaN/inf logged as NULL


# ------------------------------------------------------------------------------------------------ fill


@dataclass
class Store:
    kind: str
    url: str
    run_ids: list[str] = field(default_factory=list)
    metric_run_ids: list[str] = field(default_factory=list)
    steps: int = 0
    fill_s: dict[str, float] = field(default_factory=dict)


def create_runs(store: Store, writer: StoreWriter, pools: Pools, runs: int, steps: int) -> None:
    """Runs through the writer (as the API creates them), marked succeeded; the image pool's rows."""
    for i in range(runs):
        config = {
            "name": f"bench-{i:03d}", "algorithm": "grpo" if i % 3 else "rloo", "tags": ["bench"],
            "model": {"path": "Qwen/Qwen2-VL-2B-Instruct"}, "dataset": {"source": "synth:count-red"},
            "train": {"max_steps": steps},
        }  # fmt: skip
        store.run_ids.append(writer.create_run(config).id)
    with writer.engine.begin() as conn:
        conn.execute(update(Run).values(status="succeeded", step=steps))
    with writer.engine.begin() as conn:
        conn.execute(insert(Image.__table__), pools.images)


def fill(store: Store, args: argparse.Namespace, artifacts: Path) -> None:
    rng = random.Random(args.seed)
    pools = make_pools(rng)
    engine = engine_for(store.url)
    writer = StoreWriter(engine, artifacts)
    per_run = args.rows // args.runs
    store.steps = math.ceil(per_run / args.rows_per_step)
    started = time.perf_counter()
    create_runs(store, writer, pools, args.runs, store.steps)
    store.metric_run_ids = store.run_ids[: args.metric_runs]

    def samples() -> Iterator[tuple[list[tuple], list[tuple]]]:
        """Batches of (sample rows, sample_images rows), a few runs at a time (--bulk: the server links the images)."""
        batch: list[tuple] = []
        links: list[tuple] = []
        next_id = 1
        for position, run_id in enumerate(store.run_ids):
            rows = run_rows(rng, pools, run_id, next_id, per_run, args.rows_per_step, needle=position % 2 == 1)
            for row, shas in rows:
                batch.append(row)
                if not args.bulk:
                    links.extend((row[0], pos, sha) for pos, sha in enumerate(shas))
            next_id += per_run
            if len(batch) >= 50_000:
                yield batch, links
                batch, links = [], []
        if batch:
            yield batch, links

    metrics = (m for run_id in store.metric_run_ids for m in metric_rows(rng, run_id))
    raw = engine.raw_connection()
    try:
        if store.kind == "sqlite":
            _fill_sqlite(raw, samples(), metrics, store)
        elif args.bulk:
            _fill_postgresql_bulk(raw, samples(), metrics, store, pools)
        else:
            _fill_postgresql(raw, samples(), metrics, store)
    finally:
        raw.close()
    # the bulk load bypassed the writer, which keeps the metric rollups: build them as it would have
    from collage.app.store.engine import session_scope
    from collage.app.store.rollups import rebuild

    rollup_started = time.perf_counter()
    for run_id in store.metric_run_ids:
        with session_scope(engine) as session:
            rebuild(session, run_id)
    store.fill_s["metric rollups"] = time.perf_counter() - rollup_started
    store.fill_s["total"] = time.perf_counter() - started


def _timed(store: Store, name: str, started: float) -> None:
    store.fill_s[name] = store.fill_s.get(name, 0.0) + time.perf_counter() - started


def _fill_sqlite(raw, samples, metrics, store: Store) -> None:
    columns = ", ".join(f'"{c}"' for c in SAMPLE_COLUMNS)
    marks = ", ".join("?" for _ in SAMPLE_COLUMNS)
    cur = raw.cursor()
    started = time.perf_counter()
    for batch, links in samples:
        cur.executemany(f"INSERT INTO samples ({columns}) VALUES ({marks})", batch)
        cur.executemany("INSERT INTO sample_images (sample_id, position, sha256) VALUES (?, ?, ?)", links)
        raw.commit()
    _timed(store, "samples", started)
    started = time.perf_counter()
    cur.executemany("INSERT INTO metrics (run_id, key, step, value) VALUES (?, ?, ?, ?)", metrics)
    raw.commit()
    _timed(store, "metrics", started)
    cur.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    cur.close()


def _fill_postgresql(raw, samples, metrics, store: Store) -> None:
    columns = ", ".join(f'"{c}"' for c in SAMPLE_COLUMNS)
    conn = raw.driver_connection  # psycopg 3
    started = time.perf_counter()
    for batch, links in samples:
        with conn.cursor() as cur:
            with cur.copy(f"COPY samples ({columns}) FROM STDIN") as copy:
                for row in batch:
                    copy.write_row(row)
            with cur.copy("COPY sample_images (sample_id, position, sha256) FROM STDIN") as copy:
                for link in links:
                    copy.write_row(link)
        conn.commit()
    with conn.cursor() as cur:
        cur.execute("SELECT setval(pg_get_serial_sequence('samples', 'id'), (SELECT max(id) FROM samples))")
    conn.commit()
    _timed(store, "samples", started)
    started = time.perf_counter()
    with conn.cursor() as cur, cur.copy("COPY metrics (run_id, key, step, value) FROM STDIN") as copy:
        for row in metrics:
            copy.write_row(row)
    conn.commit()
    _timed(store, "metrics", started)
    started = time.perf_counter()
    conn.autocommit = True
    conn.execute("VACUUM ANALYZE")
    conn.autocommit = False
    _timed(store, "vacuum analyze", started)


def _fill_postgresql_bulk(raw, samples, metrics, store: Store, pools: Pools) -> None:
    """``--bulk``: COPY the rows into tables stripped of their secondary indexes and of every constraint but the
    primary keys, link the images on the server (a row's images are its dataset row's), then build the indexes
    and constraints once, from the migrations' own definitions as the database holds them."""
    conn = raw.driver_connection  # psycopg 3
    _renice_backend(conn)
    started = time.perf_counter()
    rebuild = _strip_samples(conn)
    _timed(store, "drop indexes", started)
    started = time.perf_counter()
    columns = ", ".join(f'"{c}"' for c in SAMPLE_COLUMNS)
    for batch, _ in samples:
        with conn.cursor() as cur, cur.copy(f"COPY samples ({columns}) FROM STDIN") as copy:
            for row in batch:
                copy.write_row(row)
        conn.commit()
    with conn.cursor() as cur:
        cur.execute("SELECT setval(pg_get_serial_sequence('samples', 'id'), (SELECT max(id) FROM samples))")
    conn.commit()
    _timed(store, "samples", started)
    started = time.perf_counter()
    with conn.cursor() as cur:
        cur.execute("CREATE TEMPORARY TABLE bench_links (dataset_row integer, position integer, sha256 varchar(64))")
        with cur.copy("COPY bench_links (dataset_row, position, sha256) FROM STDIN") as copy:
            for row, (_, _, shas) in enumerate(pools.dataset):
                for position, sha in enumerate(shas):
                    copy.write_row((row, position, sha))
        cur.execute("INSERT INTO sample_images (sample_id, position, sha256) SELECT s.id, l.position, l.sha256 "
                    "FROM samples s JOIN bench_links l ON l.dataset_row = s.dataset_row")  # fmt: skip
    conn.commit()
    _timed(store, "image links", started)
    started = time.perf_counter()
    with conn.cursor() as cur, cur.copy("COPY metrics (run_id, key, step, value) FROM STDIN") as copy:
        for row in metrics:
            copy.write_row(row)
    conn.commit()
    _timed(store, "metrics", started)
    started = time.perf_counter()
    with conn.cursor() as cur:
        cur.execute("SET maintenance_work_mem = '1GB'")
        cur.execute("SET max_parallel_maintenance_workers = 0")  # one backend, reniced with this process
        for statement in rebuild:
            cur.execute(statement)
            conn.commit()
    _timed(store, "indexes and constraints", started)
    started = time.perf_counter()
    conn.autocommit = True
    conn.execute("VACUUM ANALYZE")
    conn.autocommit = False
    _timed(store, "vacuum analyze", started)


def _strip_samples(conn) -> list[str]:
    """Drop every constraint but the primary keys, then every other index, of samples and sample_images; the
    statements that make them again (indexes first, then the constraints that check against them)."""
    tables = "('samples'::regclass, 'sample_images'::regclass)"
    with conn.cursor() as cur:
        constraints = cur.execute(
            "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) FROM pg_constraint "
            f"WHERE conrelid IN {tables} AND contype <> 'p' ORDER BY contype DESC, conname"  # unique before foreign
        ).fetchall()
        for table, name, _ in constraints:
            cur.execute(f'ALTER TABLE {table} DROP CONSTRAINT "{name}"')
        indexes = cur.execute(
            "SELECT indexrelid::regclass::text, pg_get_indexdef(indexrelid) FROM pg_index "
            f"WHERE indrelid IN {tables} AND NOT indisprimary ORDER BY 1"
        ).fetchall()
        for name, _ in indexes:
            cur.execute(f"DROP INDEX {name}")
    conn.commit()
    return [sql for _, sql in indexes] + [f'ALTER TABLE {t} ADD CONSTRAINT "{n}" {sql}' for t, n, sql in constraints]


def _renice_backend(conn) -> None:
    """Give the server process of ``conn`` (building indexes for minutes) this process's niceness, where the
    server runs on this machine; otherwise leave it."""
    import os

    host = conn.info.host
    if not (host.startswith("/") or host in ("127.0.0.1", "localhost", "::1")):
        return
    try:
        pid = conn.info.backend_pid
        if Path(f"/proc/{pid}/comm").read_text().strip() != "postgres":
            return
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        if os.getpriority(os.PRIO_PROCESS, pid) < mine:
            os.setpriority(os.PRIO_PROCESS, pid, mine)
    except OSError:  # another machine's process id, or not ours to change
        pass


# ---------------------------------------------------------------------------------------------- timing


class Dispatcher:
    """Hands nothing to any worker: the benchmark only reads."""

    def submit(self, run_id: str, queue: str) -> None:
        pass

    def cancel(self, run_id: str) -> None:
        pass

    def health(self) -> dict[str, Any]:
        return {"broker": {"ok": True, "url": "bench"}, "workers": []}


@dataclass
class Query:
    name: str
    route: str  # "samples" or "metrics"
    params: Callable[[Any, random.Random, str], dict[str, Any]]  # (client, rng, run_id) -> query parameters
    max_points: int | None = None  # metrics: the most points per key the answer may hold (None: every step)
    needle_free: bool = False  # samples: timed on the runs without NEEDLE_WORD only, where the page is empty


def _second_page(client, _rng: random.Random, run_id: str) -> dict[str, Any]:
    first = client.get(f"{API}/runs/{run_id}/samples", params={"sort": "-reward", "limit": PAGE})
    first.raise_for_status()
    return {"sort": "-reward", "limit": PAGE, "cursor": first.json()["next_cursor"]}


def queries(steps: int) -> list[Query]:
    keys = ",".join(METRIC_KEYS)
    return [
        Query("samples sort=step (default)", "samples", lambda c, r, i: {"limit": PAGE}),
        Query("samples sort=-reward", "samples", lambda c, r, i: {"sort": "-reward", "limit": PAGE}),
        Query("samples sort=advantage", "samples", lambda c, r, i: {"sort": "advantage", "limit": PAGE}),
        Query("samples advantage=pos", "samples", lambda c, r, i: {"advantage": "pos", "limit": PAGE}),
        Query(
            "samples min_reward=0.5 sort=-reward",
            "samples",
            lambda c, r, i: {"min_reward": 0.5, "sort": "-reward", "limit": PAGE},
        ),
        Query("samples step=N", "samples", lambda c, r, i: {"step": r.randint(1, steps), "limit": PAGE}),
        Query("samples zero_std_groups=true", "samples", lambda c, r, i: {"zero_std_groups": "true", "limit": PAGE}),
        Query(f"samples q={RARE_WORD} (~2% of rows)", "samples", lambda c, r, i: {"q": RARE_WORD, "limit": PAGE}),
        Query(
            f"samples q={NEEDLE_WORD} in a run without it (~1% of the store's rows)",
            "samples",
            lambda c, r, i: {"q": NEEDLE_WORD, "limit": PAGE},
            needle_free=True,
        ),
        Query("samples sort=-reward page 2 (cursor)", "samples", _second_page),
        Query(
            f"metrics {len(METRIC_KEYS)} keys x {METRIC_STEPS:,} steps (default max_points=2000)",
            "metrics",
            lambda c, r, i: {"keys": keys},
            max_points=2000,
        ),
        Query(
            f"metrics {len(METRIC_KEYS)} keys x {METRIC_STEPS:,} steps, max_points=500",
            "metrics",
            lambda c, r, i: {"keys": keys, "max_points": 500},
            max_points=500,
        ),
        Query(
            f"metrics every key ({len(METRIC_KEYS)}) x {METRIC_STEPS:,} steps, max_points=1000 (the run page)",
            "metrics",
            lambda c, r, i: {"max_points": 1000},
            max_points=1000,
        ),
    ]


def _check(query: Query, response) -> None:
    if response.status_code != 200:
        raise RuntimeError(f"{query.name}: HTTP {response.status_code}: {response.text[:500]}")
    body = response.json()
    if query.route == "samples" and query.needle_free:
        if body["items"]:
            raise RuntimeError(f"{query.name}: {len(body['items'])} rows in a run that should have none")
        return
    if query.route == "samples":
        # a full page, or the last one (a small --rows leaves text search fewer than 50 matches per run)
        if not body["items"] or len(body["items"]) != PAGE and body["next_cursor"] is not None:
            raise RuntimeError(f"{query.name}: a page of {len(body['items'])} rows, not {PAGE}")
        return
    if sorted(body) != sorted(METRIC_KEYS):
        raise RuntimeError(f"{query.name}: keys {sorted(body)[:5]}...")
    points = len(body[METRIC_KEYS[0]])
    if points > (query.max_points or METRIC_STEPS) or points < min(query.max_points or METRIC_STEPS, 200):
        raise RuntimeError(f"{query.name}: {points} points per key")


def measure(store: Store, args: argparse.Namespace, home: Path) -> list[tuple[str, float, float]]:
    from fastapi.testclient import TestClient

    from collage.app.cli.serve import freeze_startup_heap
    from collage.app.core.settings import Settings
    from collage.app.main import create_app
    from collage.app.store.tokens import create_token

    settings = Settings(home=home, database_url=store.url, broker_url="memory://", artifacts=home / "artifacts")
    app = create_app(settings, Dispatcher())
    token = create_token(engine_for(store.url), f"bench-{uuid.uuid4().hex[:8]}")  # --reuse-db: not the first
    client = TestClient(app, headers={"Authorization": f"Bearer {token}"})
    if not args.no_freeze:
        freeze_startup_heap()  # as `collage serve` does before it answers
    rng = random.Random(args.seed + 1)
    results = []
    for query in queries(store.steps):
        if args.only and not any(part in query.name for part in args.only):
            continue
        runs = store.run_ids if query.route == "samples" else store.metric_run_ids
        if query.needle_free:
            runs = store.run_ids[::2]  # fill(): the runs at odd positions have the needle
        count = args.requests if query.route == "samples" else args.metric_requests
        times = []
        for i in range(args.warmup + count):
            run_id = rng.choice(runs)
            params = query.params(client, rng, run_id)
            started = time.perf_counter()
            response = client.get(f"{API}/runs/{run_id}/{query.route}", params=params)
            elapsed = time.perf_counter() - started
            _check(query, response)
            if i >= args.warmup:
                times.append(elapsed * 1000)
        p50 = statistics.median(times)
        p95 = statistics.quantiles(times, n=20, method="inclusive")[18]
        results.append((query.name, p50, p95))
        print(f"  {store.kind}: {query.name}: p50 {p50:.1f} ms, p95 {p95:.1f} ms", file=sys.stderr, flush=True)
    client.close()
    return results


# ------------------------------------------------------------------------------------------------ main


def bench(kind: str, args: argparse.Namespace) -> tuple[Store, list[tuple[str, float, float]]]:
    import psycopg

    with tempfile.TemporaryDirectory(prefix="collage-bench-") as tmp:
        home = Path(tmp)
        name = None
        if kind == "sqlite":
            url = f"sqlite:///{home / 'collage.db'}"
        else:
            name = args.reuse_db or f"collage_bench_{uuid.uuid4().hex[:10]}"
            if not args.reuse_db:
                with psycopg.connect(args.pg_admin_url, autocommit=True) as conn:
                    conn.execute(f'CREATE DATABASE "{name}"')
            url = f"postgresql+psycopg://{args.pg_admin_url.split('://', 1)[1].rsplit('/', 1)[0]}/{name}"
        try:
            upgrade(url)
            store = Store(kind, url)
            if args.reuse_db:
                reopen(store)
                print(f"{kind}: reusing {name}: {len(store.run_ids)} runs", file=sys.stderr, flush=True)
            else:
                print(f"{kind}: filling {args.rows:,} rows over {args.runs} runs ...", file=sys.stderr, flush=True)
                fill(store, args, home / "artifacts")
                fills = ", ".join(f"{k} {v:.0f} s" for k, v in store.fill_s.items())
                print(f"{kind}: filled ({fills})", file=sys.stderr, flush=True)
            return store, measure(store, args, home)
        finally:
            engine_for(url).dispose()
            engine_for.cache_clear()
            if name is not None and (args.keep_db or args.reuse_db):
                print(f"{kind}: kept database {name}: --reuse-db {name} times it again", file=sys.stderr)
            elif name is not None:
                with psycopg.connect(args.pg_admin_url, autocommit=True) as conn:
                    conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def reopen(store: Store) -> None:
    """The runs of a store this script filled before (``--reuse-db``)."""
    from sqlalchemy import distinct, func, select

    from collage.app.store.tables import MetricRollup

    with engine_for(store.url).connect() as conn:
        store.run_ids = list(conn.execute(select(Run.id).order_by(Run.name)).scalars())
        with_metrics = set(conn.execute(select(distinct(MetricRollup.run_id))).scalars())
        store.metric_run_ids = [run_id for run_id in store.run_ids if run_id in with_metrics]
        store.steps = conn.execute(select(func.max(Run.step))).scalar_one()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rollout rows in all (default 1,000,000)")
    parser.add_argument("--runs", type=int, default=200, help="runs the rows are spread over (default 200)")
    parser.add_argument("--rows-per-step", type=int, default=100, help="rows per step, groups of 4 (default 100)")
    parser.add_argument("--metric-runs", type=int, default=5, help="runs given 20 keys x 10,000 steps (default 5)")
    parser.add_argument("--db", choices=("sqlite", "postgresql", "both"), default="both")
    parser.add_argument("--requests", type=int, default=100, help="timed requests per samples query")
    parser.add_argument("--metric-requests", type=int, default=20, help="timed requests per metrics query")
    parser.add_argument("--warmup", type=int, default=5, help="untimed requests before each query's timed ones")
    parser.add_argument("--pg-admin-url", default=PG_ADMIN_URL, help="a PostgreSQL database to create one from")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--bulk",
        action="store_true",
        help="postgresql: load without the secondary indexes and constraints of the rollout tables and build "
        "them after, link images on the server (10M rows in reasonable time)",
    )
    parser.add_argument("--keep-db", action="store_true", help="postgresql: keep the database at the end")
    parser.add_argument("--reuse-db", metavar="NAME", help="postgresql: time a database kept before (no fill)")
    parser.add_argument("--only", action="append", metavar="TEXT", help="time only the queries whose name has TEXT")
    parser.add_argument("--no-freeze", action="store_true",
                        help="leave the start-up heap to the garbage collector (collage serve freezes it)")  # fmt: skip
    args = parser.parse_args()
    if args.rows < args.runs or args.metric_runs > args.runs:
        parser.error("need --rows >= --runs >= --metric-runs")
    if (args.bulk or args.keep_db or args.reuse_db) and args.db != "postgresql":
        parser.error("--bulk, --keep-db and --reuse-db need --db postgresql")

    kinds = ["sqlite", "postgresql"] if args.db == "both" else [args.db]
    done = [bench(kind, args) for kind in kinds]
    print(f"\n{args.rows:,} rollout rows ({IMAGES_PER_ROW} images each) over {args.runs} runs; metrics: "
          f"{len(METRIC_KEYS)} keys x {METRIC_STEPS:,} steps for {args.metric_runs} runs; "
          f"{args.requests} requests per samples query, {args.metric_requests} per metrics query\n")  # fmt: skip
    for store, _ in done:
        fills = ", ".join(f"{k} {v:.1f} s" for k, v in store.fill_s.items())
        print(f"- fill {store.kind}: {fills or f'none (--reuse-db {args.reuse_db})'}")
    print("\n| database | query | p50 ms | p95 ms |\n|---|---|---:|---:|")
    for store, results in done:
        for name, p50, p95 in results:
            print(f"| {store.kind} | {name} | {p50:.1f} | {p95:.1f} |")


if __name__ == "__main__":
    main()
