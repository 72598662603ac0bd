"""The text of a growing token list, decoded incrementally, and the stop strings in it.

The engine (a stop string ends a request) and the streaming API (text deltas that never
show part of a stop string) both need the decoded text after every step. Decoding the
whole output each time costs O(length) per step, O(length²) per request; here a step
decodes only the tokens since the text last ended on a whole character, and a stop string
is searched for only where a match not seen before can be.
"""

from __future__ import annotations

from typing import Any, Sequence

REPLACEMENT = "\ufffd"  # what decode gives for a multi-byte character cut between tokens


class IncrementalDecoder:
    """`text` equals tokenizer.decode(ids, skip_special_tokens=True) of the ids pushed so far.

    The text is a final part, which later tokens cannot change, and a pending tail decoded
    from the tokens after the last point where the text did not end in U+FFFD. A push decodes
    the pending tokens behind the previous span of final tokens (context) and cuts the
    context's own text off again: a tokenizer may render the first token of a text
    differently (SentencePiece drops its leading space). That assumes decoding is appending
    at whole characters, which holds for byte-level BPE; tokenizers that rewrite text across
    tokens (clean_up_tokenization_spaces), or whose context text changes as tokens follow,
    are decoded whole after every push, as before.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._final: list[str] = []  # the final text, in the chunks it was added in
        self._final_len = 0
        self._pending = ""  # text of ids[_read:]
        self._context = 0  # ids[_context:_read] are decoded again as context for the pending ones
        self._read = 0  # ids[:_read] make up the final text
        self._context_text = ""  # decode(ids[_context:_read]) on its own
        self._whole = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))

    def __len__(self) -> int:
        return self._final_len + len(self._pending)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, new_ids: Sequence[int]) -> int:
        """Append tokens; returns the offset before which the text is the same as before."""
        unchanged = self._final_len
        self.ids.extend(new_ids)
        if not self._whole:
            window = self._decode(self.ids[self._context:])
            if window.startswith(self._context_text):
                self._extend(window[len(self._context_text):])
                return unchanged
            self._whole = True  # appending does not hold for this tokenizer: stay exact
        self._final, self._final_len = [], 0
        self._pending = self._decode(self.ids)
        return 0

    def _extend(self, tail: str) -> None:
        if not tail or tail.endswith(REPLACEMENT):
            self._pending = tail  # wait for the rest of the character (or for any text)
            return
        self._final.append(tail)
        self._final_len += len(tail)
        self._pending = ""
        self._context, self._read = self._read, len(self.ids)
        self._context_text = self._decode(self.ids[self._context:self._read])

    def text_from(self, start: int) -> str:
        """text[start:], joining only the final chunks it spans (callers ask for recent text)."""
        start = max(start, 0)
        parts, pos, i = [self._pending], self._final_len, len(self._final)
        while pos > start:
            i -= 1
            parts.append(self._final[i])
            pos -= len(self._final[i])
        return "".join(reversed(parts))[start - pos:]

    @property
    def text(self) -> str:
        return self.text_from(0)


class StopScanner:
    """An IncrementalDecoder plus the offset of the first stop string in its text."""

    def __init__(self, tokenizer: Any, stops: Sequence[str] = ()):
        self.stops = tuple(s for s in stops if s)
        self.decoder = IncrementalDecoder(tokenizer)
        self.stop_at: int | None = None

    def push(self, new_ids: Sequence[int]) -> None:
        unchanged = self.decoder.push(new_ids)
        if self.stop_at is not None or not self.stops:
            return
        # Every earlier push searched the text it had, so a first match ends after `unchanged`
        # and starts at most len(stop) - 1 characters before it.
        lo = max(0, unchanged - max(len(s) for s in self.stops) + 1)
        recent = self.decoder.text_from(lo)
        hits = [at for at in (recent.find(s) for s in self.stops) if at >= 0]
        if hits:
            self.stop_at = lo + min(hits)

    def text_before_stop(self) -> str:
        """The text cut at the first stop string (all of it if none)."""
        text = self.decoder.text
        return text if self.stop_at is None else text[: self.stop_at]
