"""What align and distill share (training.py): the learning-rate schedules and the row order."""
import pytest
import torch

from taylor_calibrate.training import batch_indices, warmup_cosine, wsd


def test_warmup_cosine_is_distills_schedule():
    assert warmup_cosine(1, 100, 10) == pytest.approx(0.1) and warmup_cosine(10, 100, 10) == pytest.approx(1.0)
    assert warmup_cosine(100, 100, 10) == pytest.approx(0.1) and 0.1 < warmup_cosine(50, 100, 10) < 1.0
    assert warmup_cosine(1, 5, 0) < 1.0  # no warmup: the cosine from the first step


def test_wsd_is_flat_then_straight_down_and_the_last_step_still_moves():
    assert all(wsd(s, 100, 0.2) == 1.0 for s in (1, 50, 80)) and wsd(90, 100, 0.2) == pytest.approx(0.51)
    assert wsd(100, 100, 0.2) == pytest.approx(0.01)
    assert wsd(50, 100, 0.5) == 1.0 and wsd(75, 100, 0.5) == pytest.approx(0.51)


def test_batch_indices_are_seeded_epochs():
    rows = batch_indices(5, 2, 7, seed=3)  # 14 indices: two full epochs + 4 of the third
    assert rows.shape == (7, 2)
    flat = rows.flatten()
    assert sorted(flat[:5].tolist()) == list(range(5)) and sorted(flat[5:10].tolist()) == list(range(5))
    assert torch.equal(rows, batch_indices(5, 2, 7, seed=3))
