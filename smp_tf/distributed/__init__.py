"""Data parallelism across processes: cluster environment, launcher, collectives."""
