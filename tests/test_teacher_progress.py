"""train/teacher/progress.py: the generation bar counts tokens against a bound that shrinks at
early EOS, and its rate and ETA follow an injected clock (no timing is measured)."""

import io

import pytest

from train.teacher.progress import TokenProgress

pytestmark = pytest.mark.pure


class Clock:
    def __init__(self):
        self.t = 50.0

    def __call__(self):
        return self.t


def test_tokens_rate_and_eta_follow_the_clock():
    clock = Clock()
    bar = TokenProgress(4, 10, clock=clock, show=False)
    assert bar.bound == 40 and bar.rate() is None and bar.eta_s() is None
    clock.t += 2.0
    bar.answer(10)
    bar.answer(6)  # ended at EOS: 4 unused tokens leave the bound
    assert (bar.tokens, bar.answers, bar.bound) == (16, 2, 36)
    assert bar.rate() == pytest.approx(8.0)
    assert bar.eta_s() == pytest.approx((36 - 16) / 8.0)
    assert "8 tok/s" in bar.postfix() and "ETA 00:02" in bar.postfix()
    assert bar.summary().startswith("16 tokens in 2 answers")


def test_the_eta_stops_at_the_budget():
    clock = Clock()
    bar = TokenProgress(100, 10, clock=clock, budget_s=30.0, show=False)
    assert bar.eta_s() == pytest.approx(30.0)  # no rate yet: the budget bounds it
    clock.t += 10.0
    bar.answer(10)  # 1 tok/s: 990 s to go at this rate, but the budget ends in 20
    assert bar.eta_s() == pytest.approx(20.0)
    clock.t += 100.0
    assert bar.eta_s() == 0.0


def test_the_bar_shows_tokens_rate_and_eta():
    clock, out = Clock(), io.StringIO()
    bar = TokenProgress(2, 5, clock=clock, file=out, desc="teacher")
    clock.t += 1.0
    bar.answer(5)
    bar._bar.refresh()
    bar.close()
    text = out.getvalue()
    assert "teacher" in text and "tok" in text and "tok/s" in text and "ETA" in text


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="max_new_tokens"):
        TokenProgress(3, 0, show=False)
    bar = TokenProgress(3, 4, show=False)
    with pytest.raises(ValueError, match="0 to 4 tokens"):
        bar.answer(5)
    with pytest.raises(ValueError, match="0 to 4 tokens"):
        bar.answer(-1)
