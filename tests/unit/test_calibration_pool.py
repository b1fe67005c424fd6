"""The calibration's pooled verdicts (benchmarks/minisci_calibration.py --pool): runs of other seeds joined
instance by instance, so that pooling adds instances and changes nothing else."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

_spec = importlib.util.spec_from_file_location(
    "minisci_calibration", Path(__file__).parents[2] / "benchmarks" / "minisci_calibration.py")
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
    assert v["irrelevant_within_10pct"] == (abs(change) <= 0.1 * tip_free)


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
