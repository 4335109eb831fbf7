"""Stand-in for the ``nose`` package (not installed): only ``nose.tools``'s
``raises`` and ``assert_raises``, which MXNet 1.9.1's unit tests import."""
