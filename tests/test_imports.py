"""The package layout: public API in one place, pure parts free of TensorFlow."""

import subprocess
import sys

import smp_tf


def test_pure_modules_import_without_tensorflow():
    # The configuration, the graph view, the partitioner, the task rewrite,
    # the schedules and the sharding layer's logic are plain Python: a
    # launcher or a planning tool can use them without loading TensorFlow.
    code = (
        "import sys\n"
        "import smp_tf, smp_tf.config, smp_tf.graph_view, smp_tf.schedules, smp_tf.rewrite\n"
        "import smp_tf.partitioner.plan, smp_tf.partitioner.balance, smp_tf.partitioner.groups, smp_tf.memory\n"
        "import smp_tf.sharding.spec, smp_tf.sharding.layout_map, smp_tf.sharding.rules\n"
        "import smp_tf.sharding.completion, smp_tf.sharding.reshard, smp_tf.sharding.builtin, smp_tf.sharding.pieces\n"
        "import smp_tf.planner, smp_tf.planner.resources, smp_tf.planner.mapping\n"
        "smp_tf.Config(partitions=2, microbatches=4, tensor_parallel_degree=2, layout_map={'a/kernel': (None, 'tensor')})\n"
        "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_every_public_name_resolves_and_is_documented():
    for name in smp_tf.__all__:
        value = getattr(smp_tf, name)
        assert value.__doc__, f"smp_tf.{name} has no docstring"
    assert callable(smp_tf.step) and smp_tf.step.__module__ == "smp_tf.step_function"


def test_the_data_path_points_one_way():
    """No module of smp_tf imports itself through others (at module or function level)."""
    import ast
    import pathlib

    root = pathlib.Path(smp_tf.__file__).parent
    names = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__") for p in root.rglob("*.py")}
    imports = {}
    for p in root.rglob("*.py"):
        name = ".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        deps = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("smp_tf"):
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("smp_tf"))
        imports[name] = deps - {name, "smp_tf"}
    mutual = sorted({tuple(sorted((a, b))) for a, ds in imports.items() for b in ds if a in imports.get(b, ())})
    assert not mutual, f"modules that import each other: {mutual}"
    # Nor through others: no module reaches itself.
    def reached(start):
        seen, todo = set(), [start]
        while todo:
            for dep in imports.get(todo.pop(), ()):
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        return seen

    cycles = sorted(m for m in imports if m in reached(m))
    assert not cycles, f"modules on an import cycle: {cycles}"
