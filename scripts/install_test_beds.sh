#!/usr/bin/env bash
# What the scheduler test beds need, from Debian's packages, installed once
# per machine (nothing to do when they are there): Slurm and munge for
# tests/slurm_bed.py (slurmctld, slurmd, the clients), Open MPI's mpirun for
# tests/distributed/test_mpirun.py, nftables' nft for the multi-host test
# bed's firewall (tests/netns_hosts.py). As root with apt-get only; elsewhere it
# says in one line why not, and those tests skip saying the same.
set -u
missing=()
for program in slurmctld slurmd sbatch munged mpirun nft; do
    command -v "$program" >/dev/null || missing+=("$program")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "install_test_beds: not root with apt-get; the Slurm, mpirun and firewall tests will skip (missing: ${missing[*]})."
    exit 0
fi
packages=(slurmctld slurmd slurm-client munge openmpi-bin nftables)
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -q "${packages[@]}" >/dev/null 2>&1; then
    apt-get update -q >/dev/null 2>&1
    apt-get install -y -q "${packages[@]}" >/dev/null 2>&1 ||
        echo "install_test_beds: apt-get could not install ${packages[*]}; the Slurm, mpirun and firewall tests will skip."
fi
exit 0
