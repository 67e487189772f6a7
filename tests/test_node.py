"""app/node.py: what a node container computes or checks besides training."""
from __future__ import annotations

import subprocess
import sys

import pytest

from app import node
from app.core.errors import UserError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("spec, present, nodes, expected", [
    ("", [], 2, (0, [])),                                   # a CPU host: no GPUs, no claim
    ("all", ["0", "1", "2", "3"], 2, (2, ["0", "1", "2", "3"])),
    ("", ["0", "1", "2", "3"], 4, (1, ["0", "1", "2", "3"])),
    ("2,3", ["0", "1", "2", "3"], 1, (2, ["2", "3"])),
    ("0,1,2,3", [], 2, (2, ["0", "1", "2", "3"])),           # named on a host without GPUs: how CI tests it
])
def test_gpu_plan(spec, present, nodes, expected):
    assert node.gpu_plan(spec, present, nodes) == expected


@pytest.mark.parametrize("spec, present, nodes, fragment", [
    ("0,1,2", [], 2, "3 GPUs do not split evenly over 2 nodes"),
    ("0,1", [], 3, "3 nodes on this host need at least one GPU each, GPUS has 2"),
    ("0,x", [], 1, "GPUS must be distinct GPU indices"),
    ("1,1", [], 1, "GPUS must be distinct GPU indices"),
    ("4", ["0", "1"], 1, "GPUS names GPU 4, but this host has GPUs 0, 1"),
    ("0", [], 0, "NODES must be a positive integer"),
])
def test_gpu_plan_refuses_what_cannot_work(spec, present, nodes, fragment):
    with pytest.raises(UserError, match=fragment):
        node.gpu_plan(spec, present, nodes)


def test_gpus_command_prints_the_plan(monkeypatch, capsys):
    monkeypatch.setattr(node, "host_gpus", lambda: [])
    monkeypatch.setenv("GPUS", "0,1,2,3")
    monkeypatch.setenv("NODES", "2")
    assert node.main(["gpus"]) == 0
    assert capsys.readouterr().out.split() == ["2", "0", "1", "2", "3"]
    monkeypatch.setenv("NODES", "3")
    assert node.main(["gpus"]) == 2
    assert capsys.readouterr().err.startswith("error: 4 GPUs do not split evenly over 3 nodes")


@pytest.mark.parametrize("count, nodes, expected", [
    (16, 1, 0),         # a node alone: every core, nothing to claim
    (16, 2, 8), (16, 3, 5), (2, 2, 1),
    (2, 3, 0),          # more nodes than cores: none claims, each process takes its share of every core
])
def test_cpu_plan(count, nodes, expected):
    assert node.cpu_plan(list(range(count)), nodes) == expected


def test_cpus_command_prints_the_plan_and_refuses_a_bad_node_count(monkeypatch, capsys):
    monkeypatch.setattr(node.os, "sched_getaffinity", lambda pid: {3, 1, 2, 0})
    monkeypatch.setenv("NODES", "2")
    assert node.main(["cpus"]) == 0
    assert capsys.readouterr().out.split() == ["2", "0", "1", "2", "3"]
    monkeypatch.setenv("NODES", "0")
    assert node.main(["cpus"]) == 2
    assert capsys.readouterr().err == "error: NODES must be a positive integer, got 0\n"


def test_interface_of_loopback():
    assert node.interface_of("127.0.0.1") == "lo"
    assert node.interface_of("127.0.0.1") is not None and node.interface_of("192.0.2.123") is None


