"""The planning wing's one table formatter: the compiled programs' table (`compiled.table`), the
update's (`update_cost.table`) and the rollout's (`rollout_cost.table`) are each a header, a rule,
a line a row and notes, with columns of fixed width."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Column:
    """One column: its title, its width, and how a number in it is written.

    Attributes:
      title: the header.
      width: characters, the title's and every cell's (a longer cell is not cut).
      spec: the format spec of a number, e.g. ",.1f" (a str cell is written as it is).
      suffix: written after a number, inside the width: a unit such as "s", "%" or "x".
      left: left-aligned (a name); else right-aligned.
    """

    title: str
    width: int
    spec: str = ""
    suffix: str = ""
    left: bool = False

    def cell(self, value: Any) -> str:
        text = value if isinstance(value, str) else format(value, self.spec) + self.suffix
        return text.ljust(self.width) if self.left else text.rjust(self.width)


def render(columns: Sequence[Column], rows: Sequence, notes: Sequence[str] = ()) -> str:
    """The table as lines of text: the header, a rule as long, then each row (a sequence of
    one cell per column, or a str: a line of its own, e.g. a program that failed), then `notes`.
    """
    head = " ".join(c.cell(c.title) for c in columns)
    lines = [head, "-" * len(head)]
    for row in rows:
        if isinstance(row, str):
            lines.append(row)
        else:
            lines.append(" ".join(c.cell(v) for c, v in zip(columns, row, strict=True)))
    return "\n".join([*lines, *notes])
