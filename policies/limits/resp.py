"""Script calls as RESP bytes: the parts of an EVALSHA that do not change between requests (the
script's digest, the key names, a plan's fixed parameters) are encoded once, so a request encodes
only its ticket id and numbers."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from importlib import resources


class Script:
    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode("utf-8")).hexdigest()


def load_script(package: str, name: str) -> Script:
    """The Lua script `name` shipped in `package`, behind the helpers every script shares
    (policies/limits/preamble.lua): one definition of the clock, the number format, a bucket's drain
    and the budget period, instead of a copy in each script."""
    preamble = resources.files("policies.limits").joinpath("preamble.lua").read_text(encoding="utf-8")
    return Script(preamble + resources.files(package).joinpath(name).read_text(encoding="utf-8"))


def bulk(value: bytes) -> bytes:
    """One RESP bulk string."""
    return b"$%d\r\n%s\r\n" % (len(value), value)


def command(*words: bytes) -> bytes:
    return b"*%d\r\n" % len(words) + b"".join(map(bulk, words))


class Pre:
    """A script argument encoded once (a plan's fixed parameters); `value` for clients that encode."""

    __slots__ = ("resp", "value")

    def __init__(self, value: str) -> None:
        self.value = value
        self.resp = bulk(value.encode())


Arg = str | Pre


class EvalSha:
    """An EVALSHA of `script` over fixed `keys` with `nargs` arguments, its head encoded once."""

    __slots__ = ("head", "keys", "nargs", "script")

    def __init__(self, script: Script, keys: Sequence[str], nargs: int) -> None:
        self.script = script
        self.keys = tuple(keys)
        self.nargs = nargs
        head = [b"*%d\r\n" % (3 + len(keys) + nargs), bulk(b"EVALSHA"), bulk(script.sha.encode())]
        head.append(bulk(str(len(keys)).encode()))
        head += [bulk(key.encode()) for key in keys]
        self.head = b"".join(head)

    def encode(self, args: Sequence[Arg]) -> bytes:
        assert len(args) == self.nargs
        parts = [a.resp if isinstance(a, Pre) else bulk(a.encode()) for a in args]
        return self.head + b"".join(parts)

    @staticmethod
    def values(args: Sequence[Arg]) -> list[str]:
        return [a.value if isinstance(a, Pre) else a for a in args]
