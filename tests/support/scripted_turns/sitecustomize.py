"""A scripted model for the tests of the playground with tools, inside the processes a test starts (the worker's
playground process): Python runs this file at start-up when its folder is on PYTHONPATH (tests/support/scripted.py
puts it there). A tiny random model never calls a tool, so without a script no crop would ever be made.

With ``COLLAGE_TEST_SCRIPTED_TURNS`` = ``{"marker": M, "turns": [t0, t1, ...]}``, the generation backend ``hf``
(``training.generation.BACKENDS``, through which multi-turn rollouts sample every turn, as the training tests
script it) answers a conversation whose text contains ``M`` with turn ``t_k``, ``k`` the number of tool results the
conversation holds so far (the last turn once the script runs out), followed by the end-of-turn token; any other
conversation is the real model's. The module is patched when it is first imported, so a process that never imports
it (the Celery worker, the web app) never imports torch because of this file.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys
from typing import Any

SCRIPT_ENV = "COLLAGE_TEST_SCRIPTED_TURNS"
TARGET = "collage.training.generation"
RESULT = "<tool_response>"  # how the tiny Qwen template opens a tool result


def _patch(module: Any) -> None:
    script = json.loads(os.environ[SCRIPT_ENV])
    marker, turns = script["marker"], list(script["turns"])
    real = module.BACKENDS["hf"]

    def scripted(model, batch, g, family, tokenizer, image_token_id, protected, max_new, sampling, features=None):
        contexts = [tokenizer.decode(ids) for ids in batch.input_ids]
        if not any(marker in text for text in contexts):
            return real(model, batch, g, family, tokenizer, image_token_id, protected, max_new, sampling, features)
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        rows, cut = [], []
        for i in range(len(contexts) * g):
            turn = turns[min(contexts[i // g].count(RESULT), len(turns) - 1)]
            ids = tokenizer.encode(turn, add_special_tokens=False) + [end]
            rows.append(ids[:max_new])
            cut.append(len(ids) > max_new)
        return module.Completions(rows, cut)

    module.BACKENDS["hf"] = scripted


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # found once: the real finders find the module itself
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get(SCRIPT_ENV):
    sys.meta_path.insert(0, _PatchOnImport())
