"""Faults a process injects into itself, for tests only: one hidden flag, ``--faults``, absent
from ``--help``, or ``$BATON_FAULTS`` (so a test can reach the workers ``baton up`` starts), as
comma-separated ``name=value`` pairs::

    --faults crash_engine_after=3,step_delay=0.05,delay_release=2.5

None of it is production configuration: the settings classes know nothing of it, and a worker
started without the flag or the variable injects nothing.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields

ENV = "BATON_FAULTS"


@dataclass(frozen=True)
class Faults:
    crash_engine_after: int = 0  # the engine thread fails after that many steps
    step_delay: float = 0.0  # every engine step takes at least this long (a slow machine)
    delay_release: float = 0.0  # a reader holds each lease release this long (the lease race)

    @classmethod
    def parse(cls, text: str) -> Faults:
        """From ``name=value,...``; raises ValueError naming an unknown fault or a bad value."""
        known = {f.name: f.type for f in fields(cls)}
        values = {}
        for item in filter(None, (x.strip() for x in text.split(","))):
            name, _, value = item.partition("=")
            if name not in known:
                raise ValueError(f"--faults: unknown fault {name!r} (known: {sorted(known)})")
            try:
                values[name] = (int if known[name] in (int, "int") else float)(value)
            except ValueError:
                raise ValueError(f"--faults: {name}={value!r} is not a number") from None
        return cls(**values)

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> Faults:
        """The flag's faults, else the environment's."""
        return cls.parse(getattr(a, "faults", None) or os.environ.get(ENV, ""))


NONE = Faults()  # what a process started without --faults injects: nothing


def add_flag(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--faults", default=None, help=argparse.SUPPRESS)
