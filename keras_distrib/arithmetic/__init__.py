"""Gradient and optimizer arithmetic: what the strategies and the model both
do to gradients and optimizers. It lies below the strategies and imports
none: a function that needs the model's strategy is handed it.

* `gradients`: arithmetic that keeps sparse gradients sparse
  (`scaled_gradient`, `summed_gradients`), the reduce ops, and
  `gather_sparse`, the strategies' reduction of sparse gradients;
* `compression`: the float types gradients may travel in (a
  `DistributedOptimizer`'s `compression`);
* `optimizer_tree`: the optimizers a compiled optimizer applies through;
* `reduction_switch`: Keras's own all-reduce of an optimizer switched off
  while the model's step applies the gradients it reduced;
* `optimizer_sharding`: the values of the data-parallel strategies'
  `optimizer_sharding` option, and its implementation, `optimizer_shards`
  (each replica builds and updates its part of every variable), with
  `optimizer_parts` (how a variable and its gradients split into parts)
  and `part_clipping` (Keras's clipping of whole gradients, done on their
  parts).

Importing this package imports none of them.
"""
