"""Runtime dir, endpoints and links: real sockets, a real second process, nothing left behind."""

from __future__ import annotations

import multiprocessing
import os
import stat
import threading
import time

import pytest
import zmq

from moe_pipe.shared.wire import ipc
from moe_pipe.shared.wire import messages as m
from moe_pipe.shared.wire.ipc import RuntimeDir, RuntimeDirError


@pytest.fixture
def base(tmp_path):
    b = tmp_path / "rt"
    yield b


def mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


# ---------------------------------------------------------------- runtime dir


def test_create_is_private_and_named_by_pid(base):
    rd = RuntimeDir.create(base)
    assert rd.path == base / str(os.getpid())
    assert mode(rd.path) == 0o700 and mode(base) == 0o700
    assert rd.is_live()
    assert RuntimeDir.find_live(base) == [rd]
    rd.remove()


def test_default_base_follows_xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    rd = RuntimeDir.create()
    assert rd.path.parent == tmp_path / "moe-pipe"
    rd.remove()
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert ipc._base_dir() == ipc.Path(f"/tmp/moe-pipe-{os.getuid()}")


def test_refuses_loose_permissions(base):
    base.mkdir(mode=0o755)
    os.chmod(base, 0o755)
    with pytest.raises(RuntimeDirError, match="0755"):
        RuntimeDir.create(base)


def test_refuses_a_symlinked_base(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(RuntimeDirError, match="symlink"):
        RuntimeDir.create(tmp_path / "link")


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to chown a dir to another user")
def test_refuses_another_users_dir(base):
    base.mkdir(mode=0o700)
    os.chown(base, 65534, 65534)
    with pytest.raises(RuntimeDirError, match="owned by uid 65534"):
        RuntimeDir.create(base)


def test_refuses_a_live_owner(base):
    rd = RuntimeDir.create(base)
    with pytest.raises(RuntimeDirError, match="live"):
        RuntimeDir.create(base)
    rd.remove()


def _exit_now():
    pass


@pytest.mark.integration
def test_stale_dirs_are_reclaimed_live_ones_kept(base):
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_exit_now)
    child.start()
    dead = RuntimeDir.create(base, pid=child.pid)  # recorded while the child runs
    child.join()
    (dead.path / "fetch.sock").touch()  # a socket file its owner left behind
    live = RuntimeDir.create(base)
    reused = RuntimeDir.create(base, pid=os.getppid())  # a live pid, but not the process that made it
    (reused.path / "owner").write_text(f"{os.getppid()} 12.5\n")
    assert not dead.is_live() and not reused.is_live() and live.is_live()
    assert sorted(RuntimeDir.reclaim_stale(base)) == sorted([dead.path, reused.path])
    assert [d.path for d in RuntimeDir.existing(base)] == [live.path]
    live.remove()


def test_create_reclaims_its_own_stale_pid(base):
    stale = base / str(os.getpid())
    base.mkdir(mode=0o700)
    stale.mkdir(mode=0o700)
    (stale / "owner").write_text(f"{os.getpid()} 1.0\n")  # a former process with our pid
    (stale / "control.sock").touch()
    rd = RuntimeDir.create(base)
    assert not (rd.path / "control.sock").exists()
    rd.remove()


def test_remove_leaves_nothing(base):
    rd = RuntimeDir.create(base)
    ep = rd.endpoints
    with ipc.context() as ctx:
        socks = [ipc.bind(ctx, ep, name) for name in ipc.LINKS]
        assert all(p.exists() for p in ep.socket_files())
        for s in socks:
            s.close()
    rd.remove()
    assert not rd.path.exists()
    assert not base.exists()  # the base went too, being empty
    rd.remove()  # idempotent


def test_socket_path_limit(tmp_path):
    with pytest.raises(RuntimeDirError, match="108|107"):
        ipc.Endpoints(tmp_path / ("x" * 100))


def test_endpoints_declared_once():
    ep = ipc.Endpoints(ipc.Path("/run/x"))
    assert ep.fetch == "ipc:///run/x/fetch.sock"
    assert ep.telemetry_pub == "ipc:///run/x/telemetry-pub.sock"
    assert {ep.address(n) for n in ipc.LINKS} == {ep.fetch, ep.ready, ep.telemetry_in, ep.telemetry_pub, ep.control, ep.requests, ep.tokens}
    with pytest.raises(KeyError):
        ep.address("nope")


