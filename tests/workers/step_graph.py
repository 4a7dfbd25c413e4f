"""The all-reduces of a compiled training step, read from its graph (for the workers' results)."""


def _all_reduce_op(op) -> bool:
    """TensorFlow's all-reduce, Horovod's (Gloo), or a gradient pack's on
    one of our engines (a `tf.numpy_function`,
    keras_distrib.collectives.numpy_engine)."""
    if op.type in ("CollectiveReduceV2", "HorovodGroupedAllreduce"):
        return True
    return op.type == "PyFunc" and op.name.split("/")[-1].startswith(
        ("kd_host_mean_by_count", "kd_tcp_mean_by_count", "kd_hier_mean_by_count")
    )


def matmuls_before_each_all_reduce(model):
    """For each all-reduce of gradients in the compiled training step
    (TensorFlow's or our engines'), in the order they were made: how many of
    the step's matrix products it waits for (through its inputs and control
    inputs)."""
    graph = model.train_function.compiled._list_all_concrete_functions()[-1].graph
    counts = []
    for op in graph.get_operations():
        if not _all_reduce_op(op):
            continue
        seen, stack = set(), [op]
        while stack:
            node = stack.pop()
            if node.name not in seen:
                seen.add(node.name)
                stack.extend(t.op for t in node.inputs)
                stack.extend(node.control_inputs)
        counts.append(sum(graph.get_operation_by_name(n).type == "MatMul" for n in seen))
    return counts


def matmuls_in_step(model):
    """How many matrix products the compiled training step makes in all."""
    graph = model.train_function.compiled._list_all_concrete_functions()[-1].graph
    return sum(op.type == "MatMul" for op in graph.get_operations())
