"""Shared by every layer: checks, the one clock, MXNet behaviours worked
around, scoped process state, arrays written one at a time."""
