"""`strategy="tensor_parallel"`: each large layer's kernel split over devices.

* `strategy`: the `TensorParallel` strategy (splitting, the collectives
  between split layers);
* `layout`: which layers are split and how (column, row), and where each
  variable ended up.
"""
