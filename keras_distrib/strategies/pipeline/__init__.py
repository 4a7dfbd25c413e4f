"""`strategy="pipeline"`: the model's layers in stages on several devices.

* `strategy`: the `Pipeline` strategy (placement, input, the test and
  predict steps over micro-batches);
* `stages`: the model cut into stage sub-models (`Stages`);
* `train_step`: the training step's scheduled passes, then one update;
* `plan`: `PipelinePlan`, where the layers and variables live;
* `schedule`: pure Python: the cut into balanced stages and the order of
  forward and backward passes (GPipe, 1F1B).
"""
