"""Keras integration: `DistributedModel`, its pipelined train/test/predict
steps, and layout-free checkpoints."""
