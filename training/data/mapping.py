"""From a row as the user has it to Collage's shape: a prompt, the image references in order, the other columns.

Datasets come in TRL's formats (docs/data.md): standard (``prompt`` is a string) or conversational (a list of
``{role, content}`` messages), prompt-only or prompt-completion (a ``completion`` becomes the ``answer`` the
accuracy-type rewards compare with), images in an ``images`` list or a single ``image`` column. Datasets whose
columns are named otherwise are mapped by ``dataset.columns`` (``question`` as the prompt, ``image_1`` ...
``image_4`` gathered into one list, ``solution`` as the answer), or their prompt is built by
``dataset.prompt_template`` from any columns, with ``{images}`` where the images go. ``dataset.system_prompt``
adds a system turn. One :class:`RowMapping` does all of it, the same way for training, evaluation, ``collage data
check`` and the launch form's Preview.

Torch-free: the web app imports it.
"""

from __future__ import annotations

import reprlib
import string
from dataclasses import dataclass
from typing import Any

from ..config import IMAGES_MARKER, PROMPT_MAX_CHARS, DatasetSettings, template_fields
from .errors import RowError

# columns that are the row's prompt and images, never passed to the rewards as columns of their own
PROMPT_COLUMN, IMAGES_COLUMN, IMAGE_COLUMN, ANSWER_COLUMN, COMPLETION_COLUMN = (
    "prompt", "images", "image", "answer", "completion",
)  # fmt: skip


@dataclass(frozen=True)
class MappedRow:
    prompt: Any  # a string or a conversation, as normalise_prompt takes it (images placed when it is a string)
    image_refs: list[Any]
    columns: dict[str, Any]  # what the rewards get besides prompts, completions and images


