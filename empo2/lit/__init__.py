"""The Lightning parts of a training run: `EMPO2Module` (the policy and the masked on/off-policy loss), the
`RolloutDataModule` that streams an iteration's samples as mini-batches, the `RolloutCallback` that runs each
iteration (collect, old log-probs, the buffer) and validation, the FSDP2 strategy and float32 master weights, atomic
checkpoint IO and the console's progress. May import `empo2.rollout` and everything below it; only
`empo2.workflows` and the CLI sit above it."""
