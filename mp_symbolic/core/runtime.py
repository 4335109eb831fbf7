"""The runtime interface: a Pipeline's training graph bound on its devices,
running one batch at a time. Every symbolic step runs on one.

Two implement it:

* :class:`~mp_symbolic.core.stages.StageRuntime`: the stage graphs, each
  bound as executors of its own, run in a schedule's order (every schedule,
  and over node processes);
* :class:`FusedRuntime`: GPipe's fused mode, every micro-batch in one bound
  graph whose order MXNet's engine decides (``schedule='gpipe'`` in one
  process).

:func:`bind` makes the one the Pipeline's schedule runs on; the step code
(the executor API's stepper) drives either alike.
"""
from typing import Dict, List, Optional, Protocol, Tuple, runtime_checkable

import mxnet as mx

from .batchnorm import deferred_graph, update
from .compat import split_bind
from .names import GROUP_ATTR
from . import schedule as schedules

__all__ = []


@runtime_checkable
class Runtime(Protocol):
    """A graph bound on its devices (bound when made), one batch at a time.

    Attributes:
        outputs: After :meth:`run`, the graph's outputs of the batch, in order.
        input_grads: After a training :meth:`run`, ``{input: its gradient
            over the batch}`` for the inputs whose gradient was asked for.
        parameters: ``(arg_dict, grad_dict, aux_dict)``: the weights,
            their gradients (``None`` for a fixed one) and the auxiliary
            states the runtime binds, by name, each on its device (the
            fused graph's hold its inputs too, their gradients ``None``).
        executors: The MXNet executors it runs (one per stage it binds, or
            the one fused graph's).
    """

    outputs: Optional[List[mx.nd.NDArray]]
    input_grads: Dict[str, mx.nd.NDArray]

    @property
    def parameters(self) -> Tuple[dict, dict, dict]:
        ...

    @property
    def executors(self) -> List[mx.executor.Executor]:
        ...

    def run(self, inputs, train, each=None) -> None:
        """One batch: ``inputs`` (``{input or label name: array}``) through
        the graph, with ``train`` its backward too (the batch's gradients in
        the gradient arrays); ``each`` is called with each action as it is
        issued, where the runtime issues them one by one."""


class FusedRuntime:
    """GPipe's fused mode: one executor of the graph with every micro-batch
    (:func:`~mp_symbolic.core.passes.replicate_chunks`), its forwards and
    backwards ordered by MXNet's engine.

    Args:
        executor: The bound executor.
        input_grads: The inputs whose gradient :meth:`run` returns (bound
            with a gradient).
        statistics: With ``batchnorm='deferred'``, the statistics the graph
            outputs after its own (:func:`~mp_symbolic.core.batchnorm.deferred_graph`):
            a training run then updates the running statistics once, with
            the whole batch's; ``outputs`` leaves them out.
        own_outputs: The count of the graph's own outputs, before the statistics.
    """

    def __init__(self, executor, input_grads=(), statistics=(), own_outputs=None):
        self.executor = executor
        self._input_grads = tuple(input_grads)
        self._statistics, self._own = statistics, own_outputs
        self.outputs = None
        self.input_grads = {}

    @property
    def parameters(self):
        exe = self.executor
        return exe.arg_dict, exe.grad_dict, exe.aux_dict

    @property
    def executors(self):
        return [self.executor]

    def run(self, inputs, train, each=None):
        """See :class:`Runtime`; ``inputs`` may be NDArrays on any device or
        numpy arrays, written into the executor's arrays. The whole schedule
        is one issue: ``each`` is not called."""
        exe = self.executor
        for name, value in inputs.items():
            exe.arg_dict[name][:] = value
        exe.forward(is_train=train)
        if train:
            exe.backward()
            if self._statistics:
                update(self._statistics, exe.aux_dict, exe.outputs)
            self.input_grads = {n: exe.grad_dict[n] for n in self._input_grads}
        self.outputs = exe.outputs[:self._own] if self._own else exe.outputs


