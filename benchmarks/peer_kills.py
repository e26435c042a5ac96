"""Reliability of the streamed step's dead-peer naming: one rank SIGKILLed mid-step from outside, at
P = 2 to 8, and a count of the survivors' messages that name exactly the rank that died.

    python benchmarks/peer_kills.py                    # P = 2..8, victims 1, P - 1 and 0; writes results/peer_kills.md
    python benchmarks/peer_kills.py --worlds 4 --repeat 3

Each run launches P ranks on gloo outside torchrun (rank 0 holds the store), lets every rank finish one
`distributed_backward`, SIGKILLs the victim while the others are in the next step's exchanges, and
reads each survivor's error (tests/test_streamed_peers.py's harness: the test runs it at P = 4). A
message is "named correctly" when the ranks it calls dead are exactly the victim; with rank 0 killed,
when it says the store's holder, rank 0, stopped. A run in which a survivor sends nothing within the
process group's timeout plus 30 s is counted as a hang.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the test's harness, so the figures are the test's own

from test_streamed_peers import named_dead, survivors_after_killing  # noqa: E402


def victims(world: int) -> list[int]:
    return sorted({1, world - 1, 0})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=list(range(2, 9)))
    parser.add_argument("--repeat", type=int, default=1, help="runs per (P, victim)")
    args = parser.parse_args()
    rows, totals = [], [0, 0, 0, 0]  # faults injected, survivors, messages named correctly, hangs
    for world in args.worlds:
        for victim in victims(world) * args.repeat:
            start = time.monotonic()
            try:
                survivors = survivors_after_killing(victim, world)
                right = sum(named_dead(m) == {victim} for m in survivors.values())
                hang = 0
            except Exception as err:  # noqa: BLE001 - a run that did not come back is counted, not raised
                survivors, right, hang = {}, 0, 1
                print(f"P = {world}, victim {victim}: {type(err).__name__}: {err}", flush=True)
            wrong = [m[:100] for m in survivors.values() if named_dead(m) != {victim}]
            rows.append((world, victim, world - 1, right, time.monotonic() - start, wrong))
            totals = [totals[0] + 1, totals[1] + world - 1, totals[2] + right, totals[3] + hang]
            print(f"P = {world}, killed rank {victim}: {right} of {world - 1} survivors named it", flush=True)
    lines = ["| P | killed | survivors | named exactly it | seconds |", "|---|---|---|---|---|"]
    lines += [f"| {w} | {v} | {s} | {r} | {t:.1f} |" for w, v, s, r, t, _ in rows]
    lines += [
        f"\n{totals[0]} faults injected, {totals[1]} survivor messages, {totals[2]} named exactly the "
        f"killed rank, {totals[3]} runs hung."
    ]
    lines += [f"- P = {w}, killed {v}: {m}" for w, v, *_, wrong in rows for m in wrong]
    text = "\n".join(lines)
    print(text)
    (ROOT / "benchmarks" / "results" / "peer_kills.md").write_text(
        f"# peer_kills\n\n`python benchmarks/peer_kills.py {' '.join(sys.argv[1:])}`\n\n{text}\n"
    )


if __name__ == "__main__":
    main()
