from empo2.cli import run_findings


def test_findings_set_validation_before_beside_after_and_weigh_rollouts_by_episodes():
    history = [
        {"iteration": -1, "val/score_nomem": 10.0, "val_train/score_nomem": 20.0},
        {"iteration": 0, "rollout/episodes_memory": 2.0, "rollout/score_memory": 50.0,
         "rollout/episodes_tipfree": 6.0, "rollout/score_tipfree": 10.0},
        {"iteration": 1, "rollout/episodes_memory": 0.0, "rollout/episodes_tipfree": 8.0,
         "rollout/score_tipfree": 20.0, "val/score_nomem": 15.0, "val_train/score_nomem": 30.0},
    ]
    lines = run_findings(history)
    assert lines[0] == "tip-free validation score (held out): 10.0 before training -> 15.0 after"
    assert lines[1] == "tip-free validation score (training instances): 20.0 before training -> 30.0 after"
    # (2*50) / 2 = 50 with tips; (6*10 + 8*20) / 14 = 15.7 tip-free
    assert lines[2] == "training rollouts: 50.0 with tips (2 episodes) vs 15.7 tip-free (14 episodes)"


def test_findings_say_only_what_the_history_holds():
    assert run_findings([]) == []
    only_after = run_findings([{"iteration": 2, "val/score_nomem": 40.0, "rollout/episodes_memory": 0.0,
                                "rollout/episodes_tipfree": 4.0, "rollout/score_tipfree": 5.0}])
    assert only_after == ["tip-free validation score (held out): 40.0 after training"]  # no tip rollouts: no line
    one = run_findings([{"iteration": 0, "rollout/episodes_memory": 1.0, "rollout/score_memory": 25.0,
                         "rollout/episodes_tipfree": 7.0, "rollout/score_tipfree": 0.0}])
    assert one == ["training rollouts: 25.0 with tips (1 episode) vs 0.0 tip-free (7 episodes)"]


def test_the_start_header_names_the_run_its_settings_and_where_it_goes(tmp_path):
    from empo2.config import load_config
    from empo2.train import start_lines

    cfg = load_config(["experiment=grpo_minisci", "env.tasks=[find-living-thing]", "seed=3"])
    lines = start_lines(cfg, tmp_path / "run", "abc123")
    assert lines[0].startswith("empo2 train: grpo_minisci | grpo (p 0, q 0")
    assert "model smollm2-135m-instruct | minisci: find-living-thing" in lines[0]
    assert f"seed 3 | run folder {tmp_path / 'run'}" in lines[1] and "on cpu x1" in lines[1]
    assert lines[2].startswith("  MLflow run abc123 in ")
    assert len(start_lines(cfg, tmp_path, None)) == 2  # no tracking, no MLflow line
