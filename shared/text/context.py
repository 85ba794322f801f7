"""What a prompt may be: the context's and the wire's limits, and their one-line
errors, shared by `moe-pipe run`, compute and the gateway. Light on purpose:
the parent and the gateway import it without the model's code (numba)."""

from __future__ import annotations

from ..errors import UserError


def check_prompt_fits(n_prompt: int, n_ctx: int) -> None:
    """The one context error of `run` and compute: a prompt that leaves no room for a reply."""
    if n_prompt >= n_ctx:
        raise UserError(f"the prompt is {n_prompt:,} tokens but the context holds {n_ctx:,}; shorten it or raise the context size (-c)")


def too_long_for_one_request(n_prompt: int) -> str:
    """Why a prompt that fits the context cannot reach compute: its ids pass in one
    wire frame (shared/wire/messages.py MAX_FRAME_BYTES), a few bytes an id."""
    return f"the prompt is {n_prompt:,} tokens, more than one request to compute carries (about 200,000); shorten it"
