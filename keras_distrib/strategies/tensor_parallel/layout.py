"""Which layers `strategy="tensor_parallel"` splits and how, and where each
variable ended up.

A layout maps layer-name patterns (regular expressions, matched against the
whole name) to a split kind:

* `"column"`: the kernel's output columns (an Embedding's feature columns)
  are split over the devices; each device computes its slice of the output,
  and the slices are concatenated (or handed, still split, to a `"row"`
  layer that is their only consumer);
* `"row"`: the kernel's input rows (an Embedding's vocabulary rows) are
  split; each device computes a partial output from its slice of the input,
  and the partial outputs are summed (then the bias is added once);
* `"whole"`: the layer stays whole, on one device.

Layers the layout does not name follow the default plan, Megatron's
(Shoeybi et al., 2019, arXiv:1909.08053): a Dense layer is `"row"` when its
only input is the output of a `"column"` Dense layer that feeds nothing
else, and `"column"` otherwise, so consecutive Dense layers alternate and a
pair costs one reduction forward and one backward; an Embedding is `"row"`
(its vocabulary split, as in Megatron's vocab-parallel embedding). A layer
that cannot be split is placed whole on the device holding the fewest bytes
so far. Only plain `keras.layers.Dense` and `keras.layers.Embedding` are
split: no subclasses (their `call` may differ), no quantized or LoRA layers,
no weight constraints (a constraint may couple the parts), and only
regularizers that are sums over elements (L1, L2, L1L2), which the parts can
add up.

Example:

```python
layout = {"hidden.*": "column", "logits": "row", "norm": "whole"}
model = kd.DistributedModel(inputs, outputs,
                            strategy=kd.strategies.get("tensor_parallel", layout=layout))
print(model.strategy.plan())   # each variable's device, bytes per device
```
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Optional, Sequence

import numpy as np

KINDS = ("column", "row", "whole")
SPLITTABLE = ("Dense", "Embedding")
_SUMMED_REGULARIZERS = ("L1", "L2", "L1L2")


def part_sizes(dim: int, num_parts: int) -> list[int]:
    """How `dim` is split over `num_parts` devices: as evenly as possible,
    the first parts one larger when it does not divide (`np.array_split`)."""
    return [dim // num_parts + (1 if i < dim % num_parts else 0) for i in range(num_parts)]


def split_axis(kind: str) -> int:
    """The axis of a kernel (embeddings table) that `kind` splits: its
    columns (outputs, features) or its rows (inputs, vocabulary)."""
    return 1 if kind == "column" else 0


def split_problem(layer, kind: str, num_devices: int) -> Optional[str]:
    """Why `layer` cannot be split `kind`-wise over `num_devices`, or None."""
    import keras

    name = type(layer).__name__
    if type(layer) not in (keras.layers.Dense, keras.layers.Embedding):
        return f"it is a {name}; tensor_parallel splits Dense and Embedding layers"
    if not layer.built:
        return "it is not built"
    if getattr(layer, "quantization_mode", None) or getattr(layer, "lora_enabled", False):
        return "it is quantized or has LoRA enabled"
    for role in ("kernel", "bias", "embeddings"):
        if getattr(layer, f"{role}_constraint", None) is not None:
            return f"it has a {role} constraint, which may couple the parts"
        regularizer = getattr(layer, f"{role}_regularizer", None)
        if regularizer is not None and type(regularizer).__name__ not in _SUMMED_REGULARIZERS:
            return (
                f"its {role} regularizer {type(regularizer).__name__} is not a sum over "
                "elements (L1, L2, L1L2)"
            )
    if name == "Dense":
        dim = layer.units if kind == "column" else layer.input_spec.axes[-1]
        what = "output units" if kind == "column" else "input features"
    else:
        dim = layer.output_dim if kind == "column" else layer.input_dim
        what = "output features" if kind == "column" else "vocabulary rows"
    if dim < num_devices:
        return f"it has {dim} {what}, fewer than the {num_devices} devices"
    return None


# Keras activations that act on each element alone (so on each device's
# columns of a column-split layer); any other (softmax, log_softmax, glu,
# sparsemax, a user's function) runs on the gathered output.
_ELEMENTWISE_ACTIVATIONS = (
    "linear",
    "relu",
    "relu6",
    "leaky_relu",
    "elu",
    "selu",
    "gelu",
    "celu",
    "silu",
    "swish",
    "hard_silu",
    "hard_swish",
    "sigmoid",
    "hard_sigmoid",
    "log_sigmoid",
    "tanh",
    "tanh_shrink",
    "hard_tanh",
    "softplus",
    "softsign",
    "soft_shrink",
    "hard_shrink",
    "exponential",
    "mish",
    "sparse_plus",
    "sparse_sigmoid",
    "squareplus",
    "threshold",
)


def is_elementwise(activation) -> bool:
    """Whether a layer's `activation` (a Keras activation function, or None)
    acts on each element alone."""
    import keras

    if activation is None:
        return True
    return any(
        activation is getattr(keras.activations, name, None) for name in _ELEMENTWISE_ACTIVATIONS
    )


def check_layout(layout: Optional[Mapping[str, str]]) -> dict[str, str]:
    """`layout` validated (one-line errors): patterns that compile, known kinds."""
    if layout is None:
        return {}
    if not isinstance(layout, Mapping):
        raise ValueError(
            f"layout must be a dict of layer-name pattern -> 'column' | 'row' | 'whole', "
            f"got {type(layout).__name__}."
        )
    checked = {}
    for pattern, kind in layout.items():
        if not isinstance(pattern, str):
            raise ValueError(f"layout key {pattern!r} must be a layer-name pattern (a string).")
        if kind not in KINDS:
            raise ValueError(
                f"layout[{pattern!r}]={kind!r} is not a split kind; use 'column', 'row' or 'whole'."
            )
        try:
            re.compile(pattern)
        except re.error as error:
            raise ValueError(
                f"layout pattern {pattern!r} is not a valid regular expression ({error}); "
                "fix it (it is matched against whole layer names)."
            ) from None
        checked[pattern] = kind
    return checked


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """What the strategy does with one layer.

    Attributes:
        kind: `"column"`, `"row"` or `"whole"`.
        device: for a whole layer, the device it lives and runs on.
        reason: for a whole layer the default plan could not split, why.
    """

    kind: str
    device: Optional[str] = None
    reason: str = ""


def _layers_of(template) -> list:
    """`template.layers`; none for a layer mixed with a trainer (Keras's
    "a model is a layer and a Trainer"), whose own variables stay whole."""
    return list(getattr(template, "layers", ()))


def plan_layers(
    template, layout: Mapping[str, str], devices: Sequence[str]
) -> dict[str, LayerPlan]:
    """Layer name -> `LayerPlan` for the functional `template`.

    Raises:
        ValueError: a pattern that matches no layer, a layer matched by
            patterns of different kinds, or a layer the layout asks to split
            that cannot be split.
    """
    layers = [
        layer for layer in _layers_of(template) if layer.weights or _is_splittable_type(layer)
    ]
    names = [layer.name for layer in _layers_of(template)]
    for pattern in layout:
        if not any(re.fullmatch(pattern, name) for name in names):
            raise ValueError(
                f"layout pattern {pattern!r} matches no layer of model {template.name!r} "
                f"(its layers: {names}); fix the pattern or remove it."
            )
    n = len(devices)
    functional = getattr(template, "inputs", None) is not None
    producers, consumers = _graph_links(template) if functional else _order_links(layers)
    kinds: dict[str, str] = {}
    reasons: dict[str, str] = {}
    for layer in layers:
        explicit = {layout[p] for p in layout if re.fullmatch(p, layer.name)}
        if len(explicit) > 1:
            matching = [p for p in layout if re.fullmatch(p, layer.name)]
            raise ValueError(
                f"layer {layer.name!r} matches layout patterns {matching} of different kinds "
                f"{sorted(explicit)}; make the patterns exclusive."
            )
        if explicit:
            kind = explicit.pop()
            problem = None if kind == "whole" else split_problem(layer, kind, n)
            if problem:
                raise ValueError(
                    f"layout asks to split layer {layer.name!r} {kind}-wise, but {problem}; "
                    f"map it to 'whole' or leave it out of the layout."
                )
            kinds[layer.name] = kind
            continue
        kind = _default_kind(layer, kinds, producers, consumers)
        problem = split_problem(layer, kind, n) if kind != "whole" else "it is not splittable"
        if problem:
            kind, reasons[layer.name] = "whole", problem
        kinds[layer.name] = kind
    return _place_whole_layers(layers, kinds, reasons, devices)


def _is_splittable_type(layer) -> bool:
    return type(layer).__name__ in SPLITTABLE


def _default_kind(layer, kinds, producers, consumers) -> str:
    name = type(layer).__name__
    if name == "Embedding":
        return "row"
    if name != "Dense":
        return "whole"
    producer = producers.get(layer.name)
    if (
        producer is not None
        and type(producer).__name__ == "Dense"
        and kinds.get(producer.name) == "column"
        and consumers.get(producer.name) == 1
    ):
        return "row"
    return "column"


def _order_links(layers):
    """`_graph_links` for a subclassed model, which has no graph: each layer
    is taken to feed the next, in the order the model tracks them. Only the
    pairing (and so the communication) depends on it: a row layer whose input
    is not its column producer's output slices that input itself, so the
    result is exact whatever the model's `call` does."""
    producers = {b.name: a for a, b in zip(layers, layers[1:])}
    return producers, {a.name: 1 for a in layers[:-1]}


