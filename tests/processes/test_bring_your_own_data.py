"""Datasets as users have them, through the API on SQLite and PostgreSQL and the real dataset helper process: the
preview guesses a column map and renders mapped prompts, and a submit with missing columns, a bad prompt template
or no usable row is refused before a run exists."""

from __future__ import annotations

from pathlib import Path

from tests.support.datasets import mixed_dataset

API = "/api/v1"


def _config(source: Path, **dataset) -> dict:
    return {"model": {"path": "tiny:qwen2-vl"}, "dataset": {"source": str(source), **dataset},
            "rewards": [{"name": "accuracy"}], "resources": {"gpus": 0}}  # fmt: skip


def test_preview_renders_mapped_prompts_and_guesses_the_mapping(api):
    client, _, _, app = api
    folder = mixed_dataset(Path(app.state.settings.home) / "data", corrupt=False)
    plain = client.get(f"{API}/datasets/preview", params={"source": str(folder), "rows": 2}).json()
    assert plain["column_names"] == ["question", "image_1", "solution"]
    assert plain["guess"] == {"prompt": "question", "images": "image_1", "answer": "solution"}
    assert plain["rows"][0]["error"].startswith("no 'prompt' column")
    mapped = client.get(f"{API}/datasets/preview", params={
        "source": str(folder), "rows": 2, "columns": "images=image_1,answer=solution",
        "prompt_template": "{images}Question: {question}"}).json()  # fmt: skip
    first = mapped["rows"][0]
    assert first["error"] is None and len(first["images"]) == 1
    assert first["prompt"] == [{"role": "user", "content": [{"type": "image"},
                                                            {"type": "text", "text": "Question: q0"}]}]  # fmt: skip
    bad = client.get(f"{API}/datasets/preview", params={"source": str(folder), "columns": "prompt"})
    assert bad.status_code == 422 and bad.json()["detail"].startswith("columns: 'prompt': write KEY=COLUMN")


def test_submit_refuses_missing_columns_and_datasets_without_a_usable_row_before_creating_a_run(api):
    client, _, dispatcher, app = api
    home = Path(app.state.settings.home)
    folder = mixed_dataset(home / "data", corrupt=False)
    before = client.get(f"{API}/runs").json()["items"]
    response = client.post(f"{API}/runs", json=_config(folder, columns={"prompt": "query", "images": "image_1"}))
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert detail[0]["path"] == "dataset.columns.prompt"
    assert "no column 'query'" in detail[0]["message"] and "'question'" in detail[0]["message"]
    response = client.post(f"{API}/runs", json=_config(folder, columns={"images": "image_1"},
                                                       prompt_template="{question} {hint}"))  # fmt: skip
    assert response.status_code == 422 and response.json()["detail"][0]["path"] == "dataset.prompt_template"
    broken = home / "broken"
    broken.mkdir()
    (broken / "train.jsonl").write_text('{"prompt": "a", "images": ["gone.png"]}\n{"prompt": \n')
    response = client.post(f"{API}/runs", json=_config(broken))
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["path"] == "dataset.source"
    assert "none of its rows is usable" in response.json()["detail"][0]["message"]
    assert client.get(f"{API}/runs").json()["items"] == before and not dispatcher.submitted
    good = client.post(f"{API}/runs", json=_config(folder, columns={"prompt": "question", "images": "image_1",
                                                                    "answer": "solution"}))  # fmt: skip
    assert good.status_code == 201, good.text
    stored = client.get(f"{API}/runs/{good.json()['id']}").json()["config"]["dataset"]
    assert stored["columns"] == {"prompt": "question", "images": "image_1", "answer": "solution", "system": None}
