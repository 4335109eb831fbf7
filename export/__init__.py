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
import os

# Where `make train-symbolic` writes, and where `make export` writes.
DEFAULT_CHECKPOINT_DIR = os.path.join('artifacts', 'symbolic')
DEFAULT_OUT_DIR = os.path.join('artifacts', 'export')

from .loader import LoadedModel, load_model  # noqa: E402  (after the constants it imports)

__all__ = ['load_model', 'LoadedModel', 'DEFAULT_CHECKPOINT_DIR', 'DEFAULT_OUT_DIR']
