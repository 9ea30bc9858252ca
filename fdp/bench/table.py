"""The one shape of ``python -m fdp.bench``'s tables: a title line saying what ran, then the
rows indented by two spaces under a header, the key columns on the left, the figures right
aligned, ratios to a peer in columns named ``x <peer>`` (``x ddp``, ``x fsdp2``, ``x torch``),
and notes indented after the rows::

    time: 3.2 M params, 2 ranks, batch 4x32, 30 steps (interleaved, after 3 warm-up)
      kind       ms  x ddp  x fsdp2  params == ddp's
      ddp      63.0  1.000    0.912
      zero3    85.4  1.355    1.237  52/52
      (zero3: median all-gather wait not hidden by compute 7.33 ms/step)
"""

from __future__ import annotations

from collections.abc import Sequence

INDENT = "  "


def ratio(value: float | None, peer: float | None) -> str:
    """``value / peer`` as a table shows it (three decimals), or ``-`` when there is no peer."""
    if value is None or not peer:
        return "-"
    return f"{value / peer:.3f}"


class Table:
    """Rows of cells (strings, already formatted) under ``columns``; the first ``keys`` columns
    and those named in ``text`` are left aligned, the others (figures) right aligned."""

    def __init__(self, title: str, columns: Sequence[str], keys: int = 1, text: Sequence[str] = ()) -> None:
        self.title, self.columns, self.keys = title, list(columns), keys
        self.left = {i for i, c in enumerate(self.columns) if i < keys or c in text}
        self.rows: list[list[str]] = []
        self.notes: list[str] = []

    def row(self, *cells: object) -> None:
        """One row; missing trailing cells are blank, ``None`` is blank."""
        out = ["" if c is None else str(c) for c in cells]
        self.rows.append(out + [""] * (len(self.columns) - len(out)))

    def note(self, text: str) -> None:
        self.notes.append(text)

    def render(self) -> str:
        table = [self.columns, *self.rows]
        widths = [max(len(r[i]) for r in table) for i in range(len(self.columns))]

        def line(cells: list[str]) -> str:
            parts = [c.ljust(w) if i in self.left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
            return (INDENT + "  ".join(parts)).rstrip()

        return "\n".join([self.title, *map(line, table), *(INDENT + n for n in self.notes)])


def render(tables: Sequence[Table]) -> str:
    """Several tables, a blank line between them."""
    return "\n\n".join(t.render() for t in tables)
