"""Lesson 20: DiLoCo, islands that synchronise every H steps, by hand and with torchft.

    torchrun --nproc-per-node 2 lessons/20_diloco.py     # 2 islands of P/2 ranks (P = 2, 4)

Islands. The P ranks form 2 islands of P/2 ranks. Inside an island the link is fast: the island runs
plain data parallelism (torch's DDP on the island's own group), one inner step per batch, by plain SGD (the
paper's inner optimizer is AdamW; SGD keeps each step one rounding to check, and nothing below depends on
which). Between islands the link is slow: they talk once every H inner steps (one "round"), and only then.

The outer step (DiLoCo, Douillard et al. 2023). Every island starts a round from the same global
weights theta. After H inner steps island i holds theta_i. Its pseudogradient is

    delta_i = theta - theta_i          (sign: "before minus after", the direction a gradient points)

The islands average it, delta = 1/2 sum_i delta_i (one all-reduce across islands), every island goes
back to theta and an outer optimizer steps with delta AS ITS GRADIENT: here SGD with Nesterov momentum
mu and rate eta, written out by hand below (buf = mu buf + delta; theta -= eta (delta + mu buf)). With
eta = 1 and mu = 0 this is the average of the islands' weights; eta = 0.7, mu = 0.9 is the paper's. A
sign slip (delta = theta_i - theta) walks the weights away from where the islands went: torchft shipped
one for months (its PR #233); the one-process reference below catches it on the first outer step.

Streaming fragments (Streaming DiLoCo, 2025). Cut the model into F fragments of consecutive layers and synchronise one
fragment every H/F steps, in turn: the same bytes per H steps, but in F smaller pieces, so the slow link is busy all
the time instead of in bursts. `--fragments F` does it here (F must divide the model's layers and H).

Bytes. DDP across all P ranks all-reduces the S gradient bytes at every step: 2 (P-1)/P S per rank, H
times per round. DiLoCo all-reduces the S pseudogradient bytes once per round between 2 islands:
2 (2-1)/2 S = S per rank. H times fewer synchronisations over the slow link.

torchft. The same algorithm as a library: a `Manager` per island (its replica group) asks a
`LighthouseServer` for a quorum of live islands before every outer step, all-reduces over a process group
it rebuilds for each quorum, and heals a newcomer by sending it a live island's state; `DiLoCo` hooks
the inner optimizer and runs the rounds. The Lighthouse runs inside this lesson on a free loopback port
and is shut down on every way out (`--torchft-logs` prints torchft's own log lines: every quorum, every
commit). With `init_sync=False` torchft equals the hand-written islands and a one-process simulation of them
bit for bit. With its default (`init_sync=True`) the first quorum, which
DiLoCo asks for only after the first H inner steps, "heals" the islands at step 0 as if nothing had run:
rank m of one island receives island (m mod 2)'s state, so at P = 2 island 1's first H steps are thrown
away and island 0's are counted twice (at P = 4 the two ranks of one island even heal from different
islands and drift apart); the simulation reproduces the first round bit for bit (torch 2.13, torchft 0.2.0).

A lost island (as torchft 0.2.0's source does it). Here each island member is a process of its own (torchrun stops
every rank when one dies); island 1's are SIGKILLed mid-window, before sync LOST = 1 (syncs count from 0). The
Lighthouse waits while island 1 still heartbeats (torchft's split-brain rule: more than half of the islands
heartbeating must have asked; 1 of 2 is not), calls it dead after HEARTBEAT_MS (now 1 of 1 has asked) and gives
island 0 a quorum of one. Island 0's Manager all-reduces over it, divides by num_participants = 1 and commits
(min_replica_size = 1): delta = delta_0, island 1's half round is lost. (With min_replica_size = 2 should_commit
says no: DiLoCo puts theta back, the step does not advance, the window is redone.) Island 1 restarts: a new
process, the same replica id, step 0. It trains a window and asks for a quorum, which the Lighthouse holds until
island 0 asks (at sync BACK = 2). Being behind, it heals first: it receives island 0's state of that moment (its
weights after this window, DiLoCo's saved theta, the outer momentum, the step), so its pseudogradient is island
0's and (delta_0 + delta_0) / 2 = delta_0 exactly; from the next sync on both count. The rows follow torchft's
step, so the healed island goes on at the survivors' rows. The reference leaves island 1 out of syncs LOST ..
BACK-1 and copies island 0 into it at BACK; torchft equals it bit for bit.

The reference: one process, the two islands as two plain models, each island's ranks as separate
backward passes on their rows, averaged; torch.optim.SGD as the outer optimizer. No collectives.
"""

