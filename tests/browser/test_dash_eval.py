"""The dashboard's evaluation views (issue 18, section 1) in a real browser against a real `collage serve`: the run
page's Evaluation section (eval/reward over the training reward, one chart of the eval reward per number of images)
following a running run live, the compare page's eval overlays and chart filter, the runs table's latest and best
eval reward, the rollouts page's split selector with its table, count, group view, gallery and exports, and the
launch form's evaluation and checkpoint settings.

The trainer's evaluation is built in parallel: these tests write eval metrics (`eval/*` keys in a step's metrics
record) and eval rollout rows (`split="eval"`, each evaluation in a call of its own) straight into the server's
store with `StoreWriter`, as the trainer's store callback will.
"""

from __future__ import annotations

import json

import pytest
import yaml

from collage.app.store.writer import ImageIn, SampleIn
from tests.support.api import png
from tests.support.browser import login, shoot, small_config, wait_js, wait_rows
from tests.support.serve import store_writer


def _eval_config(name: str, **train) -> dict:
    from collage.training.config import parse_config

    config = small_config(name, max_steps=9, eval_strategy="steps", eval_steps=3, save_steps=3, **train)
    config["dataset"]["eval_fraction"] = 0.25
    return parse_config(config).model_dump(mode="json")


def _training(step: int) -> dict[str, float]:
    return {"reward": 0.1 * step, "rewards/accuracy/mean": 0.05 * step, "loss": 1.0 / step,
            "completions/mean_length": 4.0 + step}  # fmt: skip


def _evaluation(step: int, reward: float, counts: dict[str, float], **extra: float) -> dict[str, float]:
    values = {"eval/reward": reward, "eval/rewards/accuracy/mean": reward / 2, "eval/pass@1": reward / 3,
              "eval/completion_length": 5.0 + step, "eval/rows": 12.0, **extra}  # fmt: skip
    values.update({f"eval/by_images/{n}/reward": v for n, v in counts.items()})
    return values


def _series(page, key: str):
    """A chart's series as the page holds them: [label, key, faint, markers, [[step, value], ...]]."""
    return page.evaluate(
        f"(() => {{ const box = document.querySelector('.chart[data-metric=\"{key}\"]'); if (!box) return null; "
        "return box.chart.series.map(s => [s.label, s.key, !!s.faint, !!s.markers, "
        "[...s.values].sort((a, b) => a[0] - b[0])]); })()"
    )


def _steps(series) -> list[int]:
    return [step for step, _ in series[4]]


