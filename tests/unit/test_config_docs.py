"""One source for what a config key means: every field's ``Field(description=...)``. The launch form's help, the
key reference in docs/training.md and ``collage config explain`` are made from it, and these tests fail when any
of them disagrees with the schema."""

from __future__ import annotations

import re
from pathlib import Path

from collage.training.config_docs import REFERENCE_END, REFERENCE_START, key_doc, key_docs, reference_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_every_config_field_says_what_it_is_for():
    docs = key_docs()
    assert len(docs) > 90
    missing = [d.path for d in docs if len(d.description) < 12]
    assert missing == []
    # TRL's keys cite TRL; a loss type's keys name the loss types that read them
    assert "TRL: learning_rate" in key_doc("train.learning_rate").description
    assert key_doc("train.vespo_k_pos").loss_types == ("vespo",)
    assert key_doc("train.loss_type").algorithm == "grpo" and key_doc("train.normalize_advantages").algorithm == "rloo"
    assert key_doc("rewards[0].weight") == key_doc("rewards.weight") == key_doc("rewards[].weight")
    assert key_doc("train.beta").default == "grpo 0.0, rloo 0.05"


def test_the_docs_key_reference_is_the_schemas():
    page = (ROOT / "docs" / "training.md").read_text(encoding="utf-8")
    start, end = page.index(REFERENCE_START), page.index(REFERENCE_END) + len(REFERENCE_END)
    assert page[start:end] == reference_markdown(), (
        "docs/training.md's key reference differs from the schema: paste `collage config explain --markdown` there"
    )


def test_every_key_a_docs_table_names_exists():
    """A renamed or removed key cannot linger in a hand-written table of any page."""
    known = {d.path for d in key_docs()} | {d.path.replace("[]", "") for d in key_docs()}
    named = set()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line in page.read_text(encoding="utf-8").splitlines():
            if line.startswith("| `"):
                first = line.split("|")[1]
                for key in re.findall(r"`((?:train|dataset|model|logging|resources)\.[a-z_.]+)`", first):
                    named.add((page.name, key))
    assert named, "no table names a key: the scan is broken"
    assert sorted((page, key) for page, key in named if key not in known) == []


def test_the_launch_forms_help_is_the_schemas():
    from collage.app.web.fields import FORM, HELP, form_fields

    assert set(FORM) == set(HELP)
    for path, (help_text, _) in HELP.items():
        assert help_text == key_doc(path).description, path
    by_path = {f.path: f for f in form_fields()}
    assert by_path["train.sapo_temperature_neg"].loss_types == ("sapo",)
    assert "dapo" in by_path["train.delta"].loss_types and "sapo" not in by_path["train.delta"].loss_types
    assert by_path["train.learning_rate"].loss_types == ()


def test_config_explain_prints_a_keys_meaning_type_default_and_limits(capsys):
    from collage.app.cli.main import main

    assert main(["config", "explain", "train.epsilon_high"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("train.epsilon_high\n") and key_doc("train.epsilon_high").description in out
    assert "type: float (optional)" in out and "default: null" in out and "limits: > 0" in out
    assert main(["config", "explain", "train.sapo_temperature_pos"]) == 0
    assert "read with loss_type: sapo" in capsys.readouterr().out
    assert main(["config", "explain", "train.los_type"]) == 2
    assert "did you mean train.loss_type" in capsys.readouterr().err
    assert main(["config", "explain"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == len(key_docs()) and listed[0].startswith("name ")
    assert main(["config", "explain", "--markdown"]) == 0
    assert capsys.readouterr().out.strip() == reference_markdown()
