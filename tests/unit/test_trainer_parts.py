"""The trainer's collaborators that need no model, on synthetic rows: the data order (training.data_order), a seeded
permutation per epoch with each process taking its slice and resuming at its position, and the trainer state
(training.checkpointing) keeping its keys and reading one written before a key existed."""

from __future__ import annotations

import torch

from collage.training.checkpoint import load_state
from collage.training.checkpointing import TrainerState
from collage.training.data.loader import LoadedDataset, load_dataset
from collage.training.data_order import DataOrder


def _rows(n: int, min_images: int = 0) -> LoadedDataset:
    return load_dataset("synth:count-red", rows=n, min_images=min_images, max_images=2, seed=0)


# ------------------------------------------------------------------------------------------------ data order
def test_the_data_order_is_a_seeded_permutation_per_epoch_each_process_taking_its_slice():
    dataset = _rows(10)
    orders = [DataOrder(dataset, seed=3, prompts_per_process=2, world=2, rank=r, check=None) for r in range(2)]
    rng = torch.get_rng_state()
    batches = [[[s.row for s in order.next_prompts()] for order in orders] for _ in range(5)]
    assert torch.equal(torch.get_rng_state(), rng), "the data order draws nothing from the global random stream"

    def expected(pos: int) -> int:  # the shared stream: epoch e is permutation e of the rows
        epoch, offset = divmod(pos, 10)
        perm = torch.randperm(10, generator=torch.Generator().manual_seed(3 * 1_000_003 + epoch))
        return dataset.rows[int(perm[offset])].row

    for b, (first, second) in enumerate(batches):  # 4 prompts a batch: process 0 the first 2, process 1 the next
        assert first + second == [expected(4 * b + k) for k in range(4)], b
    stream = [row for first, second in batches for row in first + second]
    assert sorted(stream[:10]) == sorted(stream[10:20]) == sorted(r.row for r in dataset.rows)  # two whole epochs
    assert stream[:10] != stream[10:20]  # each its own order
    assert orders[0].position == orders[1].position == 20

    resumed = DataOrder(dataset, seed=3, prompts_per_process=2, world=2, rank=1, check=None)
    resumed.position = 8  # as a checkpoint written after two batches puts it back
    assert [s.row for s in resumed.next_prompts()] == batches[2][1]


def test_a_trainer_state_keeps_its_keys_and_reads_one_written_before_a_key_existed(tmp_path):
    state = TrainerState(4, 8, 32, 10.0, {}, {}, None, 1, None, 4)
    assert list(state.to_dict()) == ["step", "micro", "position", "num_tokens", "optimizer", "scheduler", "buffer",
                                     "world", "ref_model", "last_eval_step"]  # fmt: skip
    assert TrainerState.from_dict(state.to_dict()) == state
    old = {k: v for k, v in state.to_dict().items() if k not in ("ref_model", "last_eval_step")}
    assert TrainerState.from_dict(old) == TrainerState(4, 8, 32, 10.0, {}, {}, None, 1, None, -1)
    torch.save({**state.to_dict(), "rng": []}, tmp_path / "trainer_state.pt")
    assert TrainerState.from_dict(load_state(tmp_path)) == state
