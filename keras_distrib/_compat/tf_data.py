"""tf.data internals: a pipeline's graph (to list its ops and to seed its
unseeded shuffles), its static batch size and TensorFlow's file-based
auto-sharding. Verified on TensorFlow 2.21.0."""

from __future__ import annotations

import uuid

import numpy as np
import tensorflow as tf

_EXPERIMENTAL_DISTRIBUTE = "tensorflow.python.data.experimental.ops.distribute"

# Private names the shims below use (checked at import, see `versions`).
PRIVATE = (
    # dataset_ops, agree_on_shuffles
    "tensorflow.python.data.ops.dataset_ops:DatasetV2._as_serialized_graph",
    # static_batch_size, shard_by_file
    f"{_EXPERIMENTAL_DISTRIBUTE}:compute_batch_size",
    f"{_EXPERIMENTAL_DISTRIBUTE}:_AutoShardDataset",
)


def _dataset_graph(dataset: tf.data.Dataset):
    """The pipeline's GraphDef (`Dataset._as_serialized_graph`, what
    tf.distribute's own auto-sharding reads; there is no public way to
    inspect a pipeline)."""
    graph = tf.compat.v1.GraphDef()
    graph.ParseFromString(dataset._as_serialized_graph().numpy())
    return graph


def dataset_ops(dataset: tf.data.Dataset) -> set[str]:
    """Names of the ops in a dataset's graph (to find file readers)."""
    graph = _dataset_graph(dataset)
    ops = {node.op for node in graph.node}
    for function in graph.library.function:
        ops.update(node.op for node in function.node_def)
    return ops


class UnseededShuffleError(ValueError):
    """An unseeded shuffle the workers cannot be made to agree on."""


def _unseeded(nodes: dict, shuffle) -> bool:
    # ShuffleDatasetV3(input, buffer_size, seed, seed2, seed_generator):
    # seed == seed2 == 0 is TensorFlow's "draw a random seed".
    seeds = [nodes.get(name.split(":")[0].lstrip("^")) for name in shuffle.input[2:4]]
    return all(
        node is not None and node.op == "Const" and tf.make_ndarray(node.attr["value"].tensor) == 0
        for node in seeds
    )


def agree_on_shuffles(dataset: tf.data.Dataset, draw_seed) -> tf.data.Dataset:
    """`dataset` with every unseeded `shuffle` given a seed from `draw_seed()`.

    Workers that each cut their rows from the same global batches must see
    the same batches; `.shuffle(n)` without a seed (TensorFlow's tutorials
    use it) draws a different order in every process. The pipeline's graph
    is serialized, each unseeded `ShuffleDatasetV3` gets the agreed seed
    (and a fresh seed-generator handle: deserialization reuses a live
    generator found under the old name), and the graph is deserialized
    (`DatasetFromGraph`, public raw op). Each epoch still reshuffles, in
    the same order on every worker. Returns `dataset` itself when it has no
    unseeded shuffle (`draw_seed` is then not called).

    Raises:
        UnseededShuffleError: an unseeded shuffle that cannot be rewritten
            (inside a nested dataset function, an older shuffle op, or a
            pipeline that cannot be serialized).
    """
    graph = _dataset_graph(dataset)
    nodes = {node.name: node for node in graph.node}
    top = [n for n in graph.node if n.op == "ShuffleDatasetV3" and _unseeded(nodes, n)]
    nested = [
        n.op
        for function in graph.library.function
        for n in function.node_def
        if "Shuffle" in n.op and _unseeded({m.name: m for m in function.node_def}, n)
    ] + [
        n.op
        for n in graph.node
        if "Shuffle" in n.op
        and n.op != "ShuffleDatasetV3"
        and len(n.input) >= 4
        and _unseeded(nodes, n)
    ]
    if nested:
        raise UnseededShuffleError("inside a nested dataset function or an older shuffle op")
    if not top:
        return dataset
    seed = int(draw_seed())
    for number, shuffle in enumerate(top):
        seed_node, seed2_node = (nodes[n.split(":")[0]] for n in shuffle.input[2:4])
        seed_node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(np.int64(seed)))
        seed2_node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(np.int64(number + 1)))
        generator = nodes[shuffle.input[4].split(":")[0]]
        for handle in generator.attr["value"].tensor.resource_handle_val:
            handle.name = f"kd_agreed_shuffle_{uuid.uuid4().hex}"
    try:
        variant = tf.raw_ops.DatasetFromGraph(graph_def=graph.SerializeToString())
    except (tf.errors.OpError, ValueError) as error:
        raise UnseededShuffleError(f"the pipeline cannot be rebuilt ({error})") from error
    return tf.data.experimental.from_variant(variant, dataset.element_spec)


def static_batch_size(dataset: tf.data.Dataset) -> int:
    """The batch size of a batched pipeline, or -1 (tf.distribute's helper)."""
    from tensorflow.python.data.experimental.ops import distribute

    return int(distribute.compute_batch_size(dataset))


def shard_by_file(
    dataset: tf.data.Dataset, num_shards: int, index: int, num_replicas: int
) -> tf.data.Dataset:
    """TensorFlow's file-based auto-sharding (`_AutoShardDataset`), as
    `experimental_distribute_dataset` applies it, for our own input path."""
    from tensorflow.python.data.experimental.ops import distribute

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.FILE
    return distribute._AutoShardDataset(
        dataset.with_options(options), num_shards, index, num_replicas
    )
