"""Tensor and expert parallelism across processes: the ranks' layers (layers, moe), their
collectives (group), a rank's process (worker) and the engine's executor over them (executor)."""
