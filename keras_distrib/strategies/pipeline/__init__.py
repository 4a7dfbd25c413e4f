"""`strategy="pipeline"`: the model's layers in stages on several devices.

* `strategy`: the `Pipeline` strategy (stages as sub-models, micro-batches);
* `schedule`: pure Python: the cut into balanced stages and the order of
  forward and backward passes (GPipe, 1F1B).
"""
