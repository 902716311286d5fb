"""The process that checks grammars for the gateway (`python -m ...grammar_child`).

llguidance cannot be stopped once it compiles: a hostile JSON schema (600 `patternProperties`
in 22 KB) took 105 s, and no limit of the engine bounds that work (issue 23, finding 2). So the
gateway checks each new grammar in this small process, which it kills when the check takes
longer than its bound or its client leaves (gateway/request/grammar_check.py).

Frames on stdin and stdout: a 4-byte little-endian length, then UTF-8. The child first writes
an empty frame (ready); then for each grammar it reads, it writes the validation error ("" when
the grammar is valid under the group's parser limits). It ends at end of input.
"""

from __future__ import annotations

import struct
import sys

_LENGTH = struct.Struct("<I")


def read_frame(stream) -> bytes | None:
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(head)
    body = stream.read(length)
    return body if len(body) == length else None


def write_frame(stream, body: bytes) -> None:
    stream.write(_LENGTH.pack(len(body)) + body)
    stream.flush()


def main() -> None:
    import llguidance

    from switchyard.proto.grammar_limits import parser_limits

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    write_frame(stdout, b"")
    while (frame := read_frame(stdin)) is not None:
        try:
            error = llguidance.LLMatcher.validate_grammar(frame.decode(), None,
                                                          limits=parser_limits())
        except Exception as exc:  # the process boundary: an answer for every grammar
            error = f"{type(exc).__name__}: {exc}"
        write_frame(stdout, error.encode())


if __name__ == "__main__":
    main()
