"""The chunked log-probs and entropies helper (hidden states through an LM head a chunk at a time) equals the
full-logits computation on plain tensors, in values and in gradients; an empty completion and a bad chunk size."""

from __future__ import annotations

import pytest
import torch

from collage.training import algorithms as alg
from collage.training.batching.logprobs import (
    chunked_logps_and_entropy,
)

TOL = 1e-5


def test_chunked_helper_on_plain_tensors():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    hidden = torch.randn(3, 5, 8, requires_grad=True)
    ids = torch.randint(0, 50, (3, 5))
    ref_lp, ref_ent = alg.token_logps_and_entropy(head(hidden), ids, 1.3)
    lp, ent = chunked_logps_and_entropy(hidden, ids, head, 1.3, entropy_grad=True, chunk_size=4)
    torch.testing.assert_close(lp, ref_lp, atol=TOL, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=TOL, rtol=0)
    g_ref = torch.autograd.grad((ref_lp + ref_ent).sum(), [hidden, head.weight])
    g = torch.autograd.grad((lp + ent).sum(), [hidden, head.weight])
    for a, b in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0)
    empty_lp, empty_ent = chunked_logps_and_entropy(hidden[:, :0], ids[:, :0], head)
    assert empty_lp.shape == empty_ent.shape == (3, 0)
    with pytest.raises(ValueError):
        chunked_logps_and_entropy(hidden, ids, head, chunk_size=0)
