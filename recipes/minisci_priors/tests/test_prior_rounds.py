"""The shipped readers' recorded rounds, replayed as commands: planned from their records, refused before any work
when a combination cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from empo2.models.io import RECIPE_BUILT, shipped_prior
from recipes.minisci_priors.prior import BCSettings, cache_dir
from recipes.minisci_priors.prior_rounds import (
    SHIPPED_BY_ROUNDS,
    STAGE_ONE,
    parse_round,
    planned_rounds,
    recorded_rounds,
)
from recipes.minisci_priors.prior_tips import TipPriorSettings


def test_the_signed_prior_replays_its_four_recorded_rounds_each_starting_where_the_last_wrote(tmp_path):
    plan = planned_rounds("minisci_tips_signed", tmp_path)
    assert len(plan) == 4  # the chain's stage-1 build is implied by the rounds' --setting, not a round
    outs = [argv[argv.index("--out") + 1] for argv in plan]
    assert outs == [str(tmp_path / n) for n in ("reader-v7", "reader-v7mj", "reader-v7mjt", "reader-v7mjt2")]
    assert "--start" not in plan[0]
    for before, argv in zip(outs, plan[1:]):
        assert argv[argv.index("--start") + 1] == before
    last = parse_round(plan[-1])
    # the shipped checkpoint's own record names the settings its last round ran with
    source = json.loads((shipped_prior("minisci_tips_signed") / "empo2_source.json").read_text())
    assert (last.learn, last.episodes, last.decisions, last.match_weight, last.replay, last.epochs, last.seed) == (
        source["args"]["learn"], source["args"]["episodes"], source["args"]["decisions"],
        source["args"]["match_weight"], source["args"]["replay"], source["args"]["epochs"], source["args"]["seed"])
    assert last.changes == {"irrelevant_rate": 1.0, "other_variation_rate": 1.0, "other_house_rate": 1.0,
                            "tip_signature": True, "version": 7}


def test_the_reader_replays_its_one_recorded_command(tmp_path):
    (argv,) = planned_rounds("minisci_tips_reader", tmp_path)
    args = parse_round(argv)
    assert (args.learn, args.iterations, args.start, Path(args.out)) == ("actions", 2, None,
                                                                          tmp_path / "minisci-tips-reader")
    assert args.changes == {}  # build 5 with its default settings, unsigned tips


def test_every_shipped_prior_made_by_rounds_records_them():
    for name in SHIPPED_BY_ROUNDS:
        assert recorded_rounds(name)
    with pytest.raises(SystemExit, match="not a prior built by rounds"):
        planned_rounds("minisci_bc", Path("x"))


@pytest.mark.parametrize("argv, message", [
    (["--distill"], "--distill labels the states under --foreign tips or --contrast"),
    (["--decisions", "-1"], "give 0 or more"),
    (["--decisions", "2", "--decision-families", "boil"], "--decision-families boil: not an in-distribution"),
    (["--match-weight", "1"], "--match-weight asks for the signature at the --decisions states"),
    (["--resign"], "--resign re-signs the tips of --decisions states"),
    (["--learn", "none"], "--learn none trains on --decisions or --foreign examples only"),
    (["--learn", "tips", "--contrast"], "--contrast pairs the states of --learn actions"),
    (["--setting", "vocab=3"], "'vocab' is not a numeric or boolean TipPriorSettings field"),
    (["--setting", "tip_signature=yes"], "tip_signature takes a 0 or 1"),
    (["--decisions", "2"], "--contrast and --decisions need signed tips"),
])
def test_a_round_that_cannot_run_is_refused_in_one_line_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_round([*argv, "--out", "x"])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_loader_looks_for_the_stage_one_priors_where_the_recipe_builds_them():
    # `model=minisci_bc|minisci_tips` load from the cache folder the recipe's default settings name
    assert RECIPE_BUILT == {"minisci_bc": cache_dir(BCSettings()).name,
                            "minisci_tips": cache_dir(TipPriorSettings(), "minisci_tips").name}
    assert set(STAGE_ONE) == set(RECIPE_BUILT)