def test_the_run_page_charts_evaluation_beside_training_live(browser, server):
    engine, writer = store_writer(server)
    run = writer.create_run(_eval_config("eval-live")).id
    writer.transition(run, ["queued"], "running")
    context, page = login(browser, server)
    try:
        for step in (1, 2):
            writer.append_metrics(run, step, _training(step))
            writer.set_progress(run, step)
        page.goto(f"{server['base']}/runs/{run}")
        wait_js(page, "!!document.querySelector('.chart[data-metric=\"reward\"]')")
        assert page.locator("#evaluation").count() == 0  # no evaluation yet: no section

        # the first evaluation arrives in step 3's metrics record: the section and its charts appear
        writer.append_metrics(run, 3, {**_training(3), **_evaluation(3, 0.4, {"0": 0.5, "1": 0.25, "3": 0.75})})
        writer.set_progress(run, 3)
        wait_js(page, "!!document.querySelector('#eval-charts .chart[data-metric=\"eval/by_images\"]')")
        reward = _series(page, "eval/reward")
        # the training reward (faint, with the history the page already had) and the evaluation (marked points)
        assert [s[:4] for s in reward] == [["reward (training)", "reward", True, False],
                                          ["eval/reward", "eval/reward", False, True]]  # fmt: skip
        assert _steps(reward[0]) == [1, 2, 3] and reward[1][4] == [[3, 0.4]]
        by_images = _series(page, "eval/by_images")
        assert [s[0] for s in by_images] == ["0 images", "1 image", "3 images"]
        assert [s[4] for s in by_images] == [[[3, 0.5]], [[3, 0.25]], [[3, 0.75]]]
        assert page.evaluate("document.getElementById('evaluation').previousElementSibling.contains("
                             "document.getElementById('charts'))")  # fmt: skip
        assert page.locator('#charts .chart[data-metric^="eval/"]').count() == 0

        # training steps move the training series only; the next evaluation adds a point, two new image counts and
        # a metric seen for the first time (its own chart, in its place)
        for step in (4, 5):
            writer.append_metrics(run, step, _training(step))
            writer.set_progress(run, step)
        writer.append_metrics(run, 6, {**_training(6), **_evaluation(6, 0.7, {"0": 0.6, "1": 0.5, "2": 0.9, "3": 0.8,
                                                                             "8+": 1.0}, **{"eval/pass@2": 0.5})})  # fmt: skip
        writer.set_progress(run, 6)
        wait_js(page, "document.querySelector('.chart[data-metric=\"eval/by_images\"]').chart.series.length === 5")
        wait_js(page, "!!document.querySelector('#eval-charts .chart[data-metric=\"eval/pass@2\"]')")
        reward = _series(page, "eval/reward")
        assert _steps(reward[0]) == [1, 2, 3, 4, 5, 6] and reward[1][4] == [[3, 0.4], [6, 0.7]]
        by_images = _series(page, "eval/by_images")
        assert [s[0] for s in by_images] == ["0 images", "1 image", "2 images", "3 images", "8+ images"]
        assert by_images[2][4] == [[6, 0.9]] and by_images[0][4] == [[3, 0.5], [6, 0.6]]
        order = page.evaluate("[...document.querySelectorAll('#eval-charts .chart')].map(c => c.dataset.metric)")
        assert order == ["eval/reward", "eval/by_images", "eval/pass@1", "eval/pass@2", "eval/rewards/accuracy/mean",
                         "eval/completion_length", "eval/rows"]  # fmt: skip
        accuracy = _series(page, "eval/rewards/accuracy/mean")
        assert accuracy[0][:3] == ["rewards/accuracy/mean (training)", "rewards/accuracy/mean", True]
        assert _series(page, "eval/completion_length")[0][1] == "completions/mean_length"
        assert [s[1] for s in _series(page, "eval/pass@1")] == ["eval/pass@1"]  # nothing to draw it over
        wait_js(page, "document.querySelector('.chart[data-metric=\"eval/reward\"]').chart.plot.data[0].length === 6")
        page.locator("#evaluation").scroll_into_view_if_needed()
        shoot(page, "run-evaluation")

        # the run ends: the page reloads every series from the store, the same points
        loads = page.evaluate("Number(document.body.dataset.chartLoads)")
        writer.transition(run, ["running"], "succeeded")
        wait_js(page, "document.getElementById('status').textContent === 'succeeded'")
        wait_js(page, f"Number(document.body.dataset.chartLoads) > {loads}", what="the charts reloaded from the store")
        assert _series(page, "eval/reward") == reward and _series(page, "eval/by_images") == by_images
        page.reload()  # and a fresh page builds them from the stored history alone
        wait_js(page, "!!document.querySelector('.chart[data-metric=\"eval/by_images\"]')")
        wait_js(page, "document.querySelector('.chart[data-metric=\"eval/reward\"]').chart.series[0].values.size === 6")
        assert _series(page, "eval/reward") == reward and _series(page, "eval/by_images") == by_images
        assert not page.errors, page.errors
    finally:
        context.close()
        engine.dispose()


