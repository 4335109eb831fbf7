"""Plain-text tables for the terminal."""

__all__ = []


def columns(rows):
    """Rows of cells -> lines, each column left-justified to its widest cell."""
    rows = [[str(cell) for cell in row] for row in rows]
    width = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ['  '.join(cell.ljust(w) for cell, w in zip(row, width)).rstrip() for row in rows]