def _graph_links(template):
    """(layer name -> the layer producing its only input, when it has exactly
    one input from one layer called once; layer name -> how many uses its
    output has, model outputs included).

    Shared layers (called more than once) have no single input or output:
    they are left out, and so never paired.
    """
    producer_of_tensor, uses = {}, {}
    for layer in _layers_of(template):
        try:
            outputs = _flat(layer.output)
        except (AttributeError, ValueError):
            continue  # shared: several outputs
        for tensor in outputs:
            producer_of_tensor[id(tensor)] = layer
    producers = {}
    for layer in _layers_of(template):
        try:
            inputs = _flat(layer.input)
        except (AttributeError, ValueError):
            continue
        sources = [producer_of_tensor.get(id(t)) for t in inputs]
        for source in sources:
            if source is not None:
                uses[source.name] = uses.get(source.name, 0) + 1
        if len(sources) == 1 and sources[0] is not None:
            producers[layer.name] = sources[0]
    for tensor in _flat(template.outputs):
        source = producer_of_tensor.get(id(tensor))
        if source is not None:
            uses[source.name] = uses.get(source.name, 0) + 1
    return producers, uses


def _flat(structure) -> list:
    import keras

    return keras.tree.flatten(structure)


def _place_whole_layers(layers, kinds, reasons, devices) -> dict[str, LayerPlan]:
    """Whole layers go, in graph order, to the device holding the fewest
    bytes so far (split layers counted first, as evenly spread)."""
    load = dict.fromkeys(devices, 0)
    for layer in layers:
        if kinds[layer.name] != "whole":
            for device in devices:
                load[device] += _layer_bytes(layer) // len(devices)
    plans = {}
    for layer in layers:
        if kinds[layer.name] == "whole":
            device = min(devices, key=lambda d: load[d])
            load[device] += _layer_bytes(layer)
            plans[layer.name] = LayerPlan("whole", device, reasons.get(layer.name, ""))
        else:
            plans[layer.name] = LayerPlan(kinds[layer.name])
    return plans


