"""Tests for smp_tf.schedules (pure Python, no TensorFlow)."""

from __future__ import annotations

import dataclasses
import random
from collections import defaultdict

import pytest

from smp_tf.schedules import (
    Action,
    Schedule,
    ScheduleError,
    TaskKind,
    TaskSpec,
    chain_tasks,
    custom_schedule,
    make_schedule,
    simulate,
    validate,
)

KINDS = ("simple", "interleaved")
PM = [(p, m) for p in (1, 2, 3, 4, 5, 8) for m in (1, 2, 3, 4, 7, 8, 16)]


def _all_actions(tasks, m):
    return {Action(t.partition, t.wave, mb) for t in tasks for mb in range(m)}


def _check_every_action_once(schedule):
    seen = [a for acts in schedule.order.values() for a in acts]
    assert len(seen) == len(set(seen))
    assert set(seen) == _all_actions(schedule.tasks, schedule.num_microbatches)
    for dev, acts in schedule.order.items():
        assert all(a.partition == dev for a in acts)


def _check_deps(schedule, sim):
    by_key = {t.key: t for t in schedule.tasks}
    for a, s in sim.start.items():
        for d in by_key[a.task].deps:
            assert sim.end[Action(d[0], d[1], a.microbatch)] <= s + 1e-9
    # Devices run one action at a time, in their order.
    for acts in schedule.order.values():
        for x, y in zip(acts, acts[1:]):
            assert sim.end[x] <= sim.start[y] + 1e-9


def _random_tasks(rng: random.Random, num_parts: int):
    """A task set cut from a random op graph, the way the tracer builds one.

    Forward ops form a chain with random skip connections and a random (not
    necessarily monotone) placement; the loss follows the last op; each
    forward op has a gradient op on its own partition needing the gradients of
    its users and its own forward op; sometimes a metric op on another
    partition reads the loss. Waves count partition boundaries on the longest
    path into each op; ops are grouped by (partition, wave).
    """
    n = rng.randint(1, 3 * num_parts + 2)
    parts = sorted(rng.randrange(num_parts) for _ in range(n))
    for _ in range(rng.randint(0, 2)):  # a few out-of-order placements
        i, j = rng.randrange(n), rng.randrange(n)
        parts[i], parts[j] = parts[j], parts[i]
    preds = {i: ([i - 1] if i else []) for i in range(n)}
    for i in range(2, n):
        if rng.random() < 0.4:
            preds[i].append(rng.randrange(i - 1))
    ops = []  # (name, partition, preds, is_grad, cost)
    for i in range(n):
        ops.append((("f", i), parts[i], [("f", j) for j in preds[i]], False))
    loss_part = rng.choice([parts[-1], rng.randrange(num_parts)])
    ops.append((("f", n), loss_part, [("f", n - 1)], False))
    preds[n] = [n - 1]
    if num_parts > 1 and rng.random() < 0.3:
        ops.append((("metric", 0), rng.randrange(num_parts), [("f", n)], False))
    part_of = {name: p for name, p, _, _ in ops}
    users = defaultdict(list)
    for j in range(n + 1):
        for i in preds[j]:
            users[i].append(j)
    for i in range(n, -1, -1):
        gp = [("g", j) for j in users[i]] + [("f", i)]
        ops.append((("g", i), part_of[("f", i)], gp, True))
        part_of[("g", i)] = part_of[("f", i)]
    wave = {}
    for name, p, pr, _ in ops:
        wave[name] = max([wave[q] + (part_of[q] != p) for q in pr] + [0])
    groups = {}
    for name, p, pr, grad in ops:
        g = groups.setdefault((p, wave[name]), {"deps": set(), "fwd": False, "grad": False, "cost": 0.0})
        g["grad" if grad else "fwd"] = True
        g["cost"] += rng.choice([0.0, rng.uniform(0.1, 3.0), rng.uniform(0.1, 3.0)])
        for q in pr:
            k = (part_of[q], wave[q])
            if k != (p, wave[name]):
                g["deps"].add(k)
    return [
        TaskSpec(
            k[0],
            k[1],
            deps=tuple(sorted(g["deps"])),
            cost=g["cost"],
            kind=(TaskKind.FUSED if g["fwd"] else TaskKind.BACKWARD) if g["grad"] else TaskKind.FORWARD,
        )
        for k, g in sorted(groups.items())
    ]


