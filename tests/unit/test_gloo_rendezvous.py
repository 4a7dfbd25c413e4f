"""How `multi_worker`'s workers join Horovod's Gloo without horovodrun
(keras_distrib/collectives/gloo_rendezvous.py): their places as
horovodrun assigns them, the variables `hvd.init()` reads, and the
chief's store. Training on Gloo: tests/distributed/test_gloo.py."""

import json
import os
import urllib.request

import pytest

from keras_distrib.collectives import gloo_rendezvous

hosts_lib = pytest.importorskip("horovod.runner.common.util.hosts")


@pytest.mark.parametrize(
    "hosts",
    [["a", "a", "b", "b"], ["a", "b"], ["a", "a", "a", "b"], ["b", "a", "a"], ["a"]],
)
def test_places_are_horovodruns(hosts):
    """Horovod's own assignment of the same slots is the oracle (ranks
    grouped by host, as horovodrun numbers them)."""
    order = list(dict.fromkeys(hosts))
    spec = ",".join(f"{h}:{hosts.count(h)}" for h in order)
    theirs = hosts_lib.get_host_assignments(hosts_lib.parse_hosts(spec), len(hosts))
    by_host = sorted(range(len(hosts)), key=lambda r: order.index(hosts[r]))
    ours = gloo_rendezvous.places(hosts)
    for slot, rank in zip(theirs, by_host):
        assert slot.hostname == hosts[rank]
        assert ours[rank] == dict(
            local_rank=slot.local_rank,
            local_size=slot.local_size,
            cross_rank=slot.cross_rank,
            cross_size=slot.cross_size,
        ), (hosts, rank)


def test_the_environment_names_the_place_the_store_and_the_timeout():
    env = gloo_rendezvous.environment(
        2, ["a", "a", "b", "b"], ("10.0.0.1", 4321), "eth1", timeout=299.5
    )
    assert env == {
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1",
        "HOROVOD_GLOO_RENDEZVOUS_PORT": "4321",
        "HOROVOD_GLOO_TIMEOUT_SECONDS": "300",
        "HOROVOD_GLOO_IFACE": "eth1",
        "HOROVOD_HOSTNAME": "b",
        "HOROVOD_RANK": "2",
        "HOROVOD_SIZE": "4",
        "HOROVOD_LOCAL_RANK": "0",
        "HOROVOD_LOCAL_SIZE": "2",
        "HOROVOD_CROSS_RANK": "1",
        "HOROVOD_CROSS_SIZE": "2",
    }
    unbounded = gloo_rendezvous.environment(0, ["a"], ("h", 1), None, timeout=None)
    assert "HOROVOD_GLOO_IFACE" not in unbounded
    assert int(unbounded["HOROVOD_GLOO_TIMEOUT_SECONDS"]) >= 365 * 24 * 3600


def test_the_environment_is_the_processs_own_again_after(monkeypatch):
    monkeypatch.setenv("HOROVOD_RANK", "7")
    monkeypatch.delenv("HOROVOD_SIZE", raising=False)
    with gloo_rendezvous.environ({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2"}):
        assert (os.environ["HOROVOD_RANK"], os.environ["HOROVOD_SIZE"]) == ("1", "2")
    assert os.environ["HOROVOD_RANK"] == "7"
    assert "HOROVOD_SIZE" not in os.environ


def test_the_loopback_address_is_on_the_loopback_interface():
    assert gloo_rendezvous.interface_of("127.0.0.1") == "lo"
    assert gloo_rendezvous.interface_of("") is None
    assert gloo_rendezvous.interface_of("192.0.2.77") is None  # TEST-NET-1: no one's


def test_the_store_serves_until_stopped():
    store = gloo_rendezvous.Rendezvous("127.0.0.1", ["a", "b"])
    url = f"http://127.0.0.1:{store.port}/global/rank_0"
    try:
        assert gloo_rendezvous.reachable(("127.0.0.1", store.port), 5)
        put = urllib.request.Request(url, data=json.dumps([1]).encode(), method="PUT")
        assert urllib.request.urlopen(put, timeout=5).status == 200
        assert json.loads(urllib.request.urlopen(url, timeout=5).read()) == [1]
    finally:
        store.stop()
    assert not gloo_rendezvous.reachable(("127.0.0.1", store.port), 1)
