"""Chart axes and the rollouts page's step slider in a real browser against a real `collage serve`: y-axis ticks a
nice step apart whose labels are all distinct and no longer than they need to be (a series that moves in the
fourth decimal), a chart with a single step (one evaluation) drawn over the steps around it instead of 0..100, the
rollouts page's step slider walking only the steps that have rows of the chosen split (evaluations every 20
steps), and its counts in the singular and the plural ("1 token", "1 row matches").

The run is written straight into the server's store with `StoreWriter`, as a worker writes it.
"""

from __future__ import annotations

import math

import pytest

from collage.app.store.writer import SampleIn
from tests.support.browser import shoot, small_config, wait_js, wait_rows
from tests.support.serve import store_writer

EVAL_STEPS = (0, 20, 40)
TRAIN_STEPS = (2, 4, 6)


def _row(split: str, step: int, group: int, index: int, length: int, truncated: bool = False) -> SampleIn:
    ev = split == "eval"
    return SampleIn(group=group, index=index, prompt=[{"role": "user", "content": [{"type": "text", "text": f"{split} prompt {group}"}]}],
                    completion=f"{split} {step}.{group}.{index}", images=[], rewards={"accuracy": 0.5}, reward=0.5,
                    advantage=0.0 if ev else 0.5 - index, completion_length=length, truncated=truncated,
                    group_mean=None if ev else 0.5, group_std=None if ev else 0.1, dataset_row=group, columns={},
                    split=split)  # fmt: skip


@pytest.fixture(scope="module")
def run_id(server):
    """A finished 60-step run: a reward that moves in the fourth decimal (6.7310..6.7316), a loss between 1.99 and
    2; one evaluation metric logged once (eval/pass@1 at step 20); training rows at steps 2, 4 and 6 (2 groups x 2,
    the first one truncated at 1 token) and evaluation rows at steps 0, 20 and 40 (2 held-out prompts x 1)."""
    from collage.training.config import parse_config

    engine, writer = store_writer(server)
    config = small_config("axes", max_steps=60, eval_strategy="steps", eval_steps=20)
    config["dataset"]["eval_fraction"] = 0.25
    run = writer.create_run(parse_config(config).model_dump(mode="json")).id
    for step in range(1, 61):
        writer.append_metrics(run, step, {"reward": 6.731 + 0.0001 * (step % 7), "loss": 1.99 + 0.0002 * (step % 50)})
    writer.append_metrics(run, 20, {"eval/pass@1": 0.3})
    for step in TRAIN_STEPS:
        writer.append_samples(run, step, [_row("train", step, g, i, 1 if (step, g, i) == (2, 0, 0) else 2 + i,
                                               truncated=(step, g, i) == (2, 0, 0))
                                          for g in range(2) for i in range(2)])  # fmt: skip
    for step in EVAL_STEPS:
        writer.append_samples(run, step, [_row("eval", step, g, 0, 1 if g == 0 else 3) for g in range(2)])
    writer.set_progress(run, 60)
    writer.transition(run, ["queued"], "succeeded")
    engine.dispose()
    return run


def _decimals(label: str) -> int:
    return len(label.split(".", 1)[1]) if "." in label else 0


def _is_nice(step: float) -> bool:
    """1, 2 or 5 x 10^k."""
    mantissa = step / 10 ** math.floor(math.log10(step))
    return any(mantissa == pytest.approx(m, rel=1e-9) for m in (1, 2, 5, 10))


def _check_axis(values: list[float], labels: list[str]) -> None:
    """Ticks a nice step apart, each label distinct, all with the decimals the step needs and no more."""
    assert len(values) >= 2 and len(labels) == len(values), (values, labels)
    assert len(set(labels)) == len(labels), labels
    steps = [b - a for a, b in zip(values, values[1:], strict=False)]
    assert all(s == pytest.approx(steps[0], rel=1e-6) for s in steps) and _is_nice(steps[0]), values
    need = max(0, -math.floor(math.log10(steps[0]) + 1e-9))
    assert {_decimals(label) for label in labels} == {need}, (labels, steps[0])
    assert [float(label) for label in labels] == pytest.approx(values, rel=1e-12, abs=1e-12), labels


