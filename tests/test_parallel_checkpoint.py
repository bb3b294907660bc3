"""Sharded checkpoints in one process: complete or absent, refused with the reason, consolidated to stock.

The cross-rank cases (1 -> 2, 2 -> 1, FSDP -> DDP, tensor parallel -> one file) are in
test_parallel_dist.py; these are the directory mechanics, which need no second rank.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from turbotrain import CheckpointError
from turbotrain.parallel import EXTRA_FILE, consolidate, load_sharded, run_consolidate, save_sharded


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3))


def _stepped(seed=0):
    net = _net(seed)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net(torch.randn(4, 5)).square().mean().backward()
    opt.step()
    return net, opt


def test_round_trip_with_optimizer_state_and_extra(tmp_path):
    net, opt = _stepped()
    extra = {"steps": 3, "rng": torch.get_rng_state()}
    save_sharded(tmp_path / "ck", net, opt, extra=extra)
    fresh = _net(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    got = load_sharded(tmp_path / "ck", fresh, fresh_opt)
    assert got["steps"] == 3 and torch.equal(got["rng"], extra["rng"])
    for (name, a), b in zip(net.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[a][key], fresh_opt.state[b][key]), (name, key)
    assert (tmp_path / "ck" / EXTRA_FILE).is_file()


def test_a_second_save_replaces_the_first_and_leaves_nothing_beside_it(tmp_path):
    first, _ = _stepped(0)
    second, _ = _stepped(1)
    save_sharded(tmp_path / "ck", first)
    os.makedirs(tmp_path / "ck.tmp-deadbeef")  # what a save that died before its rename leaves
    save_sharded(tmp_path / "ck", second)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    fresh = _net(seed=2)
    load_sharded(tmp_path / "ck", fresh)
    assert all(torch.equal(a, b) for a, b in zip(second.parameters(), fresh.parameters()))


def test_missing_and_foreign_directories_are_refused_with_the_reason(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_sharded(tmp_path / "nothing", _net())
    (tmp_path / "plain").mkdir()
    torch.save(_net().state_dict(), tmp_path / "plain" / "model.pt")
    with pytest.raises(CheckpointError, match="not a sharded checkpoint.*Engine.load"):
        load_sharded(tmp_path / "plain", _net())


def test_a_crash_between_the_renames_names_the_previous_checkpoint(tmp_path):
    save_sharded(tmp_path / "ck", _net())
    os.rename(tmp_path / "ck", tmp_path / "ck.old-0123abcd")  # the first rename happened, the second did not
    with pytest.raises(CheckpointError, match=r"ck.old-0123abcd holds the checkpoint it replaced.*rename"):
        load_sharded(tmp_path / "ck", _net())


def test_asking_for_optimizer_state_that_was_not_saved_is_a_checkpoint_error(tmp_path):
    save_sharded(tmp_path / "ck", _net())
    net = _net()
    with pytest.raises(CheckpointError, match="does not hold the model and optimizer"):
        load_sharded(tmp_path / "ck", net, torch.optim.AdamW(net.parameters()))


def test_a_model_of_another_build_is_a_checkpoint_error(tmp_path):
    save_sharded(tmp_path / "ck", _net())
    with pytest.raises(CheckpointError, match=r"weights this model lacks \(1.bias, 1.weight, 2.bias, 2.weight\)"):
        load_sharded(tmp_path / "ck", nn.Sequential(nn.Linear(5, 7)))
    with pytest.raises(CheckpointError, match="does not hold the model as built here"):
        load_sharded(tmp_path / "ck", nn.Sequential(nn.Linear(5, 9), nn.LayerNorm(9), nn.Linear(9, 3)))


def test_consolidate_writes_what_load_state_dict_takes(tmp_path):
    net, opt = _stepped()
    save_sharded(tmp_path / "ck", net, opt, extra={"steps": 1})
    line = run_consolidate(tmp_path / "ck", tmp_path / "out.pt")
    assert "6 tensors" in line and str(tmp_path / "out.pt") in line
    state = torch.load(tmp_path / "out.pt", weights_only=True)
    assert list(state) == list(net.state_dict())  # stock names, no "model." prefix
    fresh = _net(seed=3)
    fresh.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), fresh.parameters()))
    with pytest.raises(CheckpointError, match="not a sharded checkpoint"):
        consolidate(tmp_path / "out.pt", tmp_path / "again.pt")