# ---------------------------------------------------------- two processes


def _fake_reader(runtime_dir: str) -> None:
    """Binds fetch, answers one Ready per expert, stops on Shutdown."""
    ep = ipc.Endpoints(ipc.Path(runtime_dir))
    with ipc.context() as ctx:
        fetch = ipc.bind(ctx, ep, "fetch")
        ready = ipc.connect(ctx, ep, "ready")
        try:
            while True:
                try:
                    msg = ipc.recv(fetch, 10_000, expect=(m.Fetch, m.Release, m.Shutdown))
                except m.ProtocolError:
                    ipc.send(ready, m.FetchFailed(0, 0, 0, m.Code.BAD_MESSAGE, "junk"))
                    continue
                if msg is None or isinstance(msg, m.Shutdown):
                    return
                if isinstance(msg, m.Fetch):
                    for slab, e in enumerate(msg.experts):
                        ipc.send(ready, m.Ready(msg.req_id, msg.layer, e, slab, ((0, 64), (4096, 64)), e % 2 == 0, 1000))
        finally:
            fetch.close()
            ready.close()


@pytest.mark.integration
def test_push_pull_between_processes(base):
    rd = RuntimeDir.create(base)
    ep = rd.endpoints
    child = multiprocessing.get_context("spawn").Process(target=_fake_reader, args=(str(rd.path),))
    try:
        with ipc.context() as ctx:
            ready = ipc.bind(ctx, ep, "ready")
            fetch = ipc.connect(ctx, ep, "fetch")  # before the reader exists: frames wait
            ipc.send(fetch, m.Fetch(req_id=5, layer=3, experts=(7, 2, 9)))
            child.start()
            got = [ipc.recv(ready, 30_000, expect=(m.Ready,)) for _ in range(3)]
            assert [r.expert for r in got] == [7, 2, 9]
            assert got[0] == m.Ready(5, 3, 7, 0, ((0, 64), (4096, 64)), False, 1000)
            fetch.send(b"\x93junk")  # a malformed frame is answered, not fatal
            failed = ipc.recv(ready, 30_000)
            assert isinstance(failed, m.FetchFailed) and failed.code == "bad_message"
            ipc.send(fetch, m.Shutdown("done"))
            child.join(30)
            assert child.exitcode == 0
            ready.close()
            fetch.close()
    finally:
        if child.is_alive():
            child.kill()
        rd.remove()
    assert not base.exists()


def test_router_dealer_control_round_trip(base):
    rd = RuntimeDir.create(base)
    with ipc.context() as ctx:
        server = ipc.bind(ctx, rd.endpoints, "control")
        client = ipc.connect(ctx, rd.endpoints, "control")
        ipc.send(client, m.Command("status", {"verbose": True}))
        envelope, cmd = ipc.recv_routed(server, 5_000, expect=(m.Command,))
        assert cmd == m.Command("status", {"verbose": True}) and len(envelope) == 1
        ipc.send(server, m.Status.success(processes=[]), envelope=envelope)
        assert ipc.recv(client, 5_000) == m.Status(True, "ok", "", {"processes": []})
        client.send(b"junk")  # a bad request can still be answered: the error carries the envelope
        with pytest.raises(m.ProtocolError) as err:
            ipc.recv_routed(server, 5_000)
        ipc.send(server, m.Status.failure(m.Code.BAD_MESSAGE, str(err.value)), envelope=err.value.envelope)
        assert ipc.recv(client, 5_000).code == "bad_message"
        server.close()
        client.close()
    rd.remove()


def test_recv_times_out_with_none(base):
    rd = RuntimeDir.create(base)
    with ipc.context() as ctx:
        s = ipc.bind(ctx, rd.endpoints, "ready")
        assert ipc.recv(s, 20) is None
        s.close()
    rd.remove()


def test_oversize_frame_never_reaches_the_receiver(base):
    rd = RuntimeDir.create(base)
    with ipc.context() as ctx:
        pull = ipc.bind(ctx, rd.endpoints, "fetch")
        push = ipc.connect(ctx, rd.endpoints, "fetch")
        push.send(b"\x00" * (m.MAX_FRAME_BYTES + 100))  # ZMQ_MAXMSGSIZE drops the connection
        assert ipc.recv(pull, 300) is None
        ipc.send(push, m.Release((1,), ((2, 3),)))  # the link reconnects and carries on
        assert ipc.recv(pull, 10_000) == m.Release((1,), ((2, 3),))
        pull.close()
        push.close()
    rd.remove()


