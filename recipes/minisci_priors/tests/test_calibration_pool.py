"""The calibration's pooled verdicts (recipes/minisci_priors/minisci_calibration.py --pool): runs of other seeds joined
instance by instance, so that pooling adds instances and changes nothing else."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

_spec = importlib.util.spec_from_file_location(
    "minisci_calibration", Path(__file__).parents[1] / "minisci_calibration.py")
calibration = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(calibration)


def _row(rng: np.random.Generator, n: int) -> dict:
    scores = rng.choice([0.0, 25.0, 50.0, 100.0], size=(3, n)).tolist()  # (rounds, instances)
    return {"scores": scores, "success_by_round": [float(np.mean(np.array(r) == 100)) for r in scores],
            "irrelevant_scores": rng.choice([0.0, 100.0], size=n).tolist(),
            "irrelevant_claims_own": rng.random(n).round().astype(bool).tolist(),
            "irrelevant_same_signature": (rng.random(n) < 0.3).tolist()}


def test_pooling_one_run_gives_its_own_verdicts():
    row = _row(np.random.default_rng(0), 12)
    assert calibration.memory_verdicts(calibration.pooled_memory([row]), "find-living-thing") == \
        calibration.memory_verdicts(row, "find-living-thing")


def test_pooled_runs_are_their_instances_joined():
    rng = np.random.default_rng(1)
    a, b = _row(rng, 12), _row(rng, 4)
    pooled = calibration.pooled_memory([a, b])
    assert pooled["instances"] == 16
    assert pooled["scores"][2] == a["scores"][2] + b["scores"][2]
    assert pooled["irrelevant_claims_own"] == a["irrelevant_claims_own"] + b["irrelevant_claims_own"]
    # rates weighted by instances: the success rate over all 16 episodes of round 0
    joined = np.array(a["scores"][0] + b["scores"][0])
    assert pooled["success_by_round"][0] == pytest.approx(np.mean(joined == 100))
    v = calibration.memory_verdicts(pooled, "find-living-thing")
    tip_free = joined.mean()
    change = np.mean(a["irrelevant_scores"] + b["irrelevant_scores"]) - tip_free
    assert v["irrelevant_change"][0] == pytest.approx(change)
    point_holds = abs(change) <= 0.1 * tip_free
    assert v["targets"]["irrelevant"]["verdict"] in (("holds", "point estimate only") if point_holds else ("misses",))


def test_the_change_apart_from_tips_no_reader_can_tell_leaves_those_instances_out():
    row = _row(np.random.default_rng(2), 20)
    row["irrelevant_same_signature"][:3] = [True, True, False]
    keep = [i for i, same in enumerate(row["irrelevant_same_signature"]) if not same]
    v = calibration.memory_verdicts(row, "find-living-thing")
    assert v["next_instance_same_signature"] == 20 - len(keep)
    change = np.mean([row["irrelevant_scores"][i] - row["scores"][0][i] for i in keep])
    assert v["irrelevant_change_other_signature"][0] == pytest.approx(change)
    claimed = [i for i, c in enumerate(row["irrelevant_claims_own"]) if not c]
    assert v["irrelevant_change_signed_other"][0] == pytest.approx(
        np.mean([row["irrelevant_scores"][i] - row["scores"][0][i] for i in claimed]))


def test_a_target_holds_only_when_its_interval_does():
    assert calibration.verdict(True, True) == "holds"
    assert calibration.verdict(True, False) == "point estimate only"
    assert calibration.verdict(False, False) == "misses"


def test_the_success_interval_is_wilsons():
    # 20 successes of 216: Wilson 95% by hand, p = 20/216, z = 1.959964,
    # centre (p + z^2/2n) / (1 + z^2/n), half-width z sqrt(p(1-p)/n + z^2/4n^2) / (1 + z^2/n)
    p, n, z = 20 / 216, 216, 1.959963984540054
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    rate, low, high = calibration.success_interval(20 / 216, 216)
    assert (rate, low, high) == pytest.approx((p, centre - half, centre + half))
    assert (round(low, 4), round(high, 4)) == (0.0607, 0.1387)


def test_each_target_gets_its_verdict_from_its_interval():
    tip_free = [0.0] * 36 + [100.0] * 4  # mean 10, success 10%: Wilson high 0.23 <= 0.25, the trap holds
    after_2 = [0.0] * 28 + [100.0] * 12  # mean 30: 3x, but the bootstrap interval reaches below 2x
    row = {"scores": [tip_free, tip_free, after_2], "success_by_round": [0.1, 0.1, 0.3],
           "irrelevant_scores": tip_free[::-1]}  # the same mean: change 0, interval far wider than +-1
    v = calibration.memory_verdicts(row, "find-living-thing")
    t = v["targets"]
    assert t["trap"]["verdict"] == "holds" and t["trap"]["interval"][2] <= 0.25
    assert v["ratio_after_2"][0] == pytest.approx(3.0) and t["doubling"]["verdict"] == "point estimate only"
    assert t["irrelevant"]["bound"] == pytest.approx(1.0) and t["irrelevant"]["interval"][0] == pytest.approx(0.0)
    assert t["irrelevant"]["verdict"] == "point estimate only"
    row["scores"][0] = [0.0] * 30 + [100.0] * 10  # success 25%: the point meets the bound, the interval does not
    row["success_by_round"][0] = 0.25
    assert calibration.memory_verdicts(row, "find-living-thing")["targets"]["trap"]["verdict"] == "point estimate only"