from __future__ import annotations

import copy
import os
import signal
from contextlib import ExitStack, contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distlab.comm.collectives import ring_bytes
from distlab.processes.console import print0, rows_table
from distlab.processes.flags import check_flags_against_world, positive_int, require
from distlab.processes.identity import Runtime
from distlab.processes.runtime import distributed, run_main
from distlab.proof.cli import lesson_parser
from distlab.proof.verdict import Verdict
from distlab.resilience.lighthouse import TIMEOUT, island_stores, lighthouse, lighthouse_shows, manager, torchft_logs
from distlab.resilience.lives import Lives

ISLANDS = 2
WIDTH, LAYERS, ROWS = 8, 4, 4  # d, the model's Linear layers, rows per rank per inner step
INNER_LR, OUTER_LR, OUTER_MOMENTUM = 0.1, 0.7, 0.9
LOST, BACK, SYNCS = 1, 2, 4  # island 1 dies in the window before sync LOST, is back at BACK; SYNCS in all
HEARTBEAT_MS = 2000  # the Lighthouse calls an island dead after this long without a heartbeat
LIFE_S = 120.0  # the longest an island process may take
LIGHTHOUSES: list[str] = []  # every Lighthouse address rank 0 started (the tests check each is closed after exit)


def build_model(seed: int) -> nn.Sequential:
    """LAYERS Linear(d, d) with tanh between them, float64: a model of LAYERS whole layers to fragment."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for k in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH, dtype=torch.float64)] + ([nn.Tanh()] if k < LAYERS - 1 else [])
    return nn.Sequential(*layers)


def fragments_of(model: nn.Sequential, fragments: int) -> list[nn.ModuleList]:
    """F fragments of consecutive Linear layers (the streaming unit)."""
    linears = [m for m in model if isinstance(m, nn.Linear)]
    per = len(linears) // fragments
    return [nn.ModuleList(linears[k * per : (k + 1) * per]) for k in range(fragments)]


def rows(seed: int, step: int, island: int, member: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `member` of island `island`'s rows at inner step `step`: the same on every path."""
    g = torch.Generator().manual_seed(((seed * 1000 + step) * ISLANDS + island) * 64 + member)
    x = torch.randn(ROWS, WIDTH, generator=g, dtype=torch.float64)
    return x, torch.sin(3 * x)  # a target the model can learn


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()  # a MEAN over rows: DDP's average of equal shares is the island's mean


