"""`strategy="tensor_parallel"`: each large layer's kernel split over devices.

* `strategy`: the `TensorParallel` strategy (laying the layers out over
  the devices, the step, whole weights);
* `split_layer`: one split Dense / Embedding (`SplitLayer`): its shards,
  their whole values, saving;
* `split_forward`: a split layer's forward pass, the collectives between
  split layers (gather, sum on the first device);
* `optimizer`: the optimizer on split variables: its files, `clipnorm` over
  a split variable's joint norm, the optimizers refused;
* `layout`: which layers are split and how (column, row), and where each
  variable ended up.
"""