def test_y_ticks_are_a_nice_step_apart_and_every_label_is_distinct(page, server, run_id):
    page.goto(f"{server['base']}/runs/{run_id}")
    wait_js(
        page,
        "['reward', 'loss'].every(k => { const c = document.querySelector(`.chart[data-metric=\"${k}\"]`); "
        "return c && c.chart.plot && (c.chart.plot.axes[1]._values || []).length > 0; })",
    )
    # the charts as drawn: the reward moves in the fourth decimal, the loss between 1.99 and 2
    for key in ("reward", "loss"):
        sel = f'.chart[data-metric="{key}"]'
        # the labels uPlot drew, at the values it drew them
        values, labels = page.evaluate(f"(() => {{ const a = document.querySelector('{sel}').chart.plot.axes[1]; "
                                       "return [a._splits, a._values]; })()")  # fmt: skip
        _check_axis(values, labels)
        assert page.get_attribute(sel, "data-yticks") == ",".join(labels)
        lo, hi = map(float, page.get_attribute(sel, "data-yrange").split(","))
        assert all(lo <= v <= hi for v in values), (key, lo, hi, values)
        if key == "reward":
            assert all(label.startswith("6.731") and len(label) == 6 for label in labels), labels
    # the pure functions: ticks for a range, labels for ticks
    for lo, hi, count in ((6.7305, 6.7321, 4), (1.985, 2.003, 4), (6.7309, 6.7317, 4), (0, 100, 5), (-1, 1, 4),
                          (0.27, 0.33, 4), (-3.3, -2.7, 4), (1e-5 - 1e-3, 1e-5 + 1e-3, 4), (12, 13, 3)):  # fmt: skip
        values, labels = page.evaluate(
            f"(() => {{ const t = CollageCharts.ticks({lo}, {hi}, {count}); return [t, CollageCharts.tickLabels(t)]; }})()"
        )
        assert all(lo - 1e-12 <= v <= hi + 1e-12 for v in values), (lo, hi, values)
        assert count // 2 <= len(values) <= 2.5 * count + 1, (lo, hi, values)
        _check_axis(values, labels)
    assert page.evaluate("CollageCharts.tickLabels(CollageCharts.ticks(6.7305, 6.7321, 4))") == [
        "6.7305", "6.7310", "6.7315", "6.7320"]  # fmt: skip
    assert page.evaluate("CollageCharts.tickLabels(CollageCharts.ticks(1.985, 2.003, 4))") == [
        "1.985", "1.990", "1.995", "2.000"]  # fmt: skip
    assert page.evaluate("CollageCharts.tickLabels([0, 20, 40])") == ["0", "20", "40"]
    assert page.evaluate("CollageCharts.tickLabels([0.25, 0.5, 0.75])") == ["0.25", "0.50", "0.75"]  # never 0.3, 0.8
    assert page.evaluate("CollageCharts.tickLabels([6.730, 6.731, 6.732])") == ["6.730", "6.731", "6.732"]
    assert page.evaluate("CollageCharts.tickLabels([1200000, 1400000, 1600000])") == ["1.2e6", "1.4e6", "1.6e6"]
    assert page.evaluate("CollageCharts.tickLabels([0, 0.0002, 0.0004])") == ["0", "2e-4", "4e-4"]
    page.locator('.chart[data-metric="reward"]').scroll_into_view_if_needed()
    shoot(page, "charts-y-ticks", full_page=False)
    assert not page.errors, page.errors


def test_a_chart_with_one_step_shows_the_steps_around_it(page, server, run_id):
    page.goto(f"{server['base']}/runs/{run_id}")
    sel = '.chart[data-metric="eval/pass@1"]'
    page.wait_for_selector(f"{sel}[data-xticks]")
    scale = page.evaluate(
        f"(() => {{ const x = document.querySelector('{sel}').chart.plot.scales.x; return [x.min, x.max]; }})()"
    )
    assert scale == [19, 21], scale  # not 0..40 or 0..100
    assert page.get_attribute(sel, "data-xticks") == "19,20,21"
    # the training charts keep the run's steps
    scale = page.evaluate("(() => { const x = document.querySelector('.chart[data-metric=\"reward\"]').chart.plot.scales.x; "
                          "return [x.min, x.max]; })()")  # fmt: skip
    assert scale == [1, 60], scale
    # the range function: a lone step (however uPlot widened it), every series at one step, several steps, none
    assert page.evaluate("CollageCharts.xRange([20], 0, 40)") == [19, 21]
    assert page.evaluate("CollageCharts.xRange([0], 0, 100)") == [-1, 1]
    assert page.evaluate("CollageCharts.xRange([3, 9], 3, 9)") == [3, 9]
    assert page.evaluate("CollageCharts.xRange([], null, null)") == [0, 1]
    page.locator(sel).scroll_into_view_if_needed()
    shoot(page, "charts-one-step", full_page=False)
    assert not page.errors, page.errors


def _steps_shown(page) -> list[int]:
    return page.evaluate("[...document.querySelectorAll('tr.sample')].map(r => Number(r.querySelector('pre.completion')"
                         ".textContent.split(' ')[1].split('.')[0]))")  # fmt: skip


