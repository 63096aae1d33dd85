"""The examples run end to end and print what their READMEs promise: each
in a fresh process, as a user runs it (shorter: fewer epochs, less data),
and one of them across two processes with the launcher."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 600


def _run(*args: str) -> str:
    """Runs `python *args` from the repository root; returns its output."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{out[-4000:]}"
    return out


def _number(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in the output:\n{text[-4000:]}"
    return float(m.group(1))


def _keras_fit_checks(out: str, min_accuracy: float) -> None:
    accuracy = _number(r"test: loss [\d.]+, accuracy ([\d.]+)", out)
    from_predict = _number(r"\(from predict: ([\d.]+)\)", out)
    assert accuracy == from_predict and accuracy >= min_accuracy, out[-3000:]
    assert "restored into a fresh model: the same predictions" in out, out[-3000:]


def test_keras_fit_example():
    out = _run(str(EXAMPLES / "keras_fit.py"), "--epochs", "3")
    _keras_fit_checks(out, min_accuracy=0.85)
    # Each layer's variables on the device of its partition: both devices used.
    assert re.search(r"conv1 +CPU:0", out) and re.search(r"logits +CPU:1", out), out[-3000:]


def test_custom_training_loop_example():
    out = _run(str(EXAMPLES / "custom_training_loop.py"), "--epochs", "2", "--pipeline", "zero_bubble",
               "--virtual-stages", "2")
    assert _number(r"test accuracy: ([\d.]+)", out) >= 0.8, out[-3000:]
    assert "PartitionPlan: 4 partitions" in out, out[-3000:]  # 2 devices x 2 virtual stages


def test_gpt2_fit_example_with_tensor_parallelism():
    out = _run(str(EXAMPLES / "gpt2_fit.py"), "--epochs", "1", "--max-bytes", "20000", "--generate", "4",
               "--partitions", "2", "--tensor-parallel", "2")
    first = _number(r"loss: ([\d.]+) \(first batch\)", out)
    last = _number(r"-> ([\d.]+) \(last epoch\)", out)
    assert last < first - 0.5, out[-3000:]
    # The partition report names the stage devices and what was split.
    assert "tensor parallelism: t=2" in out and "query/kernel" in out, out[-3000:]


def test_gpt2_fit_example():
    out = _run(str(EXAMPLES / "gpt2_fit.py"), "--epochs", "1", "--max-bytes", "20000", "--generate", "8")
    first = _number(r"loss: ([\d.]+) \(first batch\)", out)
    last = _number(r"-> ([\d.]+) \(last epoch\)", out)
    assert last < first - 0.5, out[-3000:]
    assert "Greedy continuation of 'def ' (8 tokens)" in out, out[-3000:]


def test_plan_example():
    out = _run(str(EXAMPLES / "plan.py"), "--width", "256", "--layers", "4", "--measure", "2", "--epochs", "1")
    assert "ResourceGraph (" in out and "Plan: 4 device(s)" in out and "probe: P" in out, out[-3000:]
    assert re.search(r"chosen: P\d t\d R1 M\d", out), out[-3000:]
    # The planned configuration's first epoch against one device's.
    assert _number(r"relative difference ([\d.e+-]+)\)", out) <= 1e-5, out[-3000:]


@pytest.mark.multiprocess
def test_keras_fit_example_across_two_processes():
    out = _run("-m", "smp_tf.launch", "-n", "2", "--partitions", "2", "--pipeline-processes", "2",
               str(EXAMPLES / "keras_fit.py"), "--epochs", "3")
    _keras_fit_checks(out, min_accuracy=0.85)
    # Rank 0 drives; the model's last layers live in the process of rank 1.
    assert re.search(r"\[rank 0\]   conv1 +task:0/CPU:0", out), out[-3000:]
    assert re.search(r"\[rank 0\]   logits +task:1/CPU:0", out), out[-3000:]
    # The other process serves its stages and never runs the script past smp.init.
    assert "[rank 0] digits:" in out and "[rank 1] digits:" not in out, out[-3000:]