def parameter_arrays(symbol, shapes, types, group2ctx, inputs, fixed=()):
    """``(arg_dict, grad_dict, aux_dict)`` of new zero arrays for every
    argument of ``symbol`` but ``inputs``, and every auxiliary state, each on
    the device of its ``ctx_group`` (``shapes`` and ``types``: by name, as
    :func:`~mp_symbolic.core.stages.variable_specs` gives them); ``fixed``
    arguments get no gradient array (``None``)."""
    attrs = symbol.attr_dict()

    def zeros(name):
        device = group2ctx[attrs[name][GROUP_ATTR]]
        return mx.nd.zeros(shapes[name], device, dtype=types[name])
    params = [n for n in symbol.list_arguments() if n not in inputs]
    arg_dict = {n: zeros(n) for n in params}
    grad_dict = {n: None if n in fixed else mx.nd.zeros_like(a) for n, a in arg_dict.items()}
    aux_dict = {n: zeros(n) for n in symbol.list_auxiliary_states()}
    return arg_dict, grad_dict, aux_dict


def bind(pipe, loss, label_name, shapes):
    """The runtime the Pipeline's schedule runs a batch of ``shapes`` on,
    for training (one replica): :class:`FusedRuntime` where
    :func:`~mp_symbolic.core.schedule.one_graph` says so, otherwise a
    :class:`~mp_symbolic.core.stages.StageRuntime` of every stage.

    Args:
        pipe: The :class:`~mp_symbolic.Pipeline`.
        loss, label_name: As :meth:`~mp_symbolic.Pipeline.training_symbol` takes them.
        shapes: ``{input or label name: the batch's shape}`` (batch on axis 0).

    Returns:
        The runtime; parameters of Gluon's ``grad_req='null'`` have no
        gradient array.

    Raises:
        ValueError: a batch the micro-batches do not divide.
    """
    # pylint: disable=import-outside-toplevel
    from .module import fixed_param_names
    from .passes import cut
    from .stages import StageRuntime, variable_specs
    inputs = set(shapes)
    plan = pipe.plan
    if schedules.one_graph(pipe.schedule, pipe.nodes):
        placed = pipe.training_graph(loss, label_name=label_name)
        symbol = placed.to_symbol()
        fixed = set(fixed_param_names(pipe, symbol))
        statistics, own = (), None
        if pipe.batchnorm == 'deferred' and pipe.chunks > 1:
            count = len(symbol.list_outputs())
            placed, statistics = deferred_graph(placed)
            symbol = placed.to_symbol()
            own = count if statistics else None
        grad_req = {n: 'null' if n in inputs or n in fixed else 'write'
                    for n in symbol.list_arguments()}
        with split_bind(plan.group2ctx, symbol, fixed=fixed):
            exe = symbol.simple_bind(ctx=plan.first_device, group2ctx=plan.group2ctx,
                                     grad_req=grad_req, **shapes)
        return FusedRuntime(exe, statistics=statistics, own_outputs=own)
    first = next(iter(shapes.values()))[0]
    pipe.placement.micro_batch(first)
    micro = {n: (s[0] // pipe.chunks,) + tuple(s[1:]) for n, s in shapes.items()}
    placed = pipe.training_graph(loss, label_name=label_name, chunks=1)
    symbol = placed.to_symbol()
    fixed = set(fixed_param_names(pipe, symbol))
    specs = variable_specs(symbol, micro, {n: 'float32' for n in micro})
    stages = cut(placed, plan.num_stages)
    arg_dict, grad_dict, aux_dict = parameter_arrays(symbol, specs[0], specs[1], plan.group2ctx,
                                                     inputs, fixed)
    return StageRuntime(stages, plan.group2ctx, arg_dict, grad_dict, aux_dict, micro,
                        pipe.run_schedule(), True, specs=specs, batchnorm=pipe.batchnorm)
