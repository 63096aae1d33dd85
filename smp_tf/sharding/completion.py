"""Completion: a spec for every tensor of a traced step, from a few marks.

The marks are the variables' layouts (a layout map or the built-in rules)
and the activations' constraints (`smp.shard_tensor`). Completion is a
data-flow analysis over the graph, forward pass and backward pass alike,
as in PaddlePaddle's completion of distributed attributes:

1. **Forward.** In topological order every op takes the specs its inputs
   arrive in and asks its rule (`smp_tf.sharding.rules`) which specs it
   needs and which it produces. A variable read produces its variable's
   layout, a constraint its spec. An op whose inputs are all whole stays
   whole without asking. An op with no rule, or whose rule declines, runs
   whole: it needs every input whole and is listed in the plan's
   ``whole_ops``.
2. **Backward.** Where every reader of a whole tensor needs it split the
   same way, and the op that produces it can produce that split from split
   inputs (its rule's back rule: element-wise ops, bias additions,
   reshapes, transposes), that op computes split instead, and the split
   moves to its inputs; then the forward pass runs again. Repeated until
   nothing moves, so a mark reaches every op it determines. Variable
   reads, constraints and stateful ops are never moved.
3. **Sequence parallelism** (``sequence_parallel``, Megatron-LM's). Once
   nothing moves, the ops that run whole between the tensor-parallel
   regions (norms, dropouts, residual additions, biases) are split along
   the sequence instead: starting from each partial sum that is read
   whole (a row-parallel product's output, or in the backward pass a
   column-parallel product's input gradient), every op downstream whose
   rule computes it from sequence pieces without gathering anything
   runs on its rows (`sequence_dim`). The partial sum's all-reduce becomes
   a reduce-scatter, and the next column-parallel product's input is
   all-gathered. Then the forward and backward passes run again.
4. **Reshards.** Wherever a tensor is produced in one spec and read in
   another, a reshard (`smp_tf.sharding.reshard`) is recorded, once per
   tensor and target spec. The step's outputs are read whole, but for
   the gradients that are returned in their pieces.

Plain Python over `ShardGraph`, a small graph description that tests can
write by hand (`ShardGraph.from_spec`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

from smp_tf.sharding.reshard import reshard_bytes, reshard_steps
from smp_tf.sharding.rules import Decision, OpInfo, back_rule_for, rule_for
from smp_tf.sharding.spec import ShardSpec

__all__ = ["ShardOp", "ShardGraph", "Reshard", "ShardPlan", "complete", "sequence_dim", "SequenceLengthError",
           "READ_OPS", "WRITE_OPS"]

#: Ops that read a variable's value: they produce the variable's layout.
READ_OPS = frozenset(["ReadVariableOp"])
#: Ops that write a value into a variable: the value must be in its layout.
WRITE_OPS = frozenset(["AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"])
#: Ops that take a variable's handle and use its value themselves.
_HANDLE_OPS = frozenset(["ResourceGather"])


@dataclass
class ShardOp:
    """One op as completion sees it.

    Attributes:
        info: its type, attributes and shapes (`OpInfo`).
        inputs: names of its data input tensors (``"op:0"``).
        outputs: names of its output tensors.
        variable: the variable whose handle it takes (reads and writes).
        constraint: the spec `smp.shard_tensor` asks of its output.
        stateful: whether it changes state (never moved by the backward pass).
        argument: it is an argument of the step (a placeholder of the batch).
        gradient: it belongs to the backward pass.
    """

    info: OpInfo
    inputs: Tuple[str, ...] = ()
    outputs: Tuple[str, ...] = ()
    variable: Optional[str] = None
    constraint: Optional[ShardSpec] = None
    stateful: bool = False
    argument: bool = False
    gradient: bool = False

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def type(self) -> str:
        return self.info.type


@dataclass
class ShardGraph:
    """Ops in topological order, and the tensors the step returns."""

    ops: List[ShardOp]
    outputs: List[str] = field(default_factory=list)
    bytes_of: Dict[str, int] = field(default_factory=dict)
    #: The outputs that are floating-point gradients: returned in pieces
    #: where their layout allows (`returned_in_pieces`), not gathered.
    gradient_outputs: FrozenSet[str] = frozenset()
    _shapes: Dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def from_spec(cls, spec: Sequence[Mapping[str, Any]], outputs: Sequence[str] = (), t: int = 2) -> "ShardGraph":
        """A graph written by hand, for tests: each entry has ``name``,
        ``type``, ``inputs`` (op names, each op one output), ``shape`` (its
        output's), and optionally ``attrs``, ``const`` (position -> value),
        ``variable``, ``constraint``, ``stateful`` and ``argument``."""
        shapes: Dict[str, Any] = {}
        ops = []
        for s in spec:
            ins = tuple(f"{n}:0" for n in s.get("inputs", ()))
            shape = tuple(s["shape"]) if s.get("shape") is not None else None
            info = OpInfo(
                name=s["name"], type=s.get("type", "Identity"), attrs=dict(s.get("attrs", {})),
                input_shapes=tuple(shapes[n] for n in s.get("inputs", ())), output_shapes=(shape,),
                const_inputs=dict(s.get("const", {})), t=t,
            )
            c = s.get("constraint")
            ops.append(ShardOp(info, ins, (f"{s['name']}:0",), s.get("variable"),
                               None if c is None else ShardSpec(tuple(c)), bool(s.get("stateful", False)),
                               bool(s.get("argument", False))))
            shapes[s["name"]] = shape
        nbytes = {f"{n}:0": 4 * _elements(sh) for n, sh in shapes.items()}
        return cls(ops, [f"{o}:0" for o in outputs], nbytes)

    def shape_of(self, tensor: str) -> Any:
        """The static shape of `tensor` (None if unknown)."""
        if not self._shapes:
            self._shapes.update((x, s) for op in self.ops for x, s in zip(op.outputs, op.info.output_shapes))
        return self._shapes.get(tensor)


def _elements(shape: Any) -> int:
    n = 1
    for d in shape or ():
        n *= d or 1
    return n


@dataclass(frozen=True)
class Reshard:
    """One tensor taken from layout `src` to `dst` for the ops `readers`
    (``(op name, input position)``; ``("<output>", k)`` for the step's
    k-th output)."""

    tensor: str
    src: ShardSpec
    dst: ShardSpec
    readers: Tuple[Tuple[str, int], ...]
    nbytes: int = 0

    @property
    def steps(self) -> Tuple[str, ...]:
        return reshard_steps(self.src, self.dst)


@dataclass
class ShardPlan:
    """Completion's result.

    Attributes:
        t: the tensor-parallel degree.
        variables: variable -> its layout.
        specs: tensor name -> the spec its producer makes it in.
        decisions: op name -> its `Decision`, for the ops that run sharded.
        reshards: the reshards, in the order of the first reader.
        whole_ops: ``(name, type)`` of the ops that have sharded inputs but
            no rule (or a rule that declined): they run whole.
        whole_variables: the step's variables no layout splits.
        stored_split: variable -> the dimension its storage is split along
            (`smp_tf.sharding.storage`); a split variable not in it is
            stored whole and split when read.
    """

    t: int
    variables: Dict[str, ShardSpec]
    specs: Dict[str, ShardSpec]
    decisions: Dict[str, Decision]
    reshards: List[Reshard]
    whole_ops: List[Tuple[str, str]]
    whole_variables: List[str] = field(default_factory=list)
    stored_split: Dict[str, int] = field(default_factory=dict)
    sequence_parallel: bool = False
    #: With sequence parallelism: the ops that run on sequence pieces.
    sequence_ops: List[str] = field(default_factory=list)

    def reshard_bytes(self) -> float:
        """Bytes each device receives per micro-batch for the reshards."""
        return float(sum(reshard_bytes(r.src, r.dst, r.nbytes, self.t) for r in self.reshards))

    def summary(self) -> str:
        """A readable report: sharded variables, ops run whole, reshards."""
        lines = [f"tensor parallelism: t={self.t}"]
        lines.append(f"  sharded variables ({sum(not s.is_replicated for s in self.variables.values())}):")
        for v, s in self.variables.items():
            if not s.is_replicated:
                stored = "stored split" if v in self.stored_split else "stored whole, split when read"
                lines.append(f"    {v:<48} {s}  {s.dims}  {stored}")
        if self.whole_variables:
            shown = ", ".join(self.whole_variables[:6]) + (", ..." if len(self.whole_variables) > 6 else "")
            lines.append(f"  variables left whole ({len(self.whole_variables)}): {shown}")
        lines.append(f"  ops run sharded: {len(self.decisions)}")
        if self.sequence_parallel:
            lines.append(f"  sequence parallel: {len(self.sequence_ops)} ops between the regions run on 1/{self.t} "
                         "of the sequence")
        kinds: Dict[str, int] = {}
        for r in self.reshards:
            for s in r.steps:
                kinds[s] = kinds.get(s, 0) + 1
        lines.append("  reshards: " + (", ".join(f"{k} x{n}" for k, n in sorted(kinds.items())) or "none")
                     + f" ({self.reshard_bytes() / 2**20:.2f} MiB received per device per micro-batch)")
        if self.whole_ops:
            by_type: Dict[str, int] = {}
            for _, t in self.whole_ops:
                by_type[t] = by_type.get(t, 0) + 1
            lines.append("  ops without a sharding rule, run whole on gathered inputs: "
                         + ", ".join(f"{t} x{n}" for t, n in sorted(by_type.items())))
        return "\n".join(lines)


def _replicated_like(shape: Any) -> ShardSpec:
    return ShardSpec.replicated(len(shape) if shape is not None else 0)


def _whole(info: OpInfo) -> Decision:
    """Every input and output whole."""
    return Decision(tuple(_replicated_like(s) for s in info.input_shapes),
                    tuple(_replicated_like(s) for s in info.output_shapes))


def _forward(graph: ShardGraph, variables: Mapping[str, ShardSpec], preferred: Mapping[str, Decision]):
    specs: Dict[str, ShardSpec] = {}
    decisions: Dict[str, Decision] = {}
    whole: List[Tuple[str, str]] = []
    for op in graph.ops:
        info = op.info
        ins = [specs.get(x) or _replicated_like(s) for x, s in zip(op.inputs, info.input_shapes)]
        var_spec = variables.get(op.variable) if op.variable is not None else None
        dec: Optional[Decision] = None
        if op.constraint is not None:
            dec = Decision((op.constraint,) + tuple(ins[1:]), (op.constraint,) + tuple(
                _replicated_like(s) for s in info.output_shapes[1:]))
        elif var_spec is not None and op.type in READ_OPS:
            dec = Decision(tuple(ins), (var_spec,))
        elif var_spec is not None and op.type in WRITE_OPS and len(ins) > 1:
            dec = Decision((ins[0], var_spec) + tuple(ins[2:]), ())
        elif var_spec is not None and op.type in _HANDLE_OPS:
            rule = rule_for(op.type)
            dec = rule(info, [var_spec] + ins[1:]) if rule else None
            if dec is None:
                whole.append((op.name, op.type))
                dec = Decision(tuple(ins), tuple(_replicated_like(s) for s in info.output_shapes))
        elif op.name in preferred:
            dec = preferred[op.name]
        elif any(not s.is_replicated for s in ins):
            rule = rule_for(op.type)
            dec = rule(info, ins) if rule is not None else None
            if dec is None:
                whole.append((op.name, op.type))
                dec = _whole(info)
        if dec is not None:
            decisions[op.name] = dec
            for x, s in zip(op.outputs, dec.outputs):
                specs[x] = s
    return specs, decisions, whole


def _readers(graph: ShardGraph, specs, decisions) -> Dict[str, Tuple[ShardSpec, List[Tuple[str, int, ShardSpec]]]]:
    """tensor -> (the spec it is produced in, [(reader, position, spec
    needed)]), for every tensor some op reads."""
    readers: Dict[str, Tuple[ShardSpec, List[Tuple[str, int, ShardSpec]]]] = {}
    for op in graph.ops:
        d = decisions.get(op.name)
        for k, x in enumerate(op.inputs):
            have = specs.get(x) or _replicated_like(op.info.input_shapes[k])
            readers.setdefault(x, (have, []))[1].append((op.name, k, d.inputs[k] if d is not None else have))
    return readers


def _moves_back(graph: ShardGraph, readers, decisions, preferred: Dict[str, Decision]) -> bool:
    """The backward pass (module doc, 2): adds to `preferred` the producers
    of whole tensors that every reader needs split the same way and that
    can make that split from split inputs; whether any was added."""
    producer = {x: op for op in graph.ops for x in op.outputs}
    outputs = set(graph.outputs)
    moved = False
    for x, (_, reads) in readers.items():
        op = producer.get(x)
        if (op is None or x in outputs or op.name in preferred or op.name in decisions
                or op.stateful or op.variable is not None or op.constraint is not None or len(op.outputs) != 1):
            continue
        needs = {s for _, _, s in reads}
        if len(needs) != 1:
            continue
        need = needs.pop()
        back = back_rule_for(op.type)
        if need.split_dim is None or back is None:
            continue
        ins = back(op.info, need)
        if ins is None:
            continue
        preferred[op.name] = Decision(tuple(ins), (need,))
        moved = True
    return moved


class SequenceLengthError(ValueError):
    """Sequence parallelism cannot split an activation's sequence over ``t``."""


def sequence_dim(shape: Any, batch: Optional[int]) -> Optional[int]:
    """The sequence dimension of an activation of `shape` (batch-major):
    1 of a ``(batch, sequence, features)`` tensor, 0 of a ``(tokens,
    features)`` one; None for any other rank, or when the leading
    dimension is not the micro-batch's `batch` (a weight's gradient, not
    an activation)."""
    if shape is None or batch is None or not shape or shape[0] != batch:
        return None
    return {2: 0, 3: 1}.get(len(shape))


def _batch_size(graph: ShardGraph) -> Optional[int]:
    """The micro-batch size: the leading dimension the arguments share."""
    sizes = {op.info.output_shapes[0][0] for op in graph.ops
             if op.argument and op.info.output_shapes and op.info.output_shapes[0]}
    return sizes.pop() if len(sizes) == 1 else None


def _sequence_splits(graph: ShardGraph, specs, decisions, readers, preferred: Dict[str, Decision], t: int,
                     seq: Dict[str, ShardSpec], on_pieces: List[str]) -> bool:
    """Sequence parallelism (module doc, 3): adds to `preferred` the ops
    that run whole downstream of a partial sum read whole and that their
    rule computes from sequence pieces with no gather; whether any was.
    `seq`: the tensors made sequence pieces so far, `on_pieces` the ops
    that run on them (both updated).

    Raises:
        SequenceLengthError: such a partial sum's sequence dimension has a
            size `t` does not divide.
    """
    by_name = {op.name: op for op in graph.ops}
    batch = _batch_size(graph)
    outputs = set(graph.outputs)
    # The tensors whose producer runs on sequence pieces (not the partial
    # sums `seq` starts from, which are still made as partial sums).
    made = {x: seq[x] for name in on_pieces for x in by_name[name].outputs if x in seq}
    for x, (have, reads) in readers.items():
        if any(need.is_replicated for _, _, need in reads):
            piece = _sequence_piece(graph, x, have, batch, t)
            if piece is not None:
                seq[x] = piece
    moved = False
    for op in graph.ops:
        offered = [seq.get(x) for x in op.inputs]
        if op.name in preferred or not any(offered) or op.variable is not None or op.constraint is not None:
            continue
        # A partial sum read beside sequence pieces is reduce-scattered too
        # (the backward pass's chains of linear ops on partial sums).
        offered = [o or _sequence_piece(graph, x, specs.get(x), batch, t) for o, x in zip(offered, op.inputs)]
        dec = decisions.get(op.name)
        new = _on_sequence_pieces(op, dec, offered, specs, outputs, batch)
        if new is None:
            # It keeps the layout it has (the forward pass would otherwise
            # ask its rule again with the sequence pieces arriving, and a
            # product could gather its weight instead of its input), unless
            # that layout takes as a partial sum an input now made in pieces
            # (no reshard makes a partial sum): then it runs whole.
            now_pieces = [x in made for x in op.inputs]
            keeps = dec is not None and not any(p and need.partial for p, need in zip(now_pieces, dec.inputs))
            new = dec if keeps else _whole(op.info)
        else:
            on_pieces.append(op.name)
            for x, s in zip(op.outputs, new.outputs):
                if s.split_dim is not None:
                    seq[x] = made[x] = s
        preferred[op.name] = new
        moved = True
    return moved


def _sequence_piece(graph: ShardGraph, x: str, have: Optional[ShardSpec], batch: Optional[int],
                    t: int) -> Optional[ShardSpec]:
    """The sequence split of `x` if it is a partial sum of an activation,
    else None.

    Raises:
        SequenceLengthError: `t` does not divide its sequence.
    """
    if have is None or not have.partial:
        return None
    shape = graph.shape_of(x)
    d = sequence_dim(shape, batch)
    if d is None:
        return None
    if shape[d] is None or shape[d] % t or shape[d] < t:
        raise SequenceLengthError(
            f"sequence_parallel=True splits {x} of shape {tuple(shape)} along its sequence dimension "
            f"{d} over tensor_parallel_degree={t}, but {t} does not divide its size {shape[d]}. Use a "
            f"sequence length (or micro-batch of tokens) that {t} divides, or sequence_parallel=False.")
    return ShardSpec.split(len(shape), d)


def _on_sequence_pieces(op: ShardOp, dec: Optional[Decision], offered, specs, outputs,
                        batch: Optional[int]) -> Optional[Decision]:
    """How `op` runs on the sequence pieces `offered` (None per input that
    arrives as before), or None if it cannot without a gather, or it
    already runs split over the tensor axis, or it is stateful or makes a
    step output."""
    if op.stateful or op.argument or any(x in outputs for x in op.outputs):
        return None
    if dec is not None and any(s.split_dim is not None for s in dec.inputs + dec.outputs):
        return None
    rule = rule_for(op.type)
    if rule is None:
        return None
    ins = [o or specs.get(x) or _replicated_like(s) for o, x, s in zip(offered, op.inputs, op.info.input_shapes)]
    new = rule(op.info, ins)
    if new is None or all(s.is_replicated for s in new.outputs):
        return None
    # Nothing gathered: each input is needed as it arrives, or arrives whole
    # and is sliced where it is, or arrives a partial sum and is
    # reduce-scattered along its sequence.
    for need, have, shape in zip(new.inputs, ins, op.info.input_shapes):
        if need == have or (have.is_replicated and not need.partial):
            continue
        if have.partial and need.split_dim is not None and need.split_dim == sequence_dim(shape, batch):
            continue
        return None
    return new


def returned_in_pieces(spec: ShardSpec) -> bool:
    """Whether a gradient the step returns in layout `spec` is returned in
    its pieces rather than whole: split along one dimension, not a partial
    sum (which is added up first)."""
    return not spec.partial and spec.split_dim is not None


def _reshards(graph: ShardGraph, specs, readers, sequence_parallel: bool = False) -> List[Reshard]:
    """One reshard per tensor and target layout its readers need (module
    doc, 4); the step's outputs are read whole, but for the gradients
    returned in pieces (`returned_in_pieces`). With `sequence_parallel`,
    the backward's readers of a forward tensor made in pieces have their
    own (they gather it again, `smp_tf.sharding.lower`)."""
    by_name = {op.name: op for op in graph.ops}
    reshards: List[Reshard] = []
    for x, (have, reads) in readers.items():
        producer = by_name.get(x.rpartition(":")[0])
        again = sequence_parallel and have.split_dim is not None and producer is not None and not producer.gradient
        groups: Dict[Tuple[ShardSpec, bool], List[Tuple[str, int]]] = {}
        for name, k, need in reads:
            if need != have:
                groups.setdefault((need, again and by_name[name].gradient), []).append((name, k))
        for (need, _), who in groups.items():
            reshards.append(Reshard(x, have, need, tuple(who), graph.bytes_of.get(x, 0)))
    for k, x in enumerate(graph.outputs):
        have = specs.get(x)
        if have is not None and not have.is_replicated and not (
                x in graph.gradient_outputs and returned_in_pieces(have)):
            reshards.append(Reshard(x, have, ShardSpec.replicated(have.rank), (("<output>", k),),
                                    graph.bytes_of.get(x, 0)))
    return reshards


def complete(graph: ShardGraph, variables: Mapping[str, ShardSpec], t: int, max_rounds: int = 16,
             sequence_parallel: bool = False) -> ShardPlan:
    """Completes the specs of `graph` from the `variables`' layouts and the
    ops' constraints (see the module doc); with `sequence_parallel`, the
    ops between the tensor-parallel regions split along the sequence.

    Raises:
        SequenceLengthError: with `sequence_parallel`, an activation whose
            sequence `t` does not divide.
    """
    preferred: Dict[str, Decision] = {}
    seq: Dict[str, ShardSpec] = {}
    on_pieces: List[str] = []
    for _ in range(max_rounds):
        specs, decisions, whole = _forward(graph, variables, preferred)
        readers = _readers(graph, specs, decisions)
        if _moves_back(graph, readers, decisions, preferred):
            continue
        if not (sequence_parallel and _sequence_splits(graph, specs, decisions, readers, preferred, t, seq, on_pieces)):
            break
    # Decisions that change nothing (whole in, whole out) are not kept.
    kept = {n: d for n, d in decisions.items() if any(not s.is_replicated for s in d.inputs + d.outputs)}
    return ShardPlan(t, dict(variables), specs, kept, _reshards(graph, specs, readers, sequence_parallel), whole,
                     sequence_parallel=sequence_parallel, sequence_ops=on_pieces)
