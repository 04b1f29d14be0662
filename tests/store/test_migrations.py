"""The migrations and the table models stay in step, and 0007 (eval rows, checkpoint details, jobs, uploads) keeps
what an older store held, on SQLite and PostgreSQL; on PostgreSQL, 0009 moves the text search indexes under the
run id and its downgrade brings the old ones back; 0012 (trajectories) gives older rows none."""

from __future__ import annotations

import pytest
from sqlalchemy import text


def test_the_migrated_schema_is_the_models_schema(empty_url):
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext
    from sqlmodel import SQLModel

    import collage.app.store.tables  # noqa: F401 - registers the tables
    from collage.app.store.engine import make_engine, upgrade

    upgrade(empty_url)
    engine = make_engine(empty_url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), SQLModel.metadata)
    engine.dispose()
    # 0003's trigram indexes exist on PostgreSQL only (a GIN index SQLite has no such thing as): not modelled
    diff = [d for d in diff if not (d[0] == "remove_index" and d[1].name.endswith("_trgm"))]
    assert diff == [], diff


def test_0007_keeps_old_rows_as_training_rows_and_lets_eval_rows_sit_beside_them(empty_url):
    from collage.app.store.engine import downgrade, make_engine, upgrade

    upgrade(empty_url, "0006")
    engine = make_engine(empty_url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO runs (id, name, algorithm, config, status, step, max_steps, model_path, "
                          "dataset_source, created_at, updated_at, attempt, warning_count) VALUES ('r', 'n', 'grpo', "
                          "'{}', 'succeeded', 0, 0, '', '', '2026-01-01 00:00:00', '2026-01-01 00:00:00', 1, 0)"))  # fmt: skip
        conn.execute(text('INSERT INTO samples (run_id, step, "group", "index", prompt, prompt_text, completion, '
                          "rewards, reward_sort, advantage, completion_length, truncated, num_images, zero_std) VALUES "
                          "('r', 1, 0, 0, '\"p\"', 'p', 'c', '{}', 0, 0, 1, false, 0, false)"))  # fmt: skip
        conn.execute(text("INSERT INTO checkpoints (run_id, step, path, created_at) VALUES "
                          "('r', 1, '/x', '2026-01-01 00:00:00')"))  # fmt: skip
    upgrade(empty_url)
    with engine.begin() as conn:
        assert conn.execute(text("SELECT split FROM samples")).scalars().all() == ["train"]
        assert conn.execute(text("SELECT attempt, bytes, kind, metric FROM checkpoints")).all() == [
            (None, None, None, None)
        ]
        # the same position in the eval split is another row
        conn.execute(text('INSERT INTO samples (run_id, split, step, "group", "index", prompt, prompt_text, '
                          "completion, rewards, reward_sort, advantage, completion_length, truncated, num_images, "
                          "zero_std) VALUES ('r', 'eval', 1, 0, 0, '\"p\"', 'p', 'c', '{}', 0, 0, 1, false, 0, false)"))  # fmt: skip
    with pytest.raises(Exception, match="(?i)unique"), engine.begin() as conn:
        conn.execute(text('INSERT INTO samples (run_id, split, step, "group", "index", prompt, prompt_text, '
                          "completion, rewards, reward_sort, advantage, completion_length, truncated, num_images, "
                          "zero_std) VALUES ('r', 'eval', 1, 0, 0, '\"p\"', 'p', 'c', '{}', 0, 0, 1, false, 0, false)"))  # fmt: skip
    downgrade(empty_url, "0006")  # and back: the eval rows go, the training rows stay
    with engine.begin() as conn:
        assert conn.execute(text("SELECT count(*) FROM samples")).scalar() == 1
    engine.dispose()


