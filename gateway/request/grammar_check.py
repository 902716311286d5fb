"""Checking a request's grammar off the event loop, within a time bound, abandoned with its client.

Every grammar a request brings (a response format, a guided constraint, strict tools' calls) is
validated under the group's parser limits before the request is submitted, so a bad one is a
400 naming what is wrong and a hostile one never reaches the worker. Validation can take
without bound (llguidance's limits do not cover a JSON schema's `patternProperties`: 600
patterns took 105 s), so it runs in a child process
(`grammar_child.py`) at the lowest CPU priority, which the kernel ends when a check has used
`CHECK_CPU_S` of CPU (the grammar is then refused as too complex), and which is killed when the
request's client leaves. The bound is CPU, not wall time: checks only get what CPU the serving
processes leave (a bomb beside a neighbour's prefill waits for it), so a busy machine makes a
check slower, never a refusal. A check still waiting after `CHECK_TIMEOUT_S` is a 503 (busy;
not remembered). A few children check at once (started with the gateway, and each ended one
replaced at once); results are cached by the grammar's digest, refusals too, so a repeated
grammar (an agent's tools, every turn) or a repeated bomb costs nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import signal
import sys
from collections import OrderedDict

import structlog

from switchyard.gateway.errors import APIError, invalid
from switchyard.gateway.request.grammar_child import _LENGTH
from switchyard.gateway.request.structured import Constraint

log = structlog.get_logger()

# A grammar whose validation takes more CPU is refused as too complex: a 64 KB schema of the
# usual kinds takes well under 0.1 s; 300 patternProperties took 5.6 s. (The kernel counts
# whole seconds: a check may use between 1 and 2 s.)
CHECK_CPU_S = 1.0
# A check still waiting for its answer after this long (a machine too busy to give the child
# CPU) is a 503, not remembered.
CHECK_TIMEOUT_S = 30.0
NUM_CHILDREN = 2
# Children kept started beyond those checking: back-to-back schema bombs kill a child a
# second, and a replacement takes about as long to start on a busy machine (bench/abuse.py:
# with none spare, the third bomb in a row waited for one, 2.7 s).
SPARE_CHILDREN = 1
CACHED_RESULTS = 256
_CHILD = "switchyard.gateway.request.grammar_child"


class _Child:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def start(cls, cpu_s: float) -> "_Child":
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", _CHILD, "--cpu-s", str(cpu_s), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        child = cls(process)
        await child.read()  # ready: llguidance imported
        return child

    async def check(self, grammar: str) -> str:
        body = grammar.encode()
        self.process.stdin.write(_LENGTH.pack(len(body)) + body)
        await self.process.stdin.drain()
        return (await self.read()).decode()

    async def read(self) -> bytes:
        (length,) = _LENGTH.unpack(await self.process.stdout.readexactly(_LENGTH.size))
        return await self.process.stdout.readexactly(length)

    def kill(self) -> asyncio.Future:
        """Kill it; the future is its reaping (awaited by `GrammarChecker.aclose`)."""
        if self.process.returncode is None:
            self.process.kill()
        return asyncio.ensure_future(self.process.wait())


class GrammarChecker:
    def __init__(self, num_children: int = NUM_CHILDREN, cpu_s: float = CHECK_CPU_S,
                 timeout_s: float = CHECK_TIMEOUT_S) -> None:
        self.cpu_s = cpu_s
        self.timeout_s = timeout_s
        self.num_children = num_children
        self._slots = asyncio.Semaphore(num_children)
        self._idle: list[_Child] = []
        self._results: OrderedDict[bytes, str] = OrderedDict()  # digest -> error ("" valid)
        self._reaping: set[asyncio.Future] = set()
        self._spares: set[asyncio.Future] = set()  # children being started
        self.num_killed = 0

    async def warm(self) -> None:
        """Start the children ahead of the checks (the gateway's start, and a replacement for
        each one killed): a check's bound is then all validation, never a process start."""
        while len(self._idle) + len(self._spares) < self.num_children + SPARE_CHILDREN:
            self._start_spare()
        await asyncio.gather(*self._spares, return_exceptions=True)

    def _start_spare(self) -> None:
        async def start() -> None:
            self._idle.append(await _Child.start(self.cpu_s))

        spare = asyncio.ensure_future(start())
        self._spares.add(spare)
        spare.add_done_callback(self._spares.discard)

    async def _take(self) -> _Child:
        """An idle child; one being started if none is (rather than start another)."""
        while not self._idle and self._spares:
            await asyncio.wait(set(self._spares), return_when=asyncio.FIRST_COMPLETED)
        return self._idle.pop() if self._idle else await _Child.start(self.cpu_s)

    async def check(self, constraint: Constraint) -> None:
        """A 400 naming `constraint.param` unless its grammar is valid (cached)."""
        digest = hashlib.blake2b(constraint.grammar.encode(), digest_size=16).digest()
        error = self._results.get(digest)
        if error is None:
            error = await self._check(constraint.grammar)
            self._results[digest] = error
            while len(self._results) > CACHED_RESULTS:
                self._results.popitem(last=False)
        else:
            self._results.move_to_end(digest)
        if error:
            param = constraint.param
            raise invalid(f"Unsupported or invalid '{param}': {error.splitlines()[0]}",
                          param=param, code="invalid_grammar")

    async def _check(self, grammar: str) -> str:
        async with self._slots:
            child = await self._take()
            try:
                async with asyncio.timeout(self.timeout_s):
                    error = await child.check(grammar)
            except asyncio.IncompleteReadError:  # the child ended: its CPU bound, or a crash
                returncode = await child.process.wait()
                self._kill(child, "cpu" if returncode == -signal.SIGXCPU else "crashed")
                return (f"the grammar is too complex: it did not compile within "
                        f"{self.cpu_s:g} s of CPU")
            except TimeoutError:
                self._kill(child, "busy")
                raise APIError(503, f"The server is too busy to check this grammar now "
                                    f"(waited {self.timeout_s:g} s); try again shortly",
                               type="server_error", code="overloaded",
                               retry_after_s=5) from None
            except BaseException:  # the client left (cancelled)
                self._kill(child, "abandoned")
                raise
            self._idle.append(child)
            return error

    def _kill(self, child: _Child, reason: str) -> None:
        reaped = child.kill()
        self._reaping.add(reaped)
        reaped.add_done_callback(self._reaping.discard)
        self.num_killed += 1
        log.info("grammar.check_stopped", reason=reason)
        self._start_spare()  # its replacement starts now, not when the next check comes

    async def aclose(self) -> None:
        """Stop every child (they also end on their own when the gateway's pipes close)."""
        for spare in list(self._spares):
            spare.cancel()
        await asyncio.gather(*self._spares, return_exceptions=True)
        waits = [child.kill() for child in self._idle] + list(self._reaping)
        self._idle.clear()
        if waits:
            await asyncio.gather(*waits, return_exceptions=True)