# --- structure -------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("p,m", PM)
def test_every_action_once_and_deps_hold(kind, p, m):
    s = make_schedule(chain_tasks(p), m, kind)
    assert s.kind == kind and s.num_microbatches == m
    assert sorted(s.order) == list(range(p))
    _check_every_action_once(s)
    sim = s.simulate()
    _check_deps(s, sim)
    validate(s)


def test_chain_tasks_shape():
    t = chain_tasks(4, forward_cost=1.0, backward_cost=3.0)
    by_key = {x.key: x for x in t}
    assert sorted(by_key) == [(0, 0), (0, 6), (1, 1), (1, 5), (2, 2), (2, 4), (3, 3)]
    assert by_key[(3, 3)].fused and by_key[(3, 3)].label == "FB" and by_key[(3, 3)].cost == 4.0
    assert by_key[(2, 4)].deps == ((3, 3), (2, 2)) and by_key[(2, 4)].label == "B"
    assert by_key[(1, 1)].deps == ((0, 0),) and by_key[(1, 1)].label == "F"
    (only,) = chain_tasks(1)
    assert only.key == (0, 0) and only.fused and only.deps == ()


def test_action_str_roundtrip_and_display():
    a = Action(2, 5, 13)
    assert str(a) == "p2w5m13"
    assert Action.from_str("p2w5m13") == a
    tasks = chain_tasks(3)
    assert Action(2, 2, 3).display(tasks) == "FB3"
    assert Action(0, 4, 1).display(tasks) == "B1"
    # Two forward tasks on device 0: the wave disambiguates.
    skip = [
        TaskSpec(0, 0),
        TaskSpec(1, 1, deps=((0, 0),)),
        TaskSpec(0, 2, deps=((1, 1), (0, 0))),
        TaskSpec(1, 3, deps=((0, 2),), kind=TaskKind.FUSED),
        TaskSpec(0, 4, deps=((1, 3),), kind=TaskKind.BACKWARD),
    ]
    assert Action(0, 2, 7).display(skip) == "F7w2"
    assert Action(0, 4, 7).display(skip) == "B7"
    s = make_schedule(skip, 2, "interleaved")
    assert "F0w0" in s.table() and "F1w2" in s.table()


# --- 1F1B ------------------------------------------------------------------


def _classic_1f1b(p, num_stages, m):
    """Warm-up forwards, then forward/backward pairs, then cool-down backwards."""
    if p == num_stages - 1:
        return [f"FB{i}" for i in range(m)]
    warm = min(num_stages - 1 - p, m)
    seq = [f"F{i}" for i in range(warm)]
    for i in range(m - warm):
        seq += [f"F{warm + i}", f"B{i}"]
    seq += [f"B{i}" for i in range(m - warm, m)]
    return seq


def test_1f1b_p4_m8_exact():
    s = make_schedule(chain_tasks(4), 8, "interleaved")
    got = {d: [s.display(a) for a in acts] for d, acts in s.order.items()}
    assert got[0] == (
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7".split()
    )
    assert got[3] == "FB0 FB1 FB2 FB3 FB4 FB5 FB6 FB7".split()
    assert got[2] == "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7".split()
    # Same order whatever the (uniform per kind) costs.
    for f, b in [(1.0, 1.0), (1.0, 2.0), (2.0, 1.0), (0.5, 3.0)]:
        s2 = make_schedule(chain_tasks(4, f, b), 8, "interleaved")
        assert s2.order == s.order


def test_1f1b_chain_order_ignores_unbalanced_costs():
    rng = random.Random(7)
    for _ in range(30):
        p, m = rng.randint(2, 8), rng.randint(1, 16)
        tasks = [
            TaskSpec(t.partition, t.wave, t.deps, rng.uniform(0.05, 5), t.kind)
            for t in chain_tasks(p)
        ]
        s = make_schedule(tasks, m, "interleaved")
        assert s.order == make_schedule(chain_tasks(p), m, "interleaved").order