@pytest.mark.parametrize("empty_url", ["postgresql"], indirect=True)  # SQLite has no GIN: it scans one run's rows
def test_0009_moves_the_text_search_indexes_under_the_run_id_and_back(empty_url):
    """0009 replaces 0003's table-wide trigram indexes with ones led by the run id (a search names its run) and
    its downgrade brings the old ones back; a search's run and text conditions both reach the new indexes."""
    from collage.app.store.engine import downgrade, make_engine, upgrade

    def trigram_indexes(conn) -> dict[str, str]:
        rows = conn.execute(text("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'samples'")).all()
        return {name: definition.split("USING ")[1] for name, definition in rows if "gin_trgm_ops" in definition}

    upgrade(empty_url, "0008")
    engine = make_engine(empty_url)
    with engine.begin() as conn:
        assert trigram_indexes(conn) == {"ix_samples_completion_trgm": "gin (completion gin_trgm_ops)",
                                         "ix_samples_prompt_text_trgm": "gin (prompt_text gin_trgm_ops)"}  # fmt: skip
    upgrade(empty_url)
    with engine.begin() as conn:
        assert trigram_indexes(conn) == {"ix_samples_run_completion_trgm": "gin (run_id, completion gin_trgm_ops)",
                                         "ix_samples_run_prompt_text_trgm": "gin (run_id, prompt_text gin_trgm_ops)"}  # fmt: skip
        # 12 runs of 5,000 rows; "zebra" is in 4% of the even runs' completions and once in run r1
        conn.execute(text("INSERT INTO runs (id, name, algorithm, config, status, step, max_steps, model_path, "
                          "dataset_source, created_at, updated_at, attempt, warning_count) SELECT 'r' || r, 'n', "
                          "'grpo', '{}', 'succeeded', 0, 0, '', '', '2026-01-01', '2026-01-01', 1, 0 FROM "
                          "generate_series(0, 11) AS r"))  # fmt: skip
        conn.execute(text('INSERT INTO samples (run_id, split, step, "group", "index", prompt, prompt_text, '
                          "completion, rewards, reward_sort, advantage, completion_length, truncated, num_images, "
                          "zero_std) SELECT 'r' || (i / 5000), 'train', i % 5000, 0, 0, '\"p\"', 'count the cats', "
                          "CASE WHEN i = 5777 OR ((i / 5000) % 2 = 0 AND i % 25 = 0) THEN 'a zebra ' || md5(i::text) "
                          "ELSE 'no stripes ' || md5(i::text) END, '{}', 0, 0, 1, false, 0, false FROM "
                          "generate_series(0, 59999) AS i"))  # fmt: skip
        search = ("SELECT step FROM samples WHERE run_id = 'r1' AND split = 'train' AND (completion ILIKE '%zebra%' "
                  "OR prompt_text ILIKE '%zebra%') ORDER BY step, id LIMIT 51")  # fmt: skip
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE samples"))  # as autovacuum would: a GIN index's sizes are known after it
        plan = "\n".join(conn.execute(text(f"EXPLAIN {search}")).scalars())
        assert "ix_samples_run_completion_trgm" in plan and "ix_samples_run_prompt_text_trgm" in plan, plan
        assert conn.execute(text(search)).scalars().all() == [777]
    downgrade(empty_url, "0008")
    with engine.begin() as conn:
        assert set(trigram_indexes(conn)) == {"ix_samples_completion_trgm", "ix_samples_prompt_text_trgm"}
        assert conn.execute(text(search)).scalars().all() == [777]
    engine.dispose()


def test_0012_gives_old_rows_no_trajectory_and_zero_counts_and_goes_back(empty_url):
    from collage.app.store.engine import downgrade, make_engine, upgrade

    upgrade(empty_url, "0011")
    engine = make_engine(empty_url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO runs (id, name, algorithm, config, status, step, max_steps, model_path, "
                          "dataset_source, created_at, updated_at, attempt, warning_count) VALUES ('r', 'n', 'grpo', "
                          "'{}', 'succeeded', 0, 0, '', '', '2026-01-01 00:00:00', '2026-01-01 00:00:00', 1, 0)"))  # fmt: skip
        conn.execute(text('INSERT INTO samples (run_id, step, "group", "index", prompt, prompt_text, completion, '
                          "rewards, reward_sort, advantage, completion_length, truncated, num_images, zero_std) VALUES "
                          "('r', 1, 0, 0, '\"p\"', 'p', 'c', '{}', 0, 0, 1, false, 0, false)"))  # fmt: skip
    upgrade(empty_url)
    with engine.begin() as conn:
        assert conn.execute(text("SELECT trajectory, tool_calls, tool_errors, turns FROM samples")).all() == [
            (None, 0, 0, 0)
        ]
    downgrade(empty_url, "0011")
    with engine.begin() as conn:
        assert conn.execute(text("SELECT count(*) FROM samples")).scalar() == 1
        with pytest.raises(Exception, match="(?i)tool_calls"):
            conn.execute(text("SELECT tool_calls FROM samples"))
    engine.dispose()
