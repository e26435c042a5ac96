"""Concurrency and busy time from spans, without processes."""

from distlab.timeline import Span, busy_fractions, max_concurrency, render


def test_back_to_back_spans_do_not_overlap_but_nested_ones_do():
    chain = [Span(0, "F", 0, 1), Span(1, "F", 1, 2), Span(0, "I", 2, 3)]
    assert max_concurrency(chain) == 1
    assert max_concurrency(chain + [Span(1, "F", 2.5, 4)]) == 2


def test_busy_fractions_and_render():
    spans = [Span(0, "F", 0, 1), Span(1, "I", 1, 4)]
    assert busy_fractions(spans, 2) == [0.25, 0.75]
    rows = render(spans, 2, width=8).plain.splitlines()
    assert rows[0] == "rank 0 FF......" and rows[1] == "rank 1 ..IIIIII"
