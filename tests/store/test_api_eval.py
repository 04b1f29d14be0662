"""Evaluation rollouts and rewards through the API (issue 18, section 1), on SQLite and PostgreSQL: the `split`
filter of the samples, their count, histogram and export (rows of both splits at the same step; training rows
by default; cursors bound to their split), the indexes those queries read, and each run's latest and best
`eval/reward` in the runs list and on the run.
"""

from __future__ import annotations

import csv
import io
import json

from sqlalchemy import event
from sqlmodel import Session

from collage.app.store import queries
from collage.app.store.writer import ImageIn, SampleIn
from tests.support.api import png
from tests.support.rollouts import all_pages, rollout_config

API = "/api/v1"


def _rows(split: str, step: int, groups: int, gens: int) -> list[SampleIn]:
    """Rows told apart by their completion (`<split> s<step> g<group> c<index>`); eval rows as the trainer writes
    them: advantage 0, group = the held-out prompt's index."""
    rows = []
    for g in range(groups):
        for i in range(gens):
            reward = round(0.1 * (g + i) + (0.05 if split == "eval" else 0.0), 3)
            rows.append(
                SampleIn(group=g, index=i, prompt=[{"role": "user", "content": [{"type": "image"},
                         {"type": "text", "text": f"how many? {g}"}]}], completion=f"{split} s{step} g{g} c{i}",
                         images=[ImageIn(png((30 * g, 100 if split == "eval" else 0, 40 * i)))],
                         rewards={"accuracy": reward, "numeric": 0.0}, reward=reward,
                         advantage=0.0 if split == "eval" else 0.5 - 0.25 * i, completion_length=2 + i + g,
                         truncated=False, group_mean=None if split == "eval" else 0.3,
                         group_std=None if split == "eval" else 0.1, dataset_row=100 + g if split == "eval" else g,
                         columns={"answer": str(g)}, split=split)
            )  # fmt: skip
    return rows


def _fill(app, run_id: str) -> None:
    """Training rows at steps 1..4 (2 groups x 4); eval rows at steps 0, 2 and 4 (3 prompts x 2), each eval in a
    call of its own after the step's training rows, as the trainer's store callback sends them."""
    writer = app.state.writer
    for step in range(5):
        if step:
            writer.append_samples(run_id, step, _rows("train", step, 2, 4))
        if step % 2 == 0:
            writer.append_samples(run_id, step, _rows("eval", step, 3, 2))