def test_unexpected_kind_on_a_link(base):
    rd = RuntimeDir.create(base)
    with ipc.context() as ctx:
        pull = ipc.bind(ctx, rd.endpoints, "fetch")
        push = ipc.connect(ctx, rd.endpoints, "fetch")
        ipc.send(push, m.Shutdown())
        with pytest.raises(m.ProtocolError, match="unexpected Shutdown"):
            ipc.recv(pull, 5_000, expect=(m.Fetch,))
        pull.close()
        push.close()
    rd.remove()


# ------------------------------------------------------------- never blocks

RECORD = m.TokenRecord(1, 100.0, 80.0, 30.0, 1 << 20, 50.0, 5.0, 1.0, 0, 150.0)
N_SENDS = 5 * ipc.TELEMETRY_HWM


def _finishes(fn, limit_s=20.0):
    """Run fn in a thread; True if it returned within limit_s (a hang is the failure, not a speed)."""
    done = threading.Event()

    def run():
        fn()
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return done.wait(limit_s)


def test_telemetry_push_with_nobody_listening_drops_and_counts(base):
    rd = RuntimeDir.create(base)
    with ipc.context() as ctx:
        sock = ipc.connect(ctx, rd.endpoints, "telemetry_in")  # telemetry dead: nobody bound
        sender = ipc.DroppingSender(sock)
        assert _finishes(lambda: [sender.send(RECORD) for _ in range(N_SENDS)])
        assert sender.sent + sender.dropped == N_SENDS
        assert sender.dropped > 0
        assert sender.sent <= 2 * ipc.TELEMETRY_HWM  # bounded queue (HWM is per pipe, approximate)
        sock.close()
    rd.remove()


def test_telemetry_push_to_a_stuck_reader_drops_and_counts(base):
    rd = RuntimeDir.create(base)
    with ipc.context() as ctx:
        stuck = ipc.bind(ctx, rd.endpoints, "telemetry_in")  # bound, never reads
        sock = ipc.connect(ctx, rd.endpoints, "telemetry_in")
        sender = ipc.DroppingSender(sock)
        assert _finishes(lambda: [sender.send(RECORD) for _ in range(4 * N_SENDS)])
        assert sender.dropped > 0 and sender.sent + sender.dropped == 4 * N_SENDS
        sock.close()
        stuck.close()
    rd.remove()


def test_telemetry_pub_never_blocks(base):
    rd = RuntimeDir.create(base)
    with ipc.context() as ctx:
        pub = ipc.bind(ctx, rd.endpoints, "telemetry_pub")
        sender = ipc.DroppingSender(pub)
        assert _finishes(lambda: [sender.send(RECORD) for _ in range(N_SENDS)])  # nobody subscribed
        slow = ipc.connect(ctx, rd.endpoints, "telemetry_pub")  # subscribed, never reads
        time.sleep(0.2)  # let the subscription arrive, so the PUB queues for it
        assert _finishes(lambda: [sender.send(RECORD) for _ in range(4 * N_SENDS)])
        assert sender.dropped == 0  # PUB drops inside zmq, silently (see DroppingSender)
        n = 0
        while ipc.recv(slow, 50) is not None:
            n += 1
        assert 0 < n < 4 * N_SENDS  # the slow tail got a bounded slice, the rest was dropped
        pub.close()
        slow.close()
    rd.remove()


def test_reliable_send_times_out_instead_of_hanging(base):
    rd = RuntimeDir.create(base)
    with ipc.context() as ctx:
        sock = ipc.connect(ctx, rd.endpoints, "fetch")  # reader dead
        with pytest.raises(ipc.PeerTimeout):
            for i in range(ipc.RELIABLE_HWM * 3):
                ipc.send(sock, m.Release((i,)), timeout_ms=50)
        sock.close()
    rd.remove()


def test_context_closes_on_error():
    with pytest.raises(RuntimeError):
        with ipc.context() as ctx:
            ctx.socket(zmq.PUSH).setsockopt(zmq.LINGER, 0)
            raise RuntimeError("boom")
    assert ctx.closed
