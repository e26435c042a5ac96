"""Concurrency and busy time from spans, without processes."""

import time

import torch

from distlab.proof.timeline import Span, Timeline, busy_fractions, max_concurrency, render, timed


def test_back_to_back_spans_do_not_overlap_but_nested_ones_do():
    chain = [Span(0, "F", 0, 1), Span(1, "F", 1, 2), Span(0, "I", 2, 3)]
    assert max_concurrency(chain) == 1
    assert max_concurrency(chain + [Span(1, "F", 2.5, 4)]) == 2


def test_busy_fractions_and_render():
    spans = [Span(0, "F", 0, 1), Span(1, "I", 1, 4)]
    assert busy_fractions(spans, 2) == [0.25, 0.75]
    rows = render(spans, 2, width=8).plain.splitlines()
    assert rows[0] == "rank 0 FF......" and rows[1] == "rank 1 ..IIIIII"


class _QueuedGPU:
    """A GPU as the host sees it: a launch returns at once, and its work is done only when the host
    synchronizes (which then waits for everything queued)."""

    def __init__(self, monkeypatch):
        self.queued_s, self.synchronized = 0.0, []
        monkeypatch.setattr(torch.cuda, "synchronize", self.synchronize)

    def launch(self, seconds: float) -> None:
        self.queued_s += seconds

    def synchronize(self, device=None) -> None:
        self.synchronized.append(device)
        time.sleep(self.queued_s)
        self.queued_s = 0.0


def test_a_span_on_cuda_lasts_until_its_queued_work_is_done(monkeypatch):
    """The host's clock around a CUDA launch times the launch (microseconds); the span must time the work."""
    gpu, cuda = _QueuedGPU(monkeypatch), torch.device("cuda", 0)
    gpu.launch(0.2)  # queued before the span: not the span's work
    timeline = Timeline(0, cuda)
    with timeline.span("F"):
        gpu.launch(0.1)
    (span,) = timeline.spans
    assert 0.1 <= span.end - span.start < 0.2 and gpu.synchronized == [cuda, cuda]
    cpu = Timeline(0, torch.device("cpu"))
    with cpu.span("F"):
        pass
    assert gpu.synchronized == [cuda, cuda]  # a CPU timeline never synchronizes a GPU


def test_timed_on_cuda_times_the_queued_work_not_the_launch(monkeypatch):
    """What contrastive/cost.py times its loss and its collectives with."""
    gpu = _QueuedGPU(monkeypatch)
    assert timed(lambda: gpu.launch(0.1), torch.device("cuda", 0)) >= 0.1
    assert timed(lambda: gpu.launch(0.1), torch.device("cpu")) < 0.05  # (a CPU op is done when it returns)
