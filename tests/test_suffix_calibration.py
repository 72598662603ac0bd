"""The suffix chain's calibration (serve/spec_decode/suffix/calibration.py): pure, milliseconds."""

import pytest

from serve.spec_decode.suffix.calibration import Calibration

pytestmark = pytest.mark.pure


def test_a_new_calibration_reads_the_raw_figures():
    c = Calibration()
    assert c(0.3) == pytest.approx(0.3) and c(1.0) == pytest.approx(1.0)


def test_observed_acceptance_moves_each_bin_from_its_prior():
    c = Calibration(bins=5, prior_weight=8.0, decay=1.0)
    for _ in range(92):  # a chain [0.3]: rejected 92 times out of 100
        c.observe([0.3], 0)
    for _ in range(8):
        c.observe([0.3], 1)
    assert c(0.3) == pytest.approx((8 * 0.3 + 8) / (8 + 100))
    assert c(0.25) == pytest.approx((8 * 0.25 + 8) / (8 + 100))  # the same bin's counts, its own prior
    assert c(0.9) == pytest.approx(0.9)  # another bin saw nothing


def test_only_reached_positions_count():
    """Positions past the first rejected one were never judged: they teach nothing."""
    c = Calibration(bins=2, prior_weight=1.0, decay=1.0)
    c.observe([0.9, 0.9, 0.9, 0.2], 1)  # position 0 accepted, 1 rejected, 2 and 3 not reached
    assert c.reached == [0.0, 2.0] and c.accepted == [0.0, 1.0]
    c.observe([0.9, 0.2], 2)  # a fully accepted chain: both reached, both accepted
    assert c.reached == [1.0, 3.0] and c.accepted == [1.0, 2.0]
    assert c.table()[0] == {"raw": 0.2, "observed": 1.0, "positions": 1.0}


def test_old_observations_fade():
    c = Calibration(bins=1, prior_weight=1.0, decay=0.5)
    c.observe([0.5], 0)
    c.observe([0.5], 1)
    assert c.reached[0] == pytest.approx(1.5) and c.accepted[0] == pytest.approx(1.0)


@pytest.mark.parametrize("kw", [{"bins": 0}, {"prior_weight": 0}, {"decay": 0}, {"decay": 1.5}])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError):
        Calibration(**kw)


def test_more_accepted_than_drafted_is_refused():
    with pytest.raises(ValueError, match="accepted 3 of a chain of 2"):
        Calibration().observe([0.5, 0.5], 3)
