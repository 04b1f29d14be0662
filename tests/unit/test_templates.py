"""Chat templates and prompt templates rendered within bounds (training/templates.py, training/data/mapping.py): the
families' own templates render exactly as transformers renders them, and a template that loops for ever, doubles a
string, repeats one or floods the prompt stops at once with an error naming the bound (no model: the templates'
text alone, through transformers' own renderer)."""

from __future__ import annotations

import time

import pytest

from collage.training import templates
from collage.training.config import ConfigError, parse_config
from collage.training.data.errors import RowError
from collage.training.data.mapping import RowMapping
from collage.training.models.tiny import INTERNVL_TEMPLATE, LLAVA_TEMPLATE, QWEN_TEMPLATE

CONVERSATION = [
    {"role": "system", "content": [{"type": "text", "text": "Count carefully."}]},
    {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "How many are red?"}]},
]


def _render(template: str, **kwargs) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([CONVERSATION], chat_template=template, add_generation_prompt=True, **kwargs)
    return rendered[0]


def _unbounded(template: str) -> str:
    """What plain Jinja (transformers' own sandbox) renders."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=CONVERSATION, add_generation_prompt=True)


@pytest.fixture
def bounded(monkeypatch):
    templates.install()
    monkeypatch.setattr(templates, "RENDER_SECONDS", 0.5)  # the bound itself is 5 s: the tests need not wait it out


@pytest.mark.parametrize(
    "template", [QWEN_TEMPLATE, LLAVA_TEMPLATE, INTERNVL_TEMPLATE], ids=["qwen", "llava", "internvl"]
)
def test_a_familys_own_template_renders_as_it_always_did(bounded, template):
    assert _render(template) == _unbounded(template) and "How many are red?" in _render(template)


HOSTILE = {
    "nested loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "ran for more than"),
    "a string doubled": ("{% set ns = namespace(x='ab') %}{% for i in range(60) %}{% set ns.x = ns.x ~ ns.x %}"
                         "{% endfor %}{{ ns.x }}", "a text of"),
    "a repetition": ("{{ 'x' * 100000000 }}", "a repetition of 100000000"),
    "one string a thousand times": ("{% set s = 'x' * 900000 %}{{ ([s] * 1000)|tojson }}", "a tojson of"),
    "a join": ("{% set s = 'x' * 900000 %}{{ ([s] * 1000)|join }}", "a join of"),
    "a replace": ("{{ ('a' * 100000)|replace('a', 'b' * 30) }}", "a replace of"),
    "a width": ("{{ 'a'|center(100000000) }}", "a center of 100000000"),
    "a flood of output": ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "a prompt of"),
    "a power": ("{{ 10 ** 100000000 }}", "to the power 100000000"),
    "a format": ("{% set s = 'x' * 900000 %}{{ ('%s' * 1000) % ([s] * 1000) }}", "of 180"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_template_stops_at_once_naming_the_bound(bounded, name):
    template, expected = HOSTILE[name]
    started = time.monotonic()
    with pytest.raises(templates.TemplateLimit, match=expected) as caught:
        _render(template)
    assert time.monotonic() - started < 30  # a liveness bound: unbounded, these run for minutes or fill the memory
    assert "Collage" in str(caught.value) and ("1000000" in str(caught.value) or "s, Collage" in str(caught.value)
                                               or "power" in str(caught.value))  # fmt: skip


def test_a_prompt_template_of_too_many_fields_is_refused_in_the_config():
    with pytest.raises(ConfigError, match="dataset.prompt_template.*2000 \\{column\\} fields, more than the 64"):
        parse_config({"dataset": {"source": "x.jsonl", "prompt_template": "{question}" * 2000}})


def test_a_prompt_template_that_copies_long_cells_too_often_is_a_row_error_before_the_prompt_is_made():
    """The issue's case at its edge: a cell copied into the prompt 60 times (a valid template), a 100 KB cell."""
    mapping = RowMapping(template="{question} " * 60)
    started = time.monotonic()
    with pytest.raises(RowError, match="more than 1000000 characters .*Collage's bound on one prompt"):
        mapping.apply(3, {"question": "q" * 100_000, "images": []})
    assert time.monotonic() - started < 30
    assert mapping.apply(4, {"question": "short", "images": []}).prompt  # ordinary cells are untouched
