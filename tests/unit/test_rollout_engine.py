"""The rollout engine's micro-batch rules on plain lists: ``bucket_rows`` regroups rows only within their blocks, and
``composition_invariant`` names the losses whose value depends on how rows are cut into micro-batches."""

from __future__ import annotations


def test_bucket_rows_regroups_only_within_blocks():
    from collage.training.batching.buckets import block_micro_batches, bucket_rows

    order = [5, 0, 7, 2, 6, 1, 4, 3]
    prompt = [10, 10, 30, 30, 20, 20, 40, 40]
    groups = [0, 0, 1, 1, 2, 2, 3, 3]
    comp = [3, 1, 2, 2, 5, 4, 1, 1]
    out = bucket_rows(order, prompt, groups, comp, block=4)
    assert [set(out[:4]), set(out[4:])] == [set(order[:4]), set(order[4:])], "a block keeps its rows"
    assert out[:4] == [0, 5, 2, 7] and out[4:] == [1, 4, 3, 6]
    assert bucket_rows(order, prompt, groups, comp, block=1) == order
    assert block_micro_batches(4, 2) == 2 and block_micro_batches(3, 2) == 1 and block_micro_batches(2, 6) == 2


def test_composition_invariant_names_the_losses_that_depend_on_micro_batches():
    from collage.training.batching.buckets import composition_invariant

    assert composition_invariant("grpo", "dapo", 0.0, 1.0) and composition_invariant("rloo", "bnpo", 0.0, 1.0)
    assert not composition_invariant("grpo", "bnpo", 0.0, 1.0)
    assert not composition_invariant("grpo", "dapo", 0.01, 1.0)
    assert not composition_invariant("grpo", "grpo", 0.0, 0.8)
