"""dsconv: DeepSeek-V3.2 / V4-Flash checkpoints to a 16-card W8A8 deployment.

Subpackages are the pipeline's stages: `convert` (read, decode, quantize, write), `shard` (placement table,
per-rank writer, plan), `manifest` (schema, verify), `runner` (models, caches, generation, `dsrun`), `kernels`
(numeric primitives with device dispatch), `comm` (process groups, collectives, launch).
"""