def test_list_scheduler_matches_classic_1f1b_on_balanced_chains():
    # make_schedule writes chains out directly; the general builder must
    # agree with it when stage costs are balanced.
    from smp_tf.schedules.interleaved import list_order
    from smp_tf.schedules.tasks import _check_tasks

    rng = random.Random(11)
    for p, m in PM:
        f, b = rng.uniform(0.1, 3), rng.uniform(0.1, 3)
        order = list_order(_check_tasks(chain_tasks(p, f, b)), m)
        assert order == make_schedule(chain_tasks(p), m, "interleaved").order


@pytest.mark.parametrize("p,m", PM)
def test_1f1b_classic_order_and_peak_live(p, m):
    s = make_schedule(chain_tasks(p), m, "interleaved")
    for d, acts in s.order.items():
        assert [s.display(a) for a in acts] == _classic_1f1b(d, p, m)
    sim = s.simulate()
    for d in range(p):
        assert sim.peak_live[d] <= p - d
        assert sim.peak_live[d] == min(m, p - d)


def test_interleaved_peak_live_random_chain_costs():
    rng = random.Random(1)
    for _ in range(60):
        p, m = rng.randint(1, 8), rng.randint(1, 16)
        s = make_schedule(chain_tasks(p, rng.uniform(0.1, 3), rng.uniform(0.1, 3)), m, "interleaved")
        costs = {t.key: rng.uniform(0.1, 3) for t in s.tasks}
        sim = s.simulate(costs)
        _check_deps(s, sim)
        for d in range(p):
            assert sim.peak_live[d] <= p - d


@pytest.mark.parametrize("p,m", [(p, m) for p, m in PM if p > 1])
def test_simple_keeps_every_microbatch_live(p, m):
    sim = make_schedule(chain_tasks(p), m, "simple").simulate()
    assert sim.peak_live[0] == m
    assert sim.peak_live[p - 1] == 1  # the fused task finishes what it starts


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("p,m", PM)
def test_bubble_uniform_costs(kind, p, m):
    # Forward 1 and backward 1 per stage (fused last stage 2): every device
    # works M*(f+b) and the step takes (M+P-1)*(f+b) (micro-batch 0 needs P-1
    # forward and P-1 backward steps of fill/drain before and after the M
    # steps of the busiest device), so bubble = (P-1)/(M+P-1).
    sim = make_schedule(chain_tasks(p, 1.0, 1.0), m, kind).simulate()
    assert sim.makespan == pytest.approx((m + p - 1) * 2.0, abs=1e-9)
    assert sim.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-9)
    assert all(v == pytest.approx(2.0 * m) for v in sim.busy.values())


def test_simulate_costs_override_and_function_form():
    s = make_schedule(chain_tasks(3), 4, "interleaved")
    a = s.simulate()
    b = simulate(s.order, s.tasks, 4)
    assert a.start == b.start and a.makespan == b.makespan
    c = s.simulate({(2, 2): 10.0})
    assert c.makespan > a.makespan
    with pytest.raises(ValueError, match=r"\(9, 9\)"):
        s.simulate({(9, 9): 1.0})
    with pytest.raises(ValueError, match="-1"):
        s.simulate({(0, 0): -1})



def test_gap_delays_every_action_that_waits():
    # GPipe at P=2, M=1 with unit costs: F0 (device 0, starts at 0, waits for
    # nothing), FB0 (device 1, waits for F0), B0 (device 0, waits for FB0 and
    # for F0 on its device). With a gap g each of the two waiting actions
    # starts g late: makespan 4 + 2g; the gap is idle time.
    s = make_schedule(chain_tasks(2, 1.0, 1.0), 1, "simple")
    base = s.simulate()
    g = 0.25
    sim = s.simulate(gap=g)
    assert base.makespan == pytest.approx(4.0)
    assert sim.makespan == pytest.approx(4.0 + 2 * g)
    assert sim.busy == base.busy
    work = sum(base.busy.values())  # 4: F and B on device 0, the fused FB on device 1
    assert sim.bubble == pytest.approx((2 * sim.makespan - work) / (2 * sim.makespan))
    _check_deps(s, sim)
    first = min(sim.start, key=sim.start.get)
    assert sim.start[first] == 0.0


