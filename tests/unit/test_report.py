from empo2.cli import gap_lines, run_findings
from empo2.workflows.compare import run_memory_gain


def test_findings_set_validation_before_beside_after_and_the_memory_gain_like_for_like():
    history = [
        {"iteration": -1, "val/score_nomem": 10.0, "val_train/score_nomem": 20.0},
        {"iteration": 0, "rollout/memory_gain": 30.0, "rollout/memory_gain_groups": 1.0,
         "rollout/episodes_mem_miss": 5.0},
        {"iteration": 1, "rollout/memory_gain_groups": 0.0, "val/score_nomem": 15.0, "val_train/score_nomem": 30.0},
        {"iteration": 2, "rollout/memory_gain": -6.0, "rollout/memory_gain_groups": 3.0,
         "rollout/episodes_mem_miss": 1.0},
    ]
    lines = run_findings(history)
    assert lines[0] == "tip-free validation score (held out): 10.0 before training -> 15.0 after"
    assert lines[1] == "tip-free validation score (training instances): 20.0 before training -> 30.0 after"
    # every group of the run counts once: (30 * 1 + -6 * 3) / 4 = +3.0, not the mean of the iterations (+12)
    assert run_memory_gain(history) == (3.0, 4)
    assert lines[2] == ("training rollouts with tips minus tip-free, like for like: +3.0 (mean over 4 groups of "
                        "one instance and iteration holding both)")
    assert lines[3] == "6 rollouts drawn with memory found no tip (counted apart, not as tip-free)"
    assert len(lines) == 4


def test_findings_of_memory_only_use_the_first_visit_and_say_only_what_the_history_holds():
    assert run_findings([]) == []
    grpo = [{"iteration": 2, "val/score_nomem": 40.0, "rollout/memory_gain_groups": 0.0,
             "rollout/episodes_nomem": 4.0}]
    assert run_findings(grpo) == ["tip-free validation score (held out): 40.0 after training"]
    assert run_memory_gain(grpo) is None  # no group held both kinds: no estimate, not zero
    memory_only = [  # p = 1: the estimate over the run so far, its last value the run's
        {"iteration": 0, "rollout/memory_gain_groups": 0.0, "rollout/episodes_mem_miss": 24.0,
         "rollout/first_visit_gain_instances": 0.0},
        {"iteration": 1, "rollout/memory_gain_groups": 0.0, "rollout/first_visit_gain": 12.5,
         "rollout/first_visit_gain_instances": 1.0},
        {"iteration": 2, "rollout/memory_gain_groups": 0.0, "rollout/episodes_mem_miss": 8.0,
         "rollout/first_visit_gain": 20.0, "rollout/first_visit_gain_instances": 3.0},
    ]
    assert run_findings(memory_only) == [
        "training rollouts, later visits with tips minus the same instance's tip-free first visit: +20.0 "
        "(3 instances)",
        "32 rollouts drawn with memory found no tip (counted apart, not as tip-free)"]


def test_the_start_header_names_the_run_its_settings_and_where_it_goes(tmp_path):
    from empo2.config import load_config
    from empo2.workflows.train import start_lines

    cfg = load_config(["experiment=grpo_minisci", "env.tasks=[find-living-thing]", "seed=3"])
    lines = start_lines(cfg, tmp_path / "run", "abc123")
    assert lines[0].startswith("empo2 train: grpo_minisci | grpo (p 0, q 0")
    assert "model smollm2 | minisci: find-living-thing" in lines[0]
    assert f"seed 3 | run folder {tmp_path / 'run'}" in lines[1] and "on cpu x1" in lines[1]
    assert lines[2].startswith("  MLflow run abc123 in ")
    assert len(start_lines(cfg, tmp_path, None)) == 2  # no tracking, no MLflow line


def test_the_report_gives_the_sampler_trainer_gap_or_says_it_is_zero_by_construction():
    assert gap_lines({"logprobs_exact": True, "history": []}) == [
        "sampler/trainer gap: 0 by construction (the engine's log-probs, float32 like the trainer's, were the old "
        "log-probs: no scoring pass)"]
    history = [{"iteration": 0, "rollout/logprob_gap_mean": 0.01, "rollout/logprob_gap_max": 0.5,
                "rollout/logprob_gap_kl": 1e-4},
               {"iteration": 0, "val/score_nomem": 3.0},
               {"iteration": 1, "rollout/logprob_gap_mean": 0.03, "rollout/logprob_gap_max": 0.25,
                "rollout/logprob_gap_kl": 3e-4}]
    assert gap_lines({"logprobs_exact": False, "history": history}) == [
        "sampler/trainer gap |log pi_old - log pi_engine| per token: mean 2.00e-02 and KL(engine || trainer) "
        "2.00e-04 (averaged over 2 iterations), max 5.00e-01"]
    assert gap_lines({"history": history[1:2]}) == []  # no engine log-probs recorded: nothing to say
    # the scoring pass ran, but the HF engine kept no log-probs under a nucleus: the report says so
    hf_nucleus = {"engine": {"name": "hf"}, "rollout": {"top_p": 0.9}, "algo": {"update_policy": True}}
    assert gap_lines({"logprobs_exact": False, "gap_unmeasured": True, "history": history[1:2],
                      "config": hf_nucleus}) == [
        "sampler/trainer gap: not measured (the HF engine keeps no log-probs under rollout.top_p=0.9: its recorder "
        "reads the whole vocabulary, not the nucleus it samples from)"]
    memory_only = {**hf_nucleus, "algo": {"update_policy": False}}  # no update, no scoring pass: nothing to say
    assert gap_lines({"logprobs_exact": False, "gap_unmeasured": False, "history": history[1:2],
                      "config": memory_only}) == []


def test_the_closing_report_says_where_the_time_went_and_the_peak_memory(capsys):
    from empo2.cli import print_report
    from empo2.lit.progress import PHASES

    phases = {"wall_s": 100.0, "phases_s": {key: 10.0 for key, _ in PHASES}, "other_s": 10.0, "peak_rss_gib": 2.345}
    print_report({"metrics": {"time/total_s": 100.0}, "phases": phases, "run_dir": "r", "summary_path": "s",
                  "checkpoint": None, "plot": "p"})
    out = capsys.readouterr().out.splitlines()
    at = out.index("  where the time went (1:40 wall):")
    assert out[at + 2] == "    start-up                0:10  10.0%"
    assert out[at + 2 + len(PHASES)] == "    other                   0:10  10.0%"
    assert out[at + 3 + len(PHASES)].startswith("  peak memory          2.35 GiB (resident, this process and its")
