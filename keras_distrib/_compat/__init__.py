"""Every private TensorFlow / Keras name keras_distrib relies on, in one place.

One module per thing wrapped:

- `keras_trainer`: Keras's Trainer / Model hooks, the build's input,
  compile internals, the compiled loss and its trackers, a loss
  function's arguments, `fit`'s validation call;
- `keras_layers`: layers and Functional graphs (their nodes), added
  losses, a layer's own metrics, saving under Keras's public class name,
  a built layer's variables and tracker;
- `keras_backend`: Keras variables on TensorFlow, the stateless scope,
  the backend's seed draws;
- `keras_optimizer`: Keras's TensorFlow optimizer internals;
- `keras_callbacks`: BackupAndRestore's paths and progress, TensorBoard's
  profiling;
- `tf_distribute`: tf.distribute scopes, merge calls, collectives,
  Slurm, strategy options, DistributedDataset;
- `tf_variables`: ShardedVariable, a variable's strategy, distributed
  variables plain Keras code can use;
- `tf_data`: tf.data graph rewriting, batch size, auto-sharding;
- `versions`: the tested versions, the warning on others, the probe.

Each item says why no public API does the job and on which versions it was
verified. `setup.cfg` bounds TensorFlow and Keras to the minor versions the
test suite ran on (`TESTED`); importing keras_distrib's TensorFlow parts on
any other version warns once, naming it.

Each module declares the private names it uses in `PRIVATE`
(`"module.path:Dotted.attribute"`), and importing this package checks them
all (`check_private`): a name the installed TensorFlow or Keras lacks fails
the import in one line, naming it, the installed versions and the tested
ones, instead of failing somewhere inside a training step. The modules
import TensorFlow and Keras before the check runs, and every module the
declarations name is one those imports have already loaded, so the probe
imports nothing more: it reads attributes and, for instance attributes,
the owning class's code (see `versions`; about a millisecond). It runs
where this package is first imported: with `keras_distrib.model` (once
Keras is imported), or at `import keras_distrib` in a process of a
configured cluster (`runtime.bootstrap`). The launcher and a plain
`import keras_distrib` never import it.

`check_hooks()` fails in one line when a Keras method that
`DistributedModel` overrides or calls is gone from the trainer class (an
override of a method Keras no longer calls would otherwise be silently
skipped).

The rest of keras_distrib uses no private TensorFlow / Keras name but
these Trainer methods (`KERAS_HOOKS`): tests/unit/test_compat_fence.py
reads the other modules' sources and fails on any private name they use
that keras_distrib does not define itself, and
tests/integration/test_compat.py on a private name of ours that a Keras
or TensorFlow class we subclass has too.

Verified on: TensorFlow 2.21.0 (tensorflow-cpu), Keras 3.15.1, Python 3.11.
"""

from __future__ import annotations

from keras_distrib._compat import versions
from keras_distrib._compat import keras_backend
from keras_distrib._compat import keras_callbacks
from keras_distrib._compat import keras_layers
from keras_distrib._compat import keras_optimizer
from keras_distrib._compat import keras_trainer
from keras_distrib._compat import tf_data
from keras_distrib._compat import tf_distribute
from keras_distrib._compat import tf_variables
from keras_distrib._compat.keras_backend import (
    add_through_tensorflow,
    backing_variable,
    remat_in_graphs,
    replace_variable_value,
    set_variable_value,
    variable_value,
    variables_made_at_once,
    wrap_backend_draw_seed,
)
from keras_distrib._compat.keras_callbacks import (
    ProfileElsewhere,
    backup_paths,
    redirect_backup_writes,
    show_backup_progress,
    tensorboard_profiles,
)
from keras_distrib._compat.keras_layers import (
    added_losses_per_thread,
    all_layers,
    call_has_training_arg,
    clone_functional,
    direct_layers,
    drop_whole_layer_variables,
    functional_arguments,
    functional_class,
    functional_graph,
    graph_of,
    inlined_functional,
    is_functional_call,
    layer_state_unlocked,
    layer_tensors,
    name_damaged_keras_files,
    node_lists,
    own_metrics,
    save_as_keras_model,
    take_added_losses,
    whole_layer_variables,
)
from keras_distrib._compat.keras_optimizer import (
    apply_loss_scaled,
    clip_gradients,
    clipping_off,
    decide_weight_decay_by,
    learning_rate_or_schedule,
    moving_averages,
    optimizer_slot_prefix,
    optimizer_strategy,
    optimizer_trainable_variables,
    reindex_optimizer,
    route_sharded_updates,
    set_optimizer_strategy,
    sum_gradients_across_replicas,
    variable_key,
    wrap_optimizer_all_reduce,
)
from keras_distrib._compat.keras_trainer import (
    KERAS_HOOKS,
    EmptyInput,
    absent_as_none,
    build_forward,
    build_source,
    captured_output_losses,
    check_hooks,
    class_weight_as_sample_weight,
    compile_arguments,
    compute_loss,
    epoch_iterator,
    hide_distribute_strategy,
    jit_compile_off,
    loss_function_arguments,
    loss_tracker,
    output_loss_metrics,
    train_validation_split,
    unscaled_losses_where,
    validation_in_fit,
)
from keras_distrib._compat.tf_data import (
    UnseededShuffleError,
    agree_on_shuffles,
    dataset_ops,
    shard_by_file,
    static_batch_size,
)
from keras_distrib._compat.tf_distribute import (
    abort_collective_ops,
    configure_coordination_service,
    communication_options,
    cross_device_ops,
    gather,
    outside_strategy_scopes,
    rekey_collectives,
    reuse_collective_server,
    set_collective_key_base,
    set_variable_partitioner,
    slurm_hosts_and_tasks,
    slurm_worker_addresses,
    tensorflow_started,
    undistributed,
    updates_in_cross_replica_context,
    variable_partitioner,
    without_default_strategy_creator,
)
from keras_distrib._compat.tf_variables import (
    convert_sharded_variables_to_numpy,
    make_plain_usable,
    plain_usable_creator,
    sharded_variable_class,
    variable_strategy,
)
from keras_distrib._compat.versions import TESTED, warn_if_untested

# The modules whose `PRIVATE` declarations the import checks.
MODULES = (
    keras_trainer,
    keras_layers,
    keras_backend,
    keras_optimizer,
    keras_callbacks,
    tf_distribute,
    tf_variables,
    tf_data,
)


def check_private() -> None:
    """One-line ImportError naming the first declared private name the
    installed TensorFlow/Keras lack (run at the import of this package)."""
    versions.check_private(MODULES)


check_private()
