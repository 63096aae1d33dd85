"""The measured timeline: `smp.profile` records what each device ran, and when.

The pure part (`Timeline`) is checked on hand-made records; the runtime part
on real steps: every action of every step recorded once, in its device's
schedule order, without overlap on a device, the numbers unchanged by the
probes, and the trace file parseable with every task in it.
"""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import smp_tf as smp
from smp_tf.profiling.timeline import TaskRecord, Timeline
from smp_tf.schedules import TaskSpec, make_schedule
from tests import models


# -- pure part ----------------------------------------------------------------
def _two_stage_records():
    # Step 0, two devices: device 0 runs 0-2 and 5-6, device 1 runs 2-5.
    return [
        TaskRecord(0, 0, 0, 0, "F0", 0.0, 2.0),
        TaskRecord(0, 1, 1, 0, "FB0", 2.0, 5.0),
        TaskRecord(0, 0, 2, 0, "B0", 5.0, 6.0),
    ]


def test_bubbles_step_time_and_costs_of_hand_made_records():
    tl = Timeline(_two_stage_records())
    assert tl.num_steps == 1
    assert tl.step_time(0) == 6.0
    bubbles = tl.step_bubbles(0)
    assert bubbles == pytest.approx({0: 0.5, 1: 0.5})
    assert tl.measured_bubble() == pytest.approx(0.5)
    assert tl.task_costs() == {(0, 0): 2.0, (1, 1): 3.0, (0, 2): 1.0}


def test_simulated_bubble_uses_the_measured_costs():
    tasks = [TaskSpec(0, 0, cost=1.0), TaskSpec(1, 1, deps=((0, 0),), kind="FB", cost=1.0),
             TaskSpec(0, 2, deps=((1, 1),), kind="B", cost=1.0)]
    schedule = make_schedule(tasks, 1, "simple")
    tl = Timeline(_two_stage_records(), schedule=schedule)
    # Costs 2, 3, 1 in a chain: makespan 6, work 6 over 2 devices.
    assert tl.simulated().makespan == pytest.approx(6.0)
    assert tl.simulated_bubble() == pytest.approx(0.5)
    assert "measured 50.0%" in tl.summary()



def test_measured_gap_is_the_median_wait_from_ready_to_start():
    tasks = [TaskSpec(0, 0, cost=1.0), TaskSpec(1, 1, deps=((0, 0),), kind="FB", cost=1.0),
             TaskSpec(0, 2, deps=((1, 1),), kind="B", cost=1.0)]
    schedule = make_schedule(tasks, 1, "simple")
    # F0 0-2; FB0 ready at 2, starts at 2.5; B0 ready at 5.5, starts at 5.75.
    records = [
        TaskRecord(0, 0, 0, 0, "F0", 0.0, 2.0),
        TaskRecord(0, 1, 1, 0, "FB0", 2.5, 5.5),
        TaskRecord(0, 0, 2, 0, "B0", 5.75, 6.75),
    ]
    tl = Timeline(records, schedule=schedule)
    assert tl.measured_gap() == pytest.approx(0.375)  # median of 0.5 and 0.25
    # Without the gap the simulation is short of the measured span (6.75)
    # by the two waits; with the measured gap each wait counts 0.375:
    # 2 + 0.375 + 3 + 0.375 + 1 = 6.75.
    assert tl.simulated().makespan == pytest.approx(6.0)
    assert tl.simulated(gap=tl.measured_gap()).makespan == pytest.approx(tl.step_time(0))
    assert Timeline(_two_stage_records(), schedule=schedule).measured_gap() == 0.0
    # Replayed with no waits: 2 + 3 + 1.
    assert tl.replayed_span(0) == pytest.approx(6.0)
    with pytest.raises(ValueError, match="no recorded step 3"):
        tl.replayed_span(3)
    with pytest.raises(ValueError, match="no schedule"):
        Timeline(records).measured_gap()



def test_task_costs_by_median_or_mean():
    records = _two_stage_records() + [
        TaskRecord(1, 0, 0, 0, "F0", 10.0, 11.0),
        TaskRecord(1, 1, 1, 0, "FB0", 11.0, 14.0),
        TaskRecord(1, 0, 2, 0, "B0", 14.0, 14.5),
        TaskRecord(2, 0, 0, 0, "F0", 20.0, 26.0),
    ]
    tl = Timeline(records)
    assert tl.task_costs()[(0, 0)] == 2.0  # durations 2, 1, 6
    assert tl.task_costs("mean")[(0, 0)] == pytest.approx(3.0)
    assert tl.task_costs("mean")[(0, 2)] == pytest.approx(0.75)
    with pytest.raises(ValueError, match="'max'"):
        tl.task_costs("max")


def test_chrome_trace_has_one_event_per_record_on_its_device_track():
    tl = Timeline(_two_stage_records(), device_names={0: "/device:CPU:0", 1: "/device:CPU:1"})
    trace = json.loads(json.dumps(tl.chrome_trace()))
    tasks = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["tid"], e["ts"], e["dur"]) for e in tasks] == [
        ("F0", 0, 0.0, 2e6), ("FB0", 1, 2e6, 3e6), ("B0", 0, 5e6, 1e6)]
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {0: "device 0 (/device:CPU:0)", 1: "device 1 (/device:CPU:1)"}


