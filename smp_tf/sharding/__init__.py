"""Tensor parallelism: each pipeline stage's ops split over its ``t`` devices.

* `spec` — `ShardSpec`: per dimension ``"tensor"`` or None, or a partial sum.
* `layout_map` — `LayoutMap`: regular expressions on variable paths -> specs.
* `rules` — one rule per op family: the specs an op needs and produces.
* `completion` — specs for every tensor from a few marks, forward and back.
* `reshard` — the collective steps between two layouts and their bytes.
* `builtin` — Megatron's column/row pairs and attention heads, found on the graph.
* `read` — a traced step read into a `ShardGraph` (what the rules read of each op).
* `lower` — the traced graph rewritten with per-device copies and reshards.
* `special` — split ops that need more than a copy per device (vocabulary-parallel
  cross-entropy and log-softmax, masked lookups).
* `api` — `smp.shard_tensor` and the layout of a traced step's variables.
* `storage` — a variable whose value lives in pieces on the stage's devices.

Everything but `read`, `lower`, `special`, `api`, `storage` and `builtin.attention_layouts` is plain
Python, tested without TensorFlow.
"""
