"""The process that checks grammars for the gateway (`python -m ...grammar_child`).

llguidance cannot be stopped once it compiles: a hostile JSON schema (600 `patternProperties`
in 22 KB) took 105 s, and no limit of the engine bounds that work. So the
gateway checks each new grammar in this small process (gateway/request/grammar_check.py). It
runs at the lowest CPU priority, so a check never takes CPU from the serving processes, and
each check may use `--cpu-s` seconds of CPU (rounded up to the next whole second, as the
kernel counts): past that the kernel ends the process (SIGXCPU), which the gateway reads as "too
complex". Its wall time has only a generous backstop: on a busy machine a check waits for CPU
rather than being refused for the machine's load.

Frames on stdin and stdout: a 4-byte little-endian length, then UTF-8. The child first writes
an empty frame (ready); then for each grammar it reads, it writes the validation error ("" when
the grammar is valid under the group's parser limits). It ends at end of input.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
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


def cpu_used_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def limit_cpu(seconds: float) -> None:
    """SIGXCPU (the end of this process) once it has used `seconds` more CPU, or a little
    more: the limit is whole seconds."""
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = math.ceil(cpu_used_s() + seconds)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu-s", type=float, required=True)
    args = parser.parse_args()
    os.nice(19)  # checks get what CPU the serving processes leave
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU leaves no core file

    import llguidance

    from switchyard.common.grammar_limits import parser_limits

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    write_frame(stdout, b"")
    while (frame := read_frame(stdin)) is not None:
        limit_cpu(args.cpu_s)
        try:
            error = llguidance.LLMatcher.validate_grammar(frame.decode(), None,
                                                          limits=parser_limits())
        except Exception as exc:  # the process boundary: an answer for every grammar
            error = f"{type(exc).__name__}: {exc}"
        write_frame(stdout, error.encode())


if __name__ == "__main__":
    main()
