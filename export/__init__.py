"""Export of the trained model-parallel graph, and prediction from the export.

``python -m export`` turns the symbolic training checkpoint into

* an inference-only MXNet file pair (``<name>-symbol.json`` and
  ``<name>-0000.params``) that keeps every ``ctx_group`` attribute, so it can
  be bound model-parallel again with ``group2ctx``;
* ``<name>.onnx`` for onnxruntime and other ONNX runtimes;
* a verification report comparing both against the trained parameters.

``python -m export.predict`` runs either file on ``.npy`` or CSV inputs, and
:func:`load_model` binds the MXNet pair again on a device plan (or one
device) for inference from Python (docs/export.md).
"""
import importlib
import os

# Where `make train-symbolic` writes, and where `make export` writes.
DEFAULT_CHECKPOINT_DIR = os.path.join('artifacts', 'symbolic')
DEFAULT_OUT_DIR = os.path.join('artifacts', 'export')

# Largest allowed |runtime - checkpoint| over an output, as a fraction of that
# output's scale (its largest |value| on the batch).
TOLERANCE = 1e-4
# By default an output may also differ by this many times the checkpoint's own
# float32 sensitivity on the batch (export/verify.py): correct runtimes differ
# by 0.78 times it (median) and by 2.7 times at most, as measured on 212
# runtime-batch pairs of networks whose softmax saturates.
SENSITIVITY_FACTOR = 10
# ... but by at most this many times TOLERANCE x scale (1e-2 of the scale): an
# output that float32 cannot resolve better than that is refused unless
# --tolerance says what is enough.
SENSITIVITY_LIMIT = 100
# The 1-ulp perturbations of the parameters the sensitivity is measured with
# (each one more forward pass of the checkpoint per verified batch).
PERTURBATIONS = 2
# Activation bytes one batch may take in one runtime. Verification runs one
# runtime at a time (the checkpoint, onnxruntime, then each MXNet plan, each
# let go before the next loads), so 2 GiB for the activations at most,
# whatever the model. (Defined here, not in verify.py, so that the command
# line's help needs no MXNet.)
MEMORY_BUDGET = 2048 << 20
# What a --sample .npz may hold, by its members' zip headers, read before any
# member is: their declared decompressed bytes in all, and how many arrays (a
# model reads a few inputs). A small file declaring gigabytes is refused unread.
MAX_SAMPLE_BYTES = 1 << 30
MAX_SAMPLE_ARRAYS = 1000
# CSV text python -m export.predict reads from a file or stdin: an endless
# stream (`yes 1,2 | ...`) is refused once it passes this, not read until
# memory runs out. Larger inputs go in a .npy file.
MAX_CSV_BYTES = 64 << 20

__all__ = ['load_model', 'LoadedModel', 'suppress', 'DEFAULT_CHECKPOINT_DIR', 'DEFAULT_OUT_DIR']


def __getattr__(name):
    # Imported on first use: `python -m export` and `python -m export.predict`
    # import this package before their signal handling is in place, and
    # MXNet takes seconds to import.
    if name in ('load_model', 'LoadedModel'):
        return getattr(importlib.import_module('.loader', __name__), name)
    if name == 'suppress':
        return getattr(importlib.import_module('.suppression', __name__), name)
    raise AttributeError('module %r has no attribute %r' % (__name__, name))


def __dir__():
    return sorted(list(globals()) + __all__)