def test_the_split_filter_keeps_eval_rollouts_apart_in_every_route(api):
    client, _, _, app = api
    run = client.post(f"{API}/runs", json=rollout_config()).json()["id"]
    _fill(app, run)

    train = all_pages(client, run)
    assert len(train) == 4 * 8 and {s["split"] for s in train} == {"train"}
    assert all(s["completion"].startswith("train ") for s in train)
    assert all_pages(client, run, split="train") == train  # the default is train
    evals = all_pages(client, run, split="eval", limit=4)  # keyset pages within the split
    assert len(evals) == 3 * 6 and {s["split"] for s in evals} == {"eval"}
    assert [(s["step"], s["group"], s["index"]) for s in evals] == [
        (step, g, i) for step in (0, 2, 4) for g in range(3) for i in range(2)
    ]
    assert all(s["completion"] == f"eval s{s['step']} g{s['group']} c{s['index']}" for s in evals)
    assert {s["advantage"] for s in evals} == {0.0} and evals[0]["dataset_row"] == 100

    # both splits at step 2: each filter sees only its own, the group view (step + group) too
    assert {s["completion"][:5] for s in all_pages(client, run, step=2)} == {"train"}
    at2 = all_pages(client, run, step=2, group=1, split="eval", sort="-reward")
    assert [s["completion"] for s in at2] == ["eval s2 g1 c1", "eval s2 g1 c0"]
    assert all_pages(client, run, step=2, group=2) == []  # training has groups 0 and 1 only
    best = all_pages(client, run, split="eval", sort="-reward.accuracy", min_reward=0.3, reward_name="accuracy")
    assert [s["rewards"]["accuracy"] for s in best] == sorted((s["rewards"]["accuracy"] for s in evals
                                                               if s["rewards"]["accuracy"] >= 0.3), reverse=True)  # fmt: skip

    # the count
    for params, expected in (({}, 32), ({"split": "train"}, 32), ({"split": "eval"}, 18),
                             ({"split": "eval", "step": 2}, 6), ({"split": "eval", "min_step": 3}, 6)):  # fmt: skip
        answer = client.get(f"{API}/runs/{run}/samples/count", params=params)
        assert answer.status_code == 200 and answer.json()["count"] == expected, (params, answer.text)

    # the histogram: the steps of the split, and one step's rows of the split
    histogram = client.get(f"{API}/runs/{run}/histogram", params={"field": "completion_length"}).json()
    assert histogram["split"] == "train" and histogram["steps"] == [1, 2, 3, 4] and histogram["total"] == 8
    histogram = client.get(f"{API}/runs/{run}/histogram", params={"split": "eval", "step": 2}).json()
    assert histogram["split"] == "eval" and histogram["steps"] == [0, 2, 4] and histogram["total"] == 6
    assert histogram["counts"] == [1, 2, 2, 1] and histogram["edges"][0] == 2.0  # lengths 2+i+g, g<3, i<2
    missing = client.get(f"{API}/runs/{run}/histogram", params={"split": "eval", "step": 3})
    assert missing.status_code == 422 and "steps with rows: 0..4 (3 steps)" in missing.json()["detail"][0]["message"]

    # the export: one split per download, each record saying which
    jsonl = client.get(f"{API}/runs/{run}/export", params={"what": "samples"})
    records = [json.loads(line) for line in jsonl.text.splitlines()]
    assert len(records) == 32 and {r["split"] for r in records} == {"train"}
    assert 'filename="' + run + '-samples.jsonl"' in jsonl.headers["content-disposition"]
    eval_csv = client.get(f"{API}/runs/{run}/export", params={"what": "samples", "split": "eval", "format": "csv"})
    table = list(csv.DictReader(io.StringIO(eval_csv.text)))
    assert len(table) == 18 and {r["split"] for r in table} == {"eval"} and table[0]["completion"] == "eval s0 g0 c0"
    assert 'filename="' + run + '-eval-samples.csv"' in eval_csv.headers["content-disposition"]
    import pyarrow.parquet as pq

    frame = pq.read_table(io.BytesIO(client.get(f"{API}/runs/{run}/export", params={
        "what": "samples", "split": "eval", "format": "parquet"}).content)).to_pylist()  # fmt: skip
    assert [r["completion"] for r in frame] == [r["completion"] for r in table]
    refused = client.get(f"{API}/runs/{run}/export", params={"what": "metrics", "split": "eval"})
    assert refused.status_code == 422 and refused.json()["detail"][0]["path"] == "query.split"

    # anything but train or eval is refused, naming the parameter, by every route that takes it
    for path in ("samples", "samples/count", "histogram", "export"):
        bad = client.get(f"{API}/runs/{run}/{path}", params={"split": "test"})
        assert bad.status_code == 422, (path, bad.text)
        assert bad.json()["detail"][0]["path"] == "query.split", path

    # a cursor belongs to its split
    page = client.get(f"{API}/runs/{run}/samples", params={"split": "eval", "limit": 5}).json()
    other = client.get(f"{API}/runs/{run}/samples", params={"cursor": page["next_cursor"], "limit": 5})
    assert other.status_code == 400 and other.json()["detail"].startswith("cursor was made for the eval samples of")
    page = client.get(f"{API}/runs/{run}/samples", params={"limit": 5}).json()
    other = client.get(f"{API}/runs/{run}/samples", params={"cursor": page["next_cursor"], "split": "eval"})
    assert other.status_code == 400 and other.json()["detail"].startswith(
        f"cursor was made for the samples of run {run} sorted by step, not for the eval samples of run {run}"
    )

    # a training step written again (a redelivery) replaces its training rows only, never its eval rows
    app.state.writer.append_samples(run, 2, _rows("train", 2, 1, 2))
    assert len(all_pages(client, run, step=2)) == 2 and len(all_pages(client, run, step=2, split="eval")) == 6


def _captured(engine):
    statements: list[tuple[str, object]] = []

    def capture(_conn, _cursor, statement, parameters, _context, _many):
        if "FROM samples" in statement and "sample_images" not in statement and not statement.startswith("EXPLAIN"):
            statements.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", capture)
    return statements, lambda: event.remove(engine, "before_cursor_execute", capture)


def _plan(engine, statement: str, parameters) -> str:
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            return " | ".join(row[-1] for row in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, parameters))
        return " | ".join(row[0].strip() for row in conn.exec_driver_sql("EXPLAIN " + statement, parameters))


