"""The sharding library's pieces without processes: the flat layout pads and round-trips; the byte
formulas say what the ZeRO paper says (16 Psi under mixed precision, ZeRO-3 sends 1.5x DDP)."""

import torch

from distlab.data_split.sharding import accounting
from distlab.data_split.sharding.flat import FlatUnit, units_of
from distlab.data_split.sharding.problem import ShardingConfig, build_model


def test_a_flat_unit_pads_to_equal_shards_and_round_trips():
    model = build_model(ShardingConfig())
    for p in (1, 2, 3, 4):
        for unit, layer in zip(units_of(model, p - 1, p), model.children()):
            params = [q.detach() for q in layer.parameters()]
            flat = unit.flatten(params)
            assert flat.numel() == unit.padded == p * unit.shard_numel >= unit.numel > unit.padded - p
            assert torch.equal(flat[unit.numel :], torch.zeros(unit.padded - unit.numel, dtype=flat.dtype))
            assert all(torch.equal(a, b) for a, b in zip(unit.unflatten(flat), params))
            assert torch.equal(unit.my_shard(flat), flat.chunk(p)[p - 1])


def test_the_formulas_say_what_zero_says():
    psi = 1000
    assert sum(accounting.expected_states_mixed(psi, 0).values()) == 16 * psi  # 2 + 2 + 4 + 8 bytes per parameter
    assert sum(accounting.expected_states_one_dtype(psi, 0, 8).values()) == 32 * psi
    even = accounting.Sizes(psi=1200, shard=300, tensors=6, units=3, world=4, e=2)
    ddp = accounting.expected_bytes("DDP", even)
    assert ddp == 2 * 3 / 4 * 1200 * 2  # 2 (P-1)/P b Psi, the ring all-reduce
    assert accounting.expected_bytes("ZeRO-1", even) == accounting.expected_bytes("ZeRO-2", even) == ddp
    assert accounting.expected_bytes("ZeRO-3", even) == 1.5 * ddp
    held = {stage: sum(accounting.held(stage, even).values()) for stage in accounting.STAGES}
    assert held["DDP"] > held["ZeRO-1"] > held["ZeRO-2"] > held["ZeRO-3"] == 4 * 2 * 300 + 4 * 3


def test_a_unit_is_a_layer():
    unit = FlatUnit(torch.nn.Linear(3, 2), rank=0, world_size=4)
    assert (unit.numel, unit.shard_numel, unit.padded) == (8, 2, 8)


def _saved_stats_bytes(dtype: torch.dtype, device: str) -> int:
    """Bytes per element of the mean and 1/std torch's LayerNorm returns (what it saves for backward) for
    `dtype` inputs on `device`; CUDA through fake tensors, which run the device's own output rules."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def stats():
        x, w = torch.zeros(4, 8, dtype=dtype, device=device), torch.ones(8, dtype=dtype, device=device)
        _, mean, rstd = torch.native_layer_norm(x, [8], w, torch.zeros_like(w), 1e-5)
        assert mean.dtype == rstd.dtype
        return mean.element_size()

    if device == "cpu":
        return stats()
    with FakeTensorMode():
        return stats()


def test_layer_norm_statistics_are_saved_in_the_devices_accumulation_type():
    """Lesson 07's block formula on a GPU: bf16 inputs, float32 statistics (the first GPU run's one miss)."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        for device in ("cpu", "cuda"):
            e = torch.empty((), dtype=dtype).element_size()
            assert _saved_stats_bytes(dtype, device) == accounting.layer_norm_stat_bytes(e, device), (dtype, device)
    cpu, cuda = (
        accounting.block_activations(4, 8, 16, 2, 2, accounting.layer_norm_stat_bytes(2, dev))
        for dev in ("cpu", "cuda")
    )
    assert cuda - cpu == 2 * 2 * 4 * 8 * (4 - 2)  # two LayerNorms, mean and 1/std, C seq of them, 2 bytes more each
