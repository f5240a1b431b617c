"""Text-level stop strings over streamed text: a stop string may span tokens, and it is never
emitted. Text that could still turn out to be the start of a stop string is held back until the
next piece decides it."""
from __future__ import annotations


class StopScanner:
    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Feed the next piece of text; returns what can be shown now. After a stop string,
        `stopped` is set and everything from the stop string on is dropped."""
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.held = True, ""
            return buf[:min(hits)]
        keep = max((n for s in self.stops for n in range(min(len(s) - 1, len(buf)), 0, -1)
                    if buf.endswith(s[:n])), default=0)
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """The held-back text at the end of generation (it never became a stop string)."""
        out, self.held = self.held, ""
        return out
