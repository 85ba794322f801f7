"""A model's output split, as it streams, into reasoning, answer and tool calls.

Generated text reaches the front end as decoded pieces (`m.Token`, from
`Tokenizer.stream()`), and the decoder renders control tokens as their text,
so the framing the model writes is in those pieces: Qwen3's `<think>`, gpt-oss's
`<|channel|>analysis<|message|>`, Gemma 4's `<|channel>thought`. The
end-of-generation token never is (generation stops before it): gpt-oss's
`<|call|>`, which ends a tool call, is an EOG token (shared/text/tokenizer.py
`eog_ids`), so a harmony tool call is complete when the text ends.

    OutputSplitter(framing, prompt_tail, tools) .feed(piece) -> [(kind, text), ...]
                                                .finish()    -> [(kind, text), ...]

Kinds: REASONING, CONTENT, and TOOL (one complete tool call's text, parsed by
shared/text/tools.py). Whatever way the text is cut into pieces, the pieces
out, joined per kind, are the same (a marker cut in two is held until it is
whole or cannot be one).

Framings, found from the vocabulary (`framing_for`):

    think    Qwen3       <think>REASONING</think>ANSWER <tool_call>{...}</tool_call>
    gemma4   Gemma 4     <|channel>thought REASONING<channel|>ANSWER <|tool_call>call:NAME{...}<tool_call|>
    harmony  gpt-oss     <|channel|>analysis<|message|>REASONING<|end|><|start|>assistant<|channel|>final<|message|>ANSWER
                         <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}     (then <|call|>, EOG)
    none     anything else: all text is the answer

Where the output starts is read from the prompt's tail: a prompt whose last
assistant turn opened a think block (a Qwen3 template that pre-fills
`<think>\\n`) starts in the reasoning; one that opened and closed it (thinking
off: `<think>\\n\\n</think>\\n\\n`, Gemma's `<|channel>thought\\n<channel|>`)
starts in the answer, with no reasoning to find; harmony starts inside the
header `<|start|>assistant` opened. The tag framings look for a reasoning
block only at the very start of the answer, as llama.cpp's parsers do: a
`<think>` later in an answer is text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

REASONING, CONTENT, TOOL = "reasoning", "content", "tool"
Piece = tuple[str, str]

# A harmony header longer than this without <|message|> is not a header: the
# model is not writing harmony (a tiny random model), and its text is the answer.
MAX_HEADER_CHARS = 512


@dataclass(frozen=True)
class Framing:
    """How one family of models frames its output (see the module doc)."""

    name: str
    turn: str = ""  # what opens the assistant's turn in a prompt
    reasoning: tuple[tuple[str, ...], str] | None = None  # (openers, longest first; closer)
    tool: tuple[str, str] | None = None  # (opener, closer) of one tool call inside the answer

    def tool_markup(self, text: str) -> str:
        """A TOOL piece as the model wrote it, for when it does not parse as a call."""
        if self.tool is None:
            return text
        return self.tool[0] + text + self.tool[1]


THINK = Framing("think", "<|im_start|>assistant", (("<think>",), "</think>"), ("<tool_call>", "</tool_call>"))
# Gemma names its thought channel after the opener ("<|channel>thought\n");
# the name is framing, not reasoning, so it is part of the longer opener.
GEMMA4 = Framing("gemma4", "<|turn>model", (("<|channel>thought", "<|channel>"), "<channel|>"), ("<|tool_call>", "<tool_call|>"))
HARMONY = Framing("harmony", "<|start|>")
NONE = Framing("none")
FRAMINGS = {f.name: f for f in (THINK, GEMMA4, HARMONY, NONE)}

# harmony control tokens
H_START, H_CHANNEL, H_MESSAGE, H_END, H_CALL, H_RETURN = "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>"


def framing_for(tok) -> Framing:
    """The framing of a tokenizer's model, from the special tokens its vocabulary has."""
    hf = getattr(tok, "hf", None)

    def has(*texts: str) -> bool:
        return hf is not None and all(hf.token_to_id(t) is not None for t in texts)

    if has(H_START, H_CHANNEL, H_MESSAGE, H_END):
        return HARMONY
    if has("<|channel>", "<channel|>"):
        return GEMMA4
    if has("<think>", "</think>"):
        return THINK
    return NONE


def next_marker(buf: str, markers: Sequence[str], final: bool) -> tuple[int, str | None]:
    """(where, marker): the first marker in `buf` (the longest of those that
    start there); or (safe, None) when there is none, `buf[:safe]` holding no
    marker and `buf[safe:]` possibly the start of one (held until more text
    comes; nothing is held when `final`)."""
    at, found = -1, None
    for m in markers:
        i = buf.find(m)
        if i >= 0 and (at < 0 or i < at or (i == at and len(m) > len(found or ""))):
            at, found = i, m
    if not final:
        longest = max((len(m) for m in markers), default=0)
        end = len(buf) if at < 0 else at
        for i in range(max(0, len(buf) - longest + 1), end + 1):
            tail = buf[i:]
            if tail and any(len(m) > len(tail) and m.startswith(tail) for m in markers):
                return i, None  # a marker may start here (or a longer one where `found` starts)
    return (at, found) if at >= 0 else (len(buf), None)