@dataclass(frozen=True)
class RowMapping:
    """How rows become prompts: the config's ``dataset.columns``, ``prompt_template`` and ``system_prompt``."""

    prompt_column: str | None = None
    image_columns: tuple[str, ...] | None = None
    answer_column: str | None = None
    system_column: str | None = None
    template: str | None = None
    system_prompt: str | None = None

    @classmethod
    def of(cls, settings: DatasetSettings | None) -> RowMapping:
        if settings is None:
            return cls()
        columns = settings.columns
        images = columns.image_columns if columns is not None else None
        return cls(
            prompt_column=columns.prompt if columns is not None else None,
            image_columns=tuple(images) if images is not None else None,
            answer_column=columns.answer if columns is not None else None,
            system_column=columns.system if columns is not None else None,
            template=settings.prompt_template,
            system_prompt=settings.system_prompt,
        )

    @property
    def is_default(self) -> bool:
        return self == RowMapping()

    def source_columns(self) -> list[str]:
        """Every column this mapping names (for a check that the dataset has them: 422 naming the missing one)."""
        named = [self.prompt_column, *(self.image_columns or ()), self.answer_column, self.system_column]
        if self.template is not None:
            named += [f for f in template_fields(self.template) if f != IMAGES_MARKER]
        return list(dict.fromkeys(n for n in named if n is not None))

    def missing_columns(self, available: list[str]) -> list[tuple[str, str]]:
        """``(config key, column)`` for each column this mapping names that ``available`` lacks."""
        have = set(available)
        keys = [("dataset.columns.prompt", self.prompt_column), ("dataset.columns.answer", self.answer_column),
                ("dataset.columns.system", self.system_column)]  # fmt: skip
        keys += [("dataset.columns.images", c) for c in self.image_columns or ()]
        if self.template is not None:
            keys += [("dataset.prompt_template", f) for f in template_fields(self.template) if f != IMAGES_MARKER]
        return [(key, column) for key, column in keys if column is not None and column not in have]

    def apply(self, row: int, data: dict[str, Any]) -> MappedRow:
        """The row in Collage's shape, or :class:`RowError` naming what it lacks."""
        refs = self._image_refs(row, data)
        prompt = self._prompt(row, data, len(refs))
        system = self._system(row, data)
        if system is not None:
            prompt = _with_system(prompt, system, len(refs))
        used = {PROMPT_COLUMN, IMAGES_COLUMN, IMAGE_COLUMN, *(self.image_columns or ())}
        columns = {k: v for k, v in data.items() if k not in used}
        answer = self._answer(row, data)
        if answer is not _NONE:
            columns[ANSWER_COLUMN] = answer
        return MappedRow(prompt, refs, columns)

    # ------------------------------------------------------------------------------------------------ parts

    def _column(self, row: int, data: dict[str, Any], column: str, key: str) -> Any:
        if column not in data:
            raise RowError(row, f"no column {column!r} ({key}); the row's columns: {_names(data)}")
        return data[column]

    def _image_refs(self, row: int, data: dict[str, Any]) -> list[Any]:
        if self.image_columns is None:
            if data.get(IMAGES_COLUMN) is not None:
                listed = data[IMAGES_COLUMN]
                if not isinstance(listed, (list, tuple)):
                    raise RowError(row, f"'images' must be a list, got {type(listed).__name__}")
                return list(listed)
            return [data[IMAGE_COLUMN]] if data.get(IMAGE_COLUMN) is not None else []
        refs: list[Any] = []
        for column in self.image_columns:
            value = self._column(row, data, column, "dataset.columns.images")
            if value is None or value == "" or value == []:
                continue  # image_3 and image_4 of a two-image row are empty: skipped, the others keep their order
            refs.extend(value if isinstance(value, (list, tuple)) else [value])
        return refs

    def _prompt(self, row: int, data: dict[str, Any], num_images: int) -> Any:
        if self.template is not None:
            return _render(row, self.template, data, num_images)
        if self.prompt_column is not None:
            return self._column(row, data, self.prompt_column, "dataset.columns.prompt")
        if PROMPT_COLUMN not in data:
            raise RowError(
                row,
                f"no 'prompt' column (the row's columns: {_names(data)}): name the prompt's column with "
                "dataset.columns.prompt (--columns prompt=question) or build it with dataset.prompt_template",
            )
        return data[PROMPT_COLUMN]

    def _system(self, row: int, data: dict[str, Any]) -> str | None:
        if self.system_column is not None:
            value = self._column(row, data, self.system_column, "dataset.columns.system")
            return None if value is None or value == "" else str(value)
        return self.system_prompt

    def _answer(self, row: int, data: dict[str, Any]) -> Any:
        if self.answer_column is not None:
            return self._column(row, data, self.answer_column, "dataset.columns.answer")
        if ANSWER_COLUMN in data:
            return data[ANSWER_COLUMN]
        if COMPLETION_COLUMN in data:  # TRL's prompt-completion format: the completion is the reference answer
            return completion_text(data[COMPLETION_COLUMN])
        return _NONE


_NONE = object()  # no answer column at all (an answer of None is a value: "no answer for this row")


