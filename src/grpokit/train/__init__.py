"""Training, the layer above the engine: the GRPO loop (grpo.py, one step in grpo_step.py), the reward
model's and the supervised runs, the run scaffold they share (run.py, checkpoints, metrics), and the
commands' runs (eval, doctor). docs/reference/modules.md lists every module with its job."""
