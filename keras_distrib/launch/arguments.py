"""The launcher's command line read: its argv split from the script's, and
its parsed flags as a `LaunchConfig`.

The flags are those `keras_distrib.launch.cli` defines (absl's `FLAGS`);
`cli.parse_flags` splits argv with `split_argv` before absl parses it, and
`cli.main` builds the job's configuration with `config_from_flags`.
"""

from __future__ import annotations

from typing import Sequence

from absl import flags

from keras_distrib.launch.config import LaunchConfig, LaunchError, check_config

USAGE = (
    "keras-distrib launch -n N [--hosts H1:S1,H2:S2] script.py [script args...]; "
    "with parameter servers: keras-distrib launch --workers N --ps M script.py ..."
)
FLAGS = flags.FLAGS


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Splits argv into the launcher's part and `[script, *script_args]`.

    absl would parse the script's own flags (`train.py --epochs 3`) as the
    launcher's, so the script and what follows are cut off before absl
    sees the command line. The script is the second positional token (the
    first is the subcommand), or whatever follows `--`. The launcher's own
    flags may be spelled with dashes; they come back with underscores.

    Example:

    ```python
    split_argv(["kd", "launch", "-n", "2", "--max-restarts", "1", "t.py", "-n", "5"])
    # (["kd", "launch", "-n", "2", "--max_restarts", "1"], ["t.py", "-n", "5"])
    ```
    """
    head, have_subcommand, i = [argv[0]], False, 1
    while i < len(argv):
        token = argv[i]
        if token == "--":
            rest = list(argv[i + 1 :])
            if not have_subcommand and rest:
                head.append(rest.pop(0))
            return head, rest
        if token.startswith("-") and len(token) > 1:
            token = _underscored(token)
            head.append(token)
            if _takes_value(token) and i + 1 < len(argv):
                i += 1
                head.append(argv[i])
        elif not have_subcommand:
            head.append(token)
            have_subcommand = True
        else:
            return head, list(argv[i:])
        i += 1
    return head, []


def _underscored(token: str) -> str:
    """`--max-restarts=2` as `--max_restarts=2`, for a flag of ours; else `token`.

    Our flags are spelled with underscores (absl's way), but many tools
    use dashes; both work. Unknown names are left for absl to report.
    """
    if not token.startswith("--") or "-" not in token[2:].split("=", 1)[0]:
        return token
    name, sep, value = token[2:].partition("=")
    flag = name.replace("-", "_")
    return f"--{flag}{sep}{value}" if flag in FLAGS else token


def _takes_value(token: str) -> bool:
    """True for `--flag` / `-f` naming a non-boolean flag without `=value`."""
    if "=" in token:
        return False
    name = token.lstrip("-")
    try:
        return not FLAGS[name].boolean
    except KeyError:  # unknown or --noflag: absl reports it, we do not guess
        return False


def config_from_flags(positional: Sequence[str]) -> LaunchConfig:
    """Builds and checks a `LaunchConfig` from parsed FLAGS and `[script, *args]`."""
    if not positional:
        raise LaunchError(f"missing the script to run; usage: {USAGE}")
    config = LaunchConfig(
        nproc=_nproc(),
        script=positional[0],
        script_args=tuple(positional[1:]),
        hosts=tuple(FLAGS.hosts),
        port_base=FLAGS.port_base,
        bind=FLAGS.bind,
        backend=FLAGS.backend,
        output_dir=FLAGS.output_dir,
        ssh=FLAGS.ssh,
        ssh_command=FLAGS.ssh_command,
        timeout=FLAGS.timeout,
        tail_lines=FLAGS.tail_lines,
        max_restarts=FLAGS.max_restarts,
        min_workers=FLAGS.min_workers,
        elastic_grace=FLAGS.elastic_grace,
        grace_seconds=FLAGS.grace_seconds,
        straggler_warning=FLAGS.straggler_warning,
        stall_warning=FLAGS.stall_warning,
        gpus_per_worker=FLAGS.gpus_per_worker,
        ps=FLAGS.ps,
        ps_tasks_run_script=FLAGS.ps_tasks_run_script,
    )
    check_config(config)
    return config


def _nproc() -> int:
    """-n and --workers, one number: they are the same flag by two names."""
    nproc, workers = FLAGS.nproc, FLAGS.workers
    if nproc is not None and workers is not None and nproc != workers:
        raise LaunchError(
            f"-n {nproc} and --workers {workers} disagree; they are the same "
            "setting, give one of them."
        )
    if nproc is None and workers is None:
        if FLAGS.ps:
            raise LaunchError(
                "--workers is required with --ps, e.g. "
                "`keras-distrib launch --workers 2 --ps 1 train.py`."
            )
        raise LaunchError("-n/--nproc is required, e.g. `keras-distrib launch -n 2 train.py`.")
    return int(nproc if nproc is not None else workers)