def test_check_config_is_one_error_line(capsys):
    assert node.main(["check-config", "--epochs", "0"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --epochs must be positive, got 0\n"
    assert node.main(["check-config", "--epochs", "2"]) == 0


def test_unknown_command_is_one_error_line(capsys):
    assert node.main(["nonsense"]) == 2
    assert capsys.readouterr().err.startswith("error: usage: python -m app.node")


def test_the_store_listens_on_the_given_address_only():
    import socket
    import subprocess
    import sys

    from tests.helpers import REPO, clean_env, free_port

    port, lighthouse = free_port(), free_port()
    store = subprocess.Popen([sys.executable, "-m", "app.node", "store"], cwd=REPO, stdout=subprocess.PIPE,
                             env=clean_env(RDZV_BIND="127.0.0.3", RDZV_PORT=str(port),
                                           LIGHTHOUSE_PORT=str(lighthouse)), text=True)
    try:
        assert store.stdout.readline().strip() == f"[rdzv-store] TCPStore listening on 127.0.0.3:{port}"
        assert store.stdout.readline().strip() == \
            f"[rdzv-store] torchft Lighthouse listening on 127.0.0.3:{lighthouse}"
        for listening in (port, lighthouse):
            socket.create_connection(("127.0.0.3", listening), 5).close()
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", listening), 5)
    finally:
        store.terminate()
        assert store.wait(timeout=30) == 0          # SIGTERM ends it cleanly


def test_the_store_serves_without_torchft(tmp_path):
    """A GPU machine's own Python has no torchft: the store still serves the rendezvous and inplace's
    groups, and says why there is no Lighthouse (it once died at start, and inplace's nodes waited
    30 s for it)."""
    import socket
    import subprocess
    import sys

    from tests.helpers import REPO, clean_env, free_port

    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "class NoTorchft:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'torchft':\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, NoTorchft())\n")
    port = free_port()
    store = subprocess.Popen([sys.executable, "-m", "app.node", "store"], cwd=REPO, stdout=subprocess.PIPE,
                             env=clean_env(RDZV_BIND="127.0.0.1", RDZV_PORT=str(port), LIGHTHOUSE_PORT=str(free_port()),
                                           PYTHONPATH=f"{tmp_path}:{REPO}"), text=True)
    try:
        assert store.stdout.readline().strip() == f"[rdzv-store] TCPStore listening on 127.0.0.1:{port}"
        assert store.stdout.readline().strip() == \
            "[rdzv-store] no torchft Lighthouse: torchft is not installed (--ft torchft needs it)"
        socket.create_connection(("127.0.0.1", port), 5).close()
        assert store.poll() is None
    finally:
        store.terminate()
        assert store.wait(timeout=30) == 0


def test_the_object_stores_health_is_its_bucket_answering_then_its_port(object_store, tmp_path, monkeypatch, capsys):
    """The objects service's healthcheck: unhealthy while the bucket does not answer to the identity
    (nothing listening, the identity refused); healthy once it does; from then on the port alone."""
    from app.cluster.object_server import free_ports     # below 55531, as the store's ports must be

    answered = str(tmp_path / "answered")
    monkeypatch.setenv("OBJECTS_BIND", "127.0.0.1")
    monkeypatch.setenv("OBJECTS_BUCKET", object_store.BUCKET)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", object_store.KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", object_store.SECRET)
    monkeypatch.setenv("OBJECTS_PORT", str(free_ports(1)))                # nothing there
    assert node.objects_health(answered) == 1
    assert "does not answer yet: EndpointConnectionError" in capsys.readouterr().out

    monkeypatch.setenv("OBJECTS_PORT", str(object_store.port))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-stores-secret")
    assert node.objects_health(answered) == 1 and not (tmp_path / "answered").exists()
    assert "does not answer yet: ClientError" in capsys.readouterr().out

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", object_store.SECRET)
    assert node.objects_health(answered) == 0 and (tmp_path / "answered").exists()

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-stores-secret")   # no longer asked: the port is enough
    assert node.objects_health(answered) == 0
    monkeypatch.setenv("OBJECTS_PORT", str(free_ports(1)))
    assert node.objects_health(answered) == 1
    assert "the object store does not answer on 127.0.0.1:" in capsys.readouterr().out


def test_a_bad_object_store_port_is_one_error_line(monkeypatch, capsys):
    monkeypatch.setenv("OBJECTS_PORT", "60000")
    assert node.main(["objects-health"]) == 2
    assert capsys.readouterr().err == "error: OBJECTS_PORT must be a port number below 55531, got '60000'\n"


def test_an_object_store_without_openssl_is_one_error_line_and_writes_nothing(monkeypatch, tmp_path, capsys):
    """Each start makes the store's certificate with openssl (app/cluster/object_server.py)."""
    monkeypatch.setenv("PATH", str(tmp_path / "no-openssl-here"))
    monkeypatch.setenv("OBJECTS_DIR", str(tmp_path))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.delenv("OBJECTS_PORT", raising=False)
    assert node.main(["objects"]) == 2
    assert capsys.readouterr().err == ("error: the object store needs the `openssl` command to make its "
                                       "certificate: install openssl (the image has it)\n")
    assert not any(tmp_path.iterdir())