@pytest.mark.parametrize("kind", KINDS)
def test_gap_adds_at_most_one_gap_per_action(kind):
    s = make_schedule(chain_tasks(4, 1.0, 2.0), 8, kind)
    base, sim = s.simulate(), s.simulate(gap=0.1)
    n = sum(len(v) for v in s.order.values())
    assert base.makespan < sim.makespan <= base.makespan + 0.1 * n + 1e-9
    _check_deps(s, sim)


@pytest.mark.parametrize("gap", [-0.1, float("nan"), float("inf"), "1", True])
def test_gap_must_be_a_finite_nonnegative_number(gap):
    s = make_schedule(chain_tasks(2), 2, "interleaved")
    with pytest.raises(ValueError, match="gap must be"):
        s.simulate(gap=gap)


# --- fuzz ------------------------------------------------------------------


def test_fuzz_random_task_graphs_never_deadlock():
    rng = random.Random(12345)
    several = 0
    for _ in range(300):
        p, m = rng.randint(1, 8), rng.randint(1, 16)
        tasks = _random_tasks(rng, p)
        counts = defaultdict(int)
        for t in tasks:
            counts[(t.partition, t.label)] += 1
        several += any(v > 1 for v in counts.values())
        for kind in KINDS:
            s = make_schedule(tasks, m, kind)
            validate(s)
            _check_every_action_once(s)
            costs = {t.key: rng.uniform(0.0, 2.0) for t in tasks}
            for c in (None, costs):
                sim = s.simulate(c)
                _check_deps(s, sim)
                assert 0.0 <= sim.bubble <= 1.0
            str(s)
            s.simulate().table()
    # The generator must actually produce skip-connection-style task sets.
    assert several > 50


# --- errors ----------------------------------------------------------------


def test_deadlock_raises_with_marked_table():
    tasks = chain_tasks(3)
    good = make_schedule(tasks, 2, "simple")
    order = {d: list(v) for d, v in good.order.items()}
    # Stage 0 runs backward m0 before forward m0: B0 needs F0 of its own device.
    order[0].remove(Action(0, 4, 0))
    order[0].insert(0, Action(0, 4, 0))
    bad = Schedule("custom", 2, good.tasks, order)
    with pytest.raises(ScheduleError) as ei:
        validate(bad)
    msg = str(ei.value)
    assert "deadlock" in msg
    assert "[B0]" in msg and "[F0]" in msg and "[FB0]" in msg
    assert "device 0 is stuck at B0 (p0w4m0)" in msg
    assert "p0w0m0" in msg  # the missing dependency
    assert ei.value.table in msg and ei.value.stuck[0] == Action(0, 4, 0)
    assert isinstance(ei.value, ValueError)
    # The table of a deadlocking schedule renders instead of raising.
    assert "[B0]" in bad.table()
    with pytest.raises(ScheduleError):
        custom_schedule(tasks, 2, order)


def test_deadlock_after_progress_is_marked():
    tasks = chain_tasks(2)
    # Device 1 wants FB1 first, device 0 runs F0 B0 F1 B1: F0 runs, then stuck.
    order = {0: ["p0w0m0", "p0w2m0", "p0w0m1", "p0w2m1"], 1: ["p1w1m1", "p1w1m0"]}
    with pytest.raises(ScheduleError) as ei:
        custom_schedule(tasks, 2, order)
    msg = str(ei.value)
    assert "[B0]" in msg and "[FB1]" in msg
    assert "F0" in ei.value.table.splitlines()[1]


def test_custom_schedule_ok():
    tasks = chain_tasks(2)
    order = [["p0w0m0", "p0w0m1", "p0w2m0", "p0w2m1"], ["p1w1m0", "p1w1m1"]]
    s = custom_schedule(tasks, 2, order)
    assert s.kind == "custom"
    assert s.order[1] == [Action(1, 1, 0), Action(1, 1, 1)]


@pytest.mark.parametrize("kind", ["foo", "custom", "", None])
def test_bad_kind(kind):
    with pytest.raises(ValueError, match=repr(kind) if kind != "custom" else "custom"):
        make_schedule(chain_tasks(2), 2, kind)


@pytest.mark.parametrize("m", [0, -1, 1.5, True, "2"])
def test_bad_num_microbatches(m):
    with pytest.raises(ValueError, match="num_microbatches"):
        make_schedule(chain_tasks(2), m, "simple")