class _Out:
    """The pieces out, with the whitespace framing leaves around sections
    trimmed: a reasoning section loses its leading and trailing whitespace,
    an answer its leading whitespace after reasoning or a call, and the
    whitespace before a tool call."""

    def __init__(self, hold_content_ws: bool):
        self.pieces: list[Piece] = []
        self.strip_lead = {REASONING: True, CONTENT: False}
        self.pending = {REASONING: "", CONTENT: ""}
        self.hold = {REASONING: True, CONTENT: hold_content_ws}

    def start(self, kind: str) -> None:
        self.strip_lead[kind] = True

    def text(self, kind: str, s: str) -> None:
        if self.strip_lead[kind]:
            s = s.lstrip()
            if not s:
                return
            self.strip_lead[kind] = False
        if not s:
            return
        if self.hold[kind]:
            body = s.rstrip()
            if not body:
                self.pending[kind] += s
                return
            s, self.pending[kind] = self.pending[kind] + body, s[len(body) :]
        self.pieces.append((kind, s))

    def end(self, kind: str, keep_ws: bool) -> None:
        ws, self.pending[kind] = self.pending[kind], ""
        if keep_ws and ws:
            self.pieces.append((kind, ws))

    def tool(self, s: str) -> None:
        self.pending[CONTENT] = ""  # the whitespace before a call is framing
        self.pieces.append((TOOL, s))
        self.strip_lead[CONTENT] = True

    def take(self) -> list[Piece]:
        out, self.pieces = self.pieces, []
        return out