def _at(page, step: int | None, rows: int) -> None:
    """The slider says ``step`` (None: every step), the URL holds it, and the table shows its ``rows``."""
    want = "all" if step is None else str(step)
    wait_js(page, f"document.getElementById('step-out').textContent === '{want}'")
    if step is None:
        wait_js(page, "!new URLSearchParams(location.search).has('step')")
    else:
        wait_js(page, f"new URLSearchParams(location.search).get('step') === '{step}'")
    wait_rows(page, rows)
    if step is not None:
        wait_js(page, f"[...document.querySelectorAll('tr.sample')].every(r => r.querySelector('pre.completion')"
                      f".textContent.split(' ')[1].startsWith('{step}.'))")  # fmt: skip


def test_the_step_slider_walks_only_the_steps_with_rows_of_the_split(page, server, run_id):
    page.goto(f"{server['base']}/runs/{run_id}/rollouts?split=eval")
    wait_rows(page, 6)
    slider = "#step-slider"
    wait_js(page, "document.getElementById('step-slider').dataset.steps === '0,20,40'")
    assert page.get_attribute(slider, "max") == "3" and page.input_value(slider) == "0"
    page.focus(slider)
    for step in EVAL_STEPS:  # each position is an evaluated step, and it has rows; step 0 included
        page.keyboard.press("ArrowRight")
        _at(page, step, 2)
    page.keyboard.press("ArrowRight")  # the last position: it stays there
    _at(page, 40, 2)
    assert page.get_attribute(slider, "aria-valuetext") == "step 40"
    shoot(page, "rollouts-step-slider", full_page=False)
    page.keyboard.press("ArrowLeft")
    _at(page, 20, 2)
    # a reload (or a shared link) puts the slider at the step of the URL
    page.reload()
    wait_rows(page, 2)
    wait_js(page, "document.getElementById('step-slider').value === '2'")
    assert page.inner_text("#step-out") == "20" and page.input_value('[name="step"]') == "20"
    page.focus(slider)
    page.keyboard.press("Home")  # the first position: every step
    _at(page, None, 6)
    # the training split has its own steps; a step only the other split has is left for every step
    page.keyboard.press("End")
    _at(page, 40, 2)
    page.select_option('[name="split"]', "train")
    wait_js(page, "document.getElementById('step-slider').dataset.steps === '2,4,6'")
    _at(page, None, 12)
    page.focus(slider)
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowRight")
    _at(page, 4, 4)
    page.select_option('[name="split"]', "eval")  # step 4 has no evaluation rows: every step of the evaluation
    wait_js(page, "document.getElementById('step-slider').dataset.steps === '0,20,40'")
    _at(page, None, 6)
    # a step without rows from a link keeps its position (the table says it has none)
    page.goto(f"{server['base']}/runs/{run_id}/rollouts?split=eval&step=30")
    wait_js(page, "document.getElementById('step-slider').dataset.steps === '0,20,30,40'")
    assert page.input_value(slider) == "3" and page.inner_text("#step-out") == "30"
    wait_js(page, "document.getElementById('total').textContent === '0 rows match'")
    assert not page.errors, page.errors


def test_counts_on_the_rollouts_page_are_singular_or_plural(page, server, run_id):
    page.goto(f"{server['base']}/runs/{run_id}/rollouts?step=2")
    wait_rows(page, 4)
    tokens = page.locator("tr.sample td.completion-cell > small.muted").all_inner_texts()
    assert [t.strip() for t in tokens] == ["1 token", "3 tokens", "2 tokens", "3 tokens"], tokens
    first = page.locator("tr.sample").first
    assert first.locator(".badge").inner_text() == "truncated"
    assert "1 tokens" not in page.inner_text("#samples-body")
    wait_js(page, "document.getElementById('total').textContent === '4 rows match'")
    assert page.inner_text("#count") == "4 of 4 rows shown"
    page.select_option('[name="truncated"]', "true")
    wait_rows(page, 1)
    wait_js(page, "document.getElementById('total').textContent === '1 row matches'")
    wait_js(page, "document.getElementById('count').textContent === '1 of 1 row shown'")
    # the group view of a held-out prompt with one completion of 1 token
    page.goto(f"{server['base']}/runs/{run_id}/rollouts?split=eval&step=20")
    wait_rows(page, 2)
    page.locator('tr.group[data-step="20"][data-group="0"] .open-group').click()
    page.wait_for_selector("#group-view .group-completion")
    assert (
        page.inner_text("#group-view h2") == "evaluated at step 20 · held-out prompt 0 · 1 completion, ranked by reward"
    )
    assert page.inner_text("#group-view .group-completion header").strip() == "#1 completion 0 · 1 token"
    shoot(page, "rollouts-singular", full_page=False)
    assert not page.errors, page.errors