# the indexes that lead with (run_id, split, step): ix_samples_split (run_id, split, step, id), and the position's
# unique constraint (run_id, split, step, group, index), which SQLite calls sqlite_autoindex_samples_1
SPLIT_INDEXES = ("ix_samples_split", "uq_samples_position", "sqlite_autoindex_samples_1")


def _reads_split_index(plan: str) -> bool:
    return any(index in plan for index in SPLIT_INDEXES) and "Seq Scan" not in plan and "SCAN samples" not in plan


def test_eval_queries_read_the_split_index_and_train_queries_keep_their_sort_indexes(api):
    """On a store whose statistics know its data (a run of 6,400 training rows and 96 eval rows, analysed): every
    eval query (each sort, a step, the count, the histogram, the export) reads an index that leads with (run_id,
    split, step), ``ix_samples_split`` (or the position's unique index); a training
    page sorted by an indexed column still walks that column's index (no sort of the run's rows), as before
    eval rows existed."""
    from sqlalchemy import insert, text

    from collage.app.store.tables import Sample, table_of

    client, _, _, app = api
    engine = app.state.engine
    run = client.post(f"{API}/runs", json=rollout_config()).json()["id"]
    rows = []
    for step in range(1, 101):
        for k in range(64):
            value = (step * 64 + k) % 97 / 97
            rows.append({"run_id": run, "step": step, "group": k // 8, "index": k % 8, "prompt": "p",
                         "prompt_text": "p", "completion": "c", "rewards": {}, "reward": value, "reward_sort": value,
                         "advantage": value - 0.5, "completion_length": k, "num_images": k % 4, "split": "train"})  # fmt: skip
    for step in range(0, 101, 25):
        for g in range(24):
            rows.append({"run_id": run, "step": step, "group": g, "index": 0, "prompt": "p", "prompt_text": "p",
                         "completion": "c", "rewards": {}, "reward": g / 24, "reward_sort": g / 24, "advantage": 0.0,
                         "completion_length": g, "num_images": 1, "split": "eval"})  # fmt: skip
    with engine.begin() as conn:
        conn.execute(insert(table_of(Sample)), rows)
        conn.execute(text("ANALYZE"))
    if engine.dialect.name == "sqlite":
        engine.dispose()  # new connections read the statistics

    statements, stop = _captured(engine)
    try:
        sorts = ["step", "-step", "-reward", "reward", "advantage", "-completion_length", "-num_images"]
        for sort in sorts:
            for extra in ({}, {"step": 50}):
                statements.clear()
                assert client.get(
                    f"{API}/runs/{run}/samples", params={"split": "eval", "sort": sort, **extra}
                ).is_success
                plan = _plan(engine, *statements[0])
                assert _reads_split_index(plan), (sort, extra, plan)
        eval_reads = {
            "count": ("samples/count", {"split": "eval"}),
            "histogram": ("histogram", {"split": "eval", "field": "reward"}),
            "export": ("export", {"split": "eval", "what": "samples"}),
        }
        for name, (path, params) in eval_reads.items():
            statements.clear()
            assert client.get(f"{API}/runs/{run}/{path}", params=params).is_success, name
            assert statements, name
            for statement in list(statements):
                plan = _plan(engine, *statement)
                assert _reads_split_index(plan), (name, plan)

        served = {"step": "ix_samples_s", "-reward": "ix_samples_reward", "advantage": "ix_samples_advantage",
                  "-completion_length": "ix_samples_length"}  # fmt: skip
        for sort, index in served.items():
            statements.clear()
            assert client.get(f"{API}/runs/{run}/samples", params={"sort": sort}).is_success
            plan = _plan(engine, *statements[0])
            assert index in plan and "TEMP B-TREE" not in plan and "Sort" not in plan, (sort, plan)
    finally:
        stop()


def _metrics(app, run_id: str, values: dict[int, float | None], key: str = "eval/reward") -> None:
    for step, value in values.items():
        app.state.writer.append_metrics(run_id, step, {key: value, "reward": 0.1})


def _eval_config(name: str, **train) -> dict:
    config = rollout_config(name=name)
    config["dataset"]["eval_fraction"] = 0.25
    config["train"].update({"eval_strategy": "steps", "eval_steps": 2, "save_steps": 2, **train})
    return config


