"""``StagedModule``: the name the stage runtime's Module had, kept for
imports of it; the one Module of every schedule is
:class:`~mp_symbolic.core.engine.module.PipelineModule`, which runs each batch on
the stage runtime or, for GPipe in one process, on its fused graph.
"""
from .module import PipelineModule

__all__ = []

StagedModule = PipelineModule
