"""The state cache's slot layout (`SlotLayout`: `[sequences | snapshots | spare]`), its copies
and rollbacks (logged chains replayed), and the deprecated `vllm_mamba.mamba_cache` alias
module."""

from __future__ import annotations

import pytest
import torch

from vllm_mamba.cache_specs import StateSpec, StateTensor
from vllm_mamba.layers.cache_layers import StatefulLayer
from vllm_mamba.layers.chain_log import ChainLog
from vllm_mamba.ops import gated_delta as gd
from vllm_mamba.state_cache import SlotLayout, StateCache


def test_regions_follow_one_another() -> None:
    layout = SlotLayout(num_sequences=4, num_snapshots=3, num_chains=2, max_drafts=5)
    assert (layout.snapshot_base, layout.spare_base) == (4, 7)
    assert layout.num_spare == 10
    assert layout.num_slots == 17
    assert [layout.snapshot_slot(i) for i in range(3)] == [4, 5, 6]
    spare = [layout.spare_slot(c, w) for c in range(2) for w in range(5)]
    assert spare == list(range(7, 17))  # every spare slot once, chain by chain


def test_without_snapshots_or_speculation() -> None:
    layout = SlotLayout(num_sequences=3)
    assert (layout.snapshot_base, layout.spare_base, layout.num_slots) == (3, 3, 3)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda lay: lay.snapshot_slot(2), "snapshot 2 of 2"),
        (lambda lay: lay.snapshot_slot(-1), "snapshot -1 of 2"),
        (lambda lay: lay.spare_slot(3, 0), "chain 3 position 0: 3 chains of 2"),
        (lambda lay: lay.spare_slot(0, 2), "chain 0 position 2"),
    ],
)
def test_slots_out_of_their_region_are_refused(call, match: str) -> None:  # noqa: ANN001
    with pytest.raises(IndexError, match=match):
        call(SlotLayout(num_sequences=2, num_snapshots=2, num_chains=3, max_drafts=2))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_sequences": 0}, "num_sequences"),
        ({"num_sequences": 1, "max_drafts": -1}, "max_drafts"),
    ],
)
def test_bad_counts_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SlotLayout(**kwargs)


def test_old_module_name_is_an_alias() -> None:
    from vllm_mamba import mamba_cache, state_cache

    assert mamba_cache.MambaCache is state_cache.StateCache
    assert mamba_cache.SlotAllocator is state_cache.SlotAllocator
    assert mamba_cache.state_specs_of is state_cache.state_specs_of


def test_cache_allocates_every_slot_of_the_layout() -> None:
    layout = SlotLayout(num_sequences=2, num_snapshots=1, num_chains=1, max_drafts=2)
    spec = StateSpec((StateTensor("h", (3,), "recurrent", torch.float32),))
    cache = StateCache([spec], layout.num_slots, torch.device("cpu"))
    assert cache.layer(0)["h"].shape == (layout.num_slots, 3)
    cache.layer(0)["h"][0] = 1.0
    cache.copy_slots([0], [layout.spare_slot(0, 1)])
    assert torch.equal(cache.layer(0)["h"][layout.spare_slot(0, 1)], torch.ones(3))


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        ([3, 0], [1, 2]),  # disjoint: a rollback's spare slots into sequences' slots
        ([0, 1], [1, 0]),  # a swap: every source read before any is written
        ([0, 1], [1, 2]),  # a chain of copies
    ],
)
def test_copy_slots_copies_as_if_all_sources_were_read_first(src: list, dst: list) -> None:
    specs = [
        StateSpec((StateTensor("h", (2, 3), "recurrent", torch.float32),)),
        StateSpec((StateTensor("conv", (4,), "conv", torch.bfloat16),)),
    ]
    cache = StateCache(specs, 4, torch.device("cpu"))
    for i in range(2):
        for t in cache.layer(i).values():
            t.copy_(torch.randn(t.shape).to(t.dtype))
    before = [{n: t.clone() for n, t in cache.layer(i).items()} for i in range(2)]
    cache.copy_slots(src, dst)
    for i in range(2):
        for n, t in cache.layer(i).items():
            want = before[i][n].clone()
            want[dst] = before[i][n][src]
            assert torch.equal(t, want), (i, n)


class _Logged(StatefulLayer):
    """A layer with a conv history and a (Hv, Dk, Dv) recurrent state; `chain_log` set when
    `logged` (its replay the GDN reference's)."""

    def __init__(self, logged: bool) -> None:
        super().__init__()
        if logged:
            self.chain_log = ChainLog("recurrent", (2, 3 + 4 + 1), gd.gdn_chain_replay_ref)

    def state_spec(self) -> StateSpec:
        return StateSpec((
            StateTensor("conv", (5, 2), "conv", torch.float32),
            StateTensor("recurrent", (2, 3, 4), "recurrent", torch.float32),
        ))  # fmt: skip


@pytest.mark.parametrize("active", [True, False])
def test_rollback_replays_logged_states_and_copies_the_rest(active: bool) -> None:
    """`StateCache.rollback`: the states of a layer whose last chain was logged (layer 0 when
    `active`) are rebuilt from each chain's start slot (the sequence's own, in place, or a
    spare) through the kept positions' records; every other state (the conv histories, a
    layer whose last chain ran unfused, a layer without a log) is copied from the last kept
    position's slot, and stays as it is where that is the sequence's slot."""
    g = torch.Generator().manual_seed(3)
    layers = torch.nn.Sequential(_Logged(True), _Logged(True), _Logged(False))
    cache = StateCache([m.state_spec() for m in layers], 10, torch.device("cpu"))
    cache.bind(layers)
    for i, m in enumerate(layers):
        for t in cache.layer(i).values():
            t.copy_(torch.randn(t.shape, generator=g))
        if m.chain_log is not None:
            m.chain_log.buffer(cache.layer(i)["recurrent"]).copy_(torch.rand(10, 2, 8, generator=g))
    layers[0].chain_log.active = active
    before = [{n: t.clone() for n, t in cache.layer(i).items()} for i in range(3)]
    # (start, positions, slot): chain 0 keeps 3 positions from a spare start copy, chain 1 one
    # position, chain 2 its whole chain (its last position wrote slot 2) from its own slot.
    chains = [(4, [4, 5, 6], 0), (7, [7], 1), (2, [8, 9, 2], 2)]
    cache.rollback(chains)
    for i, m in enumerate(layers):
        state = cache.layer(i)
        for start, positions, slot in chains:
            assert torch.equal(state["conv"][slot], before[i]["conv"][positions[-1]])
            if i > 0 or not active:
                want = before[i]["recurrent"][positions[-1]]
                assert torch.equal(state["recurrent"][slot], want)
                continue
            want = before[i]["recurrent"][start]
            for r in positions:
                k, delta, decay = m.chain_log.tensor[r].split([3, 4, 1], dim=-1)
                want = decay[..., None] * want + k[..., None] * delta[:, None, :]
            torch.testing.assert_close(state["recurrent"][slot], want, rtol=0, atol=1e-6)