class OutputSplitter:
    """Feed decoded pieces, get (kind, text) pieces. `prompt_tail` is the end
    of the rendered prompt (a few dozen tokens decoded is plenty): it says
    where the output starts. With `tools` False, tool-call markup is answer text."""

    def __init__(self, framing: Framing, prompt_tail: str = "", tools: bool = False):
        self.framing, self.tools = framing, tools
        self.out = _Out(hold_content_ws=tools)
        self.buf = ""
        self.ended = False
        if framing is HARMONY:
            self._harmony_start(prompt_tail)
        else:
            self.state, self.may_open = self._tag_start(prompt_tail)
            self.tool_text = ""

    # -- public --------------------------------------------------------------------
    def feed(self, text: str) -> list[Piece]:
        if self.ended:
            raise ValueError("feed after finish")
        self.buf += text
        self._run(final=False)
        return self.out.take()

    def finish(self) -> list[Piece]:
        """The rest, at the end of the generation: a held partial marker is
        text; an unclosed tool call is answer text, except harmony's (its
        <|call|> is the EOG token, never in the text)."""
        if not self.ended:
            self.ended = True
            self._run(final=True)
            if self.framing is HARMONY:
                self._harmony_finish()
            elif self.state == TOOL:
                assert self.framing.tool is not None
                self.out.text(CONTENT, self.framing.tool[0] + self.tool_text)
            self.out.end(REASONING, keep_ws=False)
            self.out.end(CONTENT, keep_ws=True)
        return self.out.take()

    def split_all(self, text: str) -> list[Piece]:
        """feed + finish of one whole text, pieces of a kind merged."""
        merged: list[Piece] = []
        for kind, s in self.feed(text) + self.finish():
            if merged and merged[-1][0] == kind and kind != TOOL:
                merged[-1] = (kind, merged[-1][1] + s)
            else:
                merged.append((kind, s))
        return merged

    def _run(self, final: bool) -> None:
        if self.framing is HARMONY:
            self._harmony(final)
        else:
            self._tags(final)

    # -- tag framings (think, gemma4, none) ----------------------------------------
    def _tag_start(self, tail: str) -> tuple[str, bool]:
        """(state, whether a reasoning block may still open): REASONING if the
        prompt's last assistant turn left one open, no block to come if it
        opened and closed one (thinking off)."""
        f = self.framing
        if f.reasoning is None:
            return CONTENT, False
        if not f.turn or f.turn not in tail:
            return CONTENT, True
        after = tail[tail.rindex(f.turn) + len(f.turn) :]
        openers, closer = f.reasoning
        at, opener = next_marker(after, openers, final=True)
        if opener is None:
            return CONTENT, True
        if closer not in after[at:]:
            self.out.start(REASONING)
            return REASONING, False
        self.out.start(CONTENT)
        return CONTENT, False

    def _tags(self, final: bool) -> None:
        f = self.framing
        while True:
            if self.state == REASONING:
                assert f.reasoning is not None
                markers: Sequence[str] = (f.reasoning[1],)
            elif self.state == TOOL:
                assert f.tool is not None
                markers = (f.tool[1],)
            else:
                markers = []
                if self.may_open:
                    assert f.reasoning is not None
                    markers += f.reasoning[0]
                if self.tools and f.tool is not None:
                    markers.append(f.tool[0])
            at, marker = next_marker(self.buf, markers, final)
            text_opener = self.state == CONTENT and f.reasoning is not None and marker in f.reasoning[0] and self.buf[:at].strip()
            if text_opener:
                at, marker = at + len(marker or ""), None  # an opener after answer text is text
            before, self.buf = self.buf[:at], self.buf[at + len(marker or "") :] if marker else self.buf[at:]
            if self.state == TOOL:
                self.tool_text += before
            elif before:
                self.out.text(self.state, before)
                if self.state == CONTENT and before.strip():
                    self.may_open = False  # reasoning comes first or not at all
            if text_opener:
                continue
            if marker is None:
                return
            self._tag_transition(marker)

    def _tag_transition(self, marker: str) -> None:
        f = self.framing
        if self.state == REASONING:
            self.out.end(REASONING, keep_ws=False)
            self.out.start(CONTENT)
            self.state, self.may_open = CONTENT, False
        elif self.state == TOOL:
            self.out.tool(self.tool_text)
            self.tool_text, self.state = "", CONTENT
        elif f.tool is not None and marker == f.tool[0]:
            self.state, self.may_open = TOOL, False
        else:
            self.out.start(REASONING)
            self.state, self.may_open = REASONING, False

    # -- harmony ---------------------------------------------------------------------
    def _harmony_start(self, tail: str) -> None:
        """Inside the message the prompt's last <|start|> opened (its header, or
        its body once <|message|> was written), or between messages."""
        self.state, self.header, self.header_given = "between", "", 0
        if H_START not in tail:
            return
        after = tail[tail.rindex(H_START) + len(H_START) :]
        if any(t in after for t in (H_END, H_CALL, H_RETURN)):
            return
        if H_MESSAGE in after:  # a template that pre-fills the start of a message
            self.header = after.partition(H_MESSAGE)[0]  # the body it pre-filled is prompt, not output
            self._harmony_body_start()
            return
        self.state, self.header, self.header_given = "header", after, len(after)

    def _harmony_kind(self) -> str:
        header = self.header
        if "to=functions." in header:
            return TOOL if self.tools else CONTENT
        _, sep, rest = header.partition(H_CHANNEL)
        words = rest.replace("<|", " <|").split()  # "analysis", or "commentary <|constrain|>json"
        return REASONING if sep and words and words[0] == "analysis" else CONTENT

    def _harmony_body_start(self) -> None:
        self.state, self.kind, self.body = "body", self._harmony_kind(), ""
        if self.kind != TOOL:
            self.out.start(self.kind)

    def _harmony(self, final: bool) -> None:
        while True:
            if self.state == "raw":
                self.out.text(CONTENT, self.buf)
                self.buf = ""
                return
            if self.state == "between":
                at, marker = next_marker(self.buf, (H_START, H_CHANNEL), final)
                if at:
                    self.out.text(CONTENT, self.buf[:at])  # text outside any message: not harmony, keep it
                if marker is None:
                    self.buf = self.buf[at:]
                    return
                self.buf = self.buf[at + len(marker) :]
                self.state, self.header, self.header_given = "header", "" if marker == H_START else marker, 0
            elif self.state == "header":
                at, marker = next_marker(self.buf, (H_MESSAGE,), final)
                self.header += self.buf[:at]
                self.buf = self.buf[at + len(marker or "") :]
                if marker is None:
                    if len(self.header) > MAX_HEADER_CHARS:
                        self._harmony_give_up()
                        continue
                    return
                self._harmony_body_start()
            else:
                at, marker = next_marker(self.buf, (H_END, H_CALL, H_RETURN, H_START), final)
                piece, self.buf = self.buf[:at], self.buf[at + len(marker or "") :]
                if self.kind == TOOL:
                    self.body += piece
                elif piece:
                    self.out.text(self.kind, piece)
                if marker is None:
                    return
                self._harmony_body_end()
                if marker == H_START:  # a new message without <|end|>
                    self.state, self.header, self.header_given = "header", "", 0

    def _harmony_body_end(self) -> None:
        if self.kind == TOOL:
            self.out.tool(self.header + H_MESSAGE + self.body)
        else:
            self.out.end(self.kind, keep_ws=self.kind == CONTENT)
        self.state = "between"

    def _harmony_give_up(self) -> None:
        """A header that is not one: its generated text is the answer."""
        self.out.text(CONTENT, self.header[self.header_given :] + self.buf)
        self.buf, self.header, self.state = "", "", "raw"

    def _harmony_finish(self) -> None:
        if self.state == "header":
            self.out.text(CONTENT, self.header[self.header_given :])
        elif self.state == "body":
            self._harmony_body_end()
        self.buf = ""
