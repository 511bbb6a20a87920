"""Tables a person can read wherever they land: every CLI table is printed by `print_table`.

Rich shrinks a table that is wider than the console by cutting its cells to an
ellipsis ("ca…", "1,4…"); piped into a file, a console is 80 columns, so most
tables lost every figure. Here a table is printed as a grid only when each
column can hold its widest cell whole (headers may wrap at their spaces);
otherwise it folds into one block per row, the first cell as the block's head
and every other cell as `column: value`, which fits any width without cutting
a figure.
"""

from __future__ import annotations

from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text


def _text(cell: RenderableType) -> Text:
    if isinstance(cell, Text):
        return cell
    return Text.from_markup(cell) if isinstance(cell, str) else Text(str(cell))


def _widest_word(text: Text) -> int:
    return max((len(word) for word in text.plain.split()), default=0)


def column_widths(table: Table, *, wrap_headers: bool = True) -> list[int]:
    """Each column as wide as its widest cell and its header (or, with `wrap_headers`, the header's
    longest word: headers wrap at spaces unless the column says no_wrap)."""
    widths = []
    for column in table.columns:
        header = _text(column.header)
        head = _widest_word(header) if wrap_headers and not column.no_wrap else header.cell_len
        widths.append(max([head, *(_text(cell).cell_len for cell in column.cells)]))
    return widths


def chrome_width(table: Table) -> int:
    """What the grid adds to its columns: the table's padding and borders."""
    count = len(table.columns)
    _, right, _, left = table.padding
    padding = (left + right) * count - (0 if table.pad_edge else left + right)
    borders = (count - 1 + (2 if table.show_edge else 0)) if table.box else 0
    return padding + borders


def grid_widths(table: Table, width: int) -> list[int] | None:
    """Column widths that show every cell whole within `width`: headers on one line if that fits,
    else wrapped at their spaces; None when even that does not fit."""
    for wrap_headers in (False, True):
        widths = column_widths(table, wrap_headers=wrap_headers)
        if sum(widths) + chrome_width(table) <= width:
            return widths
    return None


def print_table(console: Console, table: Table) -> None:
    """The table as a grid if it fits the console whole, else as key: value blocks (never an ellipsis)."""
    widths = grid_widths(table, console.width)
    if widths is None:
        print_blocks(console, table)
        return
    for column, width in zip(table.columns, widths, strict=True):
        column.width = width
        column.overflow = "fold"
    console.print(table)


def print_blocks(console: Console, table: Table) -> None:
    """One block per row: the first cell as its head, then `column: value` for each non-empty cell."""
    if table.title:
        console.print(_text(table.title), style="bold")
    columns = table.columns
    rows = [list(column.cells) for column in columns]
    count = max((len(cells) for cells in rows), default=0)
    if count == 0:
        console.print("  (no rows)")
    names = [_text(column.header).plain for column in columns]
    width = max((len(name) + 1 for name in names[1:]), default=0)
    for index in range(count):
        head = _text(rows[0][index]) if index < len(rows[0]) else Text("")
        console.print(Text("  ") + head)
        for name, cells in zip(names[1:], rows[1:], strict=True):
            value = _text(cells[index]) if index < len(cells) else Text("")
            if value.plain.strip():
                console.print(Text(f"    {name + ':':<{width}} ") + value, overflow="fold")