@pytest.fixture(scope="module")
def evaluated(server):
    """Three finished runs: two evaluated at different steps, one never evaluated."""
    from collage.training.config import parse_config

    engine, writer = store_writer(server)
    ids = {}
    for name, evals in (("evaluated-a", {0: 0.2, 3: 0.7, 6: 0.6}), ("evaluated-b", {0: 0.1, 4: 0.3, 8: 0.5}),
                        ("not-evaluated", {})):  # fmt: skip
        run = writer.create_run(
            _eval_config(name) if evals else parse_config(small_config(name)).model_dump(mode="json")
        ).id
        for step in range(1, 9):
            writer.append_metrics(run, step, _training(step))
        for step, value in evals.items():
            writer.append_metrics(run, step, _evaluation(step, value, {"1": value, "2": value / 2}))
        writer.transition(run, ["queued"], "succeeded")
        ids[name] = run
    # a run that picks its best checkpoint by accuracy: the runs table names it, beside the weighted reward
    ranked = writer.create_run(_eval_config("ranked", metric_for_best_model="eval/rewards/accuracy/mean")).id
    for step, value in {3: 0.8, 6: 0.9}.items():
        writer.append_metrics(ranked, step, _evaluation(step, value, {"1": value}))
    writer.transition(ranked, ["queued"], "succeeded")
    ids["ranked"] = ranked
    engine.dispose()
    return ids


def test_compare_overlays_each_runs_eval_curves(browser, server, evaluated):
    a, b = evaluated["evaluated-a"], evaluated["evaluated-b"]
    context, page = login(browser, server)
    try:
        page.goto(f"{server['base']}/compare?ids={a},{b}")
        wait_js(page, "!!document.querySelector('#eval-charts .chart[data-metric=\"eval/reward\"]')")
        assert page.is_visible("#eval-section")
        reward = _series(page, "eval/reward")
        assert [(s[0], s[3]) for s in reward] == [("evaluated-a", True), ("evaluated-b", True)]
        assert reward[0][4] == [[0, 0.2], [3, 0.7], [6, 0.6]] and reward[1][4] == [[0, 0.1], [4, 0.3], [8, 0.5]]
        first = page.evaluate("document.querySelector('#eval-charts .chart').dataset.metric")
        assert first == "eval/reward"
        assert page.locator('#eval-charts .chart[data-metric="eval/by_images/2/reward"]').count() == 1
        assert page.locator('#charts .chart[data-metric^="eval/"]').count() == 0
        assert page.locator('#charts .chart[data-metric="reward"]').count() == 1

        # the chart filter: any eval key, or back to every chart
        page.fill("#chart-filter", "eval/by_images")
        visible = page.evaluate(
            "[...document.querySelectorAll('.chart')].filter(c => !c.hidden).map(c => c.dataset.metric)"
        )
        assert visible == ["eval/by_images/1/reward", "eval/by_images/2/reward"], visible
        page.fill("#chart-filter", "")
        assert page.evaluate("[...document.querySelectorAll('.chart')].every(c => !c.hidden)")
        page.locator("#eval-section").scroll_into_view_if_needed()
        shoot(page, "compare-evaluation")
        assert not page.errors, page.errors
    finally:
        context.close()


def test_the_runs_table_shows_the_latest_and_best_eval_reward(browser, server, evaluated):
    context, page = login(browser, server)
    try:
        page.set_viewport_size({"width": 1400, "height": 900})
        page.goto(f"{server['base']}/runs")
        heads = page.locator("table.runs thead th").all_inner_texts()
        assert heads[heads.index("Reward") + 1] == "Evaluation"
        for name, latest, best in (("evaluated-a", "0.600", "0.700"), ("evaluated-b", "0.500", "0.500")):
            row = f'#runs-body tr[data-run="{evaluated[name]}"]'
            page.wait_for_selector(row)
            # these runs rank by nothing: the weighted eval/reward is what the column shows, named
            assert page.inner_text(f"{row} td.evaluation .eval-name").strip() == "reward", name
            assert page.inner_text(f"{row} td.evaluation .eval-latest") == latest, name
            assert page.inner_text(f"{row} td.evaluation .eval-best") == best, name
        ranked = f'#runs-body tr[data-run="{evaluated["ranked"]}"] td.evaluation'
        page.wait_for_selector(ranked)
        assert page.inner_text(f"{ranked} .eval-name").strip() == "rewards/accuracy/mean"
        assert [page.inner_text(f"{ranked} .eval-{part}") for part in ("latest", "best", "reward")] == [
            "0.450",
            "0.450",
            "0.900",
        ]
        page.wait_for_selector(f'#runs-body tr[data-run="{evaluated["not-evaluated"]}"]')
        assert page.inner_text(f'#runs-body tr[data-run="{evaluated["not-evaluated"]}"] td.evaluation') == "–"
        # the whole table fits a 1,400 px screen: no column (Created, Finished) is off to the right
        width = page.evaluate(
            "[document.getElementById('runs-scroll').scrollWidth, document.getElementById('runs-scroll').clientWidth]"
        )
        assert width[0] <= width[1], width
        shoot(page, "runs-eval", full_page=False)
        assert not page.errors, page.errors
    finally:
        context.close()