def test_empty_timeline_says_nothing_was_recorded():
    tl = Timeline()
    with pytest.raises(ValueError, match="no pipelined step ran"):
        tl.measured_bubble()
    assert "no pipelined step ran" in tl.summary()


def test_profile_rejects_bad_arguments_and_nesting():
    with pytest.raises(TypeError, match="path or None"):
        smp.profile(3)
    with smp.profile(None):
        with pytest.raises(RuntimeError, match="do not nest"):
            with smp.profile(None):
                pass


# -- runtime ------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _clock_allowed(request):
    """tf.timestamp() does not run under op determinism (on for the tests)."""
    from tensorflow.python.framework import config

    was = config.is_op_determinism_enabled()
    config.disable_op_determinism()
    yield
    if was:
        config.enable_op_determinism()


def test_profile_refuses_to_open_under_op_determinism():
    from tensorflow.python.framework import config

    config.enable_op_determinism()
    with pytest.raises(RuntimeError, match="op determinism"):
        smp.profile(None).__enter__()
    config.disable_op_determinism()


def _setup(pipeline="interleaved", M=4, virtual_stages=1):
    keras.utils.set_random_seed(5)
    model = models.mlp()
    x, y = models.data("mlp")
    smp.init({"partitions": 2, "microbatches": M, "pipeline": pipeline, "virtual_stages": virtual_stages})
    step = smp.step(models.make_body(model, "mlp"))
    return model, step, x, y


def _train_fn(model, step, opt):
    @tf.function
    def train(x, y):
        loss, grads, _ = step(x, y)
        opt.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))
        return loss.reduce_mean()

    return train


@pytest.mark.parametrize("pipeline,virtual_stages", [("interleaved", 1), ("simple", 1), ("interleaved", 2)])
def test_every_action_of_every_step_is_recorded_in_schedule_order(tmp_path, pipeline, virtual_stages):
    model, step, x, y = _setup(pipeline, virtual_stages=virtual_stages)
    train = _train_fn(model, step, keras.optimizers.SGD(1e-2))
    with smp.profile(tmp_path) as prof:
        for _ in range(3):
            train(x, y)
    tl = prof.timeline
    schedule = step.last_plan and tl.schedule
    assert schedule is not None and schedule.kind == pipeline
    assert tl.num_steps == 3
    for s in range(3):
        recs = tl.step_records(s)
        for d, actions in schedule.order.items():
            mine = sorted((r for r in recs if r.device == d), key=lambda r: r.start)
            # One record per action, in the device's schedule order...
            # (With virtual stages a device runs the actions of its partitions.)
            assert [(r.partition, r.wave, r.microbatch) for r in mine] == [
                (a.partition, a.wave, a.microbatch) for a in actions]
            assert [r.name for r in mine] == [schedule.display(a) for a in actions]
            # ...one after another on the device.
            for a, b in zip(mine, mine[1:]):
                assert a.start <= a.end <= b.start
    assert 0.0 <= tl.measured_bubble() < 1.0
    assert 0.0 <= tl.simulated_bubble() < 1.0
    trace = json.loads((tmp_path / "timeline.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 3 * sum(len(a) for a in schedule.order.values())
    assert {e["tid"] for e in events} == {0, 1}  # one track per device, not per partition
    assert set(tl.task_costs()) == {t.key for t in schedule.tasks}
    assert {e["name"] for e in events} == {schedule.display(a) for acts in schedule.order.values() for a in acts}
    assert str(tmp_path / "timeline.json") in prof.files
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert len(prof.files) == 1  # no PNG without matplotlib (the "plot" extra)
    else:
        png = tmp_path / "timeline.png"
        assert str(png) in prof.files and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_probes_leave_the_numbers_unchanged():
    model, step, x, y = _setup()
    ref = keras.models.clone_model(model)
    ref.set_weights(model.get_weights())
    train = _train_fn(model, step, keras.optimizers.SGD(1e-2))
    plain = [float(train(x, y)) for _ in range(2)]
    ref_step = smp.step(models.make_body(ref, "mlp"))
    with smp.profile(None) as prof:
        ref_train = _train_fn(ref, ref_step, keras.optimizers.SGD(1e-2))
        probed = [float(ref_train(x, y)) for _ in range(2)]
    assert prof.timeline.num_steps == 2
    assert plain == probed
    for a, b in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_steps_are_recorded_only_inside_the_profile():
    model, step, x, y = _setup()
    with smp.profile(None) as prof:
        step(x, y)  # an eager call: traced with probes inside the block
        step(x, y)
    assert prof.timeline.num_steps == 2
    step(x, y)  # outside: the unprobed function, nothing recorded
    assert prof.timeline.num_steps == 2
    with smp.profile(None) as again:
        step(x, y)
    assert again.timeline.num_steps == 1


def test_keras_fit_inside_a_profile_is_recorded_and_outside_is_not():
    keras.utils.set_random_seed(5)
    model = models.mlp()
    x, y = models.data("mlp")
    smp.init({"partitions": 2, "microbatches": 2})
    model.compile(optimizer=keras.optimizers.SGD(1e-2), loss="mse")
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)
    with smp.profile(None) as prof:
        model.fit(x, y, batch_size=len(x), epochs=2, verbose=0)
    assert prof.timeline.num_steps == 2
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)
    assert prof.timeline.num_steps == 2
    assert "bubble: measured" in prof.timeline.summary()
