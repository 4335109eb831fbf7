"""The runtime: the stage graphs bound and run in a schedule's order, the
Module on it, variable-length batches, the imperative twin.
"""
