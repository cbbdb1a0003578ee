"""dsconv: DeepSeek-V3.2 / V4-Flash checkpoints to a 16-card W8A8 deployment.

Subpackages are the pipeline's stages, each importing only those below it (import-linter's contracts in
pyproject.toml): `runner` (`dsrun`: entrypoints, engine, models), `shard` (per-rank writer, plan), `manifest`
(schema, verify), `convert` (read, decode, quantize, write), `comm` (process groups, collectives, launch) and
`kernels` (numeric primitives with device dispatch), all above `family` (what each model family is: config,
tensor inventory, recipes, placement table, chat encoding). `cli` assembles the `dsconv` commands.
"""