def completion_text(completion: Any) -> Any:
    """A prompt-completion row's completion as text: a string stays, a conversational completion (assistant
    messages) gives its text parts joined; anything else is passed on unchanged."""
    if isinstance(completion, str) or not isinstance(completion, (list, tuple)):
        return completion
    texts = []
    for message in completion:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, (list, tuple)):
            texts += [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return "".join(texts)


def _names(data: dict[str, Any]) -> str:
    return ", ".join(reprlib.repr(k) for k in list(data)[:30]) or "none"


def _render(row: int, template: str, data: dict[str, Any], num_images: int) -> list[dict[str, Any]]:
    """One user turn from ``template``: its text with each ``{column}`` replaced by the row's value (``str()`` of
    a non-string), and the row's images where ``{images}`` stands (once), else before the text."""
    parts: list[dict[str, Any]] = []
    text = ""
    placed = False
    for literal, name, _, _ in string.Formatter().parse(template):
        text += literal
        if name is None:
            continue
        if name == IMAGES_MARKER:
            if text:
                parts.append({"type": "text", "text": text})
            text = ""
            parts += [{"type": "image"}] * (0 if placed else num_images)
            placed = True
            continue
        if name not in data:
            raise RowError(
                row, f"no column {name!r} (dataset.prompt_template uses it); the row's columns: {_names(data)}"
            )
        value = data[name]
        cell = "" if value is None else value if isinstance(value, str) else str(value)
        if len(text) + len(cell) > PROMPT_MAX_CHARS:  # refused before it is made: a cell copied thousands of times
            raise RowError(
                row, f"dataset.prompt_template makes a prompt of more than {PROMPT_MAX_CHARS} characters from this row "
                "(Collage's bound on one prompt): the template copies long cells too many times",
            )  # fmt: skip
        text += cell
    if text:
        parts.append({"type": "text", "text": text})
    if not placed:
        parts = [{"type": "image"}] * num_images + parts
    return [{"role": "user", "content": parts}]


def _with_system(prompt: Any, system: str, num_images: int) -> Any:
    """``prompt`` with a system turn first; a conversation that has its own system turn keeps it."""
    if isinstance(prompt, str):
        content = [{"type": "image"}] * num_images + [{"type": "text", "text": prompt}]
        return [{"role": "system", "content": system}, {"role": "user", "content": content}]
    if isinstance(prompt, (list, tuple)) and prompt:
        if isinstance(prompt[0], dict) and prompt[0].get("role") == "system":
            return prompt
        return [{"role": "system", "content": system}, *prompt]
    return prompt  # not a prompt at all: normalise_prompt names the problem


COLUMN_KEYS = ("prompt", "images", "answer", "system")


def parse_columns(text: str) -> dict[str, Any]:
    """``--columns prompt=question,images=image_1+image_2,answer=answer`` as ``dataset.columns`` (``+`` joins
    several image columns, in order); ValueError naming the bad part."""
    columns: dict[str, Any] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not value:
            raise ValueError(f"{part!r}: write KEY=COLUMN (keys: {', '.join(COLUMN_KEYS)})")
        if key not in COLUMN_KEYS:
            raise ValueError(f"{part!r}: {key!r} is not one of {', '.join(COLUMN_KEYS)}")
        if key in columns:
            raise ValueError(f"{part!r}: {key} given twice")
        columns[key] = [c.strip() for c in value.split("+")] if key == "images" and "+" in value else value
    return columns


# column names the launch form maps by default, best first (LLaMA-Factory's and ms-swift's usual names)
GUESSES = {
    "prompt": ("prompt", "question", "query", "problem", "instruction"),
    "images": ("images", "image", "img"),
    "answer": ("answer", "solution", "label", "ground_truth"),
}


def guess_columns(names: list[str]) -> dict[str, Any]:
    """``dataset.columns`` guessed from a dataset's column names (case-insensitive): the first name of each
    :data:`GUESSES` list found, and for images every ``image_1`` ... ``image_N`` (numeric order) when there is no
    ``images``/``image``/``img`` column. Keys whose guess is the default column (``prompt``, ``images``,
    ``answer``) are left out: they need no mapping."""
    lower = {name.lower(): name for name in names}
    guess: dict[str, Any] = {}
    for key, candidates in GUESSES.items():
        found = next((lower[c] for c in candidates if c in lower), None)
        if found is not None and found != key and not (key == "images" and found == "image"):
            guess[key] = found
    if not any(c in lower for c in GUESSES["images"]):
        numbered = sorted(
            (
                name
                for name in names
                if name.lower().startswith(("image_", "img_")) and name.rsplit("_", 1)[1].isdigit()
            ),
            key=lambda name: int(name.rsplit("_", 1)[1]),
        )
        if numbered:
            guess["images"] = numbered if len(numbered) > 1 else numbered[0]
    return guess
