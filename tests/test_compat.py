"""distlab.comm.compat on a torch without 2.13's names: the gathers still gather, and their gradients still sum.

torch 2.11 (the GPU image's) has `all_gather_into_tensor`, `reduce_scatter_tensor` and the functional
`all_gather_tensor_autograd`, and none of `all_gather_single`, `reduce_scatter_single`,
`all_gather_single(_autograd)`. Here the installed torch 2.13 is made to look like that to `distlab.comm.compat`
(the new names hidden from the modules it reads), and the library's three gathers run on P = 3 ranks.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from helpers import assert_gather_result, gather_forward_and_backward

from distlab.comm import compat
from distlab.processes.spawn import spawn

NEW_NAMES = {"all_gather_single", "reduce_scatter_single", "all_gather_single_autograd"}


class Without:
    """`module` with `hidden` names missing (what an older torch looks like to a getattr), every other
    name looked up in it, and every call of `counted` names recorded in `calls`."""

    def __init__(self, module, hidden: set[str], counted: set[str], calls: list[str]):
        self._module, self._hidden, self._counted, self._calls = module, hidden, counted, calls

    def __getattr__(self, name: str):
        if name in self._hidden:
            raise AttributeError(name)
        found = getattr(self._module, name)
        if name not in self._counted:
            return found

        def counted(*args, **kwargs):
            self._calls.append(name)
            return found(*args, **kwargs)

        return counted


OLD_NAMES = {"all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_tensor_autograd"}


def _as_if_torch_2_11(rt):
    from distlab.contrastive.gather import gather_library, gather_with_grad

    calls: list[str] = []
    compat.dist = Without(dist, NEW_NAMES, OLD_NAMES, calls)
    compat.funcol = Without(funcol, NEW_NAMES | {"all_gather_single"}, OLD_NAMES, calls)
    got = {
        name: gather_forward_and_backward(rt, fn)
        for name, fn in (("sum", gather_with_grad), ("library", gather_library))
    }
    return got, calls


def test_the_gathers_work_with_only_torch_2_11s_names():
    for rank, (got, calls) in enumerate(spawn(_as_if_torch_2_11, 3)):
        for gathered, grad in got.values():  # both gathers' backward sums over ranks
            assert_gather_result(rank, 3, gathered, grad, sums_over_ranks=True)
        # what ran: the old names, and each of the three
        assert sorted(set(calls)) == sorted(OLD_NAMES), calls


def test_a_torch_with_neither_name_is_one_error_naming_both(monkeypatch):
    monkeypatch.setattr(compat, "dist", Without(dist, NEW_NAMES | OLD_NAMES, set(), []))
    with pytest.raises(AttributeError, match="has none of all_gather_single, all_gather_into_tensor"):
        compat.all_gather_single(None, None)


def test_the_installed_torch_gets_its_own_new_names():
    assert compat._first(dist, "all_gather_single", "all_gather_into_tensor") is dist.all_gather_single
    assert compat._first(funcol, "all_gather_single_autograd", "x") is funcol.all_gather_single_autograd
