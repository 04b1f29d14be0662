"""The playground process's answer to running out of memory, without a model: out of GPU or host memory is one clear
message, and every loaded model is unloaded."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_out_of_memory_is_a_clear_message_and_unloads_everything():
    import torch

    from collage.worker.playground.process import Playground, answer

    playground = Playground(lambda _m: None)
    playground.loaded["x"] = object()  # type: ignore[assignment]

    def boom(_req):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    playground.generate = boom  # type: ignore[method-assign]
    reply = answer(playground, '{"op": "generate"}')
    assert reply == {"ok": False, "cancelled": False, "error": "out of GPU memory: lower num_generations or "
                     "max_new_tokens, use fewer or smaller images, or use a smaller model"}  # fmt: skip
    assert playground.loaded == {}
    playground.generate = lambda _req: (_ for _ in ()).throw(RuntimeError("DefaultCPUAllocator: can't allocate memory"))  # type: ignore[method-assign]
    assert answer(playground, '{"op": "generate"}')["error"].startswith("out of host memory")