def synced_fragment(step: int, h: int, fragments: int) -> int | None:
    """After inner step `step` (1, 2, ...): the fragment synchronised now, or None. One every H/F steps, in turn."""
    every = h // fragments
    return None if step % every else (step // every - 1) % fragments


# ---- the mechanism: the outer step by hand ---------------------------------------------------------


class OuterNesterov:
    """SGD with Nesterov momentum, written out: buf = mu buf + g (buf = g at first), theta -= eta (g + mu buf)."""

    def __init__(self, lr: float, momentum: float):
        self.lr, self.momentum, self.buf = lr, momentum, {}

    def step(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        buf = self.buf.get(id(param))
        buf = grad.clone() if buf is None else buf.mul_(self.momentum).add_(grad)
        self.buf[id(param)] = buf
        param.add_(grad.add(buf, alpha=self.momentum), alpha=-self.lr)  # the look-ahead along the momentum


def outer_step_by_hand(fragment: nn.Module, theta: dict, outer: OuterNesterov, across: dist.ProcessGroup) -> int:
    """One DiLoCo synchronisation of `fragment`: the islands' mean pseudogradient, back to theta, the outer
    step, theta updated. `theta` maps each parameter to its weights at the round's start. Returns the bytes
    this rank sent across islands (a ring all-reduce of the pseudogradients between 2 islands)."""
    sent = 0
    with torch.no_grad():
        for param in fragment.parameters():
            delta = theta[param] - param  # before minus after: the pseudogradient
            dist.all_reduce(delta, group=across)  # the one slow-link exchange of the round
            delta /= ISLANDS
            sent += ring_bytes("all_reduce", delta.numel(), delta.element_size(), ISLANDS)
            param.copy_(theta[param])  # every island back to the round's start ...
            outer.step(param, delta)  # ... and one outer step with delta as the gradient
            theta[param] = param.detach().clone()
    return sent


# ---- the islands on real ranks: by hand, and with torchft ---------------------------------------------


def island_groups(rt: Runtime) -> tuple[int, int, dist.ProcessGroup, dist.ProcessGroup]:
    """(island, member, the island's group, this member's group across islands). Every rank makes every group."""
    per = rt.world_size // ISLANDS
    island, member = divmod(rt.rank, per)
    timeout = timedelta(seconds=60)
    inside = [dist.new_group(list(range(i * per, (i + 1) * per)), timeout=timeout) for i in range(ISLANDS)]
    across = [dist.new_group([i * per + m for i in range(ISLANDS)], timeout=timeout) for m in range(per)]
    return island, member, inside[island], across[member]


def train_islands(rt: Runtime, args, groups, hooks=None) -> tuple[nn.Module, int]:
    """The rounds on real ranks: DDP inside each island, the outer step by hand (hooks=None) or torchft's
    (hooks: the torchft DiLoCo context, which steps inside the inner optimizer's step). (model, bytes sent)."""
    island, member, inside, across = groups
    model = build_model(args.seed)
    ddp = DistributedDataParallel(model, process_group=inside)
    inner = torch.optim.SGD(ddp.parameters(), lr=INNER_LR)
    theta = {p: p.detach().clone() for p in model.parameters()}
    outers = [OuterNesterov(OUTER_LR, OUTER_MOMENTUM) for _ in range(args.fragments)]
    pieces, sent = fragments_of(model, args.fragments), 0
    with hooks(model, inner) if hooks else ExitStack():
        for step in range(1, args.rounds * args.h + 1):
            inner.zero_grad()
            loss_of(ddp, *rows(args.seed, step, island, member)).backward()  # DDP averages over the island
            inner.step()  # (torchft's DiLoCo synchronises in here, after the update)
            frag = synced_fragment(step, args.h, args.fragments)
            if hooks is None and frag is not None:
                sent += outer_step_by_hand(pieces[frag], theta, outers[frag], across)
    return model, sent


@contextmanager
def torchft_islands(rt: Runtime, island: int, member: int, init_sync: bool):
    """A Lighthouse and a store per island; yields a function that makes this rank's Manager. Everything is shut
    down on every way out, the Managers first, the Lighthouse last."""
    members, managers = rt.world_size // ISLANDS, []
    with lighthouse(rt, min_replicas=ISLANDS, join_timeout_ms=100) as address:
        LIGHTHOUSES.extend([address] if rt.rank == 0 else [])
        _stores, ports = island_stores(rt, ISLANDS, member, count=1)

        def make(model: nn.Module):
            at = (address, ports[island][0])
            managers.append(
                manager(model, f"island{island}", member, members, at, init_sync=init_sync, min_replica_size=ISLANDS)
            )
            return managers[-1]

        try:
            yield make
        finally:
            for m in managers:
                m.shutdown(wait=True)


def train_torchft(rt: Runtime, args, groups, init_sync: bool) -> nn.Module:
    """The same islands, the outer step by torchft's DiLoCo (one outer optimizer per fragment)."""
    from torchft.local_sgd import DiLoCo

    island, member = groups[0], groups[1]
    with torchft_islands(rt, island, member, init_sync) as make_manager:

        @contextmanager
        def hooks(model, inner):
            pieces = fragments_of(model, args.fragments)
            outers = [
                torch.optim.SGD(f.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True) for f in pieces
            ]
            with DiLoCo(make_manager(model), pieces, inner, outers, sync_every=args.h) as diloco:
                yield diloco

        return train_islands(rt, args, groups, hooks)[0]


# ---- an island lost mid-round, and back: each island member in a process of its own -------------------


def island_life(args, island: int, member: int, members: int, at: tuple[str, int], fate: str):
    """One island member's life in its own process, `fate` "survivor", "killed" or "restarted": DDP inside the
    island (its own gloo group), torchft's Manager (min_replica_size 1: a quorum of one island may commit) and
    DiLoCo. The rows follow torchft's step (syncs committed), so a healed island continues at the survivor's
    step and a window that did not commit would be redone on the same rows. Returns the number of islands in
    each sync's quorum and the final weights."""
    from torchft.local_sgd import DiLoCo

    if fate == "restarted":  # ask for a quorum only once the survivors' quorum has shrunk to them
        lighthouse_shows(at[0], "Num participants: 1")
    store = dist.TCPStore("127.0.0.1", at[1], is_master=False, timeout=TIMEOUT)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("ddp", store), rank=member, world_size=members, timeout=TIMEOUT
    )
    model, every, counts = build_model(args.seed), args.h // args.fragments, []
    ddp = DistributedDataParallel(model)
    inner, pieces = torch.optim.SGD(ddp.parameters(), lr=INNER_LR), fragments_of(model, args.fragments)
    outers = [torch.optim.SGD(f.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True) for f in pieces]
    ft = manager(model, f"island{island}", member, members, at, init_sync=False, min_replica_size=1)
    if fate != "restarted":  # both islands heartbeat before the first quorum is asked for
        lighthouse_shows(at[0], f"[{ISLANDS} heartbeating]")
    with DiLoCo(ft, pieces, inner, outers, sync_every=args.h):
        while ft.current_step() < SYNCS:
            synced = ft.current_step()
            for k in range(1, every + 1):
                if fate == "killed" and (synced, k) == (LOST, every // 2 + 1):
                    os.kill(os.getpid(), signal.SIGKILL)  # mid-round, no goodbye: a machine lost
                if fate == "survivor" and (synced, k) == (BACK, every):  # the timeline the same on every run:
                    lighthouse_shows(at[0], "[1/1 participants healthy]")  # the restarted island is asking
                inner.zero_grad()
                loss_of(ddp, *rows(args.seed, synced * every + k, island, member)).backward()
                inner.step()  # DiLoCo synchronises after the window's last step
            counts.append(ft.num_participants())
    ft.shutdown(wait=True)
    dist.destroy_process_group()
    return counts, model.state_dict()


def lost_and_back(rt: Runtime, args, island: int, member: int) -> tuple[int, list[int], dict, list[int]]:
    """Run the islands as processes of their own; island 1's are killed mid-round and started again (same
    replica id, a fresh store). (island 1's first exit code, each sync's quorum size, weights, every pid)."""
    members = rt.world_size // ISLANDS
    with lighthouse(rt, min_replicas=1, heartbeat_timeout_ms=HEARTBEAT_MS) as address, Lives() as lives:
        LIGHTHOUSES.extend([address] if rt.rank == 0 else [])
        _stores, ports = island_stores(rt, ISLANDS, member, count=2)  # one per life of an island
        fate = "killed" if island == 1 else "survivor"
        life = lives.start(island_life, args, island, member, members, (address, ports[island][0]), fate)
        killed = life.wait(LIFE_S) if island == 1 else 0
        if island == 1:
            life = lives.start(island_life, args, island, member, members, (address, ports[1][1]), "restarted")
        counts, weights = life.result(LIFE_S)
    return killed, counts, weights, lives.pids


def show_lost_island(rt: Runtime, args, groups, verdict: Verdict) -> list[int]:
    """Island 1 killed mid-round, the survivors on alone, island 1 back by healing: against the one-process
    islands with island 1's pseudogradients left out of syncs LOST .. BACK-1 and its heal at BACK."""
    island, member = groups[0], groups[1]
    trial = copy.copy(args)
    trial.rounds = SYNCS // args.fragments
    killed, counts, weights, pids = lost_and_back(rt, trial, island, member)
    alone = [ISLANDS] * LOST + [1] * (BACK - LOST) + [ISLANDS] * (SYNCS - BACK)
    seen = [None] * rt.world_size
    dist.all_gather_object(seen, (island, killed, counts))
    print0(f"island 1 killed (exit {seen[-1][1]}) before sync {LOST}, back at {BACK}; quorums {seen[0][2]}")
    verdict.figure("quorum_sizes", seen[0][2])  # islands in each sync's quorum, as island 0 saw them
    ok = killed == (-signal.SIGKILL if island else 0) and counts == alone[BACK if island else 0 :]
    verdict.check("island 1 SIGKILLed mid-round: the quorum shrank to island 0, then grew", agreed(rt, ok))
    reference = simulate(trial, rt.world_size // ISLANDS, lost=(LOST, BACK))[island]
    model = build_model(args.seed)
    model.load_state_dict(weights)
    verdict.check(
        "survivors and healed island = one process, island 1's round dropped", agreed(rt, same_bits(model, reference))
    )
    never_lost = simulate(trial, rt.world_size // ISLANDS)[island]
    verdict.check("... which is not the run that lost nothing", agreed(rt, not same_bits(model, never_lost)))
    return pids


# ---- the reference: the islands in one process ----------------------------------------------------------


def simulate(args, members: int, heal_from: int | None = None, sign: float = 1.0, lost=None) -> list[nn.Module]:
    """Both islands in one process, plain autograd: each member's backward on its rows, the island's mean of
    them; torch.optim.SGD (Nesterov) on the global weights as the outer optimizer. Returns the islands' models
    (after a fragment's synchronisation the other fragments still differ between islands). `heal_from`: at
    the first synchronisation the other island becomes a copy of this one (torchft's init_sync). `sign` = -1
    is the pseudogradient's sign slip (a wrong twin). `lost` = (k, j): island 1 is lost before synchronisation
    k (counted from 0) and back at j > k: syncs k .. j-1 average island 0's pseudogradient alone, and at j
    island 1 is first made a copy of island 0 (the heal)."""
    world = build_model(args.seed)
    islands = [copy.deepcopy(world) for _ in range(ISLANDS)]
    inners = [torch.optim.SGD(m.parameters(), lr=INNER_LR) for m in islands]
    pieces = fragments_of(world, args.fragments)
    outers = [torch.optim.SGD(f.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True) for f in pieces]
    synced = 0
    for step in range(1, args.rounds * args.h + 1):
        for i, model in enumerate(islands):
            grads = [
                torch.autograd.grad(loss_of(model, *rows(args.seed, step, i, m)), list(model.parameters()))
                for m in range(members)
            ]
            for p, *gs in zip(model.parameters(), *grads):
                p.grad = sum(gs[1:], gs[0]) / members
            inners[i].step()
        frag = synced_fragment(step, args.h, args.fragments)
        if frag is None:
            continue
        if heal_from is not None and synced == 0:
            islands[1 - heal_from].load_state_dict(islands[heal_from].state_dict())
        if lost is not None and synced == lost[1]:
            islands[1].load_state_dict(islands[0].state_dict())
        counted = islands[:1] if lost is not None and lost[0] <= synced < lost[1] else islands
        synced += 1
        names = [n for n, p in world.named_parameters() if any(p is q for q in pieces[frag].parameters())]
        with torch.no_grad():
            for name in names:
                theta = world.get_parameter(name)
                theta.grad = sign * sum(theta - m.get_parameter(name) for m in counted) / len(counted)
            outers[frag].step()
            outers[frag].zero_grad()
            for model in islands:
                for name in names:
                    model.get_parameter(name).copy_(world.get_parameter(name))
    return islands


def held_out_loss(model: nn.Module, seed: int) -> float:
    x, y = rows(seed + 1, 10**6, 0, 0)  # rows no island trained on
    with torch.no_grad():
        return float(loss_of(model, x, y))


# ---- the lesson -------------------------------------------------------------------------------------------


def parse_args():
    parser = lesson_parser(__doc__)
    parser.add_argument("--h", type=positive_int, default=4, help="H: inner steps per round (per outer step)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="outer steps")
    parser.add_argument(
        "--fragments", type=positive_int, default=1, help="F: streaming fragments (divides the layers and H)"
    )
    parser.add_argument("--torchft-logs", action="store_true", help="show torchft's own log lines (every quorum)")
    return parser.parse_args()


def world_rules(args, world_size: int) -> None:
    require(world_size % ISLANDS == 0, "--nproc-per-node", f"P = {world_size}: {ISLANDS} islands need an even P")
    require(
        LAYERS % args.fragments == 0, "--fragments", f"F = {args.fragments} does not divide the model's {LAYERS} layers"
    )
    require(args.h % args.fragments == 0, "--fragments", f"F = {args.fragments} does not divide H = {args.h}")


def same_bits(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


def agreed(rt: Runtime, ok: bool) -> bool:
    """True on every rank when it holds on every rank (each rank compares its own island)."""
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def show_equalities(rt: Runtime, args, groups, verdict: Verdict) -> int:
    """By hand = torchft = one process, bit for bit; the default heal reproduced; the sign slip rejected."""
    members, island = rt.world_size // ISLANDS, groups[0]
    by_hand, sent = train_islands(rt, args, groups)
    reference = simulate(args, members)[island]  # the one-process twin of this rank's island
    verdict.check("by hand = one-process islands, bit for bit", agreed(rt, same_bits(by_hand, reference)))
    slip = simulate(args, members, sign=-1.0)[island]
    verdict.check("a sign slip in delta is caught", agreed(rt, not same_bits(slip, reference)))
    torchft_model = train_torchft(rt, args, groups, init_sync=False)
    same = agreed(rt, same_bits(torchft_model, reference))
    verdict.check("torchft (init_sync=False) = one-process islands, bit for bit", same)
    # torchft's default, init_sync=True, over one round of the whole model: its first quorum comes after H
    # inner steps, not before them, and heals rank m of the other island from island m mod 2 as if the run
    # were starting. One island's round is thrown away and the other's counted twice.
    one_round = copy.copy(args)
    one_round.rounds, one_round.fragments = 1, 1
    healed = train_torchft(rt, args=one_round, groups=groups, init_sync=True)
    source = groups[1] % ISLANDS
    twice = simulate(one_round, members, heal_from=source)[island]
    verdict.check(
        "torchft's default: island (rank in island mod 2)'s round counted twice, bit for bit",
        agreed(rt, same_bits(healed, twice)),
    )
    verdict.check(
        "... which is not the plain islands' result",
        agreed(rt, not same_bits(healed, simulate(one_round, members)[island])),
    )
    return sent


def show_bytes(rt: Runtime, args, sent: int, verdict: Verdict) -> None:
    """Bytes over the slow link per round: DiLoCo once, DDP across all P ranks H times."""
    size = sum(p.numel() * p.element_size() for p in build_model(args.seed).parameters())
    ddp = args.h * ring_bytes("all_reduce", size // 8, 8, rt.world_size)
    verdict.check("bytes across islands = S per round", sent == args.rounds * size, f"{sent} = {args.rounds} x {size}")
    rounds = [("DiLoCo", "1", f"{size:,}"), ("DDP, all P ranks", str(args.h), f"{ddp:,}")]
    print0(rows_table(f"Bytes per rank per round, H = {args.h}", ("", "syncs", "bytes"), rounds))
    verdict.figure("bytes_per_round_diloco", size)
    verdict.figure("bytes_per_round_ddp", ddp)


def show_loss_against_h(rt: Runtime, args, verdict: Verdict) -> None:
    """The same 48 inner steps, synchronised every H: the price of talking less (one-process islands)."""
    rows_out = []
    for h in (1, 2, 4, 8):
        trial = copy.copy(args)
        trial.h, trial.rounds, trial.fragments = h, 48 // h, 1
        loss = held_out_loss(simulate(trial, rt.world_size // ISLANDS)[0], args.seed)
        rows_out.append((str(h), str(48 // h), f"{loss:.5f}"))
        verdict.figure(f"held_out_loss_h{h}", loss)
    print0(rows_table("Loss after 48 inner steps", ("H", "outer steps", "loss"), rows_out))


def main() -> int:
    args = check_flags_against_world(parse_args(), world_rules)
    torchft_logs(args.torchft_logs)  # before torchft is first imported
    with distributed(args.device) as rt:  # the tensors stay on the CPU: gloo serves them on any backend
        verdict = Verdict(rt)
        world_rules(args, rt.world_size)
        print0(
            f"[bold]Lesson 20: DiLoCo[/] - P = {rt.world_size}: {ISLANDS} islands of {rt.world_size // ISLANDS}, "
            f"H = {args.h}, F = {args.fragments}, {args.rounds} rounds, float64, gloo"
        )
        groups = island_groups(rt)
        sent = show_equalities(rt, args, groups, verdict)
        island_pids = show_lost_island(rt, args, groups, verdict)
        show_bytes(rt, args, sent, verdict)
        show_loss_against_h(rt, args, verdict)
        pids = [None] * rt.world_size
        dist.all_gather_object(pids, (os.getpid(), island_pids))
        verdict.figure("rank_pids", [rank for rank, _ in pids])  # the tests check that none outlives the run
        verdict.figure("island_pids", [pid for _, island in pids for pid in island])
        verdict.figure("lighthouses", LIGHTHOUSES)
        return verdict.finish(args.json)


if __name__ == "__main__":
    run_main(main)