def test_bad_orders_name_the_action():
    tasks = chain_tasks(2)
    base = {0: ["p0w0m0", "p0w0m1", "p0w2m0", "p0w2m1"], 1: ["p1w1m0", "p1w1m1"]}
    dup = {0: base[0] + ["p0w0m0"], 1: base[1]}
    with pytest.raises(ValueError, match="p0w0m0.*more than once"):
        custom_schedule(tasks, 2, dup)
    missing = {0: base[0][:-1], 1: base[1]}
    with pytest.raises(ValueError, match="missing.*p0w2m1"):
        custom_schedule(tasks, 2, missing)
    wrong_dev = {0: base[0] + ["p1w1m1"], 1: base[1][:-1]}
    with pytest.raises(ValueError, match="p1w1m1 is on device 0"):
        custom_schedule(tasks, 2, wrong_dev)
    unknown = {0: base[0] + ["p0w7m0"], 1: base[1]}
    with pytest.raises(ValueError, match=r"p0w7m0.*unknown task \(0, 7\)"):
        custom_schedule(tasks, 2, unknown)
    out_of_range = {0: base[0] + ["p0w0m5"], 1: base[1]}
    with pytest.raises(ValueError, match="p0w0m5.*microbatch 5"):
        custom_schedule(tasks, 2, out_of_range)
    with pytest.raises(ValueError, match="'nonsense'"):
        custom_schedule(tasks, 2, {0: ["nonsense"]})
    # validate() on a hand-built Schedule checks the same things.
    with pytest.raises(ValueError, match="more than once"):
        validate(Schedule("custom", 2, tuple(tasks), {d: [Action.from_str(x) for x in v] for d, v in dup.items()}))
    with pytest.raises(ValueError, match="'bar'"):
        validate(Schedule("bar", 2, tuple(tasks), {}))


def test_bad_tasks():
    with pytest.raises(ValueError, match="duplicate task .*\\(0, 0\\)"):
        make_schedule([TaskSpec(0, 0), TaskSpec(0, 0)], 1, "simple")
    with pytest.raises(ValueError, match=r"unknown task \(3, 3\)"):
        make_schedule([TaskSpec(0, 0, deps=((3, 3),))], 1, "simple")
    with pytest.raises(ValueError, match="cycle"):
        make_schedule([TaskSpec(0, 0, deps=((1, 1),)), TaskSpec(1, 1, deps=((0, 0),))], 1, "simple")
    with pytest.raises(ValueError, match="empty"):
        make_schedule([], 1, "simple")
    with pytest.raises(ValueError, match="-1"):
        TaskSpec(-1, 0)
    with pytest.raises(ValueError, match="nan"):
        TaskSpec(0, 0, cost=float("nan"))
    with pytest.raises(ValueError, match="kind 'X'"):
        TaskSpec(0, 0, kind="X")
    with pytest.raises(ValueError, match="device"):
        TaskSpec(0, 0, device=-1)
    with pytest.raises(ValueError, match="itself"):
        TaskSpec(0, 0, deps=((0, 0),))
    with pytest.raises(ValueError, match="'x'"):
        TaskSpec(0, 1, deps=("x",))
    with pytest.raises(ValueError, match="num_stages"):
        chain_tasks(0)


# --- tables ----------------------------------------------------------------


def test_table_p3_m4():
    simple = make_schedule(chain_tasks(3), 4, "simple")
    assert str(simple) == simple.table() == "\n".join(
        [
            "slot  0  1   2   3   4   5  6  7  8  9",
            "dev0 F0 F1  F2  F3   .   . B0 B1 B2 B3",
            "dev1  . F0  F1  F2  F3  B0 B1 B2 B3  .",
            "dev2  .  . FB0 FB1 FB2 FB3  .  .  .  .",
        ]
    )
    inter = make_schedule(chain_tasks(3), 4, "interleaved")
    assert inter.table() == "\n".join(
        [
            "slot  0  1   2   3  4   5  6   7  8  9",
            "dev0 F0 F1  F2   . B0  F3 B1   . B2 B3",
            "dev1  . F0  F1  B0 F2  B1 F3  B2 B3  .",
            "dev2  .  . FB0 FB1  . FB2  . FB3  .  .",
        ]
    )


