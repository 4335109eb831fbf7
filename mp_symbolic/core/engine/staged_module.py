"""``StagedModule``: another name of
:class:`~mp_symbolic.core.engine.module.PipelineModule`, for imports of it."""
from .module import PipelineModule

__all__ = []

StagedModule = PipelineModule
