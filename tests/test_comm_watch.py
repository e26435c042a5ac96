"""distlab.comm.watch: torch's own collectives, counted by the group they ran on and priced by the ring
formulas, whichever way torch calls them (torch.distributed's functions, DTensor's functional collectives,
point-to-point sends); what a rank receives is not counted, a group it was not told about is 'other'."""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh

from distlab.comm.collectives import ring_bytes
from distlab.comm.p2p import post
from distlab.comm.watch import CollectiveWatch
from distlab.processes.spawn import spawn

E = 8  # float64


def _watched(rt):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rows", "cols"))
    rows, cols = mesh.get_group("rows"), mesh.get_group("cols")
    x = torch.ones(6, 4, dtype=torch.float64)
    with CollectiveWatch({"rows": rows}) as watch:
        watch.phase = "one"
        dist.all_reduce(x.clone(), group=rows)
        funcol.all_gather_tensor(x, 0, rows).wait()  # DTensor's way: 12 x 4 gathered
        watch.phase = "two"
        out = torch.empty(3, 4, dtype=torch.float64)
        dist.reduce_scatter_tensor(out, x, group=rows)
        peer = 1 - dist.get_rank(rows)
        post([(x[:2], peer)], [(torch.empty(2, 4, dtype=torch.float64), peer)], rows).wait()
        dist.all_reduce(x.clone(), group=cols)  # not named: 'other'
    return {label: dict(ledger.sent_by) for label, ledger in watch.ledgers.items()}


def test_each_collective_is_counted_on_its_group_at_the_ring_formulas_bytes():
    whole = 6 * 4
    expected = {
        "rows": {
            ("one", "all_reduce"): ring_bytes("all_reduce", whole, E, 2),
            ("one", "all_gather"): ring_bytes("all_gather", 2 * whole, E, 2),
            ("two", "reduce_scatter"): ring_bytes("reduce_scatter", whole, E, 2),
            ("two", "send"): 2 * 4 * E,  # what it sent; what it received is its peer's to count
        },
        "other": {("two", "all_reduce"): ring_bytes("all_reduce", whole, E, 2)},
    }
    assert spawn(_watched, 4) == [expected] * 4
    assert expected["rows"]["one", "all_gather"] == whole * E  # (P-1)/P of the gathered 2 x 24 elements


def _shared(rt):
    group = dist.new_group([0, 1])
    x = torch.ones(4, dtype=torch.float64)
    with CollectiveWatch({"ring": group, "shards": group}, kinds={"ring": ("send",)}) as watch:
        post([(x, 1 - rt.rank)], [(torch.empty_like(x), 1 - rt.rank)], group).wait()
        dist.all_reduce(x.clone(), group=group)
    return {label: dict(ledger.sent_by) for label, ledger in watch.ledgers.items()}


def test_two_labels_of_one_group_are_told_apart_by_their_kinds():
    expected = {"ring": {("", "send"): 4 * E}, "shards": {("", "all_reduce"): ring_bytes("all_reduce", 4, E, 2)}}
    assert spawn(_shared, 2) == [expected] * 2


def _same_ranks(rt):
    told, other = dist.new_group([0, 1]), dist.new_group([0, 1])  # two groups of the same ranks
    with CollectiveWatch({"pair": told}) as watch:
        dist.all_reduce(torch.ones(4, dtype=torch.float64), group=other)
    return {label: dict(ledger.sent_by) for label, ledger in watch.ledgers.items()}


def test_a_group_is_known_by_its_ranks_not_by_the_object():
    assert spawn(_same_ranks, 2) == [{"pair": {("", "all_reduce"): ring_bytes("all_reduce", 4, E, 2)}}] * 2