def test_simulation_table_uses_costs():
    sim = make_schedule(chain_tasks(2, 1.0, 2.0), 2, "simple").simulate()
    lines = sim.table().splitlines()
    # F costs 1 slot, B 2, the fused task 3; '-' continues an action.
    assert lines[1].split() == ["dev0", "F0", "F1", ".", ".", "B0", "-", ".", "B1", "-"]
    assert lines[2].split() == ["dev1", ".", "FB0", "-", "-", "FB1", "-", "-", ".", "."]
    frac = make_schedule(chain_tasks(2, 0.5, 1.25), 2, "interleaved").simulate()
    assert "0.5" in frac.table().splitlines()[0]
    assert "makespan" in repr(frac)
    # Flop-sized integer costs give one column per start/end time, not per unit.
    big = make_schedule(chain_tasks(3, 1e9, 2e9), 4, "simple").simulate()
    assert len(big.table().splitlines()[0].split()) < 40


def test_large_table_is_compact():
    s = make_schedule(chain_tasks(8), 16, "interleaved")
    lines = s.table().splitlines()
    assert len(lines) == 9
    # Columns are as wide as their widest cell: under 4 characters a slot.
    assert max(len(x) for x in lines) < 4 * len(lines[0].split())


# -- zero_bubble (ZB-H1) -------------------------------------------------------
def _zb_chain(P):
    from smp_tf.schedules import split_chain_tasks

    return split_chain_tasks(P)


@pytest.mark.parametrize("P,M", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_zero_bubble_fills_the_bubble_with_weight_work_and_keeps_1f1b_memory(P, M):
    from smp_tf.schedules import make_schedule

    tasks = _zb_chain(P)
    zb = make_schedule(tasks, M, "zero_bubble")
    one = make_schedule(tasks, M, "interleaved")
    zs, os_ = zb.simulate(), one.simulate()
    # Deadlock-free (simulate raises otherwise), every action once.
    assert sorted(a for acts in zb.order.values() for a in acts) == sorted(a for acts in one.order.values() for a in acts)
    # ZB-H1's bubble: (P - 1)(F + B - W) stage-times against 1F1B's
    # (P - 1)(F + B + W), with F = B = W = 1 and 3 M of work per device.
    assert zs.makespan == pytest.approx(3 * M + (P - 1))
    assert zs.bubble < os_.bubble
    assert zs.bubble == pytest.approx((P - 1) / (3 * M + P - 1))
    # No device holds more micro-batches than 1F1B's first stage does.
    assert max(zs.peak_live.values()) == max(os_.peak_live.values()) == min(P, M)


def test_zero_bubble_writes_the_papers_order_for_a_chain():
    from smp_tf.schedules import make_schedule

    s = make_schedule(_zb_chain(4), 8, "zero_bubble")
    rows = {d: [s.display(a) for a in acts] for d, acts in s.order.items()}
    # Stage p: 1F1B's P-1-p warm-up forwards, then F/B pairs with W following
    # each B once p W actions are held back; the held-back ones run last.
    assert rows[0][:7] == ["F0", "F1", "F2", "F3", "B0", "W0", "F4"]
    assert rows[2][:9] == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "W0", "F4"]
    assert rows[3][:6] == ["FB0", "FB1", "FB2", "FB3", "W0", "FB4"]
    assert rows[3][-4:] == ["W4", "W5", "W6", "W7"]


