"""The playground's worker side with real parts: generations queued through the API, run by the worker's job
handler in its real playground process, on real tiny models and real checkpoints (a LoRA adapter on its base, the
same adapter merged into a full checkpoint), with images from the store that the model sees; the run's rewards
with the worker's allowlist; cancel at the next token; clear failures; the idle timeout."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_out_of_memory_is_a_clear_message_and_unloads_everything():
    import torch

    from collage.worker.playground_child import Playground, answer

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
