"""The reader driven in this process (tests/test_faults.py, tests/test_reader.py):
real arenas, sockets and lanes; the test plays compute (Fetch, Release) and
the reader's loop (hands finished reads back), and may hold or fail a read
with the directio fault hook. Its fixtures (`model`, `harness`) are in
tests/conftest.py."""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import numpy as np
import zmq

from moe_pipe.procs.children import Launch
from moe_pipe.procs.reader import Reader
from moe_pipe.procs.resources import Resources
from moe_pipe.shared.config import load_config
from moe_pipe.shared.experts import directio
from moe_pipe.shared.experts.placement import placement_for
from moe_pipe.shared.gguf.model_file import open_model
from moe_pipe.shared.makemodel.default_model import default_model_path
from moe_pipe.shared.wire import ipc
from moe_pipe.shared.wire import messages as m


class Harness:
    """One Reader over real arenas and sockets, driven by hand: the test plays
    compute (Fetch, Release) and the loop (hands finished reads back)."""

    def __init__(self, model: Path, cache_mb: float = 1.2, io_threads: int = 2, hot_set: str = "", **overrides):
        over = {"model.path": str(model), "cache.cache_mb": cache_mb, "io.io_threads": io_threads, **overrides}
        self.cfg = load_config(None, over)
        self.res = Resources.create(self.cfg, model)
        self.ctx = zmq.Context()
        self.ready = ipc.bind(self.ctx, self.res.rt.endpoints, "ready")
        self.res_model = model
        self.reader = Reader(self.cfg, Launch(self.cfg, self.res, model, model.stem, hot_set=hot_set).facts({}), self.ctx)
        # Expected bytes come from the pristine original: a mapping of the copy would
        # SIGBUS once a test truncates it.
        self.mf = open_model(default_model_path())
        self.req = 0

    def fetch(self, layer: int, experts, guesses=(), guess_layer: int = 0, resident=(), released=()) -> int:
        self.req += 1
        self.reader.on_fetch(
            m.Fetch(self.req, layer, tuple(experts), tuple(resident), tuple(released), guess_layer=guess_layer, guesses=tuple(guesses))
        )
        return self.req

    def land(self, timeout_s: float = 10) -> None:
        """The next finished read, handed to the reader as its loop would."""
        assert self.reader.done_in.poll(int(timeout_s * 1000)), "no read finished"
        self.reader.on_read_done(*self.reader.done_in.recv_pyobj())

    def answer(self, timeout_s: float = 5):
        msg = ipc.recv(self.ready, int(timeout_s * 1000), expect=(m.Ready, m.FetchFailed, m.Guessed))
        assert msg is not None, "the reader answered nothing"
        return msg

    def answer_limit(self, timeout_s: float = 5) -> m.CacheLimited:
        msg = ipc.recv(self.ready, int(timeout_s * 1000), expect=(m.CacheLimited,))
        assert msg is not None, "the reader did not answer the CacheLimit"
        return msg

    def answer_spares(self, timeout_s: float = 5) -> m.SpareSlabs:
        msg = ipc.recv(self.ready, int(timeout_s * 1000), expect=(m.SpareSlabs,))
        assert msg is not None, "the reader did not answer the Spares"
        return msg

    def visible(self, key) -> bool:
        """What compute sees: a published residency index entry."""
        return self.reader.index.slabs(key[0], [key[1]])[0] >= 0

    def assert_holds(self, key, slab: int) -> None:
        """Slab `slab` holds exactly the file's bytes of expert `key`."""
        lay = self.mf.layout.layers[key[0]]
        held = self.reader.arena.slab(slab)
        for part, (at, n) in zip(lay.parts, placement_for(lay.extents(key[1]), self.mf.layout.align).regions):
            want = np.asarray(self.mf.gguf.view(part.tensor.name)[key[1]]).reshape(-1).view(np.uint8)
            assert np.array_equal(held[at : at + n], want), (key, part.name)

    def close(self) -> None:
        self.reader.close()
        self.mf.close()
        self.ctx.destroy(linger=0)  # the reader's sockets too (its process would simply exit)
        self.res.close()


def hold_reads_of(h: Harness, key, fail: bool):
    """A fault hook that holds the reads of `key` until released, then fails them (EIO) or lets them go."""
    start = directio.aligned(h.mf.layout.expert_extents(*key)[0], h.mf.layout.align)[0]
    entered, release = threading.Event(), threading.Event()

    def hook(path, offset, length):
        if offset == start:
            entered.set()
            assert release.wait(30)
            if fail:
                raise OSError(errno.EIO, "Input/output error (test)")

    directio.set_fault_hook(hook)
    return entered, release