@pytest.mark.parametrize("P", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("M", [1, 2, 3, 7, 16])
def test_zero_bubble_chain_without_first_stage_b_is_deadlock_free(P, M):
    """A traced chain's first stage sends nothing upstream: its whole
    backward is W. The written order skips the missing B."""
    from smp_tf.schedules import TaskSpec, make_schedule
    from smp_tf.schedules.zero_bubble import split_chain_stages

    tasks = []
    for t in _zb_chain(P):
        if P > 1 and t.partition == 0 and t.kind is TaskKind.BACKWARD:
            b = t
            continue
        tasks.append(t)
    if P > 1:
        tasks = [dataclasses.replace(t, deps=b.deps) if t.partition == 0 and t.weight else t for t in tasks]
    assert split_chain_stages(tuple(sorted(tasks, key=lambda t: t.key))) is not None
    s = make_schedule(tasks, M, "zero_bubble")
    sim = s.simulate()
    assert max(sim.peak_live.values()) <= min(P, M)
    # Skip connections are not a chain: the list schedule takes them.
    skip = tasks + [TaskSpec(P, 0, kind="F", device=0)] if P > 1 else tasks
    assert split_chain_stages(tuple(sorted(skip, key=lambda t: t.key))) is None or P == 1


def test_split_chain_stages_rejects_what_the_chain_order_cannot_run():
    from smp_tf.schedules import TaskSpec
    from smp_tf.schedules.zero_bubble import split_chain_stages

    tasks = _zb_chain(3)
    assert split_chain_stages(tuple(tasks)) is not None
    # A forward that waits for a backward is no chain.
    bad = [dataclasses.replace(t, deps=t.deps + ((0, 4),)) if t.key == (1, 1) else t for t in tasks]
    assert split_chain_stages(tuple(bad)) is None
    # Two W tasks on one stage are not either.
    extra = tasks + [TaskSpec(0, 9, deps=((0, 4),), kind="W")]
    assert split_chain_stages(tuple(extra)) is None
    # Without W tasks there is nothing to place: the list schedule runs.
    from smp_tf.schedules import chain_tasks

    assert split_chain_stages(tuple(chain_tasks(3))) is None


def test_weight_task_labels_and_validation():
    from smp_tf.schedules import TaskSpec, make_schedule

    tasks = _zb_chain(2)
    labels = {t.key: t.label for t in tasks}
    assert labels == {(0, 0): "F", (0, 2): "B", (0, 3): "W", (1, 1): "FB", (1, 4): "W"}
    table = str(make_schedule(tasks, 2, "zero_bubble"))
    assert "W0" in table and "W1" in table
    # Kinds are one enum; a label names it too.
    w = TaskSpec(0, 3, kind="W")
    assert w.kind is TaskKind.WEIGHT and w.weight and w.backward and not w.fused and str(w.kind) == "W"
    assert TaskSpec(0, 3, kind=TaskKind.FUSED).fused and not TaskSpec(0, 0).backward
    # Without W tasks, zero_bubble is the interleaved list schedule.
    from smp_tf.schedules import chain_tasks

    assert make_schedule(chain_tasks(3), 4, "zero_bubble").simulate().makespan == make_schedule(
        chain_tasks(3), 4, "interleaved").simulate().makespan


# -- virtual stages (Megatron-LM's interleaved 1F1B) ----------------------------
@pytest.mark.parametrize("P,v,M", [(2, 2, 4), (4, 2, 8), (4, 2, 16), (4, 4, 8), (8, 2, 16), (3, 3, 6)])
def test_virtual_stages_divide_the_bubble(P, v, M):
    from smp_tf.schedules import virtual_chain_tasks

    tasks = virtual_chain_tasks(P, v)
    assert {t.device for t in tasks} == set(range(P))
    assert all(t.device == t.partition % P for t in tasks)
    s = make_schedule(tasks, M, "interleaved")
    sim = s.simulate()
    # Megatron-LM's bubble: (P - 1) stage-times of (F + B) / v over M of them.
    work = M * 3.0
    assert sim.makespan == pytest.approx(work + (P - 1) * 3.0 / v)
    one = make_schedule(chain_tasks(P), M, "interleaved").simulate()
    assert sim.bubble < one.bubble
    # Device d runs 2 (P - 1 - d) + (v - 1) P warm-up forwards, holding
    # 1 + (P - 1 - d) * 2 / (P v) ... of the stage's activations at most
    # (chunks count 1/v each): Megatron's (1 + (P - 1) / (P v)) P on device 0.
    assert sim.peak_activations[0] == pytest.approx(min(M, P) * (1 + (P - 1) / (P * v)) if M >= P else M)
    for d in range(P):
        acts = s.order[d]
        warm = min(2 * (P - 1 - d) + (v - 1) * P, M * v)
        assert all(not s.task(a.task).backward for a in acts[:warm])
        # Groups of P micro-batches go through the device's chunks depth first.
        firsts = [a for a in acts if s.task(a.task).kind in (TaskKind.FORWARD, TaskKind.FUSED)][: P * v]
        assert [a.partition for a in firsts] == [j * P + d for j in range(v) for _ in range(P)][: len(firsts)]
    # The table names each device's chunks by wave.
    assert "F0w0" in s.table() and f"F0w{P}" in s.table()


@pytest.mark.parametrize("kind", ["interleaved", "simple", "zero_bubble"])
@pytest.mark.parametrize("P,v,M", [(2, 2, 3), (3, 2, 4), (4, 2, 5), (2, 3, 1)])
def test_virtual_stages_any_microbatch_count_and_kind(kind, P, v, M):
    """M not a multiple of P falls back to the list schedule; every kind
    completes and puts every action on its chunk's device."""
    from smp_tf.schedules import virtual_chain_tasks

    s = make_schedule(virtual_chain_tasks(P, v), M, kind)
    for d, acts in s.order.items():
        assert all(a.partition % P == d for a in acts)
    assert sum(len(a) for a in s.order.values()) == len(s.tasks) * M
    s.simulate()


def test_virtual_chain_shape_ignores_implied_dependencies():
    """A traced chain's backward also depends on the previous stage's forward
    (its input); that changes nothing about the order."""
    import dataclasses

    from smp_tf.schedules import virtual_chain_tasks
    from smp_tf.schedules.interleaved import is_chain, is_virtual_chain

    def with_input_deps(tasks):
        out = []
        for t in tasks:
            if t.kind is TaskKind.BACKWARD and t.partition > 0:
                t = dataclasses.replace(t, deps=t.deps + ((t.partition - 1, t.partition - 1),))
            out.append(t)
        return tuple(sorted(out, key=lambda t: t.key))

    assert is_chain(with_input_deps(chain_tasks(4)))
    assert is_virtual_chain(with_input_deps(virtual_chain_tasks(2, 2)))
    assert not is_virtual_chain(tuple(chain_tasks(4)))
    a = make_schedule(with_input_deps(virtual_chain_tasks(2, 2)), 4, "interleaved")
    b = make_schedule(virtual_chain_tasks(2, 2), 4, "interleaved")
    assert a.order == b.order
    # A missing dependency makes it another shape.
    fewer = [dataclasses.replace(t, deps=((0, 0),)) if t.key == (0, 4) else t for t in chain_tasks(3)]
    assert not is_chain(tuple(fewer))


def test_actions_on_the_wrong_device_are_refused():
    from smp_tf.schedules import virtual_chain_tasks

    tasks = virtual_chain_tasks(2, 2)
    order = make_schedule(tasks, 1, "interleaved").order
    moved = {0: order[0] + [order[1][0]], 1: order[1][1:]}
    with pytest.raises(ValueError, match="belongs to device 1"):
        custom_schedule(tasks, 1, moved)


def test_registry():
    from smp_tf.schedules import register_schedule, schedule_builder, schedule_kinds
    from smp_tf.schedules import base

    assert schedule_kinds()[:3] == ("interleaved", "simple", "zero_bubble")
    assert schedule_builder("zero_bubble").split_weight and not schedule_builder("interleaved").split_weight
    with pytest.raises(ValueError, match="'custom' needs an explicit order"):
        schedule_builder("custom")
    with pytest.raises(ValueError, match="already registered"):
        register_schedule("simple")
    with pytest.raises(ValueError, match="identifier"):
        register_schedule("not a name")

    @register_schedule("reversed_gpipe_test")
    def build(tasks, m):
        # GPipe with the micro-batches of each phase in reverse order.
        order = schedule_builder("simple").build(tasks, m)
        return {d: sorted(acts, key=lambda a: (s_of[a.task], a.wave, -a.microbatch)) for d, acts in order.items()}

    try:
        s_of = {t.key: t.backward for t in chain_tasks(3)}
        s = make_schedule(chain_tasks(3), 3, "reversed_gpipe_test")
        assert s.kind == "reversed_gpipe_test" and [str(a) for a in s.order[0][:3]] == ["p0w0m2", "p0w0m1", "p0w0m0"]
        validate(s)
        from smp_tf.config import parse_config

        assert parse_config({"pipeline": "reversed_gpipe_test"}).pipeline == "reversed_gpipe_test"
    finally:
        del base._REGISTRY["reversed_gpipe_test"]
