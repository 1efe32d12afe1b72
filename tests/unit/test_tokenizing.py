"""Where a request's inputs are tokenised (core/tokenizing.py): a batch job's short requests together, off the loop."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

from inferd.core.preprocess import InputError
from inferd.core.text_options import PLAIN_INPUTS, InputOptions, TextOptions
from inferd.core.tokenizing import Tokenizing


@dataclass
class Recorder:
    """A handler's preprocess_with that records each call (its inputs and thread) and 'encodes' a text as its upper
    case; a text "bad" is refused as a tokenizer's input error is."""

    calls: list[tuple[list[Any], int]] = field(default_factory=list)

    def preprocess_with(self, inputs: list[Any], options: InputOptions) -> list[Any]:
        self.calls.append((list(inputs), threading.get_ident()))
        if "bad" in inputs:
            raise InputError(inputs.index("bad"), "refused")
        return [f"{text.upper()}{options.shared.key_suffix}" for text in inputs]


@dataclass
class Slot:
    handler: Recorder = field(default_factory=Recorder)


def run(*requests: tuple[Slot, list[str], InputOptions, bool]) -> tuple[list[Any], int]:
    """The requests' encodes started in one turn of the loop; their outcomes (a result or the exception) in order."""
    async def main() -> tuple[list[Any], int]:
        tokenizing = Tokenizing(2)
        tasks = [asyncio.ensure_future(
                     tokenizing.encode(slot, inputs, options, background=background))  # type: ignore[arg-type]
                 for slot, inputs, options, background in requests]
        return list(await asyncio.gather(*tasks, return_exceptions=True)), threading.get_ident()
    return asyncio.run(main())


def test_a_batch_jobs_short_requests_of_one_turn_are_tokenised_in_one_call_off_the_loop() -> None:
    slot = Slot()
    out, loop_thread = run((slot, ["a"], PLAIN_INPUTS, True), (slot, ["b", "c"], PLAIN_INPUTS, True),
                           (slot, ["d"], PLAIN_INPUTS, True))
    assert out == [["A"], ["B", "C"], ["D"]]  # each request its own encodings, in its order
    assert [inputs for inputs, _ in slot.handler.calls] == [["a", "b", "c", "d"]]
    assert slot.handler.calls[0][1] != loop_thread


def test_a_live_short_request_is_tokenised_on_the_loop_alone() -> None:
    slot = Slot()
    out, loop_thread = run((slot, ["a"], PLAIN_INPUTS, False), (slot, ["b"], PLAIN_INPUTS, False))
    assert out == [["A"], ["B"]]
    assert slot.handler.calls == [(["a"], loop_thread), (["b"], loop_thread)]


def test_one_refused_line_is_that_lines_refusal_alone() -> None:
    slot = Slot()
    out, _ = run((slot, ["a"], PLAIN_INPUTS, True), (slot, ["x", "bad"], PLAIN_INPUTS, True),
                 (slot, ["c"], PLAIN_INPUTS, True))
    assert out[0] == ["A"] and out[2] == ["C"]
    assert isinstance(out[1], InputError) and out[1].index == 1  # its own index, as if tokenised alone
    # The group's call was refused, then each request was tokenised in a call of its own.
    assert [inputs for inputs, _ in slot.handler.calls] == [["a", "x", "bad", "c"], ["a"], ["x", "bad"], ["c"]]


def test_requests_of_other_options_or_models_are_tokenised_apart() -> None:
    slot, other = Slot(), Slot()
    suffixed = InputOptions(TextOptions(prompt="query: "))
    assert suffixed.shared.key_suffix
    per_text = InputOptions(each=(TextOptions(), TextOptions()))
    out, loop_thread = run((slot, ["a"], PLAIN_INPUTS, True), (slot, ["b"], suffixed, True),
                           (other, ["c"], PLAIN_INPUTS, True), (slot, ["d", "e"], per_text, True),
                           (slot, ["f"], PLAIN_INPUTS, True))
    assert out == [["A"], ["B" + suffixed.shared.key_suffix], ["C"], ["D", "E"], ["F"]]
    calls = sorted(inputs for inputs, _ in slot.handler.calls)
    assert calls == [["a", "f"], ["b"], ["d", "e"]]
    assert other.handler.calls[0][0] == ["c"]
    # Per-text options are not grouped: that request is tokenised on the loop, as a live one is.
    assert (["d", "e"], loop_thread) in slot.handler.calls
