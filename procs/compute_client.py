"""The client's side of compute's wire, without the sockets: what the parent of
a run (procs/pipeline.py, blocking zmq) and the gateway (procs/gateway.py,
zmq.asyncio) both speak.

    client.generate(...)  -> Generate   to send on "requests" (a new req_id)
    client.accept(frame)  -> str | PromptProgress | Done | None   for each frame from "tokens" (a Progress is kept in .progress)
    client.cancel()       -> Cancel     for the request in flight (or `req_id`'s)

`accept` keeps who the compute is (the pid of its last Hello, and how many
Hellos came: a new one is a restarted compute) and drops what belongs to no
request in flight: the late Token or Done of a request that was given up. With
`parallel` > 1 up to that many requests are in flight at once (compute's
slots: procs/slots.py); each is in flight until its Done or `forget`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..shared.wire import messages as m

log = logging.getLogger("moe_pipe.compute_client")


class ComputeClient:
    def __init__(self, parallel: int = 1) -> None:
        self.pid: int | None = None  # of the compute that sent the last Hello
        self.hellos = 0
        self.parallel = parallel
        self.req_id = 0  # the last request sent
        self.live: set[int] = set()  # the requests in flight: one (the last) unless parallel > 1
        self.done: m.Done | None = None  # its end, once it came
        self.progress: m.Progress | None = None  # the last Progress of a starting compute
        # No text is kept here: a caller that wants the whole text keeps it in a local,
        # as an attribute `+=` would copy it at every token (megabytes, for a long stream).

    @property
    def ready(self) -> bool:
        """A compute has said Hello (it has the model loaded and takes requests)."""
        return self.pid is not None

    def generate(
        self,
        prompt_tokens: Sequence[int],
        max_tokens: int,
        sampling: dict,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
        cache_prompt: bool = True,
        grammar: str = "",
        draft: int = m.DRAFT_FROM_CONFIG,
        slot: int = m.ANY_SLOT,
    ) -> m.Generate:
        """The next request (with parallel 1, its frames are the only ones `accept` returns from now on)."""
        self._next()
        return m.Generate(
            self.req_id,
            tuple(prompt_tokens),
            max_tokens,
            sampling,
            tuple(stop),
            ignore_eos,
            cache_prompt,
            grammar=grammar,
            draft=draft,
            slot=slot,
        )

    def slot(self, action: str, path: str = "", slot: int = 0) -> m.Slot:
        """The next request: save, restore or erase a compute slot's session (answered by a Done)."""
        self._next()
        return m.Slot(self.req_id, action, path, slot)

    def _next(self) -> None:
        self.req_id += 1
        self.done = None
        if self.parallel == 1:
            self.live.clear()
        self.live.add(self.req_id)

    def cancel(self, req_id: int = 0) -> m.Cancel:
        """Compute ends the request (default: the last sent) with Done(cancelled) at its next token."""
        return m.Cancel(req_id or self.req_id)

    def forget(self, req_id: int) -> None:
        """The request was given up (its compute died): its late frames are dropped."""
        self.live.discard(req_id)

    def accept(self, msg: m.Message) -> str | m.PromptProgress | m.Done | None:
        """A frame from compute: the text of a Token of the request in flight,
        its prompt's progress, its Done, or None (a Hello, or a frame of no
        request in flight)."""
        if isinstance(msg, m.Hello):
            self._on_hello(msg)
        elif isinstance(msg, m.Progress):
            self.progress = msg  # a compute still starting; the run's parent shows it (procs/pipeline.py)
        elif isinstance(msg, (m.Token, m.Done, m.PromptProgress)):
            if msg.req_id in self.live:
                if isinstance(msg, m.Done):
                    self.live.discard(msg.req_id)
                    if msg.req_id == self.req_id:
                        self.done = msg
                    return msg
                return msg.text if isinstance(msg, m.Token) else msg
        else:
            log.warning("dropped an unexpected %s from compute", type(msg).__name__)
        return None

    def _on_hello(self, hello: m.Hello) -> None:
        if hello.role != "compute" or hello.protocol != m.PROTOCOL_VERSION:
            log.warning("ignored a Hello from %s pid %d (protocol %d, ours %d)", hello.role, hello.pid, hello.protocol, m.PROTOCOL_VERSION)
            return
        log.info("compute pid %d is %s", hello.pid, "back" if self.hellos else "ready")
        self.pid, self.hellos = hello.pid, self.hellos + 1


def failure_text(done: m.Done) -> str:
    """A failed Done in one line, as both clients report it."""
    return f"generation failed ({done.code}): {done.error}"
