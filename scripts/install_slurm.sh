#!/usr/bin/env bash
# What the Slurm test bed (tests/slurm_bed.py) needs: slurmctld, slurmd, the
# clients and munge, from Debian's packages, installed once per machine
# (nothing to do when they are there). As root with apt-get only; elsewhere
# it says in one line why not, and the bed's tests skip saying the same.
set -u
missing=()
for program in slurmctld slurmd sbatch munged; do
    command -v "$program" >/dev/null || missing+=("$program")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "install_slurm: not root with apt-get; the Slurm bed's tests will skip (missing: ${missing[*]})."
    exit 0
fi
packages=(slurmctld slurmd slurm-client munge)
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -q "${packages[@]}" >/dev/null 2>&1; then
    apt-get update -q >/dev/null 2>&1
    apt-get install -y -q "${packages[@]}" >/dev/null 2>&1 ||
        echo "install_slurm: apt-get could not install ${packages[*]}; the Slurm bed's tests will skip."
fi
exit 0