def _layer_bytes(layer) -> int:
    return sum(variable_bytes(v) for v in layer.weights)


def variable_bytes(variable) -> int:
    """Bytes the values of `variable` take."""
    return int(np.prod(variable.shape, dtype=np.int64)) * np.dtype(variable.dtype).itemsize


# -- the report: where each variable actually lives -----------------------------------


@dataclasses.dataclass(frozen=True)
class Placement:
    """One variable: its layer and split kind, path, shape, device, size."""

    layer: str
    kind: str
    path: str
    shape: tuple
    device: str
    bytes: int


class Plan:
    """Where every weight of a tensor-parallel model lives, read from the
    variables themselves; `str(plan)` is a table with bytes per device.

    Example:

    ```python
    plan = model.strategy.plan()
    print(plan)
    plan.bytes_per_device    # {"/device:GPU:0": ..., "/device:GPU:1": ...}
    plan.kinds               # {"hidden": "column", "logits": "row", ...}
    plan.optimizer_bytes_per_device  # the optimizer's slots, next to their shards
    ```
    """

    def __init__(
        self,
        devices: Sequence[str],
        placements: Sequence[Placement],
        kinds: Mapping[str, str],
        optimizer_bytes_per_device: Optional[Mapping[str, int]] = None,
    ):
        self.devices = tuple(devices)
        self.placements = tuple(placements)
        self.kinds = dict(kinds)
        self.optimizer_bytes_per_device = {
            **dict.fromkeys(self.devices, 0),
            **(optimizer_bytes_per_device or {}),
        }

    @property
    def bytes_per_device(self) -> dict[str, int]:
        totals = dict.fromkeys(self.devices, 0)
        for p in self.placements:
            totals[p.device] = totals.get(p.device, 0) + p.bytes
        return totals

    @property
    def total_bytes(self) -> int:
        return sum(p.bytes for p in self.placements)

    def __str__(self) -> str:
        rows = [
            (p.layer, p.kind, p.path, str(p.shape), p.device, str(p.bytes)) for p in self.placements
        ]
        header = ("layer", "split", "variable", "shape", "device", "bytes")
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = [f"Tensor-parallel plan over {len(self.devices)} devices:"]
        for row in [header, *rows]:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        total = max(self.total_bytes, 1)
        lines.append("Bytes per device:")
        for device, count in self.bytes_per_device.items():
            lines.append(f"  {device}: {count} ({100 * count / total:.1f}% of {self.total_bytes})")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Plan devices={list(self.devices)} bytes_per_device={self.bytes_per_device}>"


def describe(
    layers: Sequence[Any],
    kinds: Mapping[str, str],
    devices: Sequence[str],
    optimizer_variables: Sequence[Any] = (),
) -> Plan:
    """The `Plan` of `layers` (and of the optimizer's variables) as their
    variables are actually placed."""
    placements = []
    for layer in layers:
        for variable in layer.weights:
            placements.append(
                Placement(
                    layer=layer.name,
                    kind=kinds.get(layer.name, "whole"),
                    path=variable.path,
                    shape=tuple(variable.shape),
                    device=device_of(variable, devices),
                    bytes=variable_bytes(variable),
                )
            )
    optimizer: dict[str, int] = {}
    for variable in optimizer_variables:
        device = device_of(variable, devices)
        optimizer[device] = optimizer.get(device, 0) + variable_bytes(variable)
    return Plan(devices, placements, kinds, optimizer)


def device_of(variable, devices: Sequence[str]) -> str:
    """Which of `devices` holds `variable` (its full device name if none)."""
    from keras_distrib import devices as devices_lib

    placed = devices_lib.normalize(getattr(variable, "value", variable).device)
    for device in devices:
        if placed.endswith(device):
            return device
    return placed
