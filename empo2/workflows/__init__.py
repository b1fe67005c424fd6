"""What a user runs, each a plain function the CLI calls: `train` (`train(cfg) -> summary`, the composition root
that hands the parts to a Lightning Trainer), `evaluate` (eval and memory-only adapt), `grid`, `sweep` (with
`sweep_spec`, `sweep_storage` and `sweep_trial`, one Optuna trial as a process), `compare` (tables and curves from
MLflow), the launchers (`launch`: a local worker pool; `slurm`), `tracking` (MLflow), `preflight` (what a config needs
of the machine, checked before work) and `runs` (run folders and tags). May import every package below it (lit,
rollout, models, memory, envs, config, algo, utils); only `empo2.cli` imports it. Its own layers (pyproject.toml):
the commands over `train`, over what records and launches runs."""
