"""`distlab.processes.nodes` without processes: which ranks a torchrun node ran, the words a survivor's line uses,
and the SIGTERM a lesson's rank turns into an error under several agents (tests/test_two_agents.py runs two real
agents). Each rule is shown able to fail: a layout this rank's RANK does not fit names no ranks."""

from __future__ import annotations

import signal

import pytest

from distlab.processes import nodes


def _torchrun(monkeypatch, rank: int, group: int, local: int, per: int, n_nodes: int) -> None:
    env = dict(RANK=rank, GROUP_RANK=group, LOCAL_RANK=local, LOCAL_WORLD_SIZE=per, GROUP_WORLD_SIZE=n_nodes)
    env["TORCHELASTIC_RUN_ID"] = "test"
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))


def test_a_node_s_ranks_from_torchrun_s_layout(monkeypatch):
    _torchrun(monkeypatch, rank=5, group=2, local=1, per=2, n_nodes=3)
    assert nodes.node_ranks(1) == [2, 3] and nodes.on_node(1) == "node 1 (ranks 2, 3)"
    assert nodes.nodes_of([3, 2]).startswith(" (on node 1 (ranks 2, 3): torchrun's agent stops every rank")
    assert nodes.store_holder().startswith("node 0 (ranks 0, 1), whose torchrun agent served the store, stopped")


def test_a_layout_this_rank_does_not_fit_names_no_ranks(monkeypatch):
    _torchrun(monkeypatch, rank=4, group=2, local=1, per=2, n_nodes=3)  # 2 * 2 + 1 = 5, not 4
    assert nodes.node_ranks(1) is None and nodes.on_node(1) == "node 1"


def test_one_agent_adds_no_node_words(monkeypatch):
    _torchrun(monkeypatch, rank=1, group=0, local=1, per=4, n_nodes=1)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert nodes.nodes_of([1]) == "" and nodes.store_holder().startswith("torchrun's agent")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    assert nodes.store_holder().startswith("rank 0")


def test_a_peer_failure_is_told_from_the_model_s_error():
    assert nodes.is_peer_failure(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:41858"))
    assert nodes.is_peer_failure(nodes.StoppedByAgent("stopped"))
    assert not nodes.is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_under_several_agents_the_agent_s_sigterm_is_an_error_that_says_why(monkeypatch):
    _torchrun(monkeypatch, rank=1, group=1, local=0, per=1, n_nodes=2)
    with nodes.agent_stops_named():
        assert signal.getsignal(signal.SIGTERM) is nodes.stopped_by_agent
        with pytest.raises(nodes.StoppedByAgent, match=r"torchrun's agent of node 1 \(rank 1\) stopped this rank"):
            nodes.stopped_by_agent(signal.SIGTERM, None)  # no process group here: nothing to ask the store
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    _torchrun(monkeypatch, rank=0, group=0, local=0, per=1, n_nodes=1)
    with nodes.agent_stops_named():  # one agent: a line naming the dead ranks, then SIGTERM's own stop
        assert signal.getsignal(signal.SIGTERM) is nodes.named_then_stopped
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    with nodes.agent_stops_named():  # outside torchrun: SIGTERM left alone
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_the_other_node_is_named_only_when_the_dead_peer_can_have_run_nowhere_else(monkeypatch):
    """One rank per node and two nodes: a peer's death came from the other node. A second rank on this node, or
    a third node, and the rank cannot tell: no node is named."""
    _torchrun(monkeypatch, rank=0, group=0, local=0, per=1, n_nodes=2)
    assert nodes.elsewhere(0).startswith("node 1 (rank 1) stopped: torchrun's agent stops every rank of its node")
    _torchrun(monkeypatch, rank=1, group=0, local=1, per=2, n_nodes=2)
    assert nodes.elsewhere(0) is None
    _torchrun(monkeypatch, rank=0, group=0, local=0, per=1, n_nodes=3)
    assert nodes.elsewhere(0) is None


def test_a_dead_rank_s_line_says_what_it_hosted_while_it_hosted_it():
    """Lesson 20's rank 0 hosts torchft's Lighthouse while the Lighthouse block runs: a survivor's line naming it
    says so then, and only then."""
    why = "torchrun's agent stopped this rank (SIGTERM)"
    with nodes.hosting(0, "torchft's Lighthouse"):
        assert nodes._died(1, [0], why) == f"[rank 1] rank 0 died, the host of torchft's Lighthouse: {why}"
        assert nodes._died(1, [0, 2], why).startswith("[rank 1] ranks 0, 2 died, rank 0 the host of torchft's Li")
        assert nodes._died(1, [2], why) == f"[rank 1] rank 2 died: {why}"
    assert nodes._died(1, [0], why) == f"[rank 1] rank 0 died: {why}"