def test_runs_carry_their_latest_and_best_eval_reward(api):
    client, _, _, app = api
    plain = client.post(f"{API}/runs", json=rollout_config(name="no-eval")).json()["id"]
    _metrics(app, plain, {1: None}, key="reward")
    climbing = client.post(f"{API}/runs", json=_eval_config("climbing")).json()["id"]
    _metrics(app, climbing, {0: 0.2, 2: 0.7, 4: float("nan"), 6: 0.5})  # NaN is stored as null: never the best
    # the run ranks its checkpoints by eval/reward, lower being better: its best is the lowest
    lower = client.post(f"{API}/runs", json=_eval_config(
        "lower", metric_for_best_model="eval/reward", greater_is_better=False)).json()["id"]  # fmt: skip
    _metrics(app, lower, {2: 0.4, 4: 0.1, 6: 0.3})
    # greater_is_better false for another metric says nothing about the reward: its best is the highest
    other = client.post(f"{API}/runs", json=_eval_config(
        "other", metric_for_best_model="eval/completion_length", greater_is_better=False)).json()["id"]  # fmt: skip
    _metrics(app, other, {2: 0.4, 4: 0.1, 6: 0.3})
    nan_last = client.post(f"{API}/runs", json=_eval_config("nan-last")).json()["id"]
    _metrics(app, nan_last, {2: 0.6, 4: float("nan")})
    expected = {plain: (None, None), climbing: (0.5, 0.7), lower: (0.3, 0.1), other: (0.3, 0.4), nan_last: (None, 0.6)}

    listed = {}
    cursor = None
    while True:  # pages of two: each page's values come from its own grouped query
        page = client.get(f"{API}/runs", params={"limit": 2, **({"cursor": cursor} if cursor else {})}).json()
        listed.update({r["id"]: (r["eval_reward"], r["best_eval_reward"]) for r in page["items"]})
        if not (cursor := page["next_cursor"]):
            break
    assert listed == expected
    for run_id, values in expected.items():
        one = client.get(f"{API}/runs/{run_id}").json()
        assert (one["eval_reward"], one["best_eval_reward"]) == values, run_id
    with Session(app.state.engine) as session:
        from collage.app.store.tables import Run

        runs = [session.get(Run, r) for r in expected]
        assert queries.eval_rewards(session, runs) == {r: v for r, v in expected.items() if r != plain}


def test_runs_carry_the_metric_they_pick_their_best_checkpoint_by(api):
    """The runs table shows the metric a run ranks its checkpoints by (accuracy 0.547), named, beside the
    weighted eval/reward (0.903): they are different numbers, and only the first is what `best` means."""
    client, _, _, app = api
    accuracy = client.post(f"{API}/runs", json=_eval_config("acc", metric_for_best_model="eval/accuracy")).json()["id"]
    for step, (acc, reward) in {2: (0.4, 0.9), 4: (0.6, 0.8), 6: (0.547, 0.903)}.items():
        app.state.writer.append_metrics(accuracy, step, {"eval/accuracy": acc, "eval/reward": reward, "reward": 0.1})
    # a loss is minimised unless the config says otherwise; a run named before its first evaluation shows the name
    loss = client.post(f"{API}/runs", json=_eval_config("loss", metric_for_best_model="eval/loss")).json()["id"]
    _metrics(app, loss, {2: 0.9, 4: 0.3, 6: 0.5}, key="eval/loss")
    waiting = client.post(f"{API}/runs", json=_eval_config("soon", metric_for_best_model="eval/accuracy")).json()["id"]
    plain = client.post(f"{API}/runs", json=_eval_config("plain")).json()["id"]  # ranks by nothing
    expected = {
        accuracy: ("eval/accuracy", 0.547, 0.6),
        loss: ("eval/loss", 0.5, 0.3),
        waiting: ("eval/accuracy", None, None),
        plain: (None, None, None),
    }
    fields = ("eval_metric", "eval_metric_value", "best_eval_metric")
    listed = {r["id"]: tuple(r[f] for f in fields) for r in client.get(f"{API}/runs").json()["items"]}
    assert {k: listed[k] for k in expected} == expected
    for run_id, values in expected.items():
        assert tuple(client.get(f"{API}/runs/{run_id}").json()[f] for f in fields) == values, run_id
    one = client.get(f"{API}/runs/{accuracy}").json()
    assert (one["eval_reward"], one["best_eval_reward"]) == (0.903, 0.903)  # the weighted reward, as such