def _rows(split: str, step: int, prompts: int, gens: int) -> list[SampleIn]:
    rows = []
    for g in range(prompts):
        for i in range(gens):
            pictures = [
                ImageIn(png((60 * g, 40 * k, 200 if split == "eval" else 0), (40 + 8 * k, 30))) for k in range(2)
            ]
            reward = round(0.2 * i + 0.1 * g, 3)
            rows.append(SampleIn(
                group=g, index=i, prompt=[{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                {"type": "text", "text": f"How many red shapes? ({split} prompt {g})"}]}],
                completion=f"{split} {step}.{g}.{i} the answer is {g + i}", images=pictures,
                rewards={"accuracy": reward, "numeric": 1.0}, reward=reward,
                advantage=0.0 if split == "eval" else -0.5 + i, completion_length=6 + i, truncated=False,
                group_mean=None if split == "eval" else 0.3, group_std=None if split == "eval" else 0.2,
                dataset_row=(50 if split == "eval" else 0) + g, columns={"answer": str(g)}, split=split))  # fmt: skip
    return rows


@pytest.fixture(scope="module")
def both_splits(server):
    """A finished run: training rows at steps 1 and 2 (2 groups x 3), eval rows at steps 0 and 2 (4 held-out
    prompts x 2): both splits at step 2."""
    engine, writer = store_writer(server)
    run = writer.create_run(_eval_config("eval-rollouts")).id
    writer.append_samples(run, 0, _rows("eval", 0, 4, 2))
    for step in (1, 2):
        writer.append_samples(run, step, _rows("train", step, 2, 3))
    writer.append_samples(run, 2, _rows("eval", 2, 4, 2))
    writer.transition(run, ["queued"], "succeeded")
    engine.dispose()
    return run


def _table(page) -> list[tuple[str, str]]:
    return page.evaluate("[...document.querySelectorAll('tr.sample')].map(r => [r.dataset.split, "
                         "r.querySelector('pre.completion').textContent])")  # fmt: skip


