"""The multi-host test bed's pieces that need no namespace: its ssh
stand-in's command line, its names (tests/netns_hosts.py; the bed itself
runs in tests/distributed)."""

import pytest

from netns_hosts import SUBNET, TestBed, burst_bytes, ssh_words


def test_ssh_words_read_options_before_and_after_the_host():
    # As horovodrun writes it: options, the host, more options, the command.
    argv = [
        "-o",
        "PasswordAuthentication=no",
        "-o",
        "StrictHostKeyChecking=no",
        "10.77.0.2",
        "-o",
        "ConnectTimeout=10",
        "cd",
        "/work",
        ">",
        "/dev/null",
        "2>&1",
        ";",
        "true",
    ]
    assert ssh_words(argv) == ("10.77.0.2", "cd /work > /dev/null 2>&1 ; true")
    # As the launcher's --ssh_command gives it: the host, one command word.
    assert ssh_words(["10.77.0.1", "cd /w && exec env A=1 python t.py"]) == (
        "10.77.0.1",
        "cd /w && exec env A=1 python t.py",
    )
    assert ssh_words(["-p", "22"]) == (None, "")
    # As the launcher's default --ssh_command asks a host whether it answers.
    assert ssh_words(["-o", "BatchMode=yes", "-tt", "10.77.0.2", "true"]) == ("10.77.0.2", "true")


def test_a_bed_names_its_hosts_by_address_under_its_own_prefix():
    a, b = TestBed(2), TestBed(2)
    assert a.addresses == b.addresses == [f"{SUBNET}.1", f"{SUBNET}.2"]
    assert a.prefix != b.prefix  # two beds at once do not share namespaces
    assert a.namespace(1) == f"{a.prefix}-{SUBNET}.2"
    assert a.hosts_flag(2) == f"{SUBNET}.1:2,{SUBNET}.2:2"
    assert a.ssh_command.endswith(f"netns_hosts.py exec {a.prefix}")


def test_a_links_token_bucket_holds_a_millisecond_of_its_rate():
    assert burst_bytes("1gbit") == 125_000
    assert burst_bytes("10gbit") == 1_250_000
    assert burst_bytes("10mbit") == 16384  # the least
    with pytest.raises(ValueError, match="use kbit, mbit or gbit"):
        burst_bytes("1gbps")