def test_the_rollouts_split_selector_with_its_table_count_group_view_gallery_and_exports(browser, server, both_splits):
    run = both_splits
    context, page = login(browser, server)
    try:
        page.goto(f"{server['base']}/runs/{run}/rollouts")
        wait_rows(page, 12)
        rows = _table(page)
        assert len(rows) == 12 and {s for s, _ in rows} == {"train"}
        assert page.input_value('[name="split"]') == "train" and "split=" not in page.url

        page.select_option('[name="split"]', "eval")
        wait_rows(page, 16)
        assert "split=eval" in page.url and page.inner_text("#total") == "16 rows match"
        rows = _table(page)
        assert len(rows) == 16 and {s for s, _ in rows} == {"eval"} and rows[0][1] == "eval 0.0.0 the answer is 0"
        heads = page.locator("tr.group td").all_inner_texts()
        assert len(heads) == 8 and heads[0].startswith("evaluated at step 0 · held-out prompt 0 (row 50)")
        assert "zero variance" not in " ".join(heads)
        assert set(page.locator("tr.sample td.advantage").all_inner_texts()) == {"–"}
        assert page.inner_text("tr.sample .evaluated-at >> nth=0") == "evaluated at step 0"
        assert page.is_disabled('[name="advantage"]') and page.is_disabled('[name="zero_std_groups"]')
        # the exports follow: the samples' links ask for the eval split, the metrics' do not
        samples = page.get_attribute('a.export[data-what="samples"][data-format="jsonl"]', "href")
        metrics = page.get_attribute('a.export[data-what="metrics"][data-format="csv"]', "href")
        assert "split=eval" in samples and "split" not in metrics
        assert page.inner_text('a.export[data-what="samples"][data-format="jsonl"]') == "eval samples.jsonl"
        exported = server["client"].get(samples.removeprefix("/api/v1"))
        records = [json.loads(line) for line in exported.text.splitlines()]
        assert len(records) == 16 and {r["split"] for r in records} == {"eval"}
        # a filter narrows the eval rows; the count follows
        page.fill('[name="min_step"]', "2")
        wait_rows(page, 8)
        assert {c.split(" ")[1].split(".")[0] for _, c in _table(page)} == {"2"}
        page.fill('[name="min_step"]', "")
        wait_rows(page, 16)
        shoot(page, "rollouts-eval")

        # the group view of one held-out prompt: its completions ranked by reward, no advantage
        page.locator('tr.group[data-step="2"][data-group="1"] .open-group').click()
        page.wait_for_selector("#group-view .group-completion")
        assert "view=group%3A2%3A1" in page.url or "view=group:2:1" in page.url
        head = page.inner_text("#group-view h2")
        assert head == "evaluated at step 2 · held-out prompt 1 · 2 completions, ranked by reward", head
        texts = page.locator("#group-view pre.completion").all_inner_texts()
        assert texts == ["eval 2.1.1 the answer is 2", "eval 2.1.0 the answer is 1"]
        assert "advantage" not in page.inner_text("#group-view .group-completions")
        assert "mean reward 0.200 · dataset row 51" in page.inner_text("#group-view .group-head")
        shoot(page, "rollouts-eval-group")
        # the gallery of its images
        page.locator("#group-view .group-prompt img.thumb").first.click()
        page.wait_for_selector("#modal:not([hidden]) figure.gallery")
        page.keyboard.press("ArrowRight")
        wait_js(page, "document.querySelector('figure.gallery').dataset.index === '1'")
        assert page.inner_text(".gallery-caption").startswith("image 2 of 2 · 48x30")
        page.keyboard.press("Escape")

        # a reload keeps the split and the open group view (the URL holds both)
        page.reload()
        page.wait_for_selector("#group-view .group-completion")
        assert page.input_value('[name="split"]') == "eval"
        assert page.inner_text("#group-view h2").startswith("evaluated at step 2 · held-out prompt 1")
        page.click("#group-view button.back")

        # back to training: the training rows, the advantage filter on again
        page.select_option('[name="split"]', "train")
        wait_rows(page, 12)
        assert {s for s, _ in _table(page)} == {"train"} and "split=" not in page.url
        assert not page.is_disabled('[name="advantage"]')
        assert page.inner_text('a.export[data-what="samples"][data-format="jsonl"]') == "samples.jsonl"

        assert not page.errors, page.errors
        # a split the API does not know, from a shared link: its message next to the selector, no rows
        page.goto(f"{server['base']}/runs/{run}/rollouts?split=test")
        page.wait_for_selector('[data-error-for="split"]:not(:empty)')
        assert "train" in page.inner_text('[data-error-for="split"]') and page.locator("tr.sample").count() == 0
    finally:
        context.close()


def test_the_launch_form_shows_and_sends_a_loss_types_keys_only_with_it(browser, server):
    context, page = login(browser, server)
    try:
        page.goto(f"{server['base']}/launch")
        page.wait_for_selector(".reward")
        page.click("#expand-all")  # the loss options are in a collapsed group until then
        sapo, delta = '[data-path="train.sapo_temperature_pos"]', '[data-path="train.delta"]'
        assert page.is_hidden(sapo) and page.is_visible(delta)  # dapo: clipped, not sapo
        page.select_option('[name="train.loss_type"]', "sapo")
        assert page.is_visible(sapo) and page.is_hidden(delta)
        page.click("#yaml-btn")
        sent = yaml.safe_load(page.inner_text("#yaml"))["train"]
        assert "sapo_temperature_pos" in sent and "delta" not in sent and "vespo_k_pos" not in sent
        page.click("#yaml-btn")
        page.select_option('[name="train.loss_type"]', "dapo")
        assert page.is_hidden(sapo) and page.is_visible(delta)
        assert not page.errors, page.errors
    finally:
        context.close()


def test_the_launch_form_sets_evaluation_and_checkpoint_retention(browser, server):
    from collage.training.config import parse_config

    context, page = login(browser, server)
    try:
        page.goto(f"{server['base']}/launch")
        page.wait_for_selector(".reward")
        card = page.locator("#eval-card")
        page.click("#expand-all")  # evaluation and the held-out data are in collapsed groups until then
        for key in ("eval_strategy", "eval_steps", "greater_is_better", "save_total_limit", "eval_temperature"):
            assert card.locator(f'[name="train.{key}"]').count() == 1, key
        # the untouched form still builds a valid config (evaluation off)
        page.click("#yaml-btn")
        untouched = yaml.safe_load(page.inner_text("#yaml"))
        assert untouched["train"]["eval_strategy"] == "no" and untouched["train"]["greater_is_better"] is None
        parse_config(untouched)
        page.click("#yaml-btn")

        # evaluation without held-out data: the API's error next to its field, nothing launched
        before = len(server["client"].get("/runs", params={"limit": 200}).json()["items"])
        page.select_option('[name="train.eval_strategy"]', "steps")
        page.click("#launch-btn")
        page.wait_for_selector('[data-error-for="train.eval_strategy"]:not(:empty)')
        assert "held-out data" in page.inner_text('[data-error-for="train.eval_strategy"]')
        assert len(server["client"].get("/runs", params={"limit": 200}).json()["items"]) == before
        assert page.errors and all("status of 422" in e for e in page.errors), page.errors  # the refused POST only
        page.errors.clear()

        page.fill('[name="dataset.eval_fraction"]', "0.25")
        page.fill('[name="train.max_steps"]', "8")
        page.fill('[name="train.eval_steps"]', "2")
        page.fill('[name="train.save_steps"]', "4")
        page.fill('[name="train.save_total_limit"]', "2")
        page.fill('[name="train.metric_for_best_model"]', "eval/reward")
        page.select_option('[name="train.greater_is_better"]', "false")
        page.check('[name="train.eval_on_start"]')
        page.fill('[name="train.eval_num_generations"]', "2")
        page.fill('[name="train.per_device_eval_batch_size"]', "4")
        page.fill('[name="train.eval_temperature"]', "0.7")
        page.click("#yaml-btn")
        built = yaml.safe_load(page.inner_text("#yaml"))
        train = parse_config(built).train
        assert (train.eval_strategy, train.eval_steps, train.eval_on_start, train.save_total_limit) == (
            "steps",
            2,
            True,
            2,
        )
        assert (train.metric_for_best_model, train.greater_is_better, train.best_is_greater) == (
            "eval/reward",
            False,
            False,
        )
        assert (train.eval_num_generations, train.eval_batch_size, train.eval_temperature) == (2, 4, 0.7)
        assert built["dataset"]["eval_fraction"] == 0.25 and built["dataset"]["eval_split"] is None
        page.locator("#eval-card").scroll_into_view_if_needed()
        shoot(page, "launch-evaluation", full_page=False)

        # a clone of an evaluated run fills the card from its config
        engine, writer = store_writer(server)
        source = writer.create_run(
            _eval_config("eval-clone", metric_for_best_model="eval/reward", greater_is_better=False)
        ).id
        writer.transition(source, ["queued"], "succeeded")
        engine.dispose()
        page.goto(f"{server['base']}/launch?clone={source}")
        wait_js(page, "document.querySelector('[name=\"name\"]').value === 'eval-clone-clone'")
        assert page.input_value('[name="train.greater_is_better"]') == "false"
        assert page.input_value('[name="train.eval_strategy"]') == "steps"
        assert page.input_value('[name="dataset.eval_fraction"]') == "0.25"
        assert page.input_value('[name="train.metric_for_best_model"]') == "eval/reward"
        assert not page.errors, page.errors
    finally:
        context.close()
